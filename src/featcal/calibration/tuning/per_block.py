"""`tune` with tune_scope "block": one calibration whose blocks choose their own ρ and λ (block_tuning.py).

Here the examples are split and the search's inputs resolved before any work; the engine does the rest in the
calibration's own pass. The result's `tuning` is a BlockTuningRecord.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from featcal.blocks.adapters import adapter_for
from featcal.calibration.core import setting as core
from featcal.calibration.core.inputs import as_model, check_base_for_rho, check_tasks, normalise_batches
from featcal.calibration.core.result import BlockTuningRecord, CalibrationResult
from featcal.calibration.engine.block_tuning import BLOCK_CANDIDATES, BLOCK_KNOBS, BlockTuning
from featcal.calibration.engine.driver import SearchHooks
from featcal.calibration.tuning.search import resolve_fixed
from featcal.calibration.tuning.split import fewest_held_out, folds_record, split_calibration
from featcal.config import FeatCalConfig
from featcal.errors import ConfigError
from featcal.io.read.validate import validate_expert_names
from featcal.io.write.report import Timer

log = logging.getLogger("featcal.calibration")

CRITERION = ("per block, mean over tasks of ||h - h_expert||^2 / ||h_expert||^2 at the block's output on each "
             "task's held-out calibration examples (padding excluded; in a class-token-read stack's last block the "
             "other tokens weigh cls_token_weight), each candidate solved from the fit examples; lower is better")


def check_block_scope(config: FeatCalConfig, heads: Mapping[str, Any] | None) -> None:
    """What tune_scope "block" cannot do, refused before any work."""
    if heads:
        raise ConfigError("tune_scope 'block' scores each block's drift on held-out examples; task heads (--tune-head) "
                          "are read by the model-wide search only: drop them or use tune_scope 'model'")
    if config.block_statistics != "as_merged":
        raise ConfigError(f"tune_scope 'block' chooses each block's setting from the paper's statistics "
                          f"(block_statistics as_merged), not {config.block_statistics!r}: use one or the other")
    if config.tune_folds not in ("auto", 1):
        raise ConfigError(f"tune_scope 'block' scores one held-out part (tune_holdout), not tune_folds "
                          f"{config.tune_folds}: drop tune_folds or use tune_scope 'model'")


def calibrate_per_block(merged: Any, *, base: Any, experts: Mapping[str, Any],
                        calibration: Mapping[str, Iterable[Any]], config: FeatCalConfig, progress: bool = True,
                        inplace: bool = False, allow_pickle: bool = False, check_finite: bool = True,
                        expert_kind: Mapping[str, str] | None = None) -> CalibrationResult:
    """One calibration on all the examples whose every block is solved at the (ρ, λ) that scored best on the
    held-out examples after a solve from the fit examples (block_tuning.py)."""
    validate_expert_names(experts.keys())
    check_tasks(experts, calibration)
    check_base_for_rho(config, base)
    model = as_model(merged, "merged model", allow_pickle)
    adapter = adapter_for(model)
    main = adapter.main_input(model, adapter.stacks(model)[0])
    data = {t: normalise_batches(t, calibration[t], main) for t in experts}
    split = split_calibration(data, config.tune_holdout, config.seed)
    ordered = {t: split.fit[t] + split.held[t] for t in data}  # the fit batches first, then the held-out ones
    held = {t: frozenset(range(len(split.fit[t]), len(ordered[t]))) for t in data}
    fixed, _ = resolve_fixed(config.tune_fixed, fewest_held_out([split]))
    knobs = tuple(k for k in BLOCK_KNOBS if k not in fixed and (k != "anchor_blend_rho" or base is not None))
    tuning = BlockTuning(held, {k: float(getattr(config, k)) for k in knobs}, knobs, BLOCK_CANDIDATES)
    if config.resume and config.resume_dir is not None:
        log.warning("featcal tune: tune_scope 'block' runs without per-block checkpoints (resume is off for it)")
    clock = Timer()
    result = core.calibrate_setting(model, base=base, experts=experts, calibration=ordered,
                                    config=config.model_copy(update={"tune": False, "resume": False}),
                                    progress=progress, inplace=inplace or model is not merged,
                                    allow_pickle=allow_pickle, check_finite=check_finite, expert_kind=expert_kind,
                                    search=SearchHooks(block_tuning=tuning))
    record = BlockTuningRecord(criterion=CRITERION, holdout=config.tune_holdout, seed=config.seed,
                               split=folds_record([split]), searched=list(knobs), start=dict(tuning.start),
                               limit_per_block=tuning.limit, blocks=tuning.blocks,
                               seconds={"calibration": round(clock.seconds, 3)})
    return result.with_tuning(record)
