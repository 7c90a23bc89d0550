"""`--no-progress` means no bar at all: neither featcal's nor transformers' ("Loading weights",
"Writing model shards"), in a zoo build and in a bench on a micro zoo."""

from __future__ import annotations

import dataclasses
import re

from featcal.experiments.bench.run import BenchSettings, run_bench
from featcal.experiments.zoo.build import build_zoo
from featcal.experiments.zoo.presets import PRESETS, ModelShape
from featcal.experiments.zoo.pretrain import PretrainSettings
from featcal.experiments.zoo.train import FinetuneSettings

MICRO = dataclasses.replace(
    PRESETS["tiny"], name="micro-quiet", tasks=("stripes", "colours"),
    model=ModelShape(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2),
    train=64, calibration=16, test=32,
    pretrain=PretrainSettings(images=200, categories=8, steps=3, batch_size=16, lr=1e-3, warmup=1),
    finetune=FinetuneSettings(steps=3, batch_size=16, lr=1e-3, warmup=1),
)
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
