"""`--no-progress` means no bar at all: neither featcal's nor transformers' ("Loading weights",
"Writing model shards"), in a zoo build and in a bench on a micro zoo."""

from __future__ import annotations

import re

from featcal.experiments.bench.run import BenchSettings, run_bench
from featcal.experiments.zoo.build import build_zoo
from featcal.experiments.zoo.presets import PRESETS
from tests.builders.zoo import micro_preset

MICRO = micro_preset("micro-quiet", steps=3, warmup=1)
BAR = re.compile(r"Loading weights|Writing model shards|\d+%\||it/s|s/it")


def test_zoo_build_and_bench_draw_no_bar_without_progress(tmp_path, capfd, monkeypatch):
    cache = tmp_path / "bases"
    build_zoo(tmp_path / "a", MICRO, seed=0, progress=False, base_cache=cache)  # saves: "Writing model shards"
    build_zoo(tmp_path / "b", MICRO, seed=0, progress=False, base_cache=cache)  # loads the cached base too
    out, err = capfd.readouterr()
    assert not BAR.search(err) and not BAR.search(out), err[-2000:]

    monkeypatch.setitem(PRESETS, MICRO.name, MICRO)
    settings = BenchSettings(preset=MICRO.name, calib_sizes=(8,), methods=("average",), zoo_dir=tmp_path / "a",
                             wudi_steps=1, eval_batch_size=32)
    run_bench(settings, progress=False)  # loads experts and base: "Loading weights"
    out, err = capfd.readouterr()
    assert not BAR.search(err) and not BAR.search(out), err[-2000:]
