"""tensor.py imports the op modules for Tensor's methods; the op modules never import tensor.py back (they make
results with an input's ``_make`` and test ``isinstance(x, TensorBase)``), so neither needs an import placed
after a class definition to break a cycle."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from blutrain.tensor.base import TensorBase
from blutrain.tensor.tensor import Tensor

# by module name: the package's attribute `tensor` is the function tensor()
OPS = Path(str(importlib.import_module("blutrain.tensor.ops").__file__)).parent
TENSOR_PY = Path(str(importlib.import_module("blutrain.tensor.tensor").__file__))


def _runtime_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of each import that runs at import or call time (not under ``if TYPE_CHECKING``)."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_op_modules_never_import_tensor_py() -> None:
    # factory makes tensors from no input tensor, so it needs the class; tensor.py does not import it
    for path in sorted(OPS.glob("*.py")):
        if path.name == "factory.py":
            continue
        imports = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")))
        back = [(line, m) for line, m in imports
                if m.startswith(("blutrain.tensor.tensor", "blutrain.tensor.ops.factory"))]
        assert back == [], f"{path.name} imports {back}"


def test_the_modules_tensor_py_is_built_from_never_import_it() -> None:
    for name in ("base", "views"):
        path = TENSOR_PY.parent / f"{name}.py"
        imports = _runtime_imports(ast.parse(path.read_text(encoding="utf-8")))
        assert [m for _, m in imports if m.startswith("blutrain.tensor.tensor")] == [], name


def test_tensor_py_imports_everything_before_its_first_definition() -> None:
    tree = ast.parse(TENSOR_PY.read_text(encoding="utf-8"))
    first_def = next(n.lineno for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef)))
    late = [n.lineno for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom)) and n.lineno > first_def]
    assert late == []
    assert not any(m.startswith("blutrain.tensor.ops.factory") for _, m in _runtime_imports(tree))


def test_tensor_is_the_one_subclass_of_the_base_the_ops_know() -> None:
    assert TensorBase.__subclasses__() == [Tensor]
    assert Tensor.__slots__ and TensorBase.__slots__ == ()  # no __dict__ per tensor
