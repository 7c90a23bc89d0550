"""Streaming, mergeable statistics for one block (docs/method.md §4, §8), and their per-task normalised sums.

Two levels, both plain sums so that batches, tasks and ranks can be added in any order:

- `TaskSums`: raw token-weighted sums for ONE task, accumulated batch by batch in float32 (what an
  all-reduce across ranks would add). Inputs are never stored beyond the batch that produced them.
- `NormalisedSums`: Σt over tasks of the per-task moments divided by st = ‖Ct‖_F (docs/method.md §5), held in
  float64. A task's `TaskSums` is folded in as soon as the task is finished, then dropped.

The teacher input x~ = α·xe + (1−α)·xs is never formed. Its only uses are X_t W_tᵀ and W_t μ~t, and
    X_t W_tᵀ = E[xs (x~)ᵀ] W_tᵀ = α·E[xs (W_t xe)ᵀ] + (1−α)·C_t W_tᵀ,
where W_t xe = ye − b_t is the expert module's own output (already computed by the expert forward)
minus its bias. So a Linear needs only Σ w·xs, Σ w·xs xsᵀ (shared by modules reading the same input:
q/k/v, gate/up), Σ w·xs yeᵀ and Σ w·ye — no in×in cross Gram, no second copy of the inputs.
When a group's input is narrower than its summed outputs (q/k/v, gate/up, fc1), one in×in cross
moment Σ w·xs xeᵀ (then E[xs xeᵀ] W_tᵀ) is cheaper and equally exact; `CrossSums` holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from featcal.blocks.grams import GramSums, prepare_tokens, weight_total, weighted
from featcal.errors import CalibrationDataError

F64 = torch.float64


@dataclass
class CrossSums:
    """Σ w·xe and Σ w·xs xeᵀ of one group's inputs: X_t W_tᵀ for all its Linears from one in×in product."""

    sxe: torch.Tensor
    sxxe: torch.Tensor

    def merge_(self, other: CrossSums) -> None:
        self.sxe += other.sxe
        self.sxxe += other.sxxe


@dataclass
class LinearSums:
    """Σ w·xs yᵀ and Σ w·y of one Linear, or None when its group's CrossSums serve.

    `group` names its input's GramSums (and CrossSums). y is the expert module's output ye ("output"
    form) or, with `teacher`, the teacher output W_t x~ + α·b_t = α·ye + (1−α)·W_t xs ("teacher" form: the
    expert's weight applied to the merged input in the pass, so that no in×in×out product C_t W_tᵀ is
    needed when the task is folded in; cheaper when the task has fewer tokens than the module has inputs).
    """

    group: str
    sxy: torch.Tensor | None = None
    sy: torch.Tensor | None = None
    teacher: bool = False

    def merge_(self, other: LinearSums) -> None:
        if self.teacher != other.teacher:
            raise CalibrationDataError(f"linear sums of group {self.group}: output and teacher forms mixed")
        if self.sxy is not None:
            self.sxy += other.sxy
            self.sy += other.sy


@dataclass
class NormSums:
    """Σw, Σ w·z and Σ w·z² per channel of a norm's normalised (pre-affine) input z."""

    sw: torch.Tensor
    sz: torch.Tensor
    szz: torch.Tensor

    def merge_(self, other: NormSums) -> None:
        self.sw += other.sw
        self.sz += other.sz
        self.szz += other.szz


@dataclass
class TaskSums:
    """Raw weighted sums of one task over one block, accumulated batch by batch (float32)."""

    grams: dict[str, GramSums] = field(default_factory=dict)
    cross: dict[str, CrossSums] = field(default_factory=dict)
    linears: dict[str, LinearSums] = field(default_factory=dict)
    norms: dict[str, NormSums] = field(default_factory=dict)

    # add_* take inputs (..., d) with token weights (...) or None (all 1); add_*_tokens take them as
    # flat_tokens returns them (tokens × d float32, zero-weight tokens dropped), prepared once per group.
    def add_gram(self, group: str, x: torch.Tensor, w: torch.Tensor | None) -> None:
        """Accumulate the input moments of `group` from x (..., d) with token weights w (...) or None (all 1)."""
        x, w = prepare_tokens(x, w)
        self.add_gram_tokens(group, x, w)

    def add_gram_tokens(self, group: str, x: torch.Tensor, w: torch.Tensor | None) -> None:
        g = self.grams.get(group)
        if g is None:
            g = self.grams[group] = GramSums.zeros(x.shape[-1], x.device)
        g.add_tokens(x, w)

    def add_linear(self, name: str, group: str, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None) -> None:
        """Accumulate Σ w·x yᵀ and Σ w·y for Linear `name`: x its merged input, y the expert's output."""
        x, w, y = prepare_tokens(x, w, y)
        self.add_linear_tokens(name, group, x, y, w)

    def add_linear_tokens(self, name: str, group: str, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None,
                          *, teacher: bool = False) -> None:
        yw = weighted(y, w)
        s = self.linears.get(name)
        if s is None:
            s = self.linears[name] = LinearSums(group, x.new_zeros(x.shape[1], y.shape[1]), y.new_zeros(y.shape[1]),
                                                teacher)
        elif s.teacher != teacher:
            raise CalibrationDataError(f"module {name}: output and teacher forms mixed within one task")
        s.sxy.addmm_(x.T, yw)
        s.sy += yw.sum(0)

    def add_cross(self, group: str, xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor | None) -> None:
        """Accumulate Σ w·xe and Σ w·xs xeᵀ for `group` (merged input xs, expert input xe)."""
        xs, w, xe = prepare_tokens(xs, w, xe)
        self.add_cross_tokens(group, xs, xe, w)

    def add_cross_tokens(self, group: str, xs: torch.Tensor, xe: torch.Tensor, w: torch.Tensor | None) -> None:
        c = self.cross.get(group)
        if c is None:
            d = xs.shape[1]
            c = self.cross[group] = CrossSums(xe.new_zeros(xe.shape[1]), xs.new_zeros(d, xe.shape[1]))
        xew = weighted(xe, w)
        c.sxe += xew.sum(0)
        c.sxxe.addmm_(xs.T, xew)

    def add_cross_linear(self, name: str, group: str) -> None:
        """Register Linear `name` as served by its group's CrossSums."""
        if name not in self.linears:
            self.linears[name] = LinearSums(group)

    def add_norm(self, name: str, z: torch.Tensor, w: torch.Tensor | None) -> None:
        """Accumulate the per-channel moments of a norm's normalised input z."""
        z, w = prepare_tokens(z, w)
        s = self.norms.get(name)
        if s is None:
            d = z.shape[1]
            s = self.norms[name] = NormSums(z.new_zeros(()), z.new_zeros(d), z.new_zeros(d))
        zw = weighted(z, w)
        s.sw += weight_total(z, w)
        s.sz += zw.sum(0)
        s.szz += (zw * z).sum(0)

    def merge_(self, other: TaskSums) -> None:
        """Add another shard's sums (other batches, another rank) of the same task into these."""
        for kind in ("grams", "cross", "linears", "norms"):
            mine, theirs = getattr(self, kind), getattr(other, kind)
            for k, v in theirs.items():
                if k in mine:
                    mine[k].merge_(v)
                else:
                    mine[k] = v


def _blend(a: float, cross: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """E[xs x~ᵀ] = α·E[xs xeᵀ] + (1−α)·Ct, skipping the term whose weight is 0."""
    if a == 1.0:
        return cross
    if a == 0.0:
        return c
    return a * cross + (1 - a) * c


@dataclass
class LinearNormalised:
    """Σt over tasks, each divided by st = ‖Ct‖_F: the right-hand sides of the Linear solves."""

    gram: torch.Tensor  # Σ Ct/st               (in×in)
    target: torch.Tensor  # Σ (Xt Wtᵀ)/st       (in×out)
    inv_scale: torch.Tensor  # Σ 1/st
    bias_target: torch.Tensor  # Σ (bt + Wt μ~t)/st (out)
    mean: torch.Tensor  # Σ μs,t/st             (in)
    mean_bias: torch.Tensor | None = None  # Σ μs,t btᵀ/st (in×out): the joint weight-and-bias solve only


@dataclass
class NormNormalised:
    """Σt of a norm's moments and targets (NOT normalised per task, docs/method.md §5)."""

    e: torch.Tensor  # Σ et
    m: torch.Tensor  # Σ mt
    gamma_target: torch.Tensor  # Σ (et γt + mt βt)   (RMS: Σ et γt)
    beta_target: torch.Tensor  # Σ (mt γt + βt)
    n_tasks: int = 0


class NormalisedSums:
    """Running cross-task sums for one block; one `add_task` per finished task, then solve."""

    def __init__(self, alpha: float, joint_bias: bool = False) -> None:
        self.alpha = float(alpha)
        self.joint_bias = joint_bias  # also keep Σ μs,t btᵀ/st (solver.linear_weight_bias)
        self.linears: dict[str, LinearNormalised] = {}
        self.norms: dict[str, NormNormalised] = {}

    def add_task(
        self,
        task: str,
        sums: TaskSums,
        expert_params: dict[str, dict[str, torch.Tensor | None]],
        rms: set[str],
    ) -> None:
        """Fold task `task`'s raw sums in, using expert t's parameters {module: {"weight", "bias"}}.

        `rms` names the weight-only RMS norms (no centring, no β).
        """
        group_moments: dict[str, tuple] = {}  # one float64 C_t and ‖C_t‖_F per group (q/k/v share theirs)
        teacher_moments: dict[str, torch.Tensor] = {}  # cross form: E[xs x~ᵀ] per group, blended once
        for name, lin in sums.linears.items():
            if lin.group not in group_moments:
                group_moments[lin.group] = _group_moments(task, name, sums.grams[lin.group])
            sw, mu_s, c, s_t = group_moments[lin.group]
            wt = expert_params[name]["weight"].to(F64)
            bt = expert_params[name].get("bias")
            bt = torch.zeros(wt.shape[0], dtype=F64, device=wt.device) if bt is None else bt.to(F64)
            target, bias_target = self._teacher_terms(sums, lin, group_moments[lin.group], wt, bt, teacher_moments)
            self._add_linear(name, c, target, bias_target, mu_s, bt, s_t)
        for name, ns in sums.norms.items():
            self._add_norm(task, name, ns, expert_params[name], name in rms)

    def _teacher_terms(self, sums: TaskSums, lin: LinearSums, moments: tuple, wt: torch.Tensor, bt: torch.Tensor,
                       teacher_moments: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(Xt Wtᵀ, bt + Wt μ~t) of one Linear from whichever form its sums took (hooks.py)."""
        a = self.alpha
        sw, mu_s, c, _ = moments
        if lin.sxy is None:  # "cross" form: Xt Wtᵀ = (α·E[xs xeᵀ] + (1−α)·Ct) Wtᵀ, one in×in×out product
            cr = sums.cross[lin.group]
            x_teacher = teacher_moments.get(lin.group)
            if x_teacher is None:
                x_teacher = teacher_moments[lin.group] = _blend(a, cr.sxxe.to(F64) / sw, c)
            target = x_teacher @ wt.T
            mean_y = wt @ (cr.sxe.to(F64) / sw) + bt
            return target, a * mean_y + (1 - a) * (wt @ mu_s + bt)  # bt + Wt μ~t
        if lin.teacher:  # "teacher" form: y = Wt x~ + α·bt, summed in the pass
            return lin.sxy.to(F64) / sw - a * torch.outer(mu_s, bt), lin.sy.to(F64) / sw + (1 - a) * bt
        # "output" form: from the expert module's output ye = Wt xe + bt
        mean_y = lin.sy.to(F64) / sw
        p = lin.sxy.to(F64) / sw - torch.outer(mu_s, bt)
        target = p if a == 1.0 else a * p + (1 - a) * (c @ wt.T)
        return target, a * mean_y + (1 - a) * (wt @ mu_s + bt)

    def _add_linear(self, name: str, c: torch.Tensor, target: torch.Tensor, bias_target: torch.Tensor,
                    mu_s: torch.Tensor, bt: torch.Tensor, s_t: torch.Tensor) -> None:
        """Add one task's Linear terms, each divided by st = ‖Ct‖_F."""
        inv = 1.0 / s_t
        mean_bias = torch.outer(mu_s, bt) * inv if self.joint_bias else None
        acc = self.linears.get(name)
        if acc is None:
            self.linears[name] = LinearNormalised(c * inv, target * inv, inv, bias_target * inv, mu_s * inv, mean_bias)
            return
        acc.gram += c * inv
        acc.target += target * inv
        acc.inv_scale = acc.inv_scale + inv
        acc.bias_target += bias_target * inv
        acc.mean += mu_s * inv
        if mean_bias is not None:
            acc.mean_bias += mean_bias

    def _add_norm(self, task: str, name: str, ns: NormSums, params: dict[str, torch.Tensor | None],
                  rms: bool) -> None:
        """Add one task's norm moments and targets (expert t's affine on the merged side's z), not normalised."""
        sw = ns.sw.to(F64)
        if float(sw) <= 0:
            raise CalibrationDataError(f"task {task!r}: norm {name} saw no weighted token")
        m = ns.sz.to(F64) / sw
        e = ns.szz.to(F64) / sw
        gamma = params["weight"].to(F64)
        beta = params.get("bias")
        if rms or beta is None:
            gt, bt_ = e * gamma, torch.zeros_like(e)
        else:
            beta = beta.to(F64)
            gt, bt_ = e * gamma + m * beta, m * gamma + beta
        acc = self.norms.get(name)
        if acc is None:
            self.norms[name] = NormNormalised(e, m, gt, bt_, 1)
            return
        acc.e += e
        acc.m += m
        acc.gamma_target += gt
        acc.beta_target += bt_
        acc.n_tasks += 1


def _group_moments(task: str, name: str, gram: GramSums) -> tuple:
    """(Σw, μs, Ct in float64, st = ‖Ct‖_F) of one group's input; refused when it saw no token or is all zero."""
    moments = gram.means()
    if moments is None:
        raise CalibrationDataError(f"task {task!r}: module {name} saw no weighted token")
    s_t = torch.linalg.matrix_norm(moments[2])
    if float(s_t) <= 0:
        raise CalibrationDataError(f"task {task!r}: module {name} has an all-zero input (‖C‖_F = 0)")
    return (*moments, s_t)


def blend_alpha(at_zero: NormalisedSums, at_one: NormalisedSums, alpha: float) -> NormalisedSums:
    """The sums at teacher blend `alpha` from the sums at 0 and at 1 of the same statistics: every Linear target
    and bias target is linear in α (X(α) = α·E[xs xeᵀ] + (1−α)·Ct, μ~ likewise), the rest does not depend on it.
    Only for sums folded without the teacher form, whose pass fixes α (tune_scope block, block_tuning.py)."""
    out = NormalisedSums(alpha, at_zero.joint_bias)
    out.norms = at_zero.norms
    for name, z in at_zero.linears.items():
        o = at_one.linears[name]
        out.linears[name] = LinearNormalised(z.gram, alpha * o.target + (1 - alpha) * z.target, z.inv_scale,
                                             alpha * o.bias_target + (1 - alpha) * z.bias_target, z.mean,
                                             z.mean_bias)
    return out
