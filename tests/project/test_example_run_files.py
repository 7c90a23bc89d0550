"""The run files shipped in examples/ are valid against the one config schema."""

from pathlib import Path

import pytest

from featcal.config import load_run_file

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_run_file_validates(path):
    run = load_run_file(path)
    assert run.merge.experts and run.out
    run.merge.merge_config()
    if run.calibrate is not None:
        assert set(run.calibrate.calibration) == set(run.merge.experts)
        run.calibrate.featcal_config()


def test_examples_exist():
    assert EXAMPLES, "examples/*.yaml missing"
