"""Packages and plugins meet only through public API: the import rules of ARCHITECTURE.md §2, checked on the source.

Every ``.py`` file under packages/ and plugins/ (sources and tests) is parsed with ``ast``; no module is imported.
The rules:

- a plugin's code (its src/) never imports another plugin (its tests may use one as their environment, as the
  multi-rank tests use the MPI comm plugin);
- no file imports a private name (``_x``), or from a private module, of another distribution;
- ``cupy`` (and ``cupyx``) is imported only by the CUDA backend plugin, the NCCL plugin, the kernel library's CUDA
  kernels and blutrain-alloc;
- no code outside blutrain-tensor (packages, plugins, integration_tests/, tools/) reads or writes a private member
  of a tensor (``t._rg``, ``Tensor._make``, ...: every ``_name`` of ``Tensor`` and its bases, taken from the
  class itself): it uses ``blutrain.tensor.dispatch.call`` and the tensor's public members instead. Attribute
  access is found in the syntax tree, so comments and strings do not count; ``self._name`` inside a class that
  is not a Tensor is that class's own attribute. Nor does it assign the public attributes that are read-only by
  contract (``array``, ``storage``, ``output_nr``, the hook lists: ``TENSOR_READ_ONLY``);
- no code outside blutrain-tensor touches ``blutrain.tensor.dispatch.TABLE`` (it looks kernels up with
  ``dispatch.kernel`` and intercepts them with ``dispatch.set_interceptor``).

Files that still break a rule while their fix is under way are listed in ``ALLOWED``; a listed file that no longer
breaks its rule fails the test, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from blutrain.tensor import Tensor

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
PLUGINS = ROOT / "plugins"
INTEGRATION_TESTS = ROOT / "integration_tests"
TOOLS = ROOT / "tools"
TENSOR = PACKAGES / "blutrain-tensor"  # the one distribution that may use a tensor's private members

# where `import cupy` belongs: the device backend, CuPy's NCCL binding, the CuPy kernels, the allocator
CUPY_HOMES = (
    "plugins/blutrain-backend-cupy/",
    "plugins/blutrain-comm-nccl/",
    "packages/blutrain-kernels/src/blutrain/kernels/cuda/",
    "packages/blutrain-kernels/tests/",  # the tests of those kernels
    "packages/blutrain-alloc/",
)
DEVICE_LIBRARIES = ("cupy", "cupyx", "cupy_backends")

# (rule, file relative to the repository root) pairs that still break the rule, each with the reason; each entry
# must still break it (test_allow_list_is_not_stale).
ALLOWED: dict[tuple[str, str], str] = {
    # the compiler's CUDA tests make and read CuPy arrays themselves (its executor and CUDA kernels are the CuPy
    # backend plugin's compile target): they belong beside that target's tests
    ("cupy", "packages/blutrain-compiler/tests/test_cuda.py"): "the compiler's cuda tests",
    ("cupy", "packages/blutrain-compiler/tests/test_fusion_cuda.py"): "the compiler's cuda tests",
    # the example kernel plugin compiles a CuPy ElementwiseKernel: a kernel plugin for device "cuda" needs a way
    # to build device code that the Backend protocol does not declare yet
    ("cupy", "plugins/blutrain-kernels-example/src/blutrain_kernels_example/gelu.py"): "CuPy ElementwiseKernel",
}


@dataclass(frozen=True)
class Distribution:
    name: str  # the directory name, e.g. "blutrain-tensor"
    root: Path
    is_plugin: bool
    modules: tuple[str, ...]  # the top-level import names it owns, e.g. ("blutrain.tensor",)


def _distributions() -> list[Distribution]:
    found = []
    for parent, is_plugin in ((PACKAGES, False), (PLUGINS, True)):
        for root in sorted(p for p in parent.iterdir() if (p / "pyproject.toml").is_file()):
            src = root / "src"
            modules = []
            for top in sorted(p for p in src.iterdir() if p.is_dir() and not p.name.endswith(".egg-info")):
                if top.name == "blutrain":  # the PEP 420 namespace: each sub-package is owned by one distribution
                    modules += [f"blutrain.{sub.name}" for sub in sorted(top.iterdir()) if sub.is_dir()
                                and not sub.name.startswith("__")]
                elif (top / "__init__.py").is_file():
                    modules.append(top.name)
            found.append(Distribution(root.name, root, is_plugin, tuple(modules)))
    return found


DISTRIBUTIONS = _distributions()


def _owner(module: str) -> Distribution | None:
    for dist in DISTRIBUTIONS:
        if any(module == m or module.startswith(m + ".") for m in dist.modules):
            return dist
    return None


def _dist_of(path: Path) -> Distribution:
    return next(d for d in DISTRIBUTIONS if path.is_relative_to(d.root))


def _sources(parents: Iterable[Path] = (PACKAGES, PLUGINS)) -> Iterator[Path]:
    for parent in parents:
        for path in sorted(parent.rglob("*.py")):
            if not {".venv", "build", "node_modules"} & set(path.relative_to(parent).parts):
                yield path


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # the absolute module imported from (or imported)
    names: tuple[str, ...]  # the names imported from it; empty for `import module`


def _module_name(path: Path) -> str | None:
    """The dotted name of a file under some src/ directory; None for tests and tools."""
    parts = path.parts
    if "src" not in parts:
        return None
    rel = parts[len(parts) - parts[::-1].index("src"):]
    names = [*rel[:-1], rel[-1].removesuffix(".py")]
    return ".".join(names[:-1] if names[-1] == "__init__" else names)


def _imports(path: Path, source: str) -> Iterator[Import]:
    tree = ast.parse(source, filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name, ())
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                own = _module_name(path)
                if own is None:
                    continue  # a test's relative import stays inside its own test folder
                package = own.split(".") if path.name == "__init__.py" else own.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            yield Import(node.lineno, module, tuple(alias.name for alias in node.names))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _violations(path: Path, source: str | None = None) -> Iterator[tuple[str, str]]:
    """(rule, "line: what") for each import of the file (or of `source`, read as if it were the file) that breaks a
    rule."""
    dist = _dist_of(path)
    rel = path.relative_to(ROOT).as_posix()
    for imp in _imports(path, path.read_text(encoding="utf-8") if source is None else source):
        top = imp.module.split(".")[0]
        if top in DEVICE_LIBRARIES and not rel.startswith(CUPY_HOMES):
            yield "cupy", f"{imp.line}: imports {imp.module}"
        owner = _owner(imp.module)
        if owner is None or owner is dist:
            continue
        if dist.is_plugin and owner.is_plugin and "src" in path.relative_to(dist.root).parts[:1]:
            yield "plugin", f"{imp.line}: plugin {dist.name} imports plugin {owner.name} ({imp.module})"
        private = [p for p in imp.module.split(".") if _private(p)] + [n for n in imp.names if _private(n)]
        if private:
            yield "private", f"{imp.line}: imports {', '.join(private)} from {imp.module} ({owner.name})"


# every private member of a tensor: slots, methods and properties of Tensor and its bases
TENSOR_PRIVATE = frozenset(name for cls in Tensor.__mro__ if cls is not object for name in vars(cls) if _private(name))


# public slots of a tensor that only blutrain-tensor assigns (plain slots for speed, read-only by contract)
TENSOR_READ_ONLY = frozenset({"array", "storage", "output_nr", "grad_hooks", "post_accumulate_grad_hooks"})


def _tensor_rule_sources() -> Iterator[Path]:
    for path in _sources((PACKAGES, PLUGINS, INTEGRATION_TESTS, TOOLS)):
        if not path.is_relative_to(TENSOR):
            yield path


def _tensor_classes(trees: Iterable[ast.AST]) -> frozenset[str]:
    """Names of the classes that derive from Tensor (by the simple names of their bases, transitively)."""
    bases: dict[str, set[str]] = {}
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                named = [b.id if isinstance(b, ast.Name) else b.attr for b in node.bases
                         if isinstance(b, ast.Name | ast.Attribute)]
                bases.setdefault(node.name, set()).update(named)
    found = {"Tensor", "TensorBase"}
    while True:
        more = {name for name, of in bases.items() if of & found} - found
        if not more:
            return frozenset(found)
        found |= more


def _tensor_private_uses(tree: ast.AST, tensor_classes: frozenset[str]) -> Iterator[str]:
    """"line: what" for each access of a private tensor member in ``tree``."""

    def visit(node: ast.AST, own_class: str | None) -> Iterator[str]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, None if child.name in tensor_classes else child.name)
                continue
            if isinstance(child, ast.Attribute):
                on_self = isinstance(child.value, ast.Name) and child.value.id in ("self", "cls")
                own = on_self and own_class is not None
                if child.attr in TENSOR_PRIVATE and not own:
                    yield f"{child.lineno}: uses {ast.unparse(child)}"
                elif (child.attr in TENSOR_READ_ONLY and isinstance(child.ctx, ast.Store | ast.Del)
                      and not own):
                    yield f"{child.lineno}: assigns {ast.unparse(child)}"
            yield from visit(child, own_class)

    yield from visit(tree, None)


def _dispatch_table_uses(tree: ast.AST) -> Iterator[str]:
    """"line: what" for each use of dispatch's kernel table in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "TABLE":
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "dispatch") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "dispatch"):
                yield f"{node.lineno}: uses {ast.unparse(node)}"
        elif (isinstance(node, ast.ImportFrom) and node.module == "blutrain.tensor.dispatch"
              and any(alias.name == "TABLE" for alias in node.names)):
            yield f"{node.lineno}: imports TABLE from blutrain.tensor.dispatch"


def _all_violations() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in _sources():
        for rule, what in _violations(path):
            found.setdefault((rule, path.relative_to(ROOT).as_posix()), []).append(what)
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for path in _tensor_rule_sources()}
    tensor_py = TENSOR / "src" / "blutrain" / "tensor" / "tensor.py"
    tensor_classes = _tensor_classes([*trees.values(), ast.parse(tensor_py.read_text(encoding="utf-8"))])
    for path, tree in trees.items():
        for what in _tensor_private_uses(tree, tensor_classes):
            found.setdefault(("tensor-private", path.relative_to(ROOT).as_posix()), []).append(what)
        for what in _dispatch_table_uses(tree):
            found.setdefault(("dispatch-table", path.relative_to(ROOT).as_posix()), []).append(what)
    return found


VIOLATIONS = _all_violations()


def test_the_scan_sees_every_distribution_and_its_sources() -> None:
    names = {d.name for d in DISTRIBUTIONS}
    assert {"blutrain-tensor", "blutrain", "blutrain-backend-cupy", "blutrain-parallel-cp"} <= names
    assert _owner("blutrain.tensor.dispatch") is _owner("blutrain.tensor")
    assert _owner("blutrain.nn") is _owner("blutrain.train")  # the facade owns several sub-packages
    assert _owner("numpy") is None
    assert sum(1 for _ in _sources()) > 200
    assert {"_make", "_rg", "_base", "_view"} <= TENSOR_PRIVATE  # read from the class
    scanned = {p.relative_to(ROOT).parts[0] for p in _tensor_rule_sources()}
    assert scanned == {"packages", "plugins", "integration_tests", "tools"}


@pytest.mark.parametrize("rule", ["plugin", "private", "cupy", "tensor-private", "dispatch-table"])
def test_no_file_breaks_an_import_rule_outside_the_allow_list(rule: str) -> None:
    broken = {f"{file}:{what}" for (r, file), whats in VIOLATIONS.items() if r == rule and (r, file) not in ALLOWED
              for what in whats}
    assert not broken, "\n".join(sorted(broken))


def test_allow_list_is_not_stale() -> None:
    stale = [f"{rule} {file}" for (rule, file) in ALLOWED if (rule, file) not in VIOLATIONS]
    assert not stale, "these files keep the rule now; remove them from ALLOWED: " + ", ".join(stale)


# files that need not exist: the checker reads them as sources of the distribution their path lies in
CP = PLUGINS / "blutrain-parallel-cp" / "src" / "blutrain_parallel_cp" / "probe.py"
COMPILER = PACKAGES / "blutrain-compiler" / "src" / "blutrain" / "compiler" / "probe.py"
NCCL = PLUGINS / "blutrain-comm-nccl" / "src" / "blutrain_comm_nccl" / "probe.py"


def _rules(path: Path, source: str) -> list[str]:
    return [rule for rule, _ in _violations(path, source)]


def test_checker_catches_a_plugin_importing_another_plugin() -> None:
    assert _rules(CP, "from blutrain_parallel_ddp import DistributedDataParallel\n") == ["plugin"]
    assert _rules(CP, "import blutrain_backend_cupy.backend\n") == ["plugin"]
    assert _rules(CP, "def f():\n    from blutrain_parallel_ddp.ddp import _bucket\n") == ["plugin", "private"]


def test_checker_catches_a_private_name_of_another_distribution() -> None:
    assert _rules(CP, "from blutrain.tensor.cpu import _kernels\n") == ["private"]
    assert _rules(CP, "from blutrain.tensor._x import y\n") == ["private"]
    assert _rules(COMPILER, "from .trace import _helper\n") == []  # its own private names are its own


def test_checker_catches_cupy_outside_its_homes() -> None:
    assert _rules(COMPILER, "import cupy\n") == ["cupy"]
    assert _rules(COMPILER, "def f():\n    from cupyx import jit\n") == ["cupy"]
    assert _rules(NCCL, "import cupy\nfrom cupy.cuda import nccl\n") == []


def test_checker_accepts_public_api() -> None:
    assert _rules(CP, "from blutrain.dist import all_reduce\nimport numpy\nfrom . import layout\n") == []


def _tensor_rule(source: str) -> list[str]:
    tree = ast.parse(source)
    return list(_tensor_private_uses(tree, _tensor_classes([tree])))


def test_checker_catches_a_private_tensor_member_outside_blutrain_tensor() -> None:
    assert _tensor_rule("y = x._rg\n") == ["1: uses x._rg"]
    assert _tensor_rule("t = Tensor._make(a, dt, dev)\n") == ["1: uses Tensor._make"]
    assert _tensor_rule("def f(t):\n    t._view(a)\n    t.grad._base.array[0] = 1\n") == [
        "2: uses t._view", "3: uses t.grad._base"]


def test_checker_catches_an_assignment_to_a_read_only_tensor_attribute() -> None:
    assert _tensor_rule("t.array = proxy\nt.storage.version += 1\ndel t.output_nr\nt.array[0] = 1\n") == [
        "1: assigns t.array", "3: assigns t.output_nr"]  # writing into the array or the storage is not assigning
    assert _tensor_rule("class Store:\n    def put(self, a):\n        self.array = a\n") == []


def test_checker_reads_the_syntax_tree_not_the_text() -> None:
    assert _tensor_rule("# x._rg is private\ndoc = 'use t._make'\ny = x.array\n") == []


def test_checker_lets_a_class_that_is_no_tensor_use_its_own_attributes() -> None:
    store = ("class Store:\n    def __init__(self):\n        self._base = {}\n"
             "    def get(self, t):\n        return t._base\n")
    assert _tensor_rule(store) == ["5: uses t._base"]
    subclass = "class Parameter(Tensor):\n    def __init__(self, data):\n        self._init(data)\n"
    assert _tensor_rule(subclass) == ["3: uses self._init"]
    grandchild = subclass + "class Buffer(Parameter):\n    def f(self):\n        return self._rg\n"
    assert _tensor_rule(grandchild)[-1] == "6: uses self._rg"


def test_checker_catches_a_use_of_the_dispatch_table() -> None:
    found = sorted(_dispatch_table_uses(ast.parse(
        "dispatch.TABLE.update(w)\nbt.dispatch.TABLE.clear()\nfrom blutrain.tensor.dispatch import TABLE\n"
        "from blutrain.tensor.cpu import TABLE as CPU\nfn = dispatch.kernel('add', 'cpu', dt)\n")))
    assert found == ["1: uses dispatch.TABLE", "2: uses bt.dispatch.TABLE",
                     "3: imports TABLE from blutrain.tensor.dispatch"]


# -- the trainer reads declared capabilities (ARCHITECTURE.md §2: "Contracts, not internals") ----------------------

TRAIN = PACKAGES / "blutrain" / "src" / "blutrain" / "train"
# the names the project's own plugins register: the trainer must work the same with any other mode, optimizer,
# device backend or comm backend (the device and comm backends declare what the trainer asks: accelerator,
# comm_backend)
BUILT_IN_NAMES = frozenset({"ddp", "zero", "tp", "cp", "adamw", "sgd", "cuda", "nccl", "mpi"})
BACKEND_LIBRARIES = ("cupy", "cupyx", "blutrain_backend_cupy", "blutrain.kernels.cuda")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring constants of ``tree`` (they may mention anything)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _config_defaults(tree: ast.AST) -> set[int]:
    """The ids of the default values of class-level annotated fields (``optimizer: str = "adamw"``: a user's default,
    not a decision of the trainer)."""
    return {id(stmt.value) for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
            for stmt in node.body if isinstance(stmt, ast.AnnAssign) and stmt.value is not None}


def _capability_violations(source: str) -> list[str]:
    """"line: what" for each capability probe (``hasattr``, ``getattr`` with a default), each built-in mode or
    optimizer named, and each import of a backend's library in ``source``."""
    tree = ast.parse(source)
    allowed = _docstrings(tree) | _config_defaults(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
                found.append(f"{node.lineno}: {node.func.id}(...) probes for a capability; declare it on the protocol")
        elif isinstance(node, ast.Constant) and node.value in BUILT_IN_NAMES and id(node) not in allowed:
            found.append(f"{node.lineno}: names the built-in plugin {node.value!r}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom):
                modules += [f"{node.module}.{a.name}" for a in node.names]
            for module in modules:
                if module.startswith(BACKEND_LIBRARIES):
                    found.append(f"{node.lineno}: imports {module}, a backend's own code")
    return found


def test_trainer_code_probes_no_capability_and_names_no_built_in_plugin() -> None:
    sources = sorted(TRAIN.rglob("*.py"))
    assert TRAIN / "trainer.py" in sources and TRAIN / "config.py" in sources
    broken = [f"{path.relative_to(ROOT).as_posix()}:{what}" for path in sources
              for what in _capability_violations(path.read_text(encoding="utf-8"))]
    assert not broken, "\n".join(broken)


def test_capability_checker_catches_probes_names_and_backend_imports() -> None:
    assert _capability_violations("ok = hasattr(opt, 'state_shard')\n") == [
        "1: hasattr(...) probes for a capability; declare it on the protocol"]
    assert len(_capability_violations("f = getattr(model, 'no_sync', None)\n")) == 1
    assert _capability_violations("f = getattr(cfg, name)\n") == []  # reading a known field by name
    assert _capability_violations("tp = 'tp' in plan.mesh\n") == ["1: names the built-in plugin 'tp'"]
    assert sorted(_capability_violations("b = 'nccl' if device == 'cuda' else 'mpi'\n")) == [
        f"1: names the built-in plugin {name!r}" for name in ("cuda", "mpi", "nccl")]
    assert len(_capability_violations("extra = {'betas': (0.9, 0.95)} if name == 'adamw' else {}\n")) == 1
    assert len(_capability_violations("from blutrain.kernels import cuda\n")) == 1
    assert len(_capability_violations("def f():\n    import cupy\n")) == 1
    assert _capability_violations('"""tp"""\nclass C:\n    optimizer: str = "adamw"\n') == []
