"""What a decoder-bench run is made of: one dataclass, its per-model defaults and the tiny mode's.

The defaults are sized to the machine: one seed of SmolLM2-135M, every row, within 90 minutes of two idle
cores by the bench's own --plan estimate (docs/bench-decoder.md, "Default sizing"): calibration at 32 windows
per domain, the 8 / 32 / 128 size curve on TA + default FeatCal only, 16 test and 8 selection windows per
domain, WUDI at 50 Adam steps, --tune at budget 6.
"""

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
    seeds: tuple[int, ...] = (0,)  # each: the data split and order, and the experts' training seed (--seeds 0,1,2)
    seq_len: int = 128  # tokens per window (training, calibration, selection, test)
    batch_size: int = 4
    steps: int = 40
    lr: float = 3e-4
    warmup: int = 4
    train_layers: int = 15  # the last N blocks are trained; the rest, the embeddings and the tied head stay the base's
    eval_windows: int = 16  # held-out test windows per domain
    eval_batch: int = 8
    select_windows: int = 8  # held-out calibration windows per domain that choose the best merge
    calib_sizes: tuple[int, ...] = (8, 32, 128)  # calibration windows per domain of the size curve
    main_size: int = 32  # the size of the every-merge rows (and RegMean's windows)
    calib_batch: int = 8
    merges: tuple[str, ...] = MERGES
    ta_scaling: float = 0.3
    ties_density: float = 0.2
    ties_scaling: float = 1.0
    wudi_steps: int | None = 50  # Adam iterations per Linear; None: featcal's (the paper's) 300
    curve: tuple[str, ...] = ("featcal",)  # TA + these at every calib size (the cheap rows only)
    tune_every_merge: bool = False  # also --tune on TIES, RegMean and WUDI at the main size
    tune_budget: float | None = 6.0  # --tune-budget (None: featcal's default, 10)
    tune_screen: str | None = None  # --tune-screen (None: featcal's default, off)
    tune_scope: str | None = None  # --tune-scope (None: featcal's default, model; block: rho and lambda per block)
    tune_fixed: str | None = None  # --tune-fixed (None: featcal's default; "anchor_blend_rho,lambda_ratio,
    # teacher_interp_alpha": the merge's scaling alone, what the text bench measured as the search's lever)
    tune_confirm: int | None = None  # --tune-confirm (None: featcal's default, 2; 0: the screen's best is the choice)
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
# --tiny: a few steps and windows, both curve variants (the pipeline's every path), every stage in-process
TINY = dict(seeds=(0, 1), seq_len=32, batch_size=4, steps=20, lr=1e-2, warmup=1, train_layers=4, eval_windows=4,
            eval_batch=4, select_windows=2, calib_sizes=(4, 8), main_size=4, calib_batch=4, tune_budget=6.0, wudi_steps=20,
            curve=("featcal", "featcal_tuned"), threads=1, runner="inprocess")
