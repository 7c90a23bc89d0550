"""Packaging: the extras table the code names equals pyproject's, no extra is needed by merge and calibrate,
the version has one source, and the project's own install keeps the pinned CPU stack.

The clean-venv `pip install .` itself is a CI step (make install-check, .ci/clean_install.sh: minutes of
installing); here the extras' packages are made unimportable in a subprocess instead, which is what their
absence looks like to featcal."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import featcal
from featcal.io.process.extras import EXTRAS
from tests.builders.data_fixtures import save_tokenizer, sentences, write_jsonl
from tests.builders.tiny import make_family

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the dev extra brings tomli
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """A requirement's distribution name, canonical (PEP 503), extras kept: 'featcal[plot,eval]'."""
    from packaging.requirements import Requirement

    req = Requirement(requirement)
    name = re.sub(r"[-_.]+", "-", req.name).lower()
    return f"{name}[{','.join(sorted(req.extras))}]" if req.extras else name


def _expanded(extra: str) -> set[str]:
    """The distributions an extra brings, its featcal[...] references followed."""
    out: set[str] = set()
    for requirement in PYPROJECT["optional-dependencies"][extra]:
        name = _name(requirement)
        if name.startswith("featcal["):
            for inner in name[len("featcal["):-1].split(","):
                out |= _expanded(inner)
        else:
            out.add(name)
    return out


def test_the_extras_table_is_pyprojects():
    declared = set(PYPROJECT["optional-dependencies"]) - {"dev"}
    assert set(EXTRAS) == declared
    for extra, modules in EXTRAS.items():
        assert {_name(d) for d in modules.values()} == _expanded(extra), extra
    required = {_name(r) for r in PYPROJECT["dependencies"]}
    optional = {d for extra in EXTRAS for d in _expanded(extra)}
    assert not required & optional  # merge and calibrate bring no extra's package
    assert {"torch", "transformers"} <= required and "psutil" not in required and "matplotlib" not in required
    assert _expanded("dev") >= optional - _expanded("lm-eval")  # the suite tests every optional feature but lm-eval


def test_torch_and_transformers_have_lower_bounds_and_the_makefile_pins_the_cpu_stack():
    from packaging.requirements import Requirement

    bounds = {Requirement(r).name: str(Requirement(r).specifier) for r in PYPROJECT["dependencies"]}
    assert bounds["torch"].startswith(">=") and "==" not in bounds["torch"]
    assert bounds["transformers"].startswith(">=5") or ">=5" in bounds["transformers"]
    makefile = (ROOT / "Makefile").read_text()
    pins = re.search(r"^PINS := (.+)$", makefile, re.M).group(1).split()
    assert "torch==2.13.0" in pins and any(p.startswith("transformers==") for p in pins)
    assert "pip install -q -e '.[dev]' $(PINS)" in makefile
    assert "make install-check" in (ROOT / ".ci" / "run").read_text()


def test_the_version_has_one_source():
    assert "version" in PYPROJECT["dynamic"] and "version" not in PYPROJECT
    dynamic = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["dynamic"]
    assert dynamic["version"] == {"attr": "featcal.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", featcal.__version__)


# run in a fresh interpreter: every extra's module is unimportable, as when it is not installed
_WITHOUT_EXTRAS = """
import importlib.abc, json, sys
blocked = set(json.loads(sys.argv[1]))
class Absent(importlib.abc.MetaPathFinder):  # every finder, blind to the blocked packages
    def __init__(self, finder):
        self.finder = finder
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in blocked:
            return None
        return self.finder.find_spec(name, path, target) if hasattr(self.finder, "find_spec") else None
    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()
    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the finders too
        return getattr(self.finder, "find_distributions", lambda *a, **k: ())(*args, **kwargs)
sys.meta_path[:] = [Absent(f) for f in sys.meta_path]
from featcal.cli.main import main
codes = [main(argv) for argv in json.loads(sys.argv[2])]
leaked = sorted(m for m in sys.modules if m.partition(".")[0] in blocked)
print(json.dumps({"codes": codes, "leaked": leaked}))
"""


@pytest.mark.slow
def test_merge_and_calibrate_run_without_any_extra(tmp_path):
    base, experts = make_family("llama", tmp_path, 2, scale=0.2)
    for d in (base, *experts.values()):
        save_tokenizer(d, "t5")
    data = {t: write_jsonl(tmp_path / f"{t}.jsonl", [{"text": s} for s in sentences(4, seed=i)])
            for i, t in enumerate(experts)}
    pairs = [a for t, d in experts.items() for a in ("--expert", f"{t}={d}")]
    calib = [a for t, d in data.items() for a in ("--calib", f"{t}={d}")]
    merged = tmp_path / "merged"
    calibrate = ["calibrate", "--base", str(base), "--merged", str(merged), *pairs, *calib,
                 "--num-calibration-examples", "4", "--calibration-batch-size", "2", "--no-progress"]
    argvs = [
        ["merge", "--base", str(base), *pairs, "--out", str(merged), "--no-progress"],
        [*calibrate, "--out", str(tmp_path / "calibrated")],
        [*calibrate, "--out", str(tmp_path / "plotted"), "--plot"],  # refused: names featcal[plot]
        [*calibrate, "--out", str(tmp_path / "one-pass"), "--block-statistics", "sequential_one_pass"],
        ["bench", "--preset", "tiny", "--out", str(tmp_path / "bench")],
    ]
    blocked = sorted({m for modules in EXTRAS.values() for m in modules})
    run = subprocess.run([sys.executable, "-c", _WITHOUT_EXTRAS, json.dumps(blocked), json.dumps(argvs)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 2, 2, 2], "leaked": []}, run.stderr[-3000:]
    assert (tmp_path / "calibrated" / "model.safetensors").is_file() and not (tmp_path / "plotted").exists()
    errors = [line for line in run.stderr.splitlines() if line.startswith("featcal: error:")]
    assert [re.search(r"featcal\[([a-z-]+)\]", e).group(1) for e in errors] == ["plot", "one-pass", "bench"]


def _ci_scripts() -> list[Path]:
    return sorted((ROOT / ".ci").glob("*.py"))


@pytest.mark.parametrize("script", _ci_scripts(), ids=lambda p: p.name)
def test_ci_scripts_import_what_exists_and_shadow_nothing(script):
    """The clean-install check runs only in CI, after minutes of installing; a moved test builder or a local
    import that shadows one of the script's own functions (`import featcal` hiding `def featcal`) failed it there.
    Here: every `from X import Y` resolves (the project's own names included), and no function binds a name that the
    module defines at top level."""
    import ast
    import importlib
    import importlib.util
    import symtable

    source = script.read_text()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            assert importlib.util.find_spec(node.module.split(".")[0]) is not None, f"{script.name}: {node.module}"
            if node.module.split(".")[0] not in {"tests", "featcal"}:
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{script.name}: {node.module} has no {alias.name}"
    top = symtable.symtable(source, str(script), "exec")
    defined = {c.get_name() for c in top.get_children() if c.get_type() in ("function", "class")}
    for child in top.get_children():
        if child.get_type() != "function":
            continue
        shadowed = {s.get_name() for s in child.get_symbols() if s.is_local() and s.get_name() in defined}
        assert not shadowed, f"{script.name}: {child.get_name()}() rebinds {sorted(shadowed)}"
