"""The merge methods' registry: one `MethodSpec` per method, with every fact the rest of featcal needs of it.

A spec says what kind of merge the method is, its one parameter model, whether it reads calibration data,
whether it is a task-vector merge θ0 + s·v (so that `--tune` may rebuild it at other scalings), the settings
of its paper (what `featcal bench` merges with) and the paper itself. Bench, tuning, the baselines and the CLI
read these facts here, never from tables of their own. Declared in the config layer so that validating a
method name or reading a fact needs neither torch nor the merging package; the implementation (a
featcal.merging.method.Merger) binds itself by name (`featcal.merging.register`). docs/extending.md shows how a
method is added.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel

from featcal.errors import ConfigError

MethodKind = Literal["streaming", "whole_model"]
# installed packages add merge methods through this entry-point group: each entry names a module (or an object in
# one) whose import registers its methods with featcal.merging.register (docs/extending.md)
ENTRY_POINT_GROUP = "featcal.merge_methods"
log = logging.getLogger("featcal.merging")


@dataclass(frozen=True)
class MethodSpec:
    """One merge method of the registry (mergekit's explicit method list is the model).

    `kind`: "streaming" (one tensor at a time) or "whole_model" (computed on whole models, then written tensor by
    tensor); `params`: the pydantic model of the method's parameters (its only one: the merge, the baselines
    and the bench validate with it); `needs_calibration`: reads calibration data (the others refuse it);
    `task_vector`: the merge is θ0 + s·v with s its `scaling`, so rebuilding it at another scaling is exact;
    `defaults`: the parameters its paper (or the authors' code) uses, which `featcal bench` merges with (None:
    not benched); `reference`: the paper; `implementation`: the featcal.merging.method.Merger subclass, bound by
    `featcal.merging.register`.
    """

    name: str
    kind: MethodKind
    params: type[BaseModel]
    needs_calibration: bool = False
    task_vector: bool = False
    defaults: Mapping[str, Any] | None = None
    reference: str = ""
    implementation: type | None = None
    description: str = field(default="", compare=False)


_METHODS: dict[str, MethodSpec] = {}
_PLUGINS: dict[str, str] = {}  # entry-point name -> what its import did ("loaded", or the error), once per process


def load_plugins() -> dict[str, str]:
    """Import every installed plugin of ENTRY_POINT_GROUP once (their imports register their methods); a plugin
    that fails to import is logged with its error and left out, never stopping featcal. {entry: outcome}."""
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _PLUGINS:
            continue
        try:
            ep.load()
            _PLUGINS[ep.name] = "loaded"
        except Exception as exc:  # a broken plugin is the plugin's fault: said, and featcal goes on without it
            _PLUGINS[ep.name] = f"{type(exc).__name__}: {exc}"
            log.warning("merge-method plugin %r (%s) failed to load and is left out: %s", ep.name, ep.value,
                        _PLUGINS[ep.name])
    return dict(_PLUGINS)


def own_parameters(spec: MethodSpec, shared: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of `spec`'s parameter model that `shared` (MergeConfig's fields) does not declare: the method's
    own parameters, which get flags of their own (`featcal merge --help`)."""
    return {n: f for n, f in spec.params.model_fields.items() if n not in shared}


def method_names() -> list[str]:
    """Every registered merge method, sorted: what MergeConfig.method, `featcal merge --method` and a run file's
    merge.method accept."""
    return sorted(_METHODS)


def registered_methods() -> list[MethodSpec]:
    """Every registered method's spec, in the order they were registered (the built-in ones first)."""
    return list(_METHODS.values())


def unknown_method_message(method: object) -> str:
    return f"unknown merge method {method!r}; valid methods: {', '.join(method_names())}"


def method_spec(method: str) -> MethodSpec:
    """The registry entry of `method` (ConfigError listing the registered methods if there is none)."""
    spec = _METHODS.get(method) if isinstance(method, str) else None
    if spec is None:
        raise ConfigError(unknown_method_message(method))
    return spec


def find_method(method: str) -> MethodSpec | None:
    """The registry entry of `method`, None if there is none."""
    return _METHODS.get(method) if isinstance(method, str) else None


def is_task_vector_merge(method: str | None) -> bool:
    """Whether `method` is a registered task-vector merge θ0 + s·v (what `--tune` can rebuild at other s)."""
    spec = find_method(method) if method is not None else None
    return spec is not None and spec.task_vector


def add_method(spec: MethodSpec) -> MethodSpec:
    """Add `spec` to the registry, or bind the implementation of a method declared without one. A second
    implementation of one name, or one of another kind than declared, is a ValueError
    (used by featcal.merging.register)."""
    old = _METHODS.get(spec.name)
    if old is not None:
        if old.implementation is not None and spec.implementation is not old.implementation:
            raise ValueError(f"merge method {spec.name!r} is already registered by {old.implementation.__name__}")
        if (old.kind, old.needs_calibration) != (spec.kind, spec.needs_calibration):
            raise ValueError(
                f"merge method {spec.name!r} is declared {old.kind} (needs_calibration={old.needs_calibration}), "
                f"not {spec.kind} (needs_calibration={spec.needs_calibration})"
            )
    _METHODS[spec.name] = spec
    return spec


def _registered(method: str) -> str:
    if method not in _METHODS:
        load_plugins()  # a method an installed plugin adds, validated before anything imported the merging package
    if method not in _METHODS:
        raise ValueError(unknown_method_message(method))
    return method


# a merge method's name, checked against the registry when validated (a method registered later is accepted)
MethodName = Annotated[str, AfterValidator(_registered)]
# Deprecated alias (it was a Literal of the built-in names): any registered name, see method_names()
MergeMethod = MethodName
