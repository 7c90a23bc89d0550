"""The shape of the code that #35 asked for: no long functions in calibration/, no private names imported.

Why: calibration/ had a 171-line function with two closures and a module calling ten private members of
another; a module's private names are what it may change without telling anyone, so none is imported.
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


def private_imports(root: Path) -> list[str]:
    """`from featcal.x import _y`, and `m._y` where `m` is a featcal module imported by name."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        modules: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("featcal"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        out.append(f"{path.relative_to(root.parent)}:{node.lineno} imports {node.module}.{alias.name}")
                    modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                modules.update(a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("featcal"))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                out.append(f"{path.relative_to(root.parent)}:{node.lineno} reads {node.value.id}.{node.attr}")
    return out


def test_no_function_in_calibration_is_longer_than_60_lines():
    assert long_functions(SRC / "calibration", MAX_LINES) == []


def test_no_module_imports_another_modules_private_names():
    assert private_imports(SRC) == []


def test_the_checks_see_what_they_look_for(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES + 1))
    (pkg / "a.py").write_text(f'def long():\n    """doc"""\n{body}\n\n\n'
                              'def short():\n    """doc\n    more"""\n    return 1\n')
    (pkg / "b.py").write_text("from featcal.blocks.capture import _gone\nfrom featcal import calibration\n"
                              "calibration._hidden\nfrom featcal.blocks import capture as cap\ncap.__name__\n")
    assert [r.split(" ")[1] for r in long_functions(pkg, MAX_LINES)] == ["long"]
    found = private_imports(pkg)
    assert len(found) == 2 and "imports featcal.blocks.capture._gone" in found[0] and "calibration._hidden" in found[1]
