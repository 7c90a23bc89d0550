"""Merges computed on whole models: RegMean, RegMean++ (with calibration data) and WUDI (data-free).

They plug into the same registry and driver as the streaming mergers, so that `featcal merge`,
`featcal.merge` and `featcal run` validate, check for NaN/Inf, write (atomically, safetensors named
as the base checkpoint names them) and report them exactly like the others. `prepare` loads the
models and computes the whole merge with featcal.experiments.baselines' algorithms; `merge_tensor` then hands
its tensors to the writer one by one. Memory is that of the algorithm, not the streaming bound:
RegMean holds the base, the merge and one expert at a time; RegMean++ and WUDI hold every expert.
"""

from __future__ import annotations

import copy
from abc import abstractmethod
from collections.abc import Callable, Iterator, Mapping
from functools import partial
from typing import ClassVar

import torch
from pydantic import BaseModel
from torch import Tensor, nn

from featcal.config import MergeConfig, MethodKind, method_spec
from featcal.data.inputs import ModelLike, load, validate_family_inputs
from featcal.errors import CheckpointError, ConfigError
from featcal.io.read.family import load_source_model
from featcal.io.read.sources import checkpoint_state_dict
from featcal.merging.calibration_data import LoadedCalibration
from featcal.merging.family import Family
from featcal.merging.method import Merger, register


class ModelMerger(Merger):
    """A merge computed on whole models in `prepare`, then written tensor by tensor."""

    kind: ClassVar[MethodKind] = "whole_model"
    needs_calibration: ClassVar[bool] = False

    def __init__(self, config: MergeConfig, *, calibration: LoadedCalibration | None = None,
                 allow_pickle: bool = False) -> None:
        super().__init__(config)
        self.calibration = calibration
        self.allow_pickle = allow_pickle
        self.state: dict[str, Tensor] = {}

    @classmethod
    def create(cls, config: MergeConfig, *, calibration=None, allow_pickle: bool = False) -> Merger:
        if cls.needs_calibration and calibration is None:
            raise ConfigError(f"merge method {cls.name!r} needs calibration data")
        if not cls.needs_calibration and calibration is not None:
            raise ConfigError(f"merge method {cls.name!r} is data-free and takes no calibration data")
        return cls(config, calibration=calibration, allow_pickle=allow_pickle)

    params_override: BaseModel | None = None  # the parameters, when given as such (merge_models) not by a config

    @property
    def method_params(self) -> BaseModel:
        return self.params_override if self.params_override is not None else super().method_params

    def params(self) -> dict:
        extra = self.calibration.params if self.calibration is not None else {}
        return {**super().params(), **extra}

    def report_inputs(self) -> dict:
        return {"calibration": self.calibration.report} if self.calibration is not None else {}

    @abstractmethod
    def merge_models(self, base: nn.Module, experts: Mapping[str, Callable[[], nn.Module]],
                     progress: bool) -> nn.Module:
        """The merged model, of the base's class; `experts` load on call. Must not modify `base`."""

    @torch.no_grad()
    def prepare(self, family: Family, *, progress: bool = False) -> None:
        base = load_source_model(family.base, "base", self.allow_pickle)
        experts = {t: partial(load_source_model, s, f"expert {t!r}", self.allow_pickle)
                   for t, s in family.experts.items()}
        merged = self.merge_models(base, experts, progress)
        self.state = checkpoint_state_dict(merged)
        missing = [n for n in family.floating_names if n not in self.state]
        if missing:
            raise CheckpointError(
                f"the {self.name} merge has no tensor {missing[0]!r} of the base checkpoint "
                f"({len(missing)} missing): its names differ from the model's own"
            )

    def merge_tensor(self, name: str, base: Tensor, experts: Iterator[tuple[str, Tensor]]) -> Tensor:
        return self.state.pop(name).to(base.dtype)  # the experts' tensors are not read again


class _RegMean(ModelMerger):
    needs_calibration = True
    plus_plus: ClassVar[bool] = False  # RegMean++ is its own method, not a parameter

    def merge_models(self, base, experts, progress):
        from featcal.merging.regmean import regmean_models

        return regmean_models(base, experts, self.calibration.batches, self.method_params, plus_plus=self.plus_plus,
                              progress=progress)


@register("regmean")
class RegMean(_RegMean):
    """RegMean (Jin et al., ICLR 2023): each Linear weight in closed form from the experts' own Grams."""


@register("regmean++")
class RegMeanPlusPlus(_RegMean):
    """RegMean++: blocks in forward order, Grams from the merged model's own propagated inputs."""

    plus_plus = True


@register("wudi")
class Wudi(ModelMerger):
    """WUDI (Cheng et al., 2025): data-free, per-Linear Adam on the task vectors' interference."""

    def merge_models(self, base, experts, progress):
        from featcal.merging.wudi import wudi_models

        state = wudi_models(base, {t: load() for t, load in experts.items()}, self.method_params, progress=progress)
        merged = copy.deepcopy(base)
        merged.load_state_dict(state)
        return merged


@torch.no_grad()
def merge_models(method: str, base: ModelLike, experts: Mapping[str, ModelLike], *, params: BaseModel,
                 batches: Mapping[str, list] | None = None, progress: bool = True) -> nn.Module:
    """A whole-model method of the registry (RegMean, RegMean++, WUDI, or one registered later) on models in memory
    or checkpoint paths, validated as one family first, with its parameters `params` (its parameter model) and,
    for a method that reads data, each task's `batches`: what the comparison baselines run
    (featcal.experiments.baselines.run_baseline). Returns the merged model, of the base's class."""
    spec = method_spec(method)
    if spec.kind != "whole_model" or spec.implementation is None:
        raise ConfigError(f"merge method {method!r} is not a whole-model merge with an implementation")
    calibration = LoadedCalibration(dict(batches), {}) if batches is not None else None
    merger = spec.implementation.create(MergeConfig(method=method), calibration=calibration)
    merger.params_override = params
    validate_family_inputs(base, experts)
    loaders = {t: partial(load, m, f"expert {t!r}") for t, m in experts.items()}
    return merger.merge_models(load(base, "base"), loaders, progress)
