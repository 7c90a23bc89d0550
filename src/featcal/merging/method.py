"""A merge method's implementation: the `Merger` base class, and `register`, which puts a method in the registry.

The registry itself is featcal.config's table of methods (name, kind, parameter model, implementation), so that
MergeConfig validates a method name without importing torch; featcal.merging.registry imports the built-in
implementations (mergers.py, model_mergers.py), which bind themselves to the names config.py declares.

A merger sees one tensor name at a time, with the base tensor and a lazy iterator over the experts' tensors of
that name, so that memory holds one expert tensor at a time. Methods that need global quantities (TIES'
per-expert magnitude threshold) compute them in `prepare`, which may stream over the whole family beforehand;
whole-model methods (RegMean, WUDI: model_mergers.py) compute the whole merge there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel
from torch import Tensor

from featcal.config import (
    REPORTED_WHEN_SET,
    MergeConfig,
    MethodKind,
    MethodSpec,
    add_method,
    find_method,
    params_model,
)
from featcal.errors import ConfigError
from featcal.merging.family import Family


class Merger(ABC):
    """Base class of mergers. `register` sets `name`, `params_model` (the method's parameter model) and `uses`
    (its fields); `kind` and `needs_calibration` say what the registry records about the method."""

    name: ClassVar[str] = ""
    kind: ClassVar[MethodKind] = "streaming"
    needs_calibration: ClassVar[bool] = False
    params_model: ClassVar[type[BaseModel] | None] = None
    uses: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: MergeConfig) -> None:
        self.config = config

    @classmethod
    def create(cls, config: MergeConfig, *, calibration=None, allow_pickle: bool = False) -> Merger:
        """The merger for `config`; streaming mergers read neither calibration data nor whole models."""
        if calibration is not None:
            raise ConfigError(f"merge method {cls.name!r} takes no calibration data")
        return cls(config)

    @property
    def method_params(self) -> BaseModel:
        """The validated parameters of this method (an instance of its parameter model)."""
        return self.config.method_params()

    def params(self) -> dict:
        """The hyperparameters this method actually uses (what a report should show)."""
        params = self.method_params
        # the per-expert, mergekit and method-own options appear only when used: other recipes are reported as before
        unused = {k for k in REPORTED_WHEN_SET if k in type(params).model_fields
                  and getattr(params, k) == type(params).model_fields[k].get_default(call_default_factory=True)}
        return {"method": self.name, **params.model_dump(exclude=unused)}

    def report_inputs(self) -> dict:
        """Inputs besides the checkpoints that featcal.json should record (RegMean: its calibration data)."""
        return {}

    def prepare(self, family: Family, *, progress: bool = False) -> None:
        """Global pre-passes over the family, if the method needs any (default: none)."""
        return None

    @abstractmethod
    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        """The merged value of tensor `name` in the compute dtype of `base` (do not modify inputs)."""


def register(name: str, *, params: type[BaseModel] | None = None, task_vector: bool | None = None,
             defaults: Mapping[str, Any] | None = None, reference: str | None = None,
             ) -> Callable[[type[Merger]], type[Merger]]:
    """Class decorator adding a merger under `name` to the registry (a name may be registered once): the one
    registration a new method needs (docs/extending.md).

    `params`: the method's parameter model (pydantic, a featcal.config.MethodParams); its fields that MergeConfig
    has take MergeConfig's values, the others are given as keywords (`featcal.merge(..., method=name, k=3)`, a
    run file's merge.params) and are validated by it. Default: the class's own `params_model`, else the model of
    the name's declaration in featcal.config (the built-in methods), else one made of the MergeConfig fields
    listed in the class's `uses`. `task_vector`: the merge is θ0 + s·v with s its `scaling` (`--tune` then
    searches s); `defaults`: the parameters of its paper, which `featcal bench` merges with (None: not benched);
    `reference`: the paper. A method declared in featcal.config keeps the facts declared there where these are
    not given. Once registered, the method is accepted wherever a method is (MergeConfig, featcal.merge,
    `featcal merge --method` for parsers built afterwards, run files, bench)."""

    def add(cls: type[Merger]) -> type[Merger]:
        declared = find_method(name)
        model = (params or cls.__dict__.get("params_model") or (declared.params if declared is not None else None)
                 or params_model(f"{cls.__name__}Params", *cls.uses))
        facts = {"task_vector": task_vector, "defaults": defaults, "reference": reference}
        if declared is not None:  # the declaration's facts, where this registration does not restate them
            facts = {k: getattr(declared, k) if v is None else v for k, v in facts.items()}
        add_method(MethodSpec(name, cls.kind, model, cls.needs_calibration, bool(facts["task_vector"]),
                              facts["defaults"], facts["reference"] or "", cls))
        cls.name, cls.params_model, cls.uses = name, model, tuple(model.model_fields)
        return cls

    return add
