"""The streaming merge loop: one tensor name at a time, one expert tensor at a time.

Memory: the result so far, the current base tensor, the method's per-tensor accumulators and one
expert tensor; never all experts at once, whatever their number.
"""

from __future__ import annotations

from torch import Tensor
from tqdm.auto import tqdm

from featcal.io.process import interrupts
from featcal.merging.family import Family
from featcal.merging.method import Merger


def merge_family(merger: Merger, family: Family, *, progress: bool = True) -> dict[str, Tensor]:
    """Merged state dict (base names and dtypes); non-floating tensors are copied from the base."""
    merger.prepare(family, progress=progress)
    merged: dict[str, Tensor] = {}
    for name in tqdm(family.names, desc=f"merging ({merger.name})", unit="tensor", disable=not progress):
        interrupts.check()  # SIGTERM: stop at the next tensor even if its exception was swallowed
        raw = family.base.get(name)
        if not raw.is_floating_point():
            merged[name] = raw.clone()
            continue
        base = family.base_tensor(name)
        value = merger.merge_tensor(name, base, family.expert_tensors(name))
        merged[name] = value.to(raw.dtype).contiguous()
        del raw, base, value
    return merged
