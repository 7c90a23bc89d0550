"""Forward hooks that turn one batch's block forwards into statistics, keeping nothing past the batch.

Linears reading the same input tensor with the same token weights form a group (q/k/v, gate/up,
T5's cross-attention k/v) and share one Gram. For the teacher term X_t W_tᵀ each group takes the
cheaper of two exact forms (statistics.py), chosen once per block from the module shapes:

- "output": Σ w·xs yeᵀ per module, from the expert module's own output ye (cost in·out per module);
- "cross":  Σ w·xs xeᵀ once per group, from the expert group's input xe (cost in·in per group),
  then E[xs xeᵀ] W_tᵀ at the end of the task — cheaper when in < Σ out (q/k/v, gate/up, fc1).

An "output" module also needs C_t W_tᵀ (in·in·out, float64, per task) unless α = 1. When the task has
fewer tokens than the module has inputs, the engine asks for the "teacher" form instead: the expert's
weight is applied to the merged input in the pass (tokens·in·out) and Σ w·xs (α·ye + (1−α)·W_t xs)ᵀ summed,
which holds the whole teacher term (statistics.LinearSums).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from featcal.blocks.grams import WeightFn, flat_tokens, select_tokens
from featcal.blocks.linear import features
from featcal.blocks.norms import NormForm, normalise
from featcal.calibration.maths.statistics import TaskSums
from featcal.errors import FeatCalError

KindFn = Callable[[str], tuple]  # module name -> what its token weights depend on


@dataclass(frozen=True)
class LinearPlan:
    group: str  # the first module (in execution order) of the group
    mode: str  # "output" | "cross"
    # the block changes this module's input or output in place after it runs (Falcon adds the attention
    # output into the MLP's output): the expert side keeps a copy, not the tensor the block goes on to change
    copy: bool = False


def group_inputs(calls: list[tuple[str, torch.Tensor]], kind: KindFn) -> dict[str, str]:
    """Module -> group name, from (name, input) pairs in execution order (same tensor, same weights)."""
    first: dict[tuple, str] = {}
    out = {}
    for name, x in calls:
        out[name] = first.setdefault((id(x), kind(name)), name)
    return out


def plan_block(linears: dict[str, nn.Module], calls: list[tuple[str, torch.Tensor]], kind: KindFn,
               changed: set[str] = frozenset()) -> dict[str, LinearPlan]:
    """Group the block's linear layers and pick, per group, the cheaper form of the teacher statistics.
    `changed`: the modules whose input or output the block changed in place (ExpertRecorder.changed_in_place)."""
    groups = group_inputs(calls, kind)
    out_sum: dict[str, int] = {}
    for name, g in groups.items():
        out_sum[g] = out_sum.get(g, 0) + features(linears[name])[1]
    mode = {g: ("cross" if features(linears[g])[0] < total else "output") for g, total in out_sum.items()}
    return {name: LinearPlan(g, mode[g], name in changed or g in changed) for name, g in groups.items()}


def _version(t: torch.Tensor) -> int | None:
    """The tensor's in-place version counter (None for inference-mode tensors, which carry none)."""
    try:
        return t._version
    except RuntimeError:
        return None


class ExpertRecorder:
    """Hooks on the expert block's Linears keeping, for one forward, what the merged side will need.

    Without a plan (the block's first batch) it keeps a copy of every input and output, so that the plan can
    be made from them (`adopt`), and notes which ones the rest of the block changes in place
    (`changed_in_place`); with a plan it keeps only xe of "cross" groups and ye of "output" ones, copies
    where the plan says the block changes them.
    """

    def __init__(self, linears: dict[str, nn.Module], plan: dict[str, LinearPlan] | None) -> None:
        self.linears, self.plan = linears, plan
        self.inputs: dict[str, torch.Tensor] = {}  # group (or, while planning, module) -> xe
        self.outputs: dict[str, torch.Tensor] = {}  # module -> ye
        self.calls: list[tuple[str, torch.Tensor]] = []  # (module, input) in execution order, when planning
        self._seen: set[str] = set()
        self._handles: list = []
        self._watched: list[tuple[str, torch.Tensor, int | None]] = []  # planning: (module, tensor, version)

    def record(self, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """Module `name` ran on x and gave y: keep what the plan (or, while planning, the plan's making) needs."""
        if name in self._seen:
            raise FeatCalError(f"module {name} runs more than once per block forward; FeatCal cannot calibrate it")
        if not isinstance(y, torch.Tensor):  # a Linear subclass computing more than its output (a router's top-k)
            raise FeatCalError(f"module {name} ({type(self.linears[name]).__name__}) is a linear layer whose forward "
                               f"returns a {type(y).__name__}, not its output tensor; FeatCal cannot calibrate it")
        self._seen.add(name)
        if self.plan is None:
            self.calls.append((name, x))
            self.inputs[name], self.outputs[name] = x.clone(), y.clone()
            self._watched += [(name, x, _version(x)), (name, y, _version(y))]
            return
        p = self.plan.get(name)
        if p is None:
            raise FeatCalError(f"module {name} ran in this batch but not in the block's first batch")
        if p.mode == "output":
            self.outputs[name] = y.clone() if p.copy else y
        elif name == p.group:
            self.inputs[name] = x.clone() if p.copy else x

    def changed_in_place(self) -> set[str]:
        """After the planning forward: the modules whose input or output the block changed in place later."""
        return {name for name, t, v in self._watched if v is None or _version(t) != v}

    def adopt(self, plan: dict[str, LinearPlan]) -> None:
        """After the planning forward: keep only what `plan` needs, as a planned forward would have."""
        self.plan = plan
        self.calls = []
        self._watched = []
        self.inputs = {g: x for g, x in self.inputs.items() if plan[g].group == g and plan[g].mode == "cross"}
        self.outputs = {n: y for n, y in self.outputs.items() if plan[n].mode == "output"}

    def __enter__(self) -> ExpertRecorder:
        for name, mod in self.linears.items():
            self._handles.append(mod.register_forward_hook(lambda _m, i, o, n=name: self.record(n, i[0], o)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def normalised_input(mod: nn.Module, x: torch.Tensor, form: NormForm | None = None) -> torch.Tensor:
    """A norm's input without its affine: (x−mean)/std for LayerNorm-type norms, x/rms for RMS norms (float32),
    as the norm itself computes it (blocks/norms.py)."""
    return normalise(mod, x, form)


class MergedFolder:
    """Hooks on the merged block's calibrated modules folding one forward into `sums`."""

    def __init__(
        self,
        modules: list,  # engine.Calibrated
        plan: dict[str, LinearPlan],
        expert: ExpertRecorder,
        sums: TaskSums,
        weights: WeightFn,
        teacher: dict[str, tuple[float, torch.Tensor]] | None = None,
    ) -> None:
        self.modules, self.plan, self.expert = modules, plan, expert
        self.sums, self.weights = sums, weights
        self.teacher = teacher or {}  # "output" module -> (α, expert weight W_t): sum the teacher form
        # group -> (merged input seen this forward, its tokens, their weights, the kept tokens' mask)
        self._held: dict[str, tuple] = {}
        self._handles: list = []

    def fold_linear(self, name: str, x: torch.Tensor) -> None:
        """Fold Linear `name`'s merged input x (and the expert side's recording) into the task's sums."""
        p = self.plan.get(name)
        if p is None:
            raise FeatCalError(f"module {name} ran on the merged side but not on the expert side")
        held = self._held.get(p.group)
        if held is None:
            # a group shares its input and what its token weights depend on (plan_block groups by both):
            # weights, flattening and padding removal are done once, for its first module
            xt, w, keep = flat_tokens(x, self.weights(name, x))
            held = self._held[p.group] = (x, xt, w, keep)
            self.sums.add_gram_tokens(p.group, xt, w)
            if p.mode == "cross":
                self.sums.add_cross_tokens(p.group, xt, select_tokens(self.expert.inputs[p.group], keep), w)
        elif held[0] is not x:
            raise FeatCalError(f"module {name} does not share its group's input on the merged side")
        if p.mode == "output":
            _, xt, w, keep = held
            ye = select_tokens(self.expert.outputs[name], keep)
            t = self.teacher.get(name)
            if t is None:
                self.sums.add_linear_tokens(name, p.group, xt, ye, w)
            else:  # W_t x~ + α·b_t = α·ye + (1−α)·W_t xs
                a, wt = t  # wt: the expert's weight, out×in
                y = torch.addmm(ye, xt, wt.T.to(xt.dtype), beta=a, alpha=1.0 - a)
                self.sums.add_linear_tokens(name, p.group, xt, y, w, teacher=True)
        else:
            self.sums.add_cross_linear(name, p.group)

    def fold_norm(self, mod: nn.Module, name: str, x: torch.Tensor, form: NormForm | None) -> None:
        """Fold norm `name`'s normalised merged input into the task's sums."""
        self.sums.add_norm(name, normalised_input(mod, x, form), self.weights(name, x))

    def __enter__(self) -> MergedFolder:
        for c in self.modules:
            if c.kind == "linear":
                hook = partial(_linear_hook, self, c.name)
            else:
                hook = partial(_norm_hook, self, c.name, c.form)
            self._handles.append(c.module.register_forward_hook(hook))
        return self

    def end_forward(self) -> None:
        """Forget the merged inputs held for this forward's groups (the next forward brings its own)."""
        self._held.clear()

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.end_forward()


def _linear_hook(folder: MergedFolder, name: str, _mod: nn.Module, args: tuple, _out) -> None:
    folder.fold_linear(name, args[0])


def _norm_hook(folder: MergedFolder, name: str, form: NormForm | None, mod: nn.Module, args: tuple, _out) -> None:
    folder.fold_norm(mod, name, args[0], form)


class StopForward(Exception):
    """Raised inside a forward by `StopAfter`: what is left of the forward is not needed."""


class StopAfter:
    """Hooks ending a forward once each of `modules` has run (block_statistics sequential, issue 19).

    Why: a stage's statistics need the block's forward only up to the stage's own modules. Enter it
    after the recorder / folder whose hooks must still fire on those modules: a module's forward hooks
    run in registration order. With no modules it does nothing and `run` returns the whole output.
    """

    def __init__(self, modules: dict[str, nn.Module] | None) -> None:
        self.modules = modules or {}
        self._ran: set[str] = set()
        self._handles: list = []

    def _hook(self, name: str) -> None:
        self._ran.add(name)
        if len(self._ran) == len(self.modules):
            raise StopForward

    def run(self, fn: Callable, *args, **kwargs):
        """fn(*args, **kwargs), or None when the forward was stopped (each run starts afresh)."""
        self._ran.clear()
        try:
            return fn(*args, **kwargs)
        except StopForward:
            return None

    def __enter__(self) -> StopAfter:
        for name, mod in self.modules.items():
            self._handles.append(mod.register_forward_hook(lambda _m, _i, _o, n=name: self._hook(n)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
