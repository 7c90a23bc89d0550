"""Peak-memory plan of a calibration, from checkpoint headers and configs only (no weights, no data read).

What a `featcal calibrate` process holds at its peak (during a block, models and chains resident):

- the process baseline: Python + torch + transformers + featcal, measured (RSS of the planning
  process after those imports; `featcal plan` runs in a fresh process, so it sees what calibrate sees);
- the merged model, as loaded (float32), and one expert "template": its stems and one block (template.py);
- the calibration inputs of every task (pixel values, or token ids + masks at --max-length);
- the chains: tasks × examples × tokens × hidden × bytes(chain_dtype) × 2 sides (merged, expert),
  plus their block contexts (attention masks; T5's position bias), for this rank's share of the batches;
- one block of every expert read ahead (prefetch.py), and one block's transients: float64 base anchors, the
  statistics (float32 per task, float64 across tasks, solver temporaries of the largest Linear) and one
  batch's activations.

With --offload-blocks the models and chains stay on the host and the device holds, at its peak, the
larger of two phases (placement.py): capture (both models' stems, the merged block 0, one batch) and
block (block l of the merged model and of the template, float64 base anchors, the statistics, one
batch's activations and chain entries). The host then holds no statistics, anchors or activations.

With --device cuda and no offloading the models and chains live on the device for the whole run: the
device holds what the host would (two models, chains, one block's transients: the "run" phase), and the
host holds, at its peak, both models as loaded before they move (core/setting.py copies the template on the host).

The shapes come from the model built on the meta device from its config (`model_shape`, what `featcal plan`
uses, with or without checkpoints: `plan_for_config` needs nothing but the config), or from a loaded model
(`shape_of`): the two give the same plan. Tied parameters (an LM head tied to the embedding, T5's shared
embedding) are counted once, as they are held once.

Text lengths use --max-length (batches are padded to their longest text, so this is an upper bound).
Linears are grouped by shared input (q/k/v, gate/up) by a naming rule; the engine groups by the
actual input tensor, so the statistics line can differ slightly from the run's.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from featcal.blocks.adapters import adapter_for
from featcal.blocks.discovery import calibrated_modules
from featcal.blocks.support import check_config
from featcal.calibration.engine.chains import DTYPES
from featcal.calibration.engine.placement import stem_parts
from featcal.calibration.planning.cost import input_groups
from featcal.config import DEFAULT_MAX_LENGTH, FeatCalConfig
from featcal.errors import ConfigError
from featcal.io.read.models import load_config
from featcal.io.write.report import peak_rss_mb

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'8GiB', '500MB', '1.5g', '1024' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(f"--max-memory expects a size such as 8GiB or 500MB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def fmt(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def current_rss() -> int:
    """Resident set size of this process now, in bytes (Linux /proc; ru_maxrss elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):  # pragma: no cover - non-Linux
        return int(peak_rss_mb() * 2**20)


# --- the model's shape ---------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockShape:
    linears: tuple[tuple[str, int, int], ...]  # (name, in, out)
    norm_channels: tuple[int, ...]
    param_count: int


@dataclass(frozen=True)
class StackShape:
    name: str
    blocks: tuple[BlockShape, ...]
    hidden: int
    heads: int
    tokens: int  # per example
    context_bytes: int  # per example per side: masks, position bias, rotary tables


@dataclass(frozen=True)
class ModelShape:
    param_count: int  # parameters + buffers
    stacks: tuple[StackShape, ...]
    input_bytes: int  # per example, as the calibration batches hold it
    stem_count: int = 0  # parameters + buffers under the stack entries but outside every block


def _block_shape(block: nn.Module, adapter) -> BlockShape:
    linears, norms = [], []
    for c in calibrated_modules(block, adapter):
        if c.kind == "linear":
            linears.append((c.name, *c.features))
        else:
            norms.append(int(c.module.weight.numel()))
    return BlockShape(tuple(linears), tuple(norms), sum(p.numel() for p in block.parameters()))


def model_shape(config, max_length: int) -> ModelShape:
    """The shapes that drive memory, from a transformers config (the model is built on the meta device)."""
    model = check_config(config)  # on the meta device; an architecture featcal cannot calibrate is refused here
    return shape_of(model, config, max_length)


def shape_of(model: nn.Module, config, max_length: int) -> ModelShape:
    """The shapes that drive memory, from `model` (on the meta device, or loaded: the same numbers)."""
    adapter = adapter_for(model)
    stacks = []
    vision = hasattr(config, "image_size") or hasattr(getattr(config, "vision_config", None), "image_size")
    vcfg = getattr(config, "vision_config", config)
    if vision:
        tokens = (int(vcfg.image_size) // int(vcfg.patch_size)) ** 2 + 1  # patches + class token
        input_bytes = int(getattr(vcfg, "num_channels", 3)) * int(vcfg.image_size) ** 2 * 4
    else:
        tokens = int(max_length)
        input_bytes = tokens * 8 * adapter.token_tensors  # int64 ids + mask (+ the decoder's)
    for st in adapter.stacks(model):
        blocks = st.blocks(model)
        shapes = tuple(_block_shape(b, adapter) for b in blocks)
        hidden = int(getattr(vcfg, "hidden_size", None) or config.d_model)
        heads = int(getattr(vcfg, "num_attention_heads", None) or getattr(config, "num_heads", 1))
        ctx = 0
        if not vision:
            ctx = tokens * tokens  # boolean (B, 1, S, S) mask
            ctx += adapter.context_bytes(st, tokens, hidden, heads)  # T5's position bias, Llama's rotary tables
        stacks.append(StackShape(st.name, shapes, hidden, heads, tokens, ctx))
    return ModelShape(held_count(model), tuple(stacks), input_bytes, _stem_count(model, adapter.stacks(model)))


def held_count(model: nn.Module) -> int:
    """Elements of the parameters and buffers `model` holds, each tied tensor once (a state dict lists an LM head
    tied to the embedding, or T5's shared embedding, under every name, though one tensor holds it)."""
    return sum(t.numel() for t in (*model.parameters(), *model.buffers()))


def _stem_count(model: nn.Module, stacks) -> int:
    """What offloading moves to the device for the capture step, counted as placement.stem_parts moves it."""
    seen: dict[int, int] = {}
    for mod, recurse in stem_parts(model, stacks):
        for t in (*mod.parameters(recurse=recurse), *mod.buffers(recurse=recurse)):
            seen[id(t)] = t.numel()
    return sum(seen.values())


# --- the estimate --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Component:
    name: str
    bytes: int
    detail: str
    phase: str = ""  # device components: "capture" or "block" (they are never resident together)


@dataclass
class MemoryPlan:
    components: list[Component]  # host memory (the process's RSS)
    chain_bytes_total: int  # all ranks together: what --spill-dir would put on disk
    settings: dict = field(default_factory=dict)
    device_components: list[Component] = field(default_factory=list)  # --offload-blocks: on the device

    @property
    def total(self) -> int:
        """Peak host memory (RSS) per process."""
        return sum(c.bytes for c in self.components)

    def phase_total(self, phase: str) -> int:
        return sum(c.bytes for c in self.device_components if c.phase == phase)

    @property
    def device_total(self) -> int:
        """Peak device memory per process with --offload-blocks (0 without): the larger phase."""
        return max((self.phase_total(c.phase) for c in self.device_components), default=0)


def statistics_parts(block: BlockShape) -> tuple[int, int, int]:
    """(one task's raw sums, float32; the cross-task sums, float64; the fold/solve temporaries) in bytes.

    The engine keeps one task's sums alive at a time (folded into the cross-task sums, then dropped),
    so the first part does not grow with the number of tasks; nor do the others.
    """
    task = 0  # float32, one task
    for members in input_groups(block.linears).values():
        i = members[0][1]
        outs = sum(o for _, _, o in members)
        task += (i * i + i + 1) * 4
        task += (i * i + i) * 4 if i < outs else sum(i * o + o for _, _, o in members) * 4
    task += sum(3 * d for d in block.norm_channels) * 4
    across = sum(i * i + i * o + o + i for _, i, o in block.linears) * 8 + sum(4 * d for d in block.norm_channels) * 8
    # folding a task in (statistics.NormalisedSums.add_task) holds C, Wt, E[xs ye], C Wt, their blend and
    # its scaled copy at once, in float64; the solve then needs the system, its Cholesky factor and the
    # right-hand side: the larger of the two, for the widest Linear
    fold = max((3 * i * i + 7 * i * o) * 8 for _, i, o in block.linears) if block.linears else 0
    return task, across, fold


def _statistics_bytes(block: BlockShape) -> tuple[int, str]:
    task, across, fold = statistics_parts(block)
    return task + across + fold, f"{fmt(task)} per task (float32) + {fmt(across)} across tasks (float64) + {fmt(fold)} fold/solve"


def estimate(shape: ModelShape, *, tasks: int, config: FeatCalConfig, baseline_bytes: int, world: int = 1) -> MemoryPlan:
    """The peak-memory breakdown of one rank (see the module docstring); pure arithmetic."""
    n = config.num_calibration_examples
    bs = min(config.calibration_batch_size, n)  # a batch holds at most a task's examples
    batches = math.ceil(n / bs)
    local = min(n, math.ceil(batches / world) * bs)  # examples per task on the busiest rank
    model = shape.param_count * 4
    chain_b = DTYPES[config.chain_dtype].itemsize
    chains_all = max(2 * tasks * n * s.tokens * s.hidden * chain_b for s in shape.stacks)
    chains_local = max(2 * tasks * local * s.tokens * s.hidden * chain_b for s in shape.stacks)
    ctx_local = max(2 * tasks * local * s.context_bytes for s in shape.stacks)
    spilled = config.spill_dir is not None
    if spilled:  # one entry in RAM at a time; the skeletons stay
        chains_local = max(bs * s.tokens * s.hidden * chain_b for s in shape.stacks)
        ctx_local = max(bs * s.context_bytes for s in shape.stacks)
    blocks = [(s, b) for s in shape.stacks for b in s.blocks]
    block_params = max(b.param_count for _, b in blocks)
    stats, stats_detail = max((_statistics_bytes(b) for _, b in blocks), key=lambda x: x[0])

    def activations(s: StackShape, b: BlockShape) -> int:
        per_token = sum(i + o for _, i, o in b.linears) * 4
        attention = s.heads * s.tokens * 4 * 2  # scores and probabilities
        return 2 * bs * s.tokens * (per_token + attention)  # expert outputs held while the merged side runs

    act = max(activations(s, b) for s, b in blocks)
    paused = _one_pass_parts(config, tasks, math.ceil(local / bs), act, block_params)
    s0 = max(shape.stacks, key=lambda s: s.tokens * s.hidden)
    settings = {"chain_dtype": config.chain_dtype, "spill_dir": config.spill_dir, "batch_size": bs, "world": world,
                "offload_blocks": config.offload_blocks, "device": config.device}
    if config.offload_blocks:
        return _offloaded(shape, tasks=tasks, config=config, baseline_bytes=baseline_bytes, local=local,
                          chains_local=chains_local, ctx_local=ctx_local, act=act, stats=(stats, stats_detail),
                          block_params=block_params, chains_all=chains_all, settings=settings, paused=paused)
    comps = [
        Component("process baseline", baseline_bytes, "python + torch + transformers + featcal (measured)"),
        Component("merged model", model, f"{shape.param_count:,} parameters and buffers, float32"),
        _template(shape, block_params),
        Component("calibration inputs", tasks * n * shape.input_bytes, f"{tasks} task(s) × {n} examples"),
        Component("chains", chains_local, (f"spilled to {config.spill_dir}: one batch in RAM" if spilled else
                  f"2 sides × {tasks} task(s) × {local} examples × {s0.tokens} tokens × {s0.hidden} hidden × "
                  f"{chain_b} B ({config.chain_dtype})")),
        Component("chain contexts", ctx_local, "attention masks / position bias / rotary tables per batch"),
        _read_ahead(tasks, block_params),
        Component("base anchors", block_params * 8, "one block, float64"),
        Component("statistics", stats, stats_detail),
        Component("activations", act, f"one batch of {bs} through one block, both sides"),
        *paused,
    ]
    if on_accelerator(config.device):
        return _resident(comps, chains_all, settings)
    return MemoryPlan(comps, chains_all, settings)


def on_accelerator(device: str) -> bool:
    """Whether `device` (a FeatCalConfig.device) is other memory than the host's: cuda, cuda:N, or auto here."""
    if device == "auto":
        import torch

        return bool(torch.cuda.is_available())
    return device != "cpu"


def _template(shape: ModelShape, block_params: int, where: str = "") -> Component:
    """The expert template (template.py): everything outside the blocks, and `block_params` of storage for the
    block being calibrated (0 with offloading: that block lives on the device, the "expert block" line)."""
    in_blocks = sum(b.param_count for s in shape.stacks for b in s.blocks)
    return Component("expert template", (shape.param_count - in_blocks + block_params) * 4,
                     f"the merged model's stems and one block, float32, expert weights loaded block by block{where}")


READ_AHEAD = "expert blocks read ahead"


def _read_ahead(tasks: int, block_params: int) -> Component:
    """The engine's reader (prefetch.py) holds at most one block of every expert beyond the one being loaded,
    on the host, as read (counted as float32: the widest stored dtype featcal reads into)."""
    return Component(READ_AHEAD, tasks * block_params * 4,
                     f"one block of each of {tasks} expert(s), read on a background thread while a block computes")


_ON_HOST = ("process baseline", "calibration inputs", READ_AHEAD)  # resident on an accelerator: what stays on the host
_LOADED = ("merged model", "expert template")  # on the host too until they move, at the start


def _resident(comps: list[Component], chains_all: int, settings: dict) -> MemoryPlan:
    """The plan of a run on an accelerator without offloading: both models, the chains and one block's
    transients on the device for the whole run (phase "run"); on the host, the models as loaded, before they move
    (core/setting.py copies the template on the host, then placement.setup moves both), the inputs, the experts' blocks
    read ahead (copied into the device template in place, one tensor at a time) and the baseline."""
    host = [c for c in comps if c.name in _ON_HOST + _LOADED]
    device = [Component(c.name, c.bytes, c.detail, "run") for c in comps if c.name not in _ON_HOST]
    return MemoryPlan(host, chains_all, settings, device)


def _one_pass_parts(config: FeatCalConfig, tasks: int, local_batches: int, act: int, block_params: int,
                    phase: str = "") -> list[Component]:
    """block_statistics sequential_one_pass holds every batch's paused block forwards (both sides) at once, and
    a copy of the expert's block per task (calibration/engine/one_pass.py); nothing for the other modes."""
    if config.block_statistics != "sequential_one_pass":
        return []
    return [
        Component("paused forwards", act * tasks * local_batches,
                  f"sequential_one_pass: {tasks} task(s) × {local_batches} batch(es), each as 'activations'", phase),
        Component("expert block copies", tasks * block_params * 4, "sequential_one_pass: one per task", phase),
    ]


def _offloaded(shape: ModelShape, *, tasks: int, config: FeatCalConfig, baseline_bytes: int, local: int,
               chains_local: int, ctx_local: int, act: int, stats: tuple[int, str], block_params: int,
               chains_all: int, settings: dict, paused: list[Component]) -> MemoryPlan:
    """The --offload-blocks plan: host lines as without offloading less the per-block transients, which
    move to the device; device lines per phase (capture, block), of which the larger is the peak."""
    n = config.num_calibration_examples
    bs = min(config.calibration_batch_size, n)
    model = shape.param_count * 4
    chain_b = DTYPES[config.chain_dtype].itemsize
    s0 = max(shape.stacks, key=lambda s: s.tokens * s.hidden)
    widest = max((i * o for s in shape.stacks for b in s.blocks for _, i, o in b.linears), default=0) * 4
    spilled = config.spill_dir is not None
    host = [
        Component("process baseline", baseline_bytes, "python + torch + transformers + featcal (measured)"),
        Component("merged model", model, f"{shape.param_count:,} parameters and buffers, float32, on the host"),
        _template(shape, 0, ", on the host (its current block is the device's 'expert block')"),
        Component("calibration inputs", tasks * n * shape.input_bytes, f"{tasks} task(s) × {n} examples"),
        Component("chains", chains_local, (f"spilled to {config.spill_dir}: one batch in RAM" if spilled else
                  f"on the host: 2 sides × {tasks} task(s) × {local} examples × {s0.tokens} tokens × {s0.hidden} "
                  f"hidden × {chain_b} B ({config.chain_dtype})")),
        Component("chain contexts", ctx_local, "attention masks / position bias / rotary tables per batch"),
        Component("tensor in transit", widest, "one expert or base tensor read on its way to the device"),
        _read_ahead(tasks, block_params),
    ]
    batch_chains = max(2 * bs * (s.tokens * s.hidden * 4 + s.context_bytes) for s in shape.stacks)
    batch_detail = f"2 sides × {bs} examples, float32 on the device, with their contexts"
    device = [
        Component("merged block", block_params * 4, "the block being calibrated, float32", "block"),
        Component("expert block", block_params * 4, "the template's same block, expert weights copied in", "block"),
        Component("base anchors", block_params * 8, "one block, float64", "block"),
        Component("statistics", stats[0], stats[1], "block"),
        Component("activations", act, f"one batch of {bs} through one block, both sides", "block"),
        Component("batch chains", batch_chains, batch_detail, "block"),
        *(Component(c.name, c.bytes, c.detail + ", on the device", "block") for c in paused),
        Component("stems", 2 * shape.stem_count * 4, "embeddings and final norms of both models, float32", "capture"),
        Component("merged block 0", block_params * 4, "run once to check the block context", "capture"),
        Component("activations", act, f"one batch of {bs} (an upper bound for the stem's)", "capture"),
        Component("batch chains", batch_chains, batch_detail, "capture"),
    ]
    return MemoryPlan(host, chains_all, settings, device)


def alternatives(shape: ModelShape, *, tasks: int, config: FeatCalConfig, baseline_bytes: int,
                 world: int = 1) -> list[tuple[str, MemoryPlan]]:
    """The same run with each memory option turned on (and all of them together)."""
    def plan(cfg: FeatCalConfig, w: int = world) -> MemoryPlan:
        return estimate(shape, tasks=tasks, config=cfg, baseline_bytes=baseline_bytes, world=w)

    out = []
    if config.chain_dtype == "float32":
        out.append(("--chain-dtype bfloat16", plan(config.model_copy(update={"chain_dtype": "bfloat16"}))))
    if config.spill_dir is None:
        out.append(("--spill-dir DIR", plan(config.model_copy(update={"spill_dir": Path("DIR")}))))
    batch = min(config.calibration_batch_size, config.num_calibration_examples)
    if batch > 1:
        half = max(1, batch // 2)
        out.append((f"--calibration-batch-size {half}", plan(config.model_copy(update={"calibration_batch_size": half}))))
    if on_accelerator(config.device) and not config.offload_blocks:
        out.append(("--offload-blocks", plan(config.model_copy(update={"offload_blocks": True}))))
    out.append((f"torchrun --nproc-per-node {2 * world}", plan(config, 2 * world)))
    both = config.model_copy(update={"chain_dtype": "bfloat16", "spill_dir": config.spill_dir or Path("DIR")})
    out.append(("--chain-dtype bfloat16 --spill-dir DIR", plan(both)))
    return out


def render(plan: MemoryPlan, options: list[tuple[str, MemoryPlan]], max_memory: int | None) -> str:
    """The plan as the text `featcal plan` / `calibrate --dry-run` print."""
    width = max(len(c.name) for c in plan.components + plan.device_components)
    where = " (host)" if plan.device_components else ""
    lines = [f"estimated peak memory per process{where}: {fmt(plan.total)}"]
    for c in plan.components:
        lines.append(f"  {c.name:<{width}}  {fmt(c.bytes):>11}  {c.detail}")
    if plan.settings.get("spill_dir") is not None:
        lines.append(f"  disk under spill_dir: {fmt(plan.chain_bytes_total)} (all chains)")
    if plan.device_components and plan.settings.get("offload_blocks"):
        lines.append(f"estimated peak device memory per process (--offload-blocks on {plan.settings.get('device')}): "
                     f"{fmt(plan.device_total)}, the larger phase")
    elif plan.device_components:
        lines.append(f"estimated peak device memory per process (models and chains resident on "
                     f"{plan.settings.get('device')}; --offload-blocks to hold one block there): {fmt(plan.device_total)}")
    if plan.device_components:
        for phase in dict.fromkeys(c.phase for c in plan.device_components):
            lines.append(f"  {phase} phase: {fmt(plan.phase_total(phase))}")
            lines += [f"    {c.name:<{width}}  {fmt(c.bytes):>11}  {c.detail}"
                      for c in plan.device_components if c.phase == phase]
    if max_memory is not None:
        fits = plan.total <= max_memory
        lines.append(f"--max-memory {fmt(max_memory)}: {'fits' if fits else 'does NOT fit'}")
        if not fits:
            good = [(name, p) for name, p in options if p.total <= max_memory]
            if good:
                lines.append("options that bring it under the limit:")
                lines += [f"  {name:<40} {fmt(p.total)}" for name, p in good]
            elif options:
                name, p = min(options, key=lambda x: x[1].total)
                lines.append(f"no option fits; the smallest is {name} at {fmt(p.total)}")
    elif plan.device_components:
        lines.append("with memory options (host, device):")
        lines += [f"  {name:<40} {fmt(p.total)}, {fmt(p.device_total)}" for name, p in options]
    else:
        lines.append("with memory options:")
        lines += [f"  {name:<40} {fmt(p.total)}" for name, p in options]
    return "\n".join(lines)


def plan_for_checkpoint(merged: str | os.PathLike, *, tasks: int, config: FeatCalConfig, max_length: int = DEFAULT_MAX_LENGTH,
                        baseline_bytes: int | None = None, world: int = 1) -> tuple[MemoryPlan, list]:
    """Plan a calibration of the checkpoint at `merged` (reads its config.json only)."""
    return plan_for_config(merged, tasks=tasks, config=config, max_length=max_length, baseline_bytes=baseline_bytes,
                           world=world)


def plan_for_config(source: str | os.PathLike, *, tasks: int, config: FeatCalConfig, max_length: int = DEFAULT_MAX_LENGTH,
                    baseline_bytes: int | None = None, world: int = 1) -> tuple[MemoryPlan, list]:
    """Plan a calibration from a model's config alone: a config.json file, a folder holding one, or a hub id
    (nothing but the config is read; the model is built on the meta device)."""
    shape = model_shape(load_config(source), max_length)
    base = current_rss() if baseline_bytes is None else baseline_bytes
    kw = dict(tasks=tasks, config=config, baseline_bytes=base, world=world)
    return estimate(shape, **kw), alternatives(shape, **kw)
