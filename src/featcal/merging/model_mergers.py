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
from torch import Tensor, nn

from featcal.config import MergeConfig, MethodKind
from featcal.errors import CheckpointError, ConfigError
from featcal.io.family import load_source_model
from featcal.io.sources import checkpoint_state_dict
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
    plus_plus: ClassVar[bool] = False

    def merge_models(self, base, experts, progress):
        from featcal.merging.method_params import RegMeanParams
        from featcal.merging.regmean import regmean_models

        params = RegMeanParams(alpha=self.config.alpha, plus_plus=self.plus_plus)
        return regmean_models(base, experts, self.calibration.batches, params, progress=progress)


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
        from featcal.merging.method_params import WudiParams
        from featcal.merging.wudi import wudi_models

        params = WudiParams(steps=self.config.steps, lr=self.config.lr, seed=self.config.seed)
        state = wudi_models(base, {t: load() for t, load in experts.items()}, params, progress=progress)
        merged = copy.deepcopy(base)
        merged.load_state_dict(state)
        return merged
