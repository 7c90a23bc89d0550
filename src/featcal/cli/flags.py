"""Command-line flags generated from the option schemas (featcal.config), grouped by concern in --help.

Why: the schema is the one place where an option, its default, its help and its valid range are defined; a
flag written by hand repeats them and drifts (two defaults of --max-length did). Each field of a model becomes
one flag: bools --x / --no-x, Literals their choices, a mapping NAME=VALUE pairs (repeated), a list a comma-
separated value (or, with `"repeat": True`, one flag per item). A field may name its own flag and metavar
(`json_schema_extra={"flag": "--weight", "metavar": "NAME=W"}`; "flag" None: no flag). The
flags of one model share a namespace prefix; unset flags are absent, so the schema's default applies, and the
values are validated by the same schema as the Python API and YAML files.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from featcal.config import parse
from featcal.errors import ConfigError

PREFIX = "cfg_"


def _members(annotation: Any) -> list[Any]:
    """The non-None members of `X | None`, or [annotation]."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _comma_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def _flag_kwargs(annotation: Any) -> dict[str, Any]:
    """argparse keywords for one pydantic field annotation (bool, int, float, str, Path, Literal, list, X | None)."""
    members = _members(annotation)
    if len(members) > 1:
        return {"type": str}
    annotation = members[0]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return {"choices": choices, "type": type(choices[0])}
    if origin in (list, tuple):
        return {"type": _comma_list, "metavar": "A,B"}
    if annotation is bool:
        return {"action": argparse.BooleanOptionalAction}
    if annotation in (int, float, str):
        return {"type": annotation, "metavar": annotation.__name__.upper()}
    if annotation is Path:
        return {"type": str, "metavar": "DIR"}
    return {"type": str}


def _is_mapping(info: FieldInfo) -> bool:
    return any(typing.get_origin(a) is dict for a in _members(info.annotation))


def _extra(info: FieldInfo) -> dict[str, Any]:
    return info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}


def flag_of(name: str, info: FieldInfo) -> str | None:
    """The flag of field `name`: its own (json_schema_extra "flag"; None: no flag), else --name-with-dashes."""
    extra = _extra(info)
    return extra["flag"] if "flag" in extra else "--" + name.replace("_", "-")


def concern_groups(model: type[BaseModel], titles: Mapping[str, str] | None = None) -> list[tuple[str, list[str]]]:
    """(title, field names) for each concern `model` is made of: fields grouped by the class that declares them
    (FeatCalConfig: solve, data, execution, resume, tune), the model's own first. A group's title is its class's
    `concern`, unless `titles` (class name -> title) says otherwise."""
    owner: dict[str, type] = {}
    for cls in reversed(model.__mro__):
        for name in cls.__dict__.get("__annotations__", {}):
            if name in model.model_fields:
                owner[name] = cls
    groups: dict[type, list[str]] = {}
    for name in model.model_fields:
        groups.setdefault(owner.get(name, model), []).append(name)
    order = sorted(groups, key=lambda cls: cls is not model)  # stable: the others in field order
    titles = titles or {}
    return [(titles.get(cls.__name__) or cls.__dict__.get("concern") or f"{cls.__name__} options", groups[cls])
            for cls in order]


def add_flags(
    parser: argparse.ArgumentParser, model: type[BaseModel], *, prefix: str = PREFIX,
    titles: Mapping[str, str] | None = None, choices: Mapping[str, Sequence[str]] | None = None,
    only: Iterable[str] | None = None, skip: Iterable[str] = (),
) -> None:
    """One flag per field of `model` (those in `only`, none in `skip`), in one argument group per concern.
    `choices`: field -> the values its flag accepts, known when the parser is built (MergeConfig.method: the
    registry's)."""
    keep = set(only) if only is not None else None
    for title, names in concern_groups(model, titles):
        names = [n for n in names if (keep is None or n in keep) and n not in skip
                 and flag_of(n, model.model_fields[n]) is not None]
        if not names:
            continue
        group = parser.add_argument_group(title)
        for name in names:
            _add_flag(group, name, model.model_fields[name], prefix, (choices or {}).get(name))


def add_flag(group, name: str, info: FieldInfo, prefix: str = PREFIX, choices: Sequence[str] | None = None) -> None:
    """One field's flag in `group` (argparse group or parser), as `add_flags` makes them."""
    _add_flag(group, name, info, prefix, choices)


def _add_flag(group, name: str, info: FieldInfo, prefix: str, choices: Sequence[str] | None) -> None:
    default = info.get_default(call_default_factory=True)
    if _is_mapping(info):
        metavar = _extra(info).get("metavar", "NAME=VALUE")
        kwargs: dict[str, Any] = {"action": "append", "metavar": metavar}
        help_text = f"{info.description or name.replace('_', ' ')} ({metavar}, repeat per name)"
    else:
        kwargs = _flag_kwargs(info.annotation)
        if choices is not None:
            kwargs = {"type": str, "choices": list(choices)}
        if _extra(info).get("repeat"):  # a list whose items may hold commas: one flag per item
            kwargs = {"action": "append"}
        if "metavar" in _extra(info):
            kwargs["metavar"] = _extra(info)["metavar"]
        help_text = (info.description or name.replace("_", " ")) + f" (default: {default})"
    group.add_argument(flag_of(name, info), dest=prefix + name, default=argparse.SUPPRESS, help=help_text, **kwargs)


def given_values(args: argparse.Namespace, model: type[BaseModel], prefix: str = PREFIX) -> dict[str, Any]:
    """The values of `model`'s flags that were given: NAME=VALUE pairs as mappings (numbers read as numbers
    where the field holds numbers), each a one-line ConfigError when malformed."""
    given = {}
    for key, value in vars(args).items():
        name = key[len(prefix):] if key.startswith(prefix) else None
        if name not in model.model_fields:
            continue
        info = model.model_fields[name]
        if _is_mapping(info):
            flag = flag_of(name, info)
            pairs = parse_pairs(value, flag)
            if _holds_numbers(info):
                pairs = {n: _number(v, flag, n) for n, v in pairs.items()}
            value = pairs
        given[name] = value
    return given


def options_from_args(args: argparse.Namespace, model: type[BaseModel], prefix: str = PREFIX, **extra: Any):
    """`model` validated from the flags that were given, plus `extra` fields (ConfigError on a bad value)."""
    return parse(model, {**given_values(args, model, prefix), **extra})


def _holds_numbers(info: FieldInfo) -> bool:
    for member in _members(info.annotation):
        args = typing.get_args(member)
        if typing.get_origin(member) is dict and len(args) == 2:
            return args[1] in (int, float)
    return False


def _number(value: str, flag: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag} {name}={value}: {value!r} is not a number") from None


def parse_pairs(pairs: list[str] | None, flag: str) -> dict[str, str]:
    """NAME=VALUE pairs into an ordered dict, refusing malformed and repeated names."""
    out: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise ConfigError(f"{flag} expects NAME=VALUE, got {pair!r}")
        name = name.strip()
        if name in out:
            raise ConfigError(f"{flag} {name!r} is given twice")
        out[name] = value.strip()
    return out
