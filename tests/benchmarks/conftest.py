"""Fixtures of tests/benchmarks/test_decoder_bench*.py."""

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

DECODER_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "decoder_bench.py"


def load_decoder_bench():
    """benchmarks/decoder_bench.py as a module (benchmarks/ on the path, as running the script puts it)."""
    spec = importlib.util.spec_from_file_location("decoder_bench", DECODER_BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("decoder_bench", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def frozen_decoder_bench(monkeypatch, tmp_path_factory):
    """(bench module, decoderbench.keys, folder): the bench in this process, its keys read from a copy of
    src/featcal and benchmarks/decoderbench taken now, so that other work on the tree while a test runs
    changes no key it sees (the stages still run the live code)."""
    bench = load_decoder_bench()
    from decoderbench import keys

    import featcal

    root = tmp_path_factory.mktemp("sources")
    skip = shutil.ignore_patterns("__pycache__")
    shutil.copytree(Path(featcal.__file__).parent, root / "featcal", ignore=skip)
    shutil.copytree(DECODER_BENCH.parent / "decoderbench", root / "decoderbench", ignore=skip)
    monkeypatch.setattr(keys, "_ROOTS", {})
    monkeypatch.setattr(keys, "_DIGESTS", {})
    keys.set_roots(featcal=root / "featcal", bench=root / "decoderbench")
    return bench, keys, root
