"""A validated base + experts, read tensor by tensor: what every streaming merger iterates over."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from featcal.io.read.validate import TensorSource
from featcal.merging.methods import compute_dtype


@dataclass
class Family:
    """The inputs of one merge. Expert tensors are read lazily, one at a time, on every iteration."""

    base: TensorSource
    experts: Mapping[str, TensorSource]
    names: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.names:
            self.names = sorted(self.base.keys())

    def is_floating(self, name: str) -> bool:
        return self.base.meta(name)[1].is_floating_point

    @property
    def floating_names(self) -> list[str]:
        """Tensors that get merged; the others (position ids, counters) are copied from the base."""
        return [n for n in self.names if self.is_floating(n)]

    def floating_numel(self) -> int:
        """Entries of one whole task vector (all floating parameters together)."""
        total = 0
        for n in self.floating_names:
            numel = 1
            for d in self.base.meta(n)[0]:
                numel *= d
            total += numel
        return total

    def selection_dtype(self) -> torch.dtype:
        """One dtype in which magnitudes of every floating tensor compare exactly."""
        dtypes = {compute_dtype(self.base.meta(n)[1]) for n in self.floating_names}
        return torch.float64 if torch.float64 in dtypes else torch.float32

    def base_tensor(self, name: str) -> Tensor:
        """θ0 of `name` in its compute dtype (may be the source's own tensor: never modify in place)."""
        t = self.base.get(name)
        return t.to(compute_dtype(t.dtype))

    def expert_tensors(self, name: str) -> Iterator[tuple[str, Tensor]]:
        """(expert name, θt) for every expert, each read only when the consumer asks for it."""
        for expert, source in self.experts.items():
            yield expert, source.get(name)
