"""The house's floors, checked from the code's own imports (issue #18).

Every `featcal` import counts, those inside functions included (a lazy import is still a
dependency). Packages sit on floors; a module may import its own package or a package on a lower
floor, never one above it or one beside it on the same floor (merging and calibration stand side by
side and neither imports the other). And no file-level import circle exists anywhere.

The same rule holds inside experiments/, io/, blocks/ and calibration/, each with a floor table of its own parts
(issue 52), and no two packages (nor two `registry` modules) share a name.
"""

from __future__ import annotations

import ast
from collections.abc import Mapping
from pathlib import Path

import featcal

# floor of each top-level part of featcal (docs/layout.md)
FLOORS: dict[str, int] = {
    "errors": 0,
    "config": 1, "io": 1,
    "blocks": 2, "data": 2,
    "merging": 3, "calibration": 3,
    "evaluation": 4,  # metrics and runners of `featcal eval`, used by bench and reproduce (issue #38)
    "jobs": 5,  # the use cases (run, plan): one request in, one result out (issue #52)
    "experiments": 6,
    "": 7,  # featcal/__init__.py: the public Python API
    "baselines": 7,  # the deprecated alias of experiments.baselines (0.1 import path)
    "cli": 8,
    "__main__": 9,
}
# inside experiments/: the GLUE / CLIP task data (task_data) below the baselines, both below the zoo, the zoo below bench / reproduce
EXPERIMENT_FLOORS: dict[str, int] = {"": 0, "task_data": 1, "baselines": 2, "zoo": 3, "bench": 4, "reproduce": 4}
# inside io/ (issue 52): the process (signals, host allocator, extras) below reading, reading below writing
IO_FLOORS: dict[str, int] = {"": 0, "process": 1, "read": 2, "write": 3}
# inside blocks/ (issue 52): leaves (capture, linear layers, norms, Grams, heads), then where the stacks are
# (structure, with Stack) and what a block calibrates (discovery), then the probe and the support check, then
# the adapters (which check support first) and the catalog `featcal supported` prints
BLOCK_FLOORS: dict[str, int] = {
    "": 0, "capture": 0, "linear": 0, "norms": 0, "grams": 0, "heads": 0,
    "structure": 1, "discovery": 1,
    "probe": 2, "support": 2,
    "adapters": 3, "catalog": 3,
}
# inside calibration/ (issue 52): the pure math (statistics, their sums over ranks, drift sums, closed-form solves)
# and the resume checkpoints, then the block engine, then one calibration at one setting (core: with its input
# checks and result), then the label-free search that calibrates candidates through it, then the plan (whose
# time estimate counts the search's calibrations) and the front (featcal.calibrate, calibrate_to_dir)
CALIBRATION_FLOORS: dict[str, int] = {
    "": 0,
    "maths": 1, "resume": 1,
    "engine": 2,
    "core": 3,
    "tuning": 4,
    "planning": 5, "front": 5,
}


def module_files(package_dir: Path, package: str) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under `package_dir`."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = [package, *path.relative_to(package_dir).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph(package_dir: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (at any depth of its code)."""
    modules = module_files(package_dir, package)

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        here = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from pkg import sub` depends on pkg.sub, not on pkg's __init__
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
            for target in targets:
                if target == package or target.startswith(package + "."):
                    resolved = known(target)
                    if resolved and resolved != module:
                        graph[module].add(resolved)
    return graph


def _part(module: str, package: str, depth: int) -> str:
    parts = module.split(".")[1:]
    return ".".join(parts[:depth])


def floor_violations(graph: Mapping[str, set[str]], package: str, floors: Mapping[str, int],
                     sub: str | None = None) -> list[str]:
    """'a -> b' for each import that runs up or sideways between parts (top-level parts, or those of `sub`)."""
    depth = 1 if sub is None else 2
    bad = []
    for a, targets in graph.items():
        for b in targets:
            if sub is not None and not (_part(a, package, 1) == sub == _part(b, package, 1)):
                continue
            pa, pb = _part(a, package, depth), _part(b, package, depth)
            if sub is not None:
                pa, pb = pa.partition(".")[2], pb.partition(".")[2]
            if pa == pb:
                continue
            if pa not in floors or pb not in floors:
                bad.append(f"{a} -> {b}: part {pa or pb!r} has no floor")
            elif floors[pb] >= floors[pa]:
                bad.append(f"{a} -> {b}: floor {floors[pa]} imports floor {floors[pb]}")
    return sorted(bad)


def circles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


PACKAGE_DIR = Path(featcal.__file__).parent


def test_no_package_imports_upward_or_sideways():
    graph = import_graph(PACKAGE_DIR, "featcal")
    assert floor_violations(graph, "featcal", FLOORS) == []


def test_experiments_keep_their_own_floors():
    graph = import_graph(PACKAGE_DIR, "featcal")
    assert floor_violations(graph, "featcal", EXPERIMENT_FLOORS, sub="experiments") == []


def test_io_keeps_its_own_floors():
    graph = import_graph(PACKAGE_DIR, "featcal")
    assert floor_violations(graph, "featcal", IO_FLOORS, sub="io") == []


def test_blocks_keep_their_own_floors():
    graph = import_graph(PACKAGE_DIR, "featcal")
    assert floor_violations(graph, "featcal", BLOCK_FLOORS, sub="blocks") == []


def test_calibration_keeps_its_own_floors():
    graph = import_graph(PACKAGE_DIR, "featcal")
    assert floor_violations(graph, "featcal", CALIBRATION_FLOORS, sub="calibration") == []


def test_no_import_circle():
    assert circles(import_graph(PACKAGE_DIR, "featcal")) == []


def test_every_part_has_a_floor():
    parts = {_part(m, "featcal", 1) for m in module_files(PACKAGE_DIR, "featcal")}
    assert parts <= set(FLOORS), sorted(parts - set(FLOORS))


def test_every_part_of_io_blocks_calibration_and_experiments_has_a_floor():
    """A new sub-package (or, in blocks/, a new module) gets a floor before it is checked against the others."""
    modules = module_files(PACKAGE_DIR, "featcal")
    for sub, floors in (("io", IO_FLOORS), ("blocks", BLOCK_FLOORS), ("calibration", CALIBRATION_FLOORS),
                        ("experiments", EXPERIMENT_FLOORS)):
        parts = {_part(m, "featcal", 2).partition(".")[2] for m in modules if _part(m, "featcal", 1) == sub}
        assert parts <= set(floors), (sub, sorted(parts - set(floors)))


def shared_names(package_dir: Path) -> dict[str, list[str]]:
    """Package (folder) names, and `registry` module names, used more than once under `package_dir`."""
    seen: dict[str, list[str]] = {}
    for init in sorted(package_dir.rglob("__init__.py")):
        if init.parent != package_dir:
            seen.setdefault(init.parent.name, []).append(init.parent.relative_to(package_dir).as_posix())
    for module in sorted(package_dir.rglob("registry.py")):
        seen.setdefault("registry.py", []).append(module.relative_to(package_dir).as_posix())
    return {name: where for name, where in seen.items() if len(where) > 1}


def test_no_two_packages_and_no_two_registries_share_a_name():
    """Two `evaluation` packages or two `registry` modules leave a reader (and a `from ... import`) guessing which."""
    assert shared_names(PACKAGE_DIR) == {}


def test_the_old_baselines_path_still_works_with_a_deprecation_warning():
    import importlib
    import sys

    import pytest

    from featcal.experiments.baselines import run_baseline

    sys.modules.pop("featcal.baselines", None)
    with pytest.warns(DeprecationWarning, match="featcal.experiments.baselines"):
        old = importlib.import_module("featcal.baselines")
    assert old.run_baseline is run_baseline


def test_the_checker_sees_upward_sideways_lazy_and_circular_imports(tmp_path):
    """The checks above would pass on an empty graph; show they catch what they are for."""
    pkg = tmp_path / "pkg"
    for folder in ("io", "merging", "calibration"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "reader.py").write_text("def f():\n    from pkg.merging import api  # lazy, still upward\n")
    (pkg / "merging" / "api.py").write_text("from pkg.calibration.engine import run\nfrom pkg.io import reader\n")
    (pkg / "calibration" / "engine.py").write_text("from . import helpers\nrun = 1\n")
    (pkg / "calibration" / "helpers.py").write_text("from .engine import run\n")
    graph = import_graph(pkg, "pkg")
    floors = {"": 9, "io": 1, "merging": 3, "calibration": 3}
    assert floor_violations(graph, "pkg", floors) == [
        "pkg.io.reader -> pkg.merging.api: floor 1 imports floor 3",
        "pkg.merging.api -> pkg.calibration.engine: floor 3 imports floor 3",
    ]
    assert sorted(circles(graph)) == [
        ["pkg.calibration.engine", "pkg.calibration.helpers"],
        ["pkg.io.reader", "pkg.merging.api"],
    ]


def test_the_checker_sees_imports_running_up_inside_a_package_and_shared_names(tmp_path):
    """The floors inside io/ and blocks/ and the shared-name check catch what they are for."""
    pkg = tmp_path / "pkg"
    for folder in ("io", "io/read", "io/write", "evaluation", "experiments", "experiments/evaluation", "config",
                   "merging"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "io" / "read" / "reader.py").write_text("def f():\n    from pkg.io.write import card  # reading imports writing\n")
    (pkg / "io" / "write" / "card.py").write_text("from pkg.io.read import reader\n")
    (pkg / "config" / "registry.py").write_text("")
    (pkg / "merging" / "registry.py").write_text("")
    graph = import_graph(pkg, "pkg")
    assert floor_violations(graph, "pkg", IO_FLOORS, sub="io") == [
        "pkg.io.read.reader -> pkg.io.write.card: floor 2 imports floor 3",
    ]
    assert shared_names(pkg) == {
        "evaluation": ["evaluation", "experiments/evaluation"],
        "registry.py": ["config/registry.py", "merging/registry.py"],
    }
