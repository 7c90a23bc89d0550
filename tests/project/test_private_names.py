"""No module of featcal uses another module's private names.

A leading underscore says "this module may change it without telling anyone"; a module that imports or reads
another's private name couples itself to exactly that. Checked on the code's own syntax tree, every form:
`from featcal.x import _y`, `from ._x import y` (a private module is its package's private name),
`import featcal.x as m; m._y`, `featcal.x._y`, `X._y` on a class or object imported from featcal, and
`getattr(m, "_y")`. A module's own private names and dunder names are fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import featcal

SRC = Path(featcal.__file__).parent


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module an ImportFrom reads, relative imports resolved against `module`."""
    if not node.level:
        return node.module or ""
    here = module.split(".") if is_package else module.split(".")[:-1]
    base = here[: len(here) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dotted(node: ast.expr) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything that is not a chain of names."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(root: Path, package: str = "featcal") -> list[str]:
    """Every use, in a module under `root` (the source of `package`), of another module's private name."""
    out = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root, package)
        where = f"{path.relative_to(root.parent)}"
        tree = ast.parse(path.read_text(), str(path))
        names: dict[str, str] = {}  # local name -> the featcal module or object it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _absolute(node, module, path.name == "__init__.py")
                if source.split(".")[0] != package:
                    continue
                hidden = [p for p in source.split(".") if _private(p)]
                if hidden and source != module:
                    out.append(f"{where}:{node.lineno} imports from private module {source}")
                for alias in node.names:
                    if _private(alias.name) and source != module:
                        out.append(f"{where}:{node.lineno} imports {source}.{alias.name}")
                    names[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == package:
                        if any(_private(p) for p in alias.name.split(".")):
                            out.append(f"{where}:{node.lineno} imports private module {alias.name}")
                        if alias.asname:
                            names[alias.asname] = alias.name
                        else:
                            names[package] = package
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner, attr = _dotted(node.value), node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
                  and isinstance(node.args[1].value, str) and _private(node.args[1].value)):
                owner, attr = _dotted(node.args[0]), node.args[1].value
            else:
                continue
            if owner is None or owner[0] not in names:
                continue
            full = ".".join([names[owner[0]], *owner[1:]])
            if full != module:
                out.append(f"{where}:{node.lineno} reads {full}.{attr}")
    return out


def test_no_module_uses_another_modules_private_names():
    assert private_uses(SRC) == []


def test_the_check_sees_every_form(tmp_path):
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "sub" / "__init__.py").write_text("from ._hidden import thing\n")
    (root / "sub" / "own.py").write_text("import pkg.sub.own as me\n_mine = 1\nme._mine\n")  # its own: fine
    (root / "user.py").write_text(
        "from pkg.sub.own import _gone\n"
        "from .sub import own as o, Thing\n"
        "import pkg.sub.own\n"
        "o._mine\n"
        "pkg.sub.own._mine\n"
        "Thing._cache\n"
        "getattr(o, '_mine')\n"
        "o.__name__\n"
        "self._fine\n"
    )
    found = private_uses(root, package="pkg")
    assert [f.split(" ", 1)[1] for f in found] == [
        "imports from private module pkg.sub._hidden",
        "imports pkg.sub.own._gone",
        "reads pkg.sub.own._mine",
        "reads pkg.sub.own._mine",
        "reads pkg.sub.Thing._cache",
        "reads pkg.sub.own._mine",
    ], found
