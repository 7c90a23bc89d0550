"""The registry of merging methods: a name -> a streaming merger class.

A merger sees one tensor name at a time, with the base tensor and a lazy iterator over the experts'
tensors of that name, so that memory holds one expert tensor at a time. Methods that need global
quantities (TIES' per-expert magnitude threshold) compute them in `prepare`, which may stream over
the whole family beforehand; whole-model methods (RegMean, WUDI: model_mergers.py) compute the whole
merge there. New methods plug in with `@register("name")`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar

from torch import Tensor

from featcal.config import MergeConfig
from featcal.errors import ConfigError
from featcal.merging.family import Family


class Merger(ABC):
    """Base class of streaming mergers; `uses` names the MergeConfig fields the method reads."""

    name: ClassVar[str] = ""
    uses: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: MergeConfig) -> None:
        self.config = config

    @classmethod
    def create(cls, config: MergeConfig, *, calibration=None, allow_pickle: bool = False) -> Merger:
        """The merger for `config`; streaming mergers read neither calibration data nor whole models."""
        if calibration is not None:
            raise ConfigError(f"merge method {cls.name!r} takes no calibration data")
        return cls(config)

    def params(self) -> dict:
        """The hyperparameters this method actually uses (what a report should show)."""
        return {"method": self.name, **{k: getattr(self.config, k) for k in self.uses}}

    def report_inputs(self) -> dict:
        """Inputs besides the checkpoints that featcal.json should record (RegMean: its calibration data)."""
        return {}

    def prepare(self, family: Family, *, progress: bool = False) -> None:
        """Global pre-passes over the family, if the method needs any (default: none)."""
        return None

    @abstractmethod
    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        """The merged value of tensor `name` in the compute dtype of `base` (do not modify inputs)."""


_REGISTRY: dict[str, type[Merger]] = {}


def register(name: str) -> Callable[[type[Merger]], type[Merger]]:
    """Class decorator adding a merger under `name` (a name may be registered once)."""

    def add(cls: type[Merger]) -> type[Merger]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"merge method {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def available_methods() -> list[str]:
    import featcal.merging.mergers  # noqa: F401  (registers the built-in methods)
    import featcal.merging.model_mergers  # noqa: F401  (RegMean, RegMean++, WUDI)

    return sorted(_REGISTRY)


def check_method(method: str) -> str:
    """`method` if registered, else a ConfigError listing the valid names."""
    valid = available_methods()
    if method not in valid:
        raise ConfigError(f"unknown merge method {method!r}; valid methods: {', '.join(valid)}")
    return method


def make_merger(config: MergeConfig, *, calibration=None, allow_pickle: bool = False) -> Merger:
    """The merger of `config.method`; `calibration` (a LoadedCalibration) for the methods that read data,
    `allow_pickle` for those that load whole models from pickled checkpoints."""
    return _REGISTRY[check_method(config.method)].create(config, calibration=calibration, allow_pickle=allow_pickle)
