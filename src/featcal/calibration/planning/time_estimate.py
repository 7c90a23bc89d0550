"""The time a calibration would take on this machine, from a short measured probe.

calibration/planning/cost.py counts what a run computes (per block: forwards, statistics, fold and solves, bytes
read) and turns the counts into seconds at a Throughput. Its stated throughputs describe kinds of machines
(a CPU server, a 24 GB card, an 80 GB card); `measure` replaces them by what this machine does now: it
times, for about half a second, float32 products shaped as the run's largest block Linear on one batch
of tokens ((batch·tokens × in)·(in × out)), and float64 work shaped as its fold and solve (an in×in
product with out columns, a Cholesky factor and its triangular solves), at torch's current thread count
(--threads) and on the run's device. The estimate says which source it used, and the probe's shapes,
threads and duration.

What the probe does not see: checkpoint reads (their rate stays the stated one), attention's own
products (counted in the forwards at the float32 rate), Python and hook overhead between small
operations (it dominates tiny models, so a tiny run takes longer than its estimate), and other
processes sharing the machine later. Widths above PROBE_WIDTH_CAP are probed at the cap: the probe
stays bounded in memory and time for any model, and a product that wide already runs near its
sustained rate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from featcal.calibration.planning import cost
from featcal.config import FeatCalConfig

PROBE_SECONDS = 0.5  # the whole probe, both parts
PROBE_WIDTH_CAP = 2048
PROBE_ROWS_CAP = 4096


@dataclass(frozen=True)
class Probe:
    """What was timed: the shapes, the device and threads, and the rates found."""

    rows: int
    width_in: int
    width_out: int
    device: str
    threads: int
    seconds: float
    f32: float  # FLOP/s
    f64: float


def _largest_linear(shape) -> tuple[int, int, int]:
    """(token rows per batch, in, out) of the block Linear with the most work per token, over every stack."""
    best = (0, 0, 0, 0)
    for stack in shape.stacks:
        for block in stack.blocks:
            for _, i, o in block.linears:
                if i * o > best[0]:
                    best = (i * o, stack.tokens, i, o)
    return best[1], best[2], best[3]


def _timed(fn, budget: float, sync) -> tuple[int, float]:
    """(calls, seconds) of repeating `fn` until `budget` seconds have passed (one untimed warm-up call first)."""
    fn()
    sync()
    calls, start = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= budget:
            return calls, elapsed


def probe(shape, config: FeatCalConfig, *, seconds: float = PROBE_SECONDS, device: str = "cpu") -> Probe:
    """Time float32 and float64 work shaped as the run's (`shape`: planner.ModelShape) on `device`."""
    tokens, width_in, width_out = _largest_linear(shape)
    i, o = min(width_in, PROBE_WIDTH_CAP), min(width_out, PROBE_WIDTH_CAP)
    rows = max(1, min(config.calibration_batch_size * max(tokens, 1), PROBE_ROWS_CAP))
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, i, generator=g).to(dev)
    w = torch.randn(o, i, generator=g).to(dev)
    calls32, t32 = _timed(lambda: x @ w.T, seconds / 2, sync)

    a = torch.randn(i, i, generator=g, dtype=torch.float64).to(dev)
    gram = a @ a.T + i * torch.eye(i, dtype=torch.float64, device=dev)  # well conditioned, as the solver's are
    rhs = torch.randn(i, o, generator=g, dtype=torch.float64).to(dev)

    def f64_work():
        folded = gram @ rhs  # the fold: an in×in product with out columns
        return torch.cholesky_solve(folded, torch.linalg.cholesky(gram))

    calls64, t64 = _timed(f64_work, seconds / 2, sync)
    f32 = 2 * rows * i * o * calls32 / t32
    f64 = 2 * (i * i * o + i**3 / 6 + i * i * o) * calls64 / t64  # product, Cholesky factor, two triangular solves
    return Probe(rows, i, o, str(dev), torch.get_num_threads(), t32 + t64, f32, f64)


def measured_throughput(p: Probe, stated: cost.Throughput) -> cost.Throughput:
    """`stated` with the probe's float32 and float64 rates (reads and transfers keep the stated rates)."""
    note = (f"a {p.seconds:.1f} s probe here just now: float32 ({p.rows}×{p.width_in})·({p.width_in}×"
            f"{p.width_out}) products and float64 {p.width_in}×{p.width_in} folds and Cholesky solves on "
            f"{p.device}, {p.threads} thread(s); checkpoint reads at the stated {stated.read / 1e9:.3g} GB/s")
    return replace(stated, name="this machine", f32=p.f32, f64=p.f64, note=note, source="measured")


def can_probe(device: str) -> bool:
    """Whether the run's device (FeatCalConfig.device) is here to be probed."""
    return device == "cpu" or torch.cuda.is_available()  # cuda, cuda:N and auto need a GPU here


def probe_device(device: str) -> str:
    """The device a FeatCalConfig.device runs on here."""
    return "cuda" if device == "auto" and torch.cuda.is_available() else "cpu" if device == "auto" else device


def run_time(source, *, tasks: int, config: FeatCalConfig, max_length: int, measure: bool,
             throughput: cost.Throughput | None = None) -> tuple[list[cost.BlockCounts], cost.TimeEstimate]:
    """The run's per-block counts and time: from a probe of this machine (`measure`), or at `throughput` (the stated
    one of config.device when None). `source`: the merged checkpoint or a config."""
    from featcal.calibration.planning.fit import file_bytes
    from featcal.calibration.planning.planner import model_shape
    from featcal.io.read.models import load_config

    model_config = load_config(source)
    shape = model_shape(model_config, max_length)
    per_param = file_bytes(model_config)
    stated = throughput or cost.throughput_for(config.device)
    tp = measured_throughput(probe(shape, config, device=probe_device(config.device)), stated) if measure else stated
    blocks = cost.run_counts(shape, tasks=tasks, config=config, file_bytes=per_param)
    return blocks, cost.estimate_time(blocks, tp, model_bytes=shape.param_count * per_param)


def render_run_time(blocks: list[cost.BlockCounts], est: cost.TimeEstimate, config: FeatCalConfig) -> str:
    """The counts and time as `featcal plan` prints them, with tune's line."""
    return cost.render_time(blocks, est) + tune_line(config, est.total_s)


def time_report(source, *, tasks: int, config: FeatCalConfig, max_length: int, measure: bool,
                throughput: cost.Throughput | None = None) -> str:
    """The run's counts and time (run_time), as `featcal plan` prints them."""
    blocks, est = run_time(source, tasks=tasks, config=config, max_length=max_length, measure=measure,
                           throughput=throughput)
    return render_run_time(blocks, est, config)


def tune_line(config: FeatCalConfig, one_calibration_s: float) -> str:
    """With `tune`: what the search and its refit cost at most, in calibrations on all the data and in time."""
    if not config.tune:
        return ""
    from featcal.calibration.tuning.search import planned_calibrations

    calibrations, how = planned_calibrations(config, config.num_calibration_examples)
    tape = ("" if config.tune_scope == "block" or not config.tune_cache_gb else
            f"; host memory: up to {config.tune_cache_gb:g} GiB more for the experts' block forwards kept across "
            "candidates (tune_cache_gb)")
    return (f"\n  --tune: at most {calibrations:.1f} calibrations' work ({how}) ≈ "
            f"{cost.duration(calibrations * one_calibration_s)}{tape}")
