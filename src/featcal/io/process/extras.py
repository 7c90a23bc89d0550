"""Optional features and the featcal extra that brings each one's packages.

`pip install featcal` carries what merge and calibrate need; plots, evaluation metrics, the one-pass
statistics variant, GGUF / ONNX inputs and the experiment apparatus (zoo, bench, reproduce) need
packages that only their users want. A feature asks for its extra before any work, so a missing
package is one line naming the install command, not a traceback halfway through a run.

EXTRAS mirrors pyproject.toml's [project.optional-dependencies] (tests/project/test_packaging.py keeps the two
equal): import name -> the distribution pip installs.
"""

from __future__ import annotations

import importlib.util

from featcal.errors import MissingExtraError

EXTRAS: dict[str, dict[str, str]] = {
    "plot": {"matplotlib": "matplotlib"},
    "eval": {"sklearn": "scikit-learn", "scipy": "scipy"},
    "one-pass": {"greenlet": "greenlet"},
    "gguf": {"gguf": "gguf"},
    "vision": {"onnx": "onnx", "onnxruntime": "onnxruntime"},
    "lm-eval": {"lm_eval": "lm-eval"},
    # the experiment apparatus (zoo, bench, reproduce): the plots, metrics and one-pass variant, plus memory probes
    "bench": {"matplotlib": "matplotlib", "sklearn": "scikit-learn", "scipy": "scipy", "greenlet": "greenlet",
              "psutil": "psutil"},
}


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a cheap check before any work)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a half-imported module
        return False


def missing(extra: str) -> list[str]:
    """The distributions of `extra` that are not installed."""
    return [dist for module, dist in EXTRAS[extra].items() if not installed(module)]


def require(extra: str, feature: str) -> None:
    """Refuse `feature` in one line, naming the extra that installs what it lacks."""
    if extra not in EXTRAS:
        raise KeyError(f"unknown featcal extra {extra!r}")
    lacking = missing(extra)
    if lacking:
        what = ", ".join(lacking)
        raise MissingExtraError(f"{feature} needs {what}, which is not installed: pip install 'featcal[{extra}]' "
                                f"(or pip install {' '.join(lacking)})")
