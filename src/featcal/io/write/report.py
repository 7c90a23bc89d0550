"""The JSON report (`featcal.json`) every command writes beside its output."""

from __future__ import annotations

import json
import os
import platform
import resource
import sys
import time
from pathlib import Path
from typing import Any

from featcal.io.write.atomic import atomic_write_text

REPORT_NAME = "featcal.json"


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB.

    On Linux this is the memory map's high-water mark (VmHWM in /proc/self/status), not ru_maxrss:
    execve keeps the old memory map's peak in ru_maxrss, so a featcal started by fork/vfork from a
    larger process (a test runner, a notebook, a benchmark driver) would report its PARENT's peak
    when that is higher (measured: 811 MiB reported by a 9 MiB child of an 800 MiB parent).
    """
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/status", encoding="ascii") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024.0  # kB
        except (OSError, ValueError, IndexError):
            pass
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024.0 if sys.platform != "darwin" else kib / 2**20


def package_versions() -> dict[str, str]:
    """Versions of the packages whose behaviour determines the output."""
    out = {"python": platform.python_version()}
    for name in ("featcal", "torch", "transformers", "safetensors", "numpy"):
        try:
            from importlib.metadata import version

            out[name] = version(name)
        except Exception:  # pragma: no cover - not installed
            out[name] = "unknown"
    return out


class Timer:
    """Wall-clock timer used for the `seconds` field of reports."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.start


def build_report(command: str, params: dict[str, Any], **extra: Any) -> dict[str, Any]:
    report: dict[str, Any] = {
        "command": command,
        "argv": sys.argv,
        "params": params,
        "versions": package_versions(),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    report.update(extra)
    return report


def write_report(directory: str | os.PathLike, report: dict[str, Any], name: str = REPORT_NAME) -> Path:
    path = Path(directory) / name
    atomic_write_text(path, json.dumps(report, indent=2, sort_keys=False, default=str) + "\n")
    return path
