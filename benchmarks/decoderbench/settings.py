"""What a decoder-bench run is made of: one dataclass, its per-model defaults and the tiny mode's."""

from __future__ import annotations

from dataclasses import dataclass

from decoderbench.sources import DOMAINS
from decoderbench.summary import MERGES

MODELS = ("smollm2", "gemma3")
MODEL_TITLES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma-3-270M"}


@dataclass
class Settings:
    model: str = "smollm2"
    tiny: bool = False
    domains: tuple[str, ...] = DOMAINS
    seeds: tuple[int, ...] = (0, 1, 2)  # each: the data split and order, and the experts' training seed
    seq_len: int = 128  # tokens per window (training, calibration, selection, test)
    batch_size: int = 4
    steps: int = 40
    lr: float = 3e-4
    warmup: int = 4
    train_layers: int = 15  # the last N blocks are trained; the rest, the embeddings and the tied head stay the base's
    eval_windows: int = 24  # held-out test windows per domain
    eval_batch: int = 8
    select_windows: int = 16  # held-out calibration windows per domain that choose the best merge
    calib_sizes: tuple[int, ...] = (8, 32, 128)  # calibration windows per domain of the size curve
    main_size: int = 32  # the size of the every-merge rows (and RegMean's windows)
    calib_batch: int = 8
    merges: tuple[str, ...] = MERGES
    ta_scaling: float = 0.3
    ties_density: float = 0.2
    ties_scaling: float = 1.0
    wudi_steps: int | None = None  # None: featcal's (the paper's) 300 Adam iterations per Linear
    curve: tuple[str, ...] = ("featcal", "featcal_tuned")  # TA + these at every calib size
    tune_every_merge: bool = False  # also --tune on TIES, RegMean and WUDI at the main size
    tune_budget: float | None = None  # None: featcal's default
    keep_models: bool = False  # else a calibrated checkpoint's weights are deleted once it is evaluated
    base_from_gguf: bool = False  # merges and calibrations read the .gguf (else its safetensors copy)
    threads: int = 2
    runner: str = "subprocess"  # each stage a fresh `featcal` process (its own time and peak RSS), or in-process

    def per_seed(self, seed: int) -> dict:
        """The fields an expert's key reads, at one seed."""
        return {"seq_len": self.seq_len, "batch_size": self.batch_size, "steps": self.steps, "lr": self.lr,
                "warmup": self.warmup, "train_layers": self.train_layers, "seed": seed}


# Gemma-3-270M: every block trained, three times the steps (docs/bench-decoder.md, "Gemma-3-270M: the plan")
MODEL_DEFAULTS = {"gemma3": {"train_layers": 18, "steps": 120}}
TINY = dict(seeds=(0, 1), seq_len=32, batch_size=4, steps=20, lr=1e-2, warmup=1, train_layers=4, eval_windows=4,
            eval_batch=4, select_windows=2, calib_sizes=(4, 8), main_size=4, calib_batch=4, tune_budget=6.0, wudi_steps=20,
            threads=1, runner="inprocess")
