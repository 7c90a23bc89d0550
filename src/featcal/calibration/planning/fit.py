"""Which machine a calibration fits, with which memory options, and roughly how long it takes there.

A target is a kind of machine: its device memory (none for the CPU), its host memory and its stated throughput
(cost.py). The option sets, from the simplest: the models resident on the device, then offloaded block by block
(--offload-blocks); within each, float32 chains, bfloat16 chains, the chains spilled to disk. Of those whose
planned host and device peaks (planner.py) fit, the answer is the quickest by the time estimate (offloading moves
every block and chain entry across the bus; spilled chains go through the disk), the simpler one when it is
within 5 % of it. When none fits, the batch is halved on the most frugal set. On the CPU "offload" can only mean
the disk: bfloat16 chains, then --spill-dir.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from featcal.calibration.planning import cost
from featcal.calibration.planning.planner import (
    MemoryPlan,
    ModelShape,
    alternatives,
    current_rss,
    estimate,
    fmt,
    model_shape,
    render,
)
from featcal.config import DEFAULT_MAX_LENGTH, FeatCalConfig
from featcal.errors import ConfigError
from featcal.io.read.models import load_config

GiB = 2**30
SPILL = Path("DIR")  # what the options name; a run picks its own folder
QUICKER = 0.05  # a more intrusive option set is preferred only when its time estimate is at least this much lower


@dataclass(frozen=True)
class Target:
    name: str
    device: str  # FeatCalConfig.device on that machine
    device_bytes: int | None  # None: the CPU (no device memory apart from the host's)
    host_bytes: int
    throughput: cost.Throughput


TARGETS: dict[str, Target] = {
    "gpu-24gb": Target("gpu-24gb", "cuda", 24 * GiB, 128 * GiB, cost.THROUGHPUTS["gpu-24gb"]),
    "gpu-80gb": Target("gpu-80gb", "cuda", 80 * GiB, 256 * GiB, cost.THROUGHPUTS["gpu-80gb"]),
    "cpu": Target("cpu", "cpu", None, 128 * GiB, cost.THROUGHPUTS["cpu"]),
}


def target(name: str, *, device_bytes: int | None = None, host_bytes: int | None = None,
           f32: float | None = None, f64: float | None = None) -> Target:
    """A stated target with what the user changed (--device-memory, --host-memory, --flops, --flops64)."""
    if name not in TARGETS:
        raise ConfigError(f"--target {name!r} is not one of {', '.join(TARGETS)}")
    t = TARGETS[name]
    return Target(t.name, t.device, t.device_bytes if device_bytes is None or t.device_bytes is None else device_bytes,
                  host_bytes or t.host_bytes, cost.with_rates(t.throughput, f32, f64))


@dataclass(frozen=True)
class Fit:
    target: Target
    options: str  # the flags that make it fit (or the most frugal tried, when none does)
    config: FeatCalConfig
    plan: MemoryPlan
    time: cost.TimeEstimate
    fits: bool

    @property
    def short_of(self) -> str:
        """What does not fit, in words ('' when it fits)."""
        out = []
        if self.plan.total > self.target.host_bytes:
            out.append(f"host needs {fmt(self.plan.total)} of {fmt(self.target.host_bytes)}")
        dev = self.target.device_bytes
        if dev is not None and self.plan.device_total > dev:
            out.append(f"device needs {fmt(self.plan.device_total)} of {fmt(dev)}")
        return "; ".join(out)


def _candidates(config: FeatCalConfig, t: Target) -> list[tuple[str, FeatCalConfig]]:
    """(flags, config) from the simplest to the most frugal; the user's own choices kept."""
    on_device = t.device != "cpu"
    base = config.model_copy(update={"device": t.device, "offload_blocks": config.offload_blocks and on_device})
    memory = [("", {})]
    if base.chain_dtype == "float32":
        memory.append(("--chain-dtype bfloat16", {"chain_dtype": "bfloat16"}))
    if base.spill_dir is None:
        memory.append((f"{memory[-1][0]} --spill-dir DIR", {**memory[-1][1], "spill_dir": SPILL}))
    placements = [False, True] if on_device and not base.offload_blocks else [base.offload_blocks]
    out = []
    for offload in placements:
        for flags, update in memory:
            words = f"{'--offload-blocks' if offload and not config.offload_blocks else ''} {flags}".split()
            out.append((" ".join(words), base.model_copy(update={**update, "offload_blocks": offload})))
    return out


def _smaller_batches(flags: str, config: FeatCalConfig) -> list[tuple[str, FeatCalConfig]]:
    bs, out = min(config.calibration_batch_size, config.num_calibration_examples), []
    while bs > 1:
        bs //= 2
        out.append((f"{flags} --calibration-batch-size {bs}".strip(), config.model_copy(
            update={"calibration_batch_size": bs})))
    return out


def fit(shape: ModelShape, t: Target, *, tasks: int, config: FeatCalConfig, baseline_bytes: int,
        file_bytes: int = 4, world: int = 1) -> Fit:
    """What fits target `t`: of the option sets that fit at the user's batch size, the quickest by the time estimate,
    unless an earlier (simpler) one is within QUICKER of it; when none fits, the batch is halved on the most
    frugal set until it fits (else that last try is returned, not fitting)."""
    def attempt(flags: str, cfg: FeatCalConfig) -> Fit:
        plan = estimate(shape, tasks=tasks, config=cfg, baseline_bytes=baseline_bytes, world=world)
        fits = plan.total <= t.host_bytes and (t.device_bytes is None or plan.device_total <= t.device_bytes)
        blocks = cost.run_counts(shape, tasks=tasks, config=cfg, file_bytes=file_bytes)
        time = cost.estimate_time(blocks, t.throughput, model_bytes=shape.param_count * file_bytes)
        return Fit(t, flags or "(none)", cfg, plan, time, fits)

    tried = [attempt(flags, cfg) for flags, cfg in _candidates(config, t)]
    fitting = [f for f in tried if f.fits]
    if fitting:
        quickest = min(f.time.total_s for f in fitting)
        return next(f for f in fitting if f.time.total_s <= quickest * (1 + QUICKER))
    last = tried[-1]
    for flags, cfg in _smaller_batches(last.options.replace("(none)", ""), last.config):
        last = attempt(flags, cfg)
        if last.fits:
            break
    return last


def render_fits(fits: list[Fit]) -> str:
    """The targets table `featcal plan` prints."""
    lines = ["what fits where (host / device memory of each target; --device-memory, --host-memory to change):"]
    for f in fits:
        t = f.target
        dev = f"{fmt(t.device_bytes)} device, " if t.device_bytes is not None else ""
        where = f"  {t.name} ({dev}{fmt(t.host_bytes)} host): "
        if f.fits:
            device = f", device {fmt(f.plan.device_total)}" if f.plan.device_components else ""
            disk = f", disk {fmt(f.plan.chain_bytes_total)}" if f.config.spill_dir is not None else ""
            lines.append(f"{where}fits with {f.options}: host {fmt(f.plan.total)}{device}{disk}; "
                         f"≈ {cost.duration(f.time.total_s)}")
        else:
            lines.append(f"{where}does NOT fit, even with {f.options}: {f.short_of}")
    return "\n".join(lines)


def file_bytes(model_config) -> int:
    """Bytes per parameter in the checkpoints, from the config's dtype (float32 when it names none)."""
    import torch

    dtype = getattr(model_config, "dtype", None) or getattr(model_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 4


@dataclass(frozen=True)
class ConfigPlan:
    """A calibration planned from a model's config alone: what `featcal plan --config` prints, as numbers."""

    source: str  # the config.json, folder or hub id planned from
    architecture: str
    param_count: int  # parameters and buffers
    file_bytes: int  # bytes per parameter in its files
    tasks: int
    num_calibration_examples: int
    max_length: int
    memory: MemoryPlan  # at the given config
    alternatives: list[tuple[str, MemoryPlan]]  # (flags, plan) of the memory options
    blocks: list[cost.BlockCounts]
    time: cost.TimeEstimate  # one calibration at the given throughput
    fits: list[Fit]  # one per target


def config_plan(source: str | os.PathLike, *, tasks: int, config: FeatCalConfig, max_length: int = DEFAULT_MAX_LENGTH,
                targets: list[Target] = (), throughput: cost.Throughput | None = None,
                baseline_bytes: int | None = None, world: int = 1) -> ConfigPlan:
    """Plan from a model's config alone (`source`: a config.json, a folder, a hub id): the memory plan at `config`,
    its time at `throughput` (the stated one of config.device when None), and, for each of `targets`, what fits."""
    model_config = load_config(source)
    shape = model_shape(model_config, max_length)
    base = current_rss() if baseline_bytes is None else baseline_bytes
    per_param = file_bytes(model_config)
    kw = dict(tasks=tasks, config=config, baseline_bytes=base, world=world)
    blocks = cost.run_counts(shape, tasks=tasks, config=config, file_bytes=per_param)
    tp = throughput or cost.throughput_for(config.device)
    return ConfigPlan(
        source=str(source), architecture=(getattr(model_config, "architectures", None)
                                          or [type(model_config).__name__])[0],
        param_count=shape.param_count, file_bytes=per_param, tasks=tasks,
        num_calibration_examples=config.num_calibration_examples, max_length=max_length,
        memory=estimate(shape, **kw), alternatives=alternatives(shape, **kw), blocks=blocks,
        time=cost.estimate_time(blocks, tp, model_bytes=shape.param_count * per_param),
        fits=[fit(shape, t, file_bytes=per_param, **kw) for t in targets],
    )


def render_config_plan(p: ConfigPlan, *, with_plan: bool = True, max_memory: int | None = None) -> str:
    """The text `featcal plan --config` prints (`with_plan` False: the targets' table alone)."""
    parts = []
    if with_plan:
        parts.append(f"plan for {p.source}: {p.architecture}, {p.param_count:,} parameters and buffers ({p.file_bytes} "
                     f"B each in its files), {p.tasks} task(s) × {p.num_calibration_examples} examples × up to "
                     f"{p.max_length} tokens")
        parts.append(render(p.memory, p.alternatives, max_memory))
        parts.append(cost.render_time(p.blocks, p.time))
    if p.fits:
        parts.append(render_fits(p.fits))
    return "\n".join(parts)


def plan_report(source: str | os.PathLike, *, tasks: int, config: FeatCalConfig, max_length: int = DEFAULT_MAX_LENGTH,
                targets: list[Target] = (), throughput: cost.Throughput | None = None, with_plan: bool = True,
                max_memory: int | None = None, baseline_bytes: int | None = None, world: int = 1) -> str:
    """What `featcal plan` prints from a model's config alone (config_plan, rendered): the memory plan at `config`
    (with `with_plan`), its time at `throughput`, and, for each of `targets`, what fits there."""
    return render_config_plan(config_plan(source, tasks=tasks, config=config, max_length=max_length, targets=targets,
                                          throughput=throughput, baseline_bytes=baseline_bytes, world=world),
                              with_plan=with_plan, max_memory=max_memory)
