"""RunOptions: overwrite, allow_pickle, max_length, allow_fewer validated by one model from CLI flags, the Python
API and YAML run files; a run file can set max_length and allow_fewer (issue #18)."""

from __future__ import annotations

import json

import pytest
import yaml

import featcal.merging.api as merge_api
from featcal import merge
from featcal.config import RunOptions, load_run_file, run_options
from featcal.errors import ConfigError
from tests.builders.guarantees import calibrate_argv, cli, merge_argv, one_line_error

pytestmark = pytest.mark.usefixtures("one_thread")



def _run_file(tmp_path, clip, calibrate=True, **top):
    doc = {"merge": {"base": str(clip["base"]), "experts": {t: str(p) for t, p in clip["experts"].items()}},
           "out": str(tmp_path / "out"), **top}
    if calibrate:
        doc["calibrate"] = {"calibration": {t: str(p) for t, p in clip["data"].items()},
                            "config": {"num_calibration_examples": 50}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_run_file_sets_the_run_options(clip, tmp_path):
    run = load_run_file(_run_file(tmp_path, clip, max_length=32, allow_fewer=True, overwrite=True))
    assert run.run_options() == RunOptions(max_length=32, allow_fewer=True, overwrite=True)
    assert load_run_file(_run_file(tmp_path, clip)).run_options() == RunOptions()


def test_allow_fewer_from_a_run_file(clip, tmp_path, capsys):
    rc, _, err = cli(["run", _run_file(tmp_path, clip), "--no-progress"], capsys)
    assert rc == 2 and "fewer than the 50 asked for" in one_line_error(err)  # the default: refused
    rc, _, err = cli(["run", _run_file(tmp_path, clip, allow_fewer=True), "--no-progress"], capsys)
    assert rc == 0, err
    report = json.loads((tmp_path / "out" / "featcal.json").read_text())
    assert any("fewer than the 50 asked for" in w for w in report["warnings"])


def test_max_length_from_a_run_file_reaches_the_merge(clip, tmp_path, capsys, monkeypatch):
    seen = []
    real = merge_api.merge_to

    def spy(request):
        seen.append(request.options)
        return real(request)

    monkeypatch.setattr(merge_api, "merge_to", spy)
    rc, _, err = cli(["run", _run_file(tmp_path, clip, calibrate=False, max_length=7, allow_fewer=True),
                      "--no-progress"], capsys)
    assert rc == 0, err
    options = seen[0]
    assert (options.max_length, options.allow_fewer, options.overwrite, options.allow_pickle) == (7, True, False, False)


@pytest.mark.parametrize(("key", "value", "flags", "message"), [
    ("max_length", 0, ("--max-length", "0"), "invalid RunOptions: max_length: Value error, max_length must be at least 1"),
    ("max_length", -3, ("--max-length", "-3"), "invalid RunOptions: max_length: Value error, max_length must be at least 1"),
])
def test_a_bad_value_is_the_same_error_from_cli_yaml_and_python(clip, tmp_path, capsys, key, value, flags, message):
    rc, _, err = cli(["run", _run_file(tmp_path, clip, **{key: value}), "--no-progress"], capsys)
    assert rc == 2 and message in one_line_error(err), err
    rc, _, err = cli(calibrate_argv(clip, tmp_path / "c", *flags), capsys)
    assert rc == 2 and message in one_line_error(err), err
    rc, _, err = cli(merge_argv(clip["base"], clip["experts"], tmp_path / "m", *flags), capsys)
    assert rc == 2 and message in one_line_error(err), err
    with pytest.raises(ConfigError, match=message):
        merge(clip["base"], clip["experts"], progress=False, **{key: value})
    assert not any((tmp_path / d).exists() for d in ("out", "c", "m"))


def test_run_options_refuse_non_booleans_and_unknown_keys(clip, tmp_path, capsys):
    with pytest.raises(ConfigError, match="allow_fewer: Input should be a valid boolean"):
        run_options(allow_fewer="sometimes")
    with pytest.raises(ConfigError, match="max_length: Value error, Input should be a number, not the boolean true"):
        run_options(max_length=True)
    rc, _, err = cli(["run", _run_file(tmp_path, clip, allow_fewer="sometimes"), "--no-progress"], capsys)
    assert rc == 2 and "invalid RunOptions: allow_fewer: Input should be a valid boolean" in one_line_error(err)
