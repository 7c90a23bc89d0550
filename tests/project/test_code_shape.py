"""The shape of the code that #35 asked for: no long functions in calibration/ (private names:
test_private_names.py).

Why: calibration/ had a 171-line function with two closures.
"""

from __future__ import annotations

import ast
from pathlib import Path

import featcal

SRC = Path(featcal.__file__).parent
MAX_LINES = 60  # a function's lines, its docstring not counted


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    n = node.end_lineno - node.lineno + 1
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        n -= first.end_lineno - first.lineno + 1
    return n


def long_functions(root: Path, limit: int) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > limit:
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({_code_lines(node)} lines)")
    return out


def test_no_function_in_calibration_is_longer_than_60_lines():
    assert long_functions(SRC / "calibration", MAX_LINES) == []


def test_the_check_sees_a_long_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    (pkg / "a.py").write_text(f'def long():\n    """doc"""\n{body}\n\n\n'
                              'def short():\n    """doc\n    more"""\n    return 1\n')
    assert [r.split(" ")[1] for r in long_functions(pkg, MAX_LINES)] == ["long"]
