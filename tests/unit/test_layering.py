"""dyncp's import layering, checked on the source: no circle, no torch below the runtime, no upward
import, no test helper in library code, no library file over 500 lines.

Why read the source (``ast``) instead of importing: an import inside a function body runs only
when the function does, so importing a module proves nothing about it; every ``import`` statement
in a file counts here, wherever it is (also under ``if TYPE_CHECKING:``). Why not import-linter:
it covers layers and forbidden imports, but not the line count, the own-facade rule or the
allow-lists below, and a graph of a hundred lines needs no new dependency. The mutation tests at
the end run the same checks on a copy of ``dyncp/`` with one violation written in, so a check that
stopped seeing anything would fail there.
"""

from __future__ import annotations

import ast
import functools
import shutil
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest
from layout_page import LAYERS, TORCH_FREE

ROOT = Path(__file__).resolve().parents[2]

# The layer order (low to high: a module may import its own package, a package of its own layer or
# of a lower one; dyncp.testing on top, imported by no library module) and the torch-free packages
# are stated once, in tools/layout_page.py, which draws them on docs/layout.md.

#: What a torch-free package never imports, directly or through another dyncp module.
HEAVY = frozenset({"torch", "transformers", "accelerate", "trl"})
#: Top-level modules outside the layers: the package root and the old-path aliases (which import
#: their targets by name, at run time, for code written against dyncp 0.1).
UNLAYERED = frozenset({"dyncp", "dyncp._compat"})
MAX_LINES = 500

# --- Allowed violations -------------------------------------------------------------------------
# What the tree of issue 33's phase 1 still does wrong, while the splits of phase 2 are in flight.
# The lead empties these lists after merging them; nothing is ever added. An entry that is no
# longer needed fails the test too, so each list only shrinks.

#: Import circles (the modules of one strongly connected component).
KNOWN_CIRCLES: dict[frozenset[str], str] = {}
#: (importer, imported) against the layer order.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}
#: (importer, imported) of dyncp.testing by a library module.
KNOWN_TESTING_IMPORTS: dict[tuple[str, str], str] = {}
#: Library files allowed over MAX_LINES, each with its reason (path relative to the repository).
LONG_FILES: dict[str, str] = {}


@functools.cache
def import_statements(source: str) -> tuple[tuple[int, str, tuple[str, ...]], ...]:
    """(level, module, names) of each ``from`` import; (0, module, ()) of each ``import module``
    and of each ``importlib.import_module("module")`` / ``__import__("module")`` with a literal."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(0, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or "", tuple(a.name for a in node.names)))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in {"import_module", "__import__"}
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((0, node.args[0].value, ()))
    return tuple(found)


class Tree:
    """The modules of a ``dyncp`` folder and what each imports (dyncp modules and top-level names).

    ``from X import a`` imports the module ``X.a`` where there is one, else ``X``; importing
    ``X.a`` also runs the packages above it, which only :meth:`runs` follows: a package
    ``__init__`` re-exporting its submodules is then no circle, since they import each other from
    their defining modules (test_no_module_imports_its_own_package_facade), but a module of
    another package that imports the facade back is one.
    """

    def __init__(self, pkg: Path) -> None:
        self.pkg = pkg
        self.files: dict[str, Path] = {}
        for path in sorted(pkg.rglob("*.py")):
            parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
            self.files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
        self.imports: dict[str, set[str]] = {m: set() for m in self.files}
        self.external: dict[str, set[str]] = {m: set() for m in self.files}
        for module, path in self.files.items():
            for target in self._targets(module, path):
                top = target.split(".")[0]
                if top != "dyncp":
                    self.external[module].add(top)
                elif (found := self._resolve(target)) and found != module:
                    self.imports[module].add(found)

    def _targets(self, module: str, path: Path) -> Iterator[str]:
        base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for level, name, aliases in import_statements(path.read_text()):
            if not level and not aliases:
                yield name
                continue
            stem = base[: len(base) - level + 1] if level else []
            name = ".".join(stem + ([name] if name else []))
            for alias in aliases:  # a submodule, or a name of the module's own
                sub = f"{name}.{alias}"
                yield sub if sub in self.files else name

    def _resolve(self, name: str) -> str | None:
        while name and name not in self.files:
            name = name.rpartition(".")[0]
        return name or None

    def is_package(self, module: str) -> bool:
        return self.files[module].name == "__init__.py"

    def circles(self) -> list[frozenset[str]]:
        """Strongly connected components of more than one module (Tarjan's algorithm)."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        found: list[frozenset[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            for w in sorted(self.imports[v]):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                comp = stack[stack.index(v) :]
                del stack[stack.index(v) :]
                if len(comp) > 1:
                    found.append(frozenset(comp))

        for v in self.imports:
            if v not in index:
                visit(v)
        return found

    def path_to_heavy(self, module: str) -> list[str]:
        """The shortest import chain by which importing ``module`` runs one of HEAVY ([] if
        none): through what each module imports and the packages above it (``a.b`` of ``a.b.c``)."""
        came_from: dict[str, str | None] = {module: None}
        todo = deque([module])
        while todo:
            m = todo.popleft()
            if heavy := sorted(self.external[m] & HEAVY):
                chain = [heavy[0]]
                while m is not None:
                    chain.append(m)
                    m = came_from[m]
                return chain[::-1]
            parents = [".".join(m.split(".")[:i]) for i in range(1, m.count(".") + 1)]
            for t in sorted(self.imports[m]) + [p for p in parents if p in self.files]:
                if t not in came_from:
                    came_from[t] = m
                    todo.append(t)
        return []


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if module in UNLAYERED or len(parts) < 2:
        return None
    return next((i for i, names in enumerate(LAYERS) if parts[1] in names), None)


def circles(tree: Tree) -> list[str]:
    return [" <-> ".join(sorted(c)) for c in tree.circles() if c not in KNOWN_CIRCLES]


def imports_of_heavy(tree: Tree) -> list[str]:
    """Each import by which a torch-free module reaches HEAVY: its own, or one of a module outside
    the torch-free packages that does (the root counts as torch-free: every import runs it)."""
    free = {m for m in tree.files if m in UNLAYERED or m.split(".")[1] in TORCH_FREE}
    out = []
    for module in sorted(free):
        out += [f"{module} -> {name}" for name in sorted(tree.external[module] & HEAVY)]
        for target in sorted(tree.imports[module] - free):
            if chain := tree.path_to_heavy(target):
                out.append(" -> ".join([module, *chain]))
    return out


def upward_imports(tree: Tree) -> list[str]:
    out = []
    for module, targets in tree.imports.items():
        for target in sorted(targets):
            low, high = layer_of(module), layer_of(target)
            if low is None or high is None or high == len(LAYERS) - 1:
                continue  # dyncp.testing is test_testing_is_imported_by_no_library_module's
            if high > low and (module, target) not in KNOWN_UPWARD:
                out.append(f"{module} -> {target}")
    return out


def imports_of_testing(tree: Tree) -> list[str]:
    return [
        f"{module} -> {target}"
        for module, targets in tree.imports.items()
        if module != "dyncp.testing" and not module.startswith("dyncp.testing.")
        for target in sorted(targets)
        if (target == "dyncp.testing" or target.startswith("dyncp.testing."))
        and (module, target) not in KNOWN_TESTING_IMPORTS
    ]


def long_files(tree: Tree) -> dict[str, int]:
    lengths = {
        path.relative_to(tree.pkg.parent).as_posix(): len(path.read_text().splitlines())
        for path in tree.files.values()
    }
    return {p: n for p, n in sorted(lengths.items()) if n > MAX_LINES}


def imports_of_own_facade(tree: Tree) -> list[str]:
    found = []
    for module, path in tree.files.items():
        if tree.is_package(module):
            continue
        base = module.split(".")[:-1]
        for level, name, aliases in import_statements(path.read_text()):
            stem = base[: len(base) - level + 1] if level else []
            name = ".".join(stem + ([name] if name else []))
            names = [a for a in aliases if f"{name}.{a}" not in tree.files]
            if name != "dyncp" and module.startswith(name + ".") and names:
                found.append(f"{module}: from {name} import {', '.join(names)}")
    return found


@pytest.fixture(scope="module")
def tree() -> Tree:
    return Tree(ROOT / "dyncp")


def test_every_package_has_a_layer(tree: Tree) -> None:
    loose = [m for m in tree.files if m not in UNLAYERED and layer_of(m) is None]
    assert not loose, f"not in LAYERS (tests/unit/test_layering.py): {loose}"


def test_no_import_circle(tree: Tree) -> None:
    assert not circles(tree), "import circles:\n" + "\n".join(circles(tree))
    stale = set(KNOWN_CIRCLES) - set(tree.circles())
    assert not stale, f"gone, remove from KNOWN_CIRCLES: {[sorted(c) for c in stale]}"


def test_torch_free_packages_import_no_torch(tree: Tree) -> None:
    found = imports_of_heavy(tree)
    assert not found, "torch-free packages reach:\n" + "\n".join(found)


def test_no_upward_import(tree: Tree) -> None:
    assert not upward_imports(tree), "against the layer order:\n" + "\n".join(upward_imports(tree))
    stale = [e for e in KNOWN_UPWARD if e[1] not in tree.imports.get(e[0], ())]
    assert not stale, f"gone, remove from KNOWN_UPWARD: {stale}"


def test_testing_is_imported_by_no_library_module(tree: Tree) -> None:
    found = imports_of_testing(tree)
    assert not found, "library code imports dyncp.testing:\n" + "\n".join(found)
    stale = [e for e in KNOWN_TESTING_IMPORTS if e[1] not in tree.imports.get(e[0], ())]
    assert not stale, f"gone, remove from KNOWN_TESTING_IMPORTS: {stale}"


def test_no_library_file_over_500_lines_without_a_reason(tree: Tree) -> None:
    over = long_files(tree)
    unexcused = {p: n for p, n in over.items() if p not in LONG_FILES}
    assert not unexcused, (
        f"over {MAX_LINES} lines (split it, or say why in LONG_FILES): {unexcused}"
    )
    stale = sorted(set(LONG_FILES) - set(over))
    assert not stale, f"no longer over {MAX_LINES} lines, remove from LONG_FILES: {stale}"


def test_no_module_imports_its_own_package_facade(tree: Tree) -> None:
    """Inside a package, a sibling comes from its defining module, not through ``__init__``."""
    found = imports_of_own_facade(tree)
    assert not found, "imports through its own package's __init__:\n" + "\n".join(found)


# --- The checks see what they should: each mutation of a copy of dyncp/ is found ----------------


def mutated(tmp_path: Path, module: str, line: str) -> Tree:
    pkg = tmp_path / "dyncp"
    shutil.copytree(
        ROOT / "dyncp", pkg, ignore=shutil.ignore_patterns("__pycache__", "*.json", "*.parquet")
    )
    path = pkg.joinpath(*module.split(".")[1:]).with_suffix(".py")
    path.write_text(path.read_text() + f"\n\ndef _mutation():\n    {line}\n")
    return Tree(pkg)


def test_a_circle_through_a_function_body_is_found(tmp_path: Path) -> None:
    tree = mutated(
        tmp_path, "dyncp.plan.menu", "from dyncp.planner.construction.packing import pack"
    )
    assert any(
        "dyncp.plan.menu" in c and "dyncp.planner.construction.packing" in c for c in circles(tree)
    )


def test_a_lazy_torch_import_in_the_planner_is_found(tmp_path: Path) -> None:
    tree = mutated(tmp_path, "dyncp.planner.construction.packing", "import torch.nn")
    assert "dyncp.planner.construction.packing -> torch" in imports_of_heavy(tree)


def test_torch_reached_through_another_module_is_found(tmp_path: Path) -> None:
    tree = mutated(tmp_path, "dyncp.cost_model.shapes", "from dyncp.runtime import execute")
    assert any(
        c.startswith("dyncp.cost_model.shapes -> dyncp.runtime -> ") and c.endswith(" -> torch")
        for c in imports_of_heavy(tree)
    )


def test_a_test_helper_in_the_runtime_is_found(tmp_path: Path) -> None:
    tree = mutated(tmp_path, "dyncp.runtime.reduce", "from dyncp.testing import TinyDecoder")
    assert "dyncp.runtime.reduce -> dyncp.testing" in imports_of_testing(tree)


def test_an_upward_import_is_found(tmp_path: Path) -> None:
    tree = mutated(tmp_path, "dyncp.ring_attention.merge", "import dyncp.sampler.sampler")
    assert "dyncp.ring_attention.merge -> dyncp.sampler.sampler" in upward_imports(tree)


def test_a_circle_through_another_package_facade_is_found(tmp_path: Path) -> None:
    # dyncp.plan's __init__ imports menu; menu -> planner.packing -> `from dyncp.plan import ...`
    tree = mutated(
        tmp_path, "dyncp.plan.menu", "from dyncp.planner.construction.packing import pack"
    )
    assert "dyncp.plan" in next(c for c in tree.circles() if "dyncp.plan.menu" in c)


def test_a_package_init_re_exporting_its_modules_is_no_circle(tmp_path: Path) -> None:
    # dyncp.plan's __init__ imports slice and menu, and now slice imports menu: no circle
    tree = mutated(tmp_path, "dyncp.plan.slice", "import dyncp.plan.menu")
    assert "dyncp.plan.menu" in tree.imports["dyncp.plan.slice"]
    assert not any("dyncp.plan.slice" in c for c in circles(tree))


def test_an_import_through_the_own_package_facade_is_found(tmp_path: Path) -> None:
    tree = mutated(tmp_path, "dyncp.plan.slice", "from dyncp.plan import StepPlan")
    assert imports_of_own_facade(tree) == ["dyncp.plan.slice: from dyncp.plan import StepPlan"]
