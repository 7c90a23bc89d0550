"""`featcal plan` as a use case: the peak memory and the time a calibration would need, before any work.

Two ways to plan. From a run's inputs, as `featcal calibrate` takes them (base, merged, experts, calibration data,
out): every check the run makes before its work, then the memory plan from the merge's config.json, what each
task's data gives, the time (measured by a short probe of this machine, or at a stated throughput) and, for each
target, what fits there. From a model's config alone (`model_config`, `tasks`): no weights, no data; the same plan
at a stated throughput, and what fits on each target (all of them by default). See calibration/planning/planner.py
(memory), cost.py and time_estimate.py (time), fit.py (targets).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from featcal.config import FeatCalConfig, RunOptions
from featcal.errors import ConfigError

if TYPE_CHECKING:  # torch-free at import: the CLI's help imports this module's command without torch
    from featcal.calibration.planning import cost
    from featcal.calibration.planning.fit import Fit
    from featcal.calibration.planning.planner import MemoryPlan

__all__ = ["PlanRequest", "PlanResult", "plan"]

Size = int | str  # bytes, or a size such as "16GiB"


@dataclass(frozen=True)
class PlanRequest:
    """One `featcal plan`: a calibration's inputs (base, merged, experts, calibration, out, heads: the flags --base,
    --merged, --expert, --calib, --out, --tune-head), or a model's config alone (model_config, tasks: --config,
    --tasks); the calibration's settings (config: FeatCalConfig; options: RunOptions, --max-length and the other
    run flags); what to plan for: max_memory (--max-memory), targets (--target: gpu-24gb, gpu-80gb, cpu),
    device_memory / host_memory (the targets'), flops / flops64 (the stated throughput's rates), time_from
    ("probe", "stated", or None: a probe for a run on this machine, the stated throughput otherwise).

    check_device: refuse a config.device this machine lacks (calibrate --dry-run does; featcal plan plans for
    another machine). estimate_time / summarise_data: leave out the time, or the read of each task's data for its
    summary (the checks read the data anyway). world: ranks (None: $WORLD_SIZE, else 1); baseline_bytes: the
    process's memory before the run (None: this process's, measured now)."""

    base: str | os.PathLike | None = None
    merged: str | os.PathLike | None = None
    experts: Mapping[str, str | os.PathLike] = field(default_factory=dict)
    calibration: Mapping[str, Any] = field(default_factory=dict)
    out: str | os.PathLike | None = None
    heads: Mapping[str, str | os.PathLike] = field(default_factory=dict)
    model_config: str | os.PathLike | None = None
    tasks: int | None = None
    config: FeatCalConfig = field(default_factory=FeatCalConfig)
    options: RunOptions = field(default_factory=RunOptions)
    max_memory: Size | None = None
    targets: tuple[str, ...] | None = None
    device_memory: Size | None = None
    host_memory: Size | None = None
    flops: float | None = None
    flops64: float | None = None
    time_from: Literal["probe", "stated"] | None = None
    check_device: bool = False
    estimate_time: bool = True
    summarise_data: bool = True
    world: int | None = None
    baseline_bytes: int | None = None


@dataclass(frozen=True)
class PlanResult:
    """A plan: the numbers `featcal plan` prints, and its text (`text`, what it prints)."""

    memory: MemoryPlan  # at the request's config; .total: peak host memory per process in bytes
    alternatives: list[tuple[str, MemoryPlan]]  # (flags, plan) of the memory options
    max_memory: int | None  # the limit planned against, in bytes
    time: cost.TimeEstimate | None  # one calibration's time (None without estimate_time); .total_s: seconds
    blocks: list[cost.BlockCounts]  # per block: token positions, forwards, solves, FLOPs, bytes read
    fits: list[Fit]  # one per target
    data: Mapping[str, Mapping[str, Any]]  # per task: the examples and tokens its data gives (from checkpoints)
    text: str

    @property
    def peak_memory(self) -> int:
        """Estimated peak host memory (RSS) per process, in bytes."""
        return self.memory.total

    @property
    def peak_device_memory(self) -> int:
        """Estimated peak device memory per process, in bytes (0 when the run keeps nothing on a device)."""
        return self.memory.device_total

    @property
    def seconds(self) -> float | None:
        """Estimated seconds of one calibration (None without estimate_time)."""
        return None if self.time is None else self.time.total_s

    @property
    def fits_max_memory(self) -> bool | None:
        """Whether the peak fits max_memory (None without one)."""
        return None if self.max_memory is None else self.memory.total <= self.max_memory

    def options_that_fit(self) -> list[str]:
        """The memory options (flags) whose peak fits max_memory (all of them without one)."""
        return [name for name, p in self.alternatives if self.max_memory is None or p.total <= self.max_memory]


def plan(request: PlanRequest | None = None, /, **fields: Any) -> PlanResult:
    """Plan a calibration before any work, as `featcal plan` does: its peak memory, its time, what fits where.

    `request`: a PlanRequest, or PlanRequest's fields as keywords (`featcal.plan(base=..., merged=..., experts=...,
    calibration=..., out=..., config=FeatCalConfig(...))`, or `featcal.plan(model_config="config.json", tasks=4)`).
    From checkpoints, every check the calibration makes before its work is made (a plan that returns is a run that
    starts), reading no weights. Raises a FeatCalError naming the culprit."""
    if request is None:
        request = PlanRequest(**fields)
    elif fields:
        raise TypeError("plan takes a PlanRequest or its fields as keywords, not both")
    _check(request)
    if request.model_config is not None:
        return _plan_from_config(request)
    return _plan_from_checkpoints(request)


def _check(r: PlanRequest) -> None:
    """The request's inputs: checkpoints and data, or a config alone; positive rates."""
    given = [n for n in ("base", "merged", "out") if getattr(r, n) is not None]
    given += [n for n in ("experts", "calibration") if getattr(r, n)]
    if r.model_config is not None:
        if given:
            raise ConfigError(f"model_config plans from a model's config alone, while {', '.join(given)} name a "
                              "run's checkpoints and data: give one or the other")
        if r.tasks is None or r.tasks < 1:
            raise ConfigError(f"model_config needs tasks: the number of experts (tasks) to plan for, got {r.tasks}")
    else:
        missing = [n for n in ("base", "merged", "experts", "calibration", "out") if n not in given]
        if missing:
            raise ConfigError(f"a plan needs {', '.join(missing)} (a calibration's inputs), or model_config and "
                              "tasks to plan from a model's config alone")
        if r.tasks is not None:
            raise ConfigError("tasks goes with model_config: with checkpoints, the tasks are the experts given")
    for name in ("flops", "flops64"):
        value = getattr(r, name)
        if value is not None and not value > 0:
            raise ConfigError(f"{name} must be a positive number of FLOP/s, got {value}")


def _size(value: Size | None) -> int | None:
    from featcal.calibration.planning.planner import parse_size

    return parse_size(value) if isinstance(value, str) else value


def _world(r: PlanRequest) -> int:
    return r.world if r.world is not None else int(os.environ.get("WORLD_SIZE", "1"))


def _measure(r: PlanRequest) -> bool:
    """Whether the time comes from a measured probe of this machine: time_from, by default a probe for a run on
    this machine (checkpoints given, its device here, no flops) and the stated throughput for model_config."""
    from featcal.calibration.planning.time_estimate import can_probe

    rates = [f"--{f}" for f in ("flops", "flops64") if getattr(r, f) is not None]
    if r.time_from == "probe":
        if rates:
            raise ConfigError(f"--time-from probe measures the rates that {' and '.join(rates)} state: give one")
        if not can_probe(r.config.device):
            raise ConfigError(f"--time-from probe: device {r.config.device} is not on this machine to be measured; "
                              "use --time-from stated (or --flops) to plan for it")
        return True
    if r.time_from == "stated":
        return False
    return r.model_config is None and not rates and can_probe(r.config.device)


def _targets(r: PlanRequest, default: tuple[str, ...]) -> list:
    from featcal.calibration.planning import fit

    return [fit.target(name, device_bytes=_size(r.device_memory), host_bytes=_size(r.host_memory), f32=r.flops,
                       f64=r.flops64) for name in (r.targets or default)]


def _stated(r: PlanRequest) -> cost.Throughput:
    from featcal.calibration.planning import cost

    return cost.with_rates(cost.throughput_for(r.config.device), r.flops, r.flops64)


def _plan_from_checkpoints(r: PlanRequest) -> PlanResult:
    from featcal.calibration.planning import fit
    from featcal.calibration.planning.planner import plan_for_checkpoint, render
    from featcal.calibration.planning.time_estimate import render_run_time, run_time

    limit = _size(r.max_memory)
    measure = r.estimate_time and _measure(r)
    targets = _targets(r, ())
    checked = _check_inputs(r)
    memory, options = plan_for_checkpoint(checked.merged, tasks=len(r.experts), config=r.config,
                                          max_length=r.options.max_length, baseline_bytes=r.baseline_bytes,
                                          world=_world(r))
    parts = [render(memory, options, limit)]
    data = _data(r, checked) if r.summarise_data else {}
    if data:
        from featcal.calibration.front.data_summary import task_data_lines

        parts.append("\n".join(task_data_lines(data, r.options.max_length)))
    blocks, time = [], None
    if r.estimate_time:
        blocks, time = run_time(checked.merged, tasks=len(r.experts), config=r.config,
                                max_length=r.options.max_length, measure=measure, throughput=_stated(r))
        parts.append(render_run_time(blocks, time, r.config))
    fits = []
    if targets:
        found = fit.config_plan(checked.merged, tasks=len(r.experts), config=r.config, max_length=r.options.max_length,
                                targets=targets, baseline_bytes=r.baseline_bytes, world=_world(r))
        fits = found.fits
        parts.append(fit.render_config_plan(found, with_plan=False))
    return PlanResult(memory=memory, alternatives=options, max_memory=limit, time=time, blocks=blocks, fits=fits,
                      data=data, text="\n".join(parts))


def _check_inputs(r: PlanRequest):
    """Every check the run makes before its work (task names, options, output, checkpoints' headers, each task's
    data as the run draws and tokenises it, the head files), so a plan that returns is a run that starts; the NaN
    scan, which reads all weights, is left."""
    from featcal.calibration.front.pipeline import CalibrateRequest, check_calibration_inputs, feature_width
    from featcal.calibration.tuning import load_heads
    from featcal.io.read.models import load_config

    heads = dict(r.heads)
    checked = check_calibration_inputs(CalibrateRequest(
        r.merged, r.base, dict(r.experts), dict(r.calibration), r.out, config=r.config, options=r.options, heads=heads,
        check_finite=False, progress=False,
    ), check_device=r.check_device)
    load_heads(heads, checked.tasks, r.config.tune, feature_width(load_config(checked.merged)))
    return checked


def _data(r: PlanRequest, checked) -> dict:
    """Per task, the examples and tokens its data gives the run and how it is read, read now as the run will read
    it (calibration/front/data_summary.py)."""
    from featcal.calibration.front.data_summary import read_task_data

    return read_task_data(checked.data)


def _plan_from_config(r: PlanRequest) -> PlanResult:
    import featcal.calibration.front.pipeline  # noqa: F401  (what calibrate imports: the measured baseline sees it too)
    from featcal.calibration.planning import fit

    limit = _size(r.max_memory)
    measure = r.estimate_time and _measure(r)
    targets = _targets(r, tuple(fit.TARGETS))
    tp = _stated(r)
    if measure:  # time_from "probe": this machine's rates, for the plan and its targets' times
        from featcal.calibration.planning import time_estimate
        from featcal.calibration.planning.planner import model_shape
        from featcal.io.read.models import load_config

        shape = model_shape(load_config(r.model_config), r.options.max_length)
        found = time_estimate.probe(shape, r.config, device=time_estimate.probe_device(r.config.device))
        tp = time_estimate.measured_throughput(found, tp)
    p = fit.config_plan(r.model_config, tasks=r.tasks, config=r.config, max_length=r.options.max_length,
                        targets=targets, throughput=tp, baseline_bytes=r.baseline_bytes, world=_world(r))
    return PlanResult(memory=p.memory, alternatives=p.alternatives, max_memory=limit, time=p.time, blocks=p.blocks,
                      fits=p.fits, data={}, text=fit.render_config_plan(p, max_memory=limit))

