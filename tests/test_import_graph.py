"""featcal's modules form an acyclic import graph, and no module imports a package that contains it.

The graph is read from the source with ``ast``: imports at module level, inside functions and under
``TYPE_CHECKING`` all count, and so do the names a package's ``__getattr__`` resolves through
:func:`featcal.lazy.lazy_attributes` (its ``_EXPORTS`` table). An import of a submodule
(``featcal.calibration.params``) is an edge to that submodule, not to the package around it; an
import of a name a package defines (``from featcal.merging import get_method`` in
``featcal/merging/registry.py``) is an edge to the package.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "featcal"


def module_files(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The module a dotted name lives in: the longest prefix of it that is a module."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _import_nodes(tree: ast.Module, at_import_time: bool) -> Iterator[ast.Import | ast.ImportFrom]:
    """The module's import statements: all of them, or (``at_import_time``) those that run when it is
    imported: at module level, outside functions, classes and ``if TYPE_CHECKING:`` blocks."""
    if not at_import_time:
        yield from (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))
        return
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            todo.extend([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            todo.extend([*node.body, *(h for handler in node.handlers for h in handler.body), *node.orelse])


def _imported_names(tree: ast.Module, module: str, is_package: bool, at_import_time: bool) -> Iterator[str]:
    """Every dotted name the module imports (``from a import b`` gives ``a.b``)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in _import_nodes(tree, at_import_time):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            parts = package.split(".")
            parts = parts[: len(parts) - node.level + 1]
            base = ".".join([*parts, base] if base else parts)
        yield from (f"{base}.{alias.name}" for alias in node.names)


def _lazy_exports(tree: ast.AST) -> Iterator[str]:
    """The modules named by an ``_EXPORTS = {name: module}`` table (what ``lazy_attributes`` imports)."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "_EXPORTS" for t in node.targets)
            and isinstance(node.value, ast.Dict)
        ):
            for value in node.value.values:  # "name": "module", or **dict.fromkeys(names, "module")
                if isinstance(value, ast.Call) and value.args:
                    value = value.args[-1]
                if isinstance(value, ast.Constant) and isinstance(value.value, str):
                    yield value.value


def import_graph(root: Path = PACKAGE, *, at_import_time: bool = False) -> dict[str, set[str]]:
    """Module → the featcal modules it imports (itself left out); with ``at_import_time``, only those
    imported when the module itself is (no function-local, ``TYPE_CHECKING`` or lazy imports)."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        targets = list(_imported_names(tree, name, path.name == "__init__.py", at_import_time))
        if not at_import_time:
            targets += _lazy_exports(tree)
        for target in targets:
            owner = _owner(target, modules) if target.startswith("featcal") else None
            if owner is not None and owner != name:
                graph[name].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_a_package_that_contains_it() -> None:
    graph = import_graph()
    upward = sorted(f"{m} -> {t}" for m, targets in graph.items() for t in targets if m.startswith(f"{t}."))
    assert upward == []


def test_the_import_graph_has_no_cycle() -> None:
    assert cycles(import_graph()) == []


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """A cycle through a function-local import, a TYPE_CHECKING import and a lazy table are all found."""
    pkg = tmp_path / "featcal"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("VERSION = '1'\n")
    (pkg / "a.py").write_text("def f():\n    from featcal.b import g\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from featcal import a\n")
    (pkg / "sub" / "__init__.py").write_text("_EXPORTS = {'x': 'featcal.sub.x'}\n")
    (pkg / "sub" / "x.py").write_text("from featcal.sub import y\nfrom featcal import VERSION\n")
    graph = import_graph(pkg)
    assert cycles(graph) == [["featcal.a", "featcal.b"], ["featcal.sub", "featcal.sub.x"]]
    assert graph["featcal.sub.x"] >= {"featcal", "featcal.sub"}


@pytest.mark.parametrize(
    "module",
    [
        "featcal.spec",
        "featcal.options",
        "featcal.calibration.params",
        "featcal.families",  # looking a family up
        "featcal.families.causal_lm",
        "featcal.families.causal_lm.mergekit",
        "featcal.data_file",
    ],
)
def test_the_option_modules_import_no_torch(module: str) -> None:
    """The modules every `--help` reads, and those that look a model family up or read a merge's records,
    stay free of torch and transformers (and so fast to import); importing a module runs the ``__init__``
    of every package around it too."""
    modules = module_files()
    graph = import_graph(at_import_time=True)
    seen, todo = set(), [module]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph[name])
            todo.extend(".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1))
    heavy = sorted(
        name
        for name in seen
        for node in _import_nodes(ast.parse(modules[name].read_text(encoding="utf-8")), at_import_time=True)
        for imported in ([a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""])
        if imported.split(".")[0] in {"torch", "transformers"}
    )
    assert heavy == []


# Generic modules reach a model family only through the registry (featcal.families): no string naming a family
# and no import of a family's modules outside the families' own packages, the demos and the (CLIP-only) Space.
FAMILY_OWNERS = ("families/", "demo/", "space/")
# The leaks left, each (module, what) as many times as it occurs; the list may only shrink: a leak gone must
# leave it, and a new one fails.
ALLOWED_LEAKS: dict[tuple[str, str], int] = {}  # none left: a new one asks the family through the registry


def family_leaks(root: Path = PACKAGE) -> dict[tuple[str, str], int]:
    """Each (module, what) by which a module outside :data:`FAMILY_OWNERS` names a family (a string equal to a
    family package's name) or imports a family's modules, with how often it does."""
    families = sorted(p.name for p in (root / "families").iterdir() if p.is_dir() and not p.name.startswith("_"))
    packages = [f"{root.name}.families.{name}" for name in families]
    inside = tuple(f"{package}." for package in packages)
    leaks: dict[tuple[str, str], int] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(FAMILY_OWNERS):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            found: list[str] = []
            if isinstance(node, ast.Constant) and node.value in families:
                found.append(f"names the family {node.value!r}")
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            modules += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            found += [f"imports {m}" for m in modules if m in packages or m.startswith(inside)]
            for what in found:
                key = (f"{root.name}/{rel}", what)
                leaks[key] = leaks.get(key, 0) + 1
    return leaks


def test_generic_modules_name_no_family_and_import_none_of_its_modules() -> None:
    leaks = family_leaks()
    new = {key: n for key, n in leaks.items() if n > ALLOWED_LEAKS.get(key, 0)}
    gone = {key: n for key, n in ALLOWED_LEAKS.items() if leaks.get(key, 0) < n}
    assert new == {}, "ask the family through featcal.families (its registry) instead"
    assert gone == {}, "these leaks are gone: take them off ALLOWED_LEAKS"


def test_the_family_leak_check_sees_names_and_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "featcal"
    for folder in ("families/fam", "families/_private", "demo", "generic"):
        (pkg / folder).mkdir(parents=True)
    (pkg / "families" / "fam" / "__init__.py").write_text("NAME = 'fam'\n")
    (pkg / "demo" / "run.py").write_text("FAMILY = 'fam'\n")
    (pkg / "generic" / "a.py").write_text(
        "from featcal.families.fam.x import y\nimport featcal.families.fam\nimport featcal.families.famous\nA = 'fam'\n"
        "B = 'fam'\nC = '_private'\n"
    )
    (pkg / "generic" / "b.py").write_text("from featcal.families import get_family\nD = 'family fam'\n")
    assert family_leaks(pkg) == {
        ("featcal/generic/a.py", "imports featcal.families.fam.x"): 1,
        ("featcal/generic/a.py", "imports featcal.families.fam"): 1,
        ("featcal/generic/a.py", "names the family 'fam'"): 2,
    }


# CLIP's task fields (class names and prompt templates) are its family's own (``ImageClasses``, read through
# ``featcal.families.clip_vision.entries.image_classes``): a module outside FAMILY_OWNERS names none of them.
CLIP_NAMES = ("classnames",)  # never named at all: no variable, attribute, keyword, string or word in a docstring
CLIP_ATTRIBUTES = ("classnames", "templates", "prompts")  # never read from an object (``task.templates``)


def task_field_leaks(root: Path = PACKAGE) -> list[tuple[str, str]]:
    """Each (module, what) by which a module outside :data:`FAMILY_OWNERS` names CLIP's class names or reads a
    task's templates or prompts as attributes, once per occurrence."""
    leaks = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(FAMILY_OWNERS):
            continue
        text = path.read_text(encoding="utf-8")
        where = f"{root.name}/{rel}"
        leaks += [(where, f"names {name!r}") for name in CLIP_NAMES for _ in range(text.count(name))]
        leaks += [
            (where, f"reads .{node.attr}")
            for node in ast.walk(ast.parse(text))
            if isinstance(node, ast.Attribute) and node.attr in CLIP_ATTRIBUTES
        ]
    return leaks


def test_generic_modules_name_no_clip_task_field() -> None:
    assert task_field_leaks() == [], "read them through the family (featcal.families.clip_vision.entries)"


def test_the_task_field_check_sees_names_and_attributes(tmp_path: Path) -> None:
    pkg = tmp_path / "featcal"
    for folder in ("families/fam", "space", "generic"):
        (pkg / folder).mkdir(parents=True)
    (pkg / "families" / "fam" / "entries.py").write_text("def f(task):\n    return task.classnames, task.templates\n")
    (pkg / "space" / "model.py").write_text("KEY = 'classnames'\n")
    (pkg / "generic" / "a.py").write_text(
        '"""The classnames."""\n\n\ndef f(task, fmt):\n    return task.templates, fmt.prompts("x"), fmt.text\n'
    )
    (pkg / "generic" / "b.py").write_text("KEYS = {'templates': 1}\n")
    assert task_field_leaks(pkg) == [
        ("featcal/generic/a.py", "names 'classnames'"),
        ("featcal/generic/a.py", "reads .templates"),
        ("featcal/generic/a.py", "reads .prompts"),
    ]
