"""What a calibration computes and moves, per block, counted from the model's shape; a time at a stated throughput.

The counts follow the engine (engine/driver.py) for `block_statistics` "as_merged", the default: per block and task,
every batch of the task runs through the expert's block (its statistics recorded), through the merged block as
merged (the merged statistics folded in), and through the calibrated block (propagation); one batch per task
also runs through the block as merged on the reference chain (the end-to-end drift), and one batch through the
whole merged model once, before the first block (the check that blocks replay as the model calls them). Then each task's sums
are folded into the float64 cross-task sums (an in×in×out product per Linear) and every Linear is solved
(a Cholesky factor of its in×in system and two triangular solves against its out right-hand sides).
"sequential" runs the merged block once more per stage (an upper bound is counted: whole forwards);
"sequential_one_pass" one forward per batch and side.

Multiply-accumulates per token follow experiments/bench/cost.py (the same count for a CLIP block: Grams as
their block-upper triangles, each cross moment in the cheaper of its two exact forms, attention as 2·tokens·
width); here they come from the block's own Linears (planner.BlockShape), so any family is counted.

The time is arithmetic over a stated throughput plus bytes over stated bandwidths, summed (reads and transfers
do not overlap compute today). Throughputs are sustained rates, roughly half the datasheet peaks, stated with
the estimate and overridable (`featcal plan --flops / --flops64`): an estimate to choose a machine by, not a
promise. `featcal plan` prints it; the planner's memory figures come from planner.py, this module's only input
being the same shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from featcal.blocks.grams import gram_chunks
from featcal.calibration.engine.chains import DTYPES
from featcal.calibration.engine.context import TEACHER_FORM_TOKENS_PER_INPUT
from featcal.config import FeatCalConfig

_OUTPUT_PROJECTIONS = {"out_proj", "o_proj", "o", "wo"}  # read the attention output, not the block input


@dataclass(frozen=True)
class Throughput:
    """Sustained rates of one kind of machine (FLOP/s, bytes/s)."""

    name: str
    f32: float  # the forwards and the statistics (float32 matrix products)
    f64: float  # the fold and the solves (float64)
    read: float  # expert and base checkpoints read from disk
    link: float  # host <-> device copies (offloaded blocks and chains); unused on the CPU
    note: str
    source: str = "stated"  # where the rates come from: "stated", or "measured" by a probe (time_estimate.py)


THROUGHPUTS: dict[str, Throughput] = {
    "cpu": Throughput("cpu", 1.0e12, 0.5e12, 2.0e9, 0.0,
                      "a 32-core AVX-512 server, about half its peak; this 2-core test machine does ~0.05e12"),
    "gpu-24gb": Throughput("gpu-24gb", 40e12, 0.6e12, 2.0e9, 20e9,
                           "an RTX 4090-class card: about half its 82.6 TFLOP/s float32 and 1.3 TFLOP/s float64 "
                           "peaks, PCIe 4.0 x16"),
    "gpu-80gb": Throughput("gpu-80gb", 30e12, 25e12, 2.0e9, 20e9,
                           "an A100/H100-class card: about half an H100's 67 TFLOP/s float32 (TF32 off) and its "
                           "float64 rate, PCIe"),
}


def throughput_for(device: str) -> Throughput:
    """The stated throughput of a FeatCalConfig.device: 'cpu', else (cuda, cuda:N, auto) the 80 GB class."""
    return THROUGHPUTS["cpu" if device == "cpu" else "gpu-80gb"]


def with_rates(tp: Throughput, f32: float | None = None, f64: float | None = None) -> Throughput:
    """`tp` with the FLOP/s the user gave (--flops, --flops64)."""
    out = replace(tp, f32=f32 or tp.f32, f64=f64 or tp.f64)
    return out if out == tp else replace(out, note=f"{tp.note}; rates overridden")


@dataclass(frozen=True)
class BlockCounts:
    """One block of one stack: what the calibration runs, computes and moves for it."""

    stack: str
    tokens: int  # token positions per side: tasks × examples × tokens per example
    batches: int  # batches over all tasks (block forwards of each kind below run on every one)
    expert_forwards: int  # batch forwards of the expert block
    merged_forwards: int  # batch forwards of the merged block as merged: statistics, reference, context check
    calibrated_forwards: int  # batch forwards of the calibrated block (propagation)
    linear_solves: int
    norm_solves: int
    largest_system: tuple[int, int]  # (in, out) of the widest Linear solve
    forward_macs: int  # all three sides' forwards
    statistics_macs: int  # Grams and cross moments (float32), with the teacher form's products where taken
    fold_macs: int  # float64: each task's sums folded into the cross-task sums
    solve_macs: int  # float64: Cholesky factors and triangular solves
    read_bytes: int  # expert and base block weights read from their files; spilled chains read and written
    moved_bytes: int  # host <-> device (offload_blocks only)

    @property
    def f32_flops(self) -> int:
        return 2 * (self.forward_macs + self.statistics_macs)

    @property
    def f64_flops(self) -> int:
        return 2 * (self.fold_macs + self.solve_macs)


def input_groups(linears) -> dict[tuple[str, int], list[tuple[str, int, int]]]:
    """Linears reading the same input: same parent module and width, output projections apart (a naming rule;
    the engine groups by the actual input tensor)."""
    out: dict[tuple[str, int], list] = {}
    for name, i, o in linears:
        parent, _, leaf = name.rpartition(".")
        out.setdefault((name if leaf in _OUTPUT_PROJECTIONS else parent, i), []).append((name, i, o))
    return out


def gram_macs(width: int, symmetric: bool = True) -> int:
    """Multiply-accumulates per token of one width×width Gram: its block-upper triangle ((k+1)/(2k) of width²
    with k chunks), or the whole product (`symmetric` False)."""
    k = gram_chunks(width) if symmetric else 1
    bounds = [i * width // k for i in range(k + 1)]
    return sum((hi - lo) * (width - lo) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True))


def token_macs(block, tokens: int, hidden: int) -> tuple[int, int]:
    """(one forward's, the statistics') multiply-accumulates per token of `block` (a planner.BlockShape):
    its Linears and attention's two products (2·tokens·hidden); a Gram and the cheaper cross moment per input."""
    forward = sum(i * o for _, i, o in block.linears) + 2 * tokens * hidden
    stats = 0
    for (_, i), members in input_groups(block.linears).items():
        outs = sum(o for _, _, o in members)
        stats += gram_macs(i) + min(i * i, i * outs)
    return forward, stats


def block_counts(stack, block, *, tasks: int, config: FeatCalConfig, file_bytes: int = 4) -> BlockCounts:
    """The counts of one block (`stack`: planner.StackShape, `block`: planner.BlockShape) of a run of `tasks`
    tasks at `config`; `file_bytes`: bytes per parameter in the experts' and the base's files."""
    n = config.num_calibration_examples
    bs = min(config.calibration_batch_size, n)
    per_task = math.ceil(n / bs)
    batches = tasks * per_task
    tokens = tasks * n * stack.tokens
    fwd, stats = token_macs(block, stack.tokens, stack.hidden)
    mode = config.block_statistics
    groups = input_groups(block.linears)
    stages = len(groups) + len(block.norm_channels)
    merged_passes = {"as_merged": 1, "sequential": stages, "sequential_one_pass": 1}[mode]
    calibrated = 0 if mode == "sequential_one_pass" else batches  # one pass: the propagation is the same forward
    # as merged, outside the statistics: one batch per task on the reference chain (the end-to-end drift), and
    # one batch through the whole model at the start (engine.check_context_replay)
    extra = (tasks + 1) * bs * stack.tokens
    forward_macs = fwd * (tokens * (1 + merged_passes) + (tokens if calibrated else 0) + extra)
    fold, teacher = _fold_macs(groups, n * stack.tokens, config.teacher_interp_alpha)
    solve = sum(i ** 3 // 6 + i * i * o for _, i, o in block.linears)
    widest = max(((i, o) for _, i, o in block.linears), key=lambda x: x[0] * x[0] * x[1], default=(0, 0))
    read = (tasks + 1) * block.param_count * file_bytes  # each expert's block, and the base's anchors
    entry = tokens * stack.hidden * DTYPES[config.chain_dtype].itemsize  # one side's chains for this block
    if config.spill_dir is not None:  # every chain entry read back and written again, both sides
        read += 4 * entry
    moved = 0
    if config.offload_blocks:
        # expert chains in and out, merged chains in twice (statistics, propagation) and out once, and
        # both blocks there and back (float32), each expert's weights in
        moved = 5 * entry + 4 * block.param_count * 4 + tasks * block.param_count * 4
    return BlockCounts(
        stack=stack.name, tokens=tokens, batches=batches, expert_forwards=batches,
        merged_forwards=batches * merged_passes + tasks + 1, calibrated_forwards=calibrated,
        linear_solves=len(block.linears), norm_solves=len(block.norm_channels), largest_system=widest,
        forward_macs=forward_macs, statistics_macs=(stats + teacher) * tokens, fold_macs=tasks * fold,
        solve_macs=solve, read_bytes=read, moved_bytes=moved,
    )


def _fold_macs(groups, task_tokens: int, alpha: float) -> tuple[int, int]:
    """(float64 multiply-accumulates folding one task in, float32 ones per token the teacher form adds to the pass).

    As statistics.NormalisedSums.add_task and engine._teacher_form do it: a "cross" group (input narrower than
    its outputs together) forms its target as an in×in×out product per member; an "output" group needs that
    product only to blend in (1 − α)·C_t W_tᵀ, and takes the teacher form instead (W_t x~ summed in the pass,
    in·out per token) when the task has fewer tokens than the group's input width."""
    fold = teacher = 0
    for (_, i), members in groups.items():
        outs = sum(o for _, _, o in members)
        if i < outs:  # cross form
            fold += sum(i * i * o for _, _, o in members)
        elif alpha < 1 and task_tokens * TEACHER_FORM_TOKENS_PER_INPUT < i:
            teacher += sum(i * o for _, _, o in members)
        elif alpha < 1:
            fold += sum(i * i * o for _, _, o in members)
    return fold, teacher


def run_counts(shape, *, tasks: int, config: FeatCalConfig, file_bytes: int = 4) -> list[BlockCounts]:
    """Every block's counts, in the order the engine calibrates them (`shape`: planner.ModelShape)."""
    return [block_counts(s, b, tasks=tasks, config=config, file_bytes=file_bytes) for s in shape.stacks
            for b in s.blocks]


@dataclass(frozen=True)
class TimeEstimate:
    throughput: Throughput
    f32_s: float
    f64_s: float
    read_s: float
    moved_s: float
    load_s: float  # reading the merged model at the start

    @property
    def total_s(self) -> float:
        return self.f32_s + self.f64_s + self.read_s + self.moved_s + self.load_s


def estimate_time(blocks: list[BlockCounts], tp: Throughput, *, model_bytes: int = 0) -> TimeEstimate:
    """Seconds at `tp`: arithmetic over its FLOP/s plus bytes over its bandwidths, nothing overlapped."""
    return TimeEstimate(
        throughput=tp,
        f32_s=sum(b.f32_flops for b in blocks) / tp.f32,
        f64_s=sum(b.f64_flops for b in blocks) / tp.f64,
        read_s=sum(b.read_bytes for b in blocks) / tp.read,
        moved_s=sum(b.moved_bytes for b in blocks) / tp.link if tp.link else 0.0,
        load_s=model_bytes / tp.read,
    )


def duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.1f} s"


def _si(x: float, unit: str) -> str:
    for prefix, size in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if x >= size:
            return f"{x / size:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def render_time(blocks: list[BlockCounts], est: TimeEstimate) -> str:
    """The per-block counts and the time, as `featcal plan` prints them."""
    tp = est.throughput
    lines = [f"estimated time at {tp.source} throughput '{tp.name}' ({tp.note}): float32 {_si(tp.f32, 'FLOP/s')}, "
             f"float64 {_si(tp.f64, 'FLOP/s')}, reads {_si(tp.read, 'B/s')}"
             + (f", host<->device {_si(tp.link, 'B/s')}" if tp.link else "") + "; --flops / --flops64 to change"]
    for stack in dict.fromkeys(b.stack for b in blocks):
        mine = [b for b in blocks if b.stack == stack]
        b = max(mine, key=lambda x: x.f32_flops + x.f64_flops)
        i, o = b.largest_system
        lines.append(
            f"  {stack}: {len(mine)} block(s); per block {b.tokens:,} token positions per side; batch forwards "
            f"{b.expert_forwards} expert + {b.merged_forwards} merged as merged + {b.calibrated_forwards} calibrated; "
            f"{b.linear_solves} Linear solves (largest {i}×{i}, {o} right-hand sides) + {b.norm_solves} norms")
        lines.append(
            f"    per block: {_si(b.f32_flops, 'FLOP')} float32 (forwards {_si(2 * b.forward_macs, 'FLOP')}, "
            f"statistics {_si(2 * b.statistics_macs, 'FLOP')}), {_si(b.f64_flops, 'FLOP')} float64 (fold "
            f"{_si(2 * b.fold_macs, 'FLOP')}, solves {_si(2 * b.solve_macs, 'FLOP')}), {_si(b.read_bytes, 'B')} "
            "read" + (f", {_si(b.moved_bytes, 'B')} host<->device" if b.moved_bytes else ""))
    lines.append(f"  total ≈ {duration(est.total_s)}: float32 {duration(est.f32_s)}, float64 {duration(est.f64_s)}, "
                 f"reads {duration(est.read_s + est.load_s)}" + (f", transfers {duration(est.moved_s)}"
                                                                if est.moved_s else ""))
    return "\n".join(lines)
