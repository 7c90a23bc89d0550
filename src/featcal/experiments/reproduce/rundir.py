"""The output directory of a reproduce run: its stages, what they cost, and how a rerun reuses them.

Layout of DIR:
    run_config.json      every parameter, versions, seed, and where each id was read from
    merged/              the Task Arithmetic checkpoint          (stage "merged")
    featcal/             the calibrated checkpoint               (stage "featcal")
    heads/<task>.safetensors   CLIP zero-shot heads (text tower of the base; CLIP only)
    eval/<stage>/<task>.json   one evaluation, tagged with the options it depends on
    metrics.json, metrics.txt  the table: per task and average, beside the paper's numbers

Each checkpoint is written through a temporary directory and renamed into place, so a directory
that exists is complete: a rerun with the same parameters reuses it. A rerun with different
parameters is refused (the stages would mix two runs).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from featcal.errors import ConfigError, OutputExistsError
from featcal.io.write.atomic import atomic_output_dir, atomic_write_text

RUN_CONFIG = "run_config.json"


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    # ------------------------------------------------------------------ identity
    def check(self, identity: dict[str, Any]) -> bool:
        """Refuse a DIR that is not this run's (other parameters, or not a reproduce run); True: resuming."""
        if self.path.exists() and not self.path.is_dir():
            raise OutputExistsError(f"--out {self.path} exists and is not a directory")
        cfg = self.path / RUN_CONFIG
        resuming = cfg.is_file()
        if resuming:
            try:
                previous = json.loads(cfg.read_text()).get("identity", {})
            except json.JSONDecodeError:
                raise ConfigError(f"{cfg} is not valid JSON; remove it or choose another --out") from None
            diff = {k: (previous.get(k), v) for k, v in identity.items() if previous.get(k) != v}
            if diff:
                detail = "; ".join(f"{k}: {old!r} there, {new!r} now" for k, (old, new) in diff.items())
                raise ConfigError(
                    f"{self.path} holds a run with other parameters ({detail}); rerun with the same ones to "
                    "resume it, or choose another --out"
                )
        elif self.path.is_dir() and any(self.path.iterdir()):
            raise OutputExistsError(
                f"{self.path} exists, is not empty and holds no {RUN_CONFIG}: not a featcal reproduce run; "
                "choose another --out"
            )
        return resuming

    def claim(self, identity: dict[str, Any], record: dict[str, Any]) -> bool:
        """Check DIR (see check), then write run_config.json; True when resuming."""
        resuming = self.check(identity)
        self.write_json(RUN_CONFIG, {"identity": identity, **record})
        return resuming

    # ------------------------------------------------------------------ stages
    def stage_dir(self, name: str) -> Path:
        return self.path / name

    def has_stage(self, name: str) -> bool:
        d = self.stage_dir(name)
        return d.is_dir() and (d / "config.json").is_file()

    def stage(self, name: str, build: Callable[[Path], None]) -> tuple[Path, bool]:
        """The stage's checkpoint dir, built by `build(tmp)` unless present; (path, reused)."""
        if self.has_stage(name):
            return self.stage_dir(name), True
        with atomic_output_dir(self.stage_dir(name), overwrite=True) as tmp:
            build(tmp)
        return self.stage_dir(name), False

    # ------------------------------------------------------------------ small files
    def write_json(self, relative: str, obj: Any) -> Path:
        path = self.path / relative
        atomic_write_text(path, _dump(obj))
        return path

    def write_text(self, relative: str, text: str) -> Path:
        path = self.path / relative
        atomic_write_text(path, text)
        return path

    def cached_eval(self, stage: str, task: str, key: dict[str, Any]) -> dict[str, Any] | None:
        """A stored evaluation of `stage` on `task`, if it was made with the same `key` options."""
        path = self.path / "eval" / stage / f"{task}.json"
        if not path.is_file():
            return None
        try:
            stored = json.loads(path.read_text())
        except json.JSONDecodeError:
            return None
        return stored["result"] if stored.get("key") == key else None

    def store_eval(self, stage: str, task: str, key: dict[str, Any], result: dict[str, Any]) -> None:
        self.write_json(f"eval/{stage}/{task}.json", {"key": key, "result": result})
