"""The package's dependency order holds: each module imports only modules below it, at the top."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import utils

UTILS = Path(utils.__file__).parent
README = UTILS.parent / "README.md"


def local_imports(tree: ast.AST) -> list[tuple[str, int]]:
    """(module, line) of every ``from . import x`` / ``from .x import y`` anywhere in the tree."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            found += [(n.split(".")[0], node.lineno) for n in names]
    return found


def test_every_module_is_in_the_order_and_imports_only_lower_ones():
    order = list(utils.MODULE_ORDER)
    files = sorted(p.stem for p in UTILS.glob("*.py") if p.stem != "__init__")
    assert sorted(order) == files, "utils.MODULE_ORDER must list every module once"
    for name in order:
        tree = ast.parse((UTILS / f"{name}.py").read_text())
        for dep, line in local_imports(tree):
            assert order.index(dep) < order.index(name), f"utils/{name}.py:{line} imports {dep}, which is above it"


def test_no_package_imports_hidden_in_function_bodies():
    for path in UTILS.glob("*.py"):
        tree = ast.parse(path.read_text())
        top = {id(n) for n in tree.body}
        hidden = [n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and n.level == 1 and id(n) not in top]
        assert not hidden, f"{path.name}: package imports inside functions at lines {hidden}"


def test_readme_and_package_docstring_list_the_same_order():
    doc_order = re.findall(r"^- ``(\w+)``", utils.__doc__, flags=re.M)
    readme_order = re.findall(r"^utils/(\w+)\.py", README.read_text(), flags=re.M)
    assert doc_order == list(utils.MODULE_ORDER) == readme_order


def test_every_name_in_a_modules_all_is_defined_there():
    """``from utils.x import *`` works: each name in ``__all__`` is defined or imported at the module's top."""
    for path in sorted(UTILS.glob("*.py")):
        tree = ast.parse(path.read_text())
        defined = set()
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                defined |= {(a.asname or a.name).split(".")[0] for a in node.names}
        listed = next((ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                       and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)), [])
        assert not set(listed) - defined, f"{path.name}: __all__ names {sorted(set(listed) - defined)} it does not define"
