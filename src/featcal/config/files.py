"""YAML run files: read safely and boundedly, then validated (config/run.py's RunConfig)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from featcal.config.base import parse
from featcal.config.run import RunConfig, RunOptions, run_options
from featcal.errors import ConfigError


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` overrides are what merge keys are for
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise ConfigError(
                        f"{self.name}, line {line}: key {key!r} is given twice in one mapping (first on line "
                        f"{seen[key]}); YAML would keep only the last, so remove one"
                    )
                seen[key] = line
            except TypeError:  # an unhashable key: the base loader refuses it
                continue
        return super().construct_mapping(node, deep=deep)


# A run file is a few dozen lines; these bounds keep a crafted one (nested 20,000 levels deep, or YAML aliases
# expanding to billions of values) from exhausting the stack or memory before it is validated.
MAX_RUN_FILE_BYTES = 16 << 20
MAX_RUN_FILE_DEPTH = 64
MAX_RUN_FILE_VALUES = 100_000


def _check_run_file_shape(path: Path, data: Any) -> None:
    """Refuse a run file deeper than MAX_RUN_FILE_DEPTH, or holding more than MAX_RUN_FILE_VALUES values once
    its aliases are expanded (counted per distinct node, so an alias bomb costs no more to count than to read)."""
    sizes: dict[int, int] = {}

    def walk(node: Any, depth: int) -> int:
        if depth > MAX_RUN_FILE_DEPTH:
            raise ConfigError(f"{path} nests its values too deeply for a run file (at most {MAX_RUN_FILE_DEPTH} levels)")
        if not isinstance(node, (dict, list)):
            return 1
        if id(node) not in sizes:
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            sizes[id(node)] = 1 + sum(walk(c, depth + 1) for c in children)
            if sizes[id(node)] > MAX_RUN_FILE_VALUES:
                raise ConfigError(f"{path} holds over {MAX_RUN_FILE_VALUES} values once its YAML aliases are expanded; "
                                  "a run file is far smaller")
        return sizes[id(node)]

    walk(data, 0)


def load_run_file(path: str | Path) -> RunConfig:
    """Read and validate a YAML run file: one-line errors for a missing, non-UTF-8 or invalid file."""
    return run_config(read_run_data(path))


def run_config(data: dict[str, Any]) -> RunConfig:
    """A run file's mapping, validated (the run options first, with the CLI flags' own errors)."""
    run_options(**{k: v for k, v in data.items() if k in RunOptions.model_fields})
    return parse(RunConfig, data)


def read_run_data(path: str | Path) -> dict[str, Any]:
    """A YAML run file's top-level mapping, not yet validated (a mergekit YAML is translated before)."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"run file {p} does not exist")
    if p.is_file() and p.stat().st_size > MAX_RUN_FILE_BYTES:
        raise ConfigError(f"{p} is {p.stat().st_size >> 20} MiB; a run file is at most {MAX_RUN_FILE_BYTES >> 20} MiB")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{p}, line {line}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); save it as UTF-8"
        ) from None
    loader = UniqueKeyLoader(text)
    loader.name = str(p)
    try:
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{p} nests its values too deeply for a run file (at most {MAX_RUN_FILE_DEPTH} levels)") from None
    finally:
        loader.dispose()
    _check_run_file_shape(p, data)
    if not isinstance(data, dict):
        raise ConfigError(f"{p} must hold a mapping at the top level")
    return data
