"""The registry of merging methods: the one list of what `method=` accepts, with each method's implementation.

Each entry (featcal.config.MethodSpec) is a name, a kind (streaming or whole-model), a parameter model and an
implementation (a featcal.merging.method.Merger subclass). Importing this module imports the built-in
implementations (mergers.py: average, task_arithmetic, ties, dare_ta, dare_ties; model_mergers.py: regmean,
regmean++, wudi), which register themselves; new methods plug in with `@register("name", params=Model)`.
"""

from __future__ import annotations

import featcal.merging.mergers  # noqa: F401  (average, task_arithmetic, ties, dare_ta, dare_ties)
import featcal.merging.model_mergers  # noqa: F401  (regmean, regmean++, wudi)
from featcal.config import MergeConfig, load_plugins, method_names, method_spec
from featcal.errors import ConfigError
from featcal.merging.method import Merger, register

load_plugins()  # installed packages' methods (entry-point group featcal.merge_methods), after the built-in ones

__all__ = ["Merger", "register", "available_methods", "check_method", "make_merger"]


def available_methods() -> list[str]:
    """Every registered method, sorted."""
    return method_names()


def check_method(method: str) -> str:
    """`method` if registered, else a ConfigError listing the valid names."""
    method_spec(method)
    return method


def make_merger(config: MergeConfig, *, calibration=None, allow_pickle: bool = False) -> Merger:
    """The merger of `config.method`; `calibration` (a LoadedCalibration) for the methods that read data,
    `allow_pickle` for those that load whole models from pickled checkpoints."""
    spec = method_spec(config.method)
    if spec.implementation is None:
        raise ConfigError(f"merge method {config.method!r} is declared but no implementation is registered")
    return spec.implementation.create(config, calibration=calibration, allow_pickle=allow_pickle)
