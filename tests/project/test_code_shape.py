"""The shape of the code (issues #35 and #52; private names: test_private_names.py): no function in src/ longer
than 60 lines, none with more than 8 parameters, but for the public entry points' keyword options and the
functions listed below, each with why it is still there.

Why: calibration/ had a 171-line function with two closures; the same 13-17 keyword parameters were re-declared at
every level of a call chain (a request object, one parameter, now carries them). The lists only shrink: a function
that no longer breaks the rule must leave its list (the test says so), and a new one may not join it.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import featcal

SRC = Path(featcal.__file__).parent
MAX_LINES = 60  # a function's lines, its docstring not counted
MAX_PARAMS = 8  # positional-only, ordinary and keyword-only; self / cls, *args and **kwargs not counted

# the public entry points: featcal.merge / calibrate / evaluate / run / plan may take their options as keywords
ENTRY_POINTS = {
    "merging/api.py:merge",
    "calibration/front/api.py:calibrate",
    "evaluation/api.py:evaluate",
    "jobs/run_job.py:run_file",
    "jobs/plan_job.py:plan",
}

# functions still longer than MAX_LINES, and why they are not split yet
LONG_ALLOWED = {
    "experiments/zoo/text_build.py:build_text": "the text zoo's build script, one recipe in order; not reached yet",
    "experiments/zoo/vision_build.py:build_vision_real": "the vision zoo's build script, likewise; not reached yet",
    "experiments/zoo/onnx_dinov2.py:convert": "the vision zoo's ONNX-to-transformers conversion, one graph walk; not reached yet",
}

# functions (other than ENTRY_POINTS) still taking more than MAX_PARAMS parameters, and why
PARAMS_ALLOWED = {
    # the in-memory calibration chain, featcal.calibrate's keywords passed down level by level; its request object
    # is the next step (one for calibrate_models, calibrate_setting, the search and the per-block search)
    "calibration/front/in_memory.py:calibrate_models": "featcal.calibrate's keywords, one level down; request not built yet",
    "calibration/core/setting.py:calibrate_setting": "the same keywords at one setting; request not built yet",
    "calibration/tuning/run.py:calibrate_tuned": "the search's entry, the same keywords; request not built yet",
    "calibration/tuning/per_block.py:calibrate_per_block": "the per-block search, likewise",
    "calibration/front/task_data.py:resolve_calibration": "featcal.calibrate's data keywords, to go through the request",
    # numerical and planning code another engineer is profiling: not touched this session
    "calibration/maths/solver.py:linear_weight_bias": "the closed-form solve's arguments (numerical code, not touched)",
    "calibration/planning/planner.py:_offloaded": "the planner's memory pricing (being profiled, not touched)",
    "calibration/planning/fit.py:plan_report": "the planner's report, beside its memory pricing; not reached yet",
    # the lower floors' doors
    "io/read/family.py:open_family": "the checkpoint door's read options; an options object is the next step",
    "data/calibration.py:load_calibration_batches": "the older data loader behind the door; not reached yet",
    "evaluation/data.py:read_eval_set": "the eval data reader's options; with an eval request, not reached yet",
    # the experiment apparatus (extra `bench`)
    "experiments/bench/baselines.py:surgery_rows": "bench rows of the Surgery baselines; not reached yet",
    "experiments/bench/baselines.py:merge_baseline_rows": "bench rows of the merge baselines; not reached yet",
    "experiments/bench/run.py:_featcal_row": "one bench row; not reached yet",
    "experiments/bench/run.py:_regime_record": "one bench regime's record; not reached yet",
    "experiments/zoo/build.py:_finetune_experts": "the zoo's fine-tuning loop; not reached yet",
    "experiments/zoo/train.py:frozen_head_steps": "the zoo's training step; not reached yet",
    "experiments/baselines/training.py:train_module": "the Surgery baselines' training; not reached yet",
    "experiments/baselines/training.py:fit_modules": "likewise",
}


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    n = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        n -= first.end_lineno - first.lineno + 1
    return n


def _params(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    args = node.args
    return sum(a.arg not in ("self", "cls") for a in (*args.posonlyargs, *args.args, *args.kwonlyargs))


def functions(root: Path) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """("path/under/root.py:Qualified.name", node) for every function and method under `root`."""
    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.AST]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{child.name}", child
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        for name, node in walk(ast.parse(path.read_text(), str(path)), ""):
            yield f"{where}:{name}", node


def long_functions(root: Path, limit: int) -> dict[str, int]:
    return {name: _code_lines(node) for name, node in functions(root) if _code_lines(node) > limit}


def wide_functions(root: Path, limit: int) -> dict[str, int]:
    return {name: _params(node) for name, node in functions(root) if _params(node) > limit}


def test_no_function_in_src_is_longer_than_60_lines_but_the_listed():
    found = long_functions(SRC, MAX_LINES)
    new = {n: lines for n, lines in found.items() if n not in LONG_ALLOWED}
    assert not new, f"longer than {MAX_LINES} lines (split them): {new}"
    fixed = sorted(set(LONG_ALLOWED) - set(found))
    assert not fixed, f"no longer too long (or gone): take them off LONG_ALLOWED: {fixed}"


def test_no_function_in_src_takes_more_than_8_parameters_but_the_entry_points_and_the_listed():
    found = wide_functions(SRC, MAX_PARAMS)
    new = {n: k for n, k in found.items() if n not in PARAMS_ALLOWED and n not in ENTRY_POINTS}
    assert not new, f"more than {MAX_PARAMS} parameters (group them, e.g. into a request object): {new}"
    fixed = sorted(set(PARAMS_ALLOWED) - set(found))
    assert not fixed, f"no longer over {MAX_PARAMS} parameters (or gone): take them off PARAMS_ALLOWED: {fixed}"
    assert not set(PARAMS_ALLOWED) & ENTRY_POINTS


def test_the_entry_points_exist():
    names = {name for name, _ in functions(SRC)}
    assert ENTRY_POINTS <= names, ENTRY_POINTS - names


def test_the_check_sees_a_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    (pkg / "a.py").write_text(f'def long():\n    """doc"""\n{body}\n\n\n'
                              'def short():\n    """doc\n    more"""\n    return 1\n')
    assert list(long_functions(pkg, MAX_LINES)) == ["a.py:long"]


def test_the_check_counts_parameters_without_self(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "def wide(a, b, /, c, d, *args, e, f, g, h, i, **kw):\n    pass\n\n\n"
        "def narrow(a, b, c, d, *, e, f, g, h):\n    pass\n\n\n"
        "class C:\n    def method(self, a, b, c, d, e, f, g, h):\n        pass\n\n"
        "    @classmethod\n    def make(cls, a, b, c, d, e, f, g, h, i):\n        def inner(a, b, c, d, e, f, g, h, i):\n"
        "            pass\n"
    )
    assert wide_functions(pkg, MAX_PARAMS) == {"a.py:wide": 9, "a.py:C.make": 9, "a.py:C.make.inner": 9}
