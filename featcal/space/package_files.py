"""The files of the featcal package a staged Space needs: the modules its app imports, found by walking the import
graph from ``app.py`` at staging time, and the data files of the packages among them.

The walk reads each module's source (:mod:`ast`) and imports none. A module brings:

- what its top-level ``import`` statements import (they run when the module is imported), with the packages
  above each (Python runs every ``__init__.py`` on the way); not those under ``if TYPE_CHECKING:``, which never
  run;
- in the Space's own package (``featcal.space``, whose functions the app calls), also the imports inside its
  functions. Elsewhere an import inside a function runs only when that function is called: the command line's
  commands, the release's card rendering and the other families' evaluations import their parts so, and the
  Space calls none of them;
- the modules its strings name, which featcal imports by name: a family's parts (``".entries:TASK_FIELDS"``,
  relative to its package; the registry names every family, and reading a task resolves its family's parts),
  ``"featcal.x.y:name"`` and ``f"{__name__}.cli"``. A package's lazy attributes (``lazy_attributes``) bring the
  modules of the attributes imported from it, not the others.

A package among them brings its data files (the JSON resources, a family's card templates), which featcal reads
beside its modules.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from featcal.errors import FeatcalError

PACKAGE = "featcal"
SPACE_PACKAGE = "featcal.space"  # the app's own code: every import of it is followed, those in functions too
INIT = "__init__.py"
SKIPPED_DATA = re.compile(r"(^\.|\.pyc$|\.pyo$)")
_MODULE_TEXT = re.compile(r"^(\.+)?[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[\w.]+)?$")


@dataclass(frozen=True)
class ModuleImports:
    """What a module's source may import.

    Attributes:
        top_level: Absolute names its top-level ``import`` statements import (some are attributes: ``from a
            import f`` gives ``a.f``).
        in_functions: Those its functions and methods import when called.
        named: Modules its strings name, which featcal imports by name when it needs them.
        exports: A package's lazy attributes, attribute -> the module that defines it.
    """

    top_level: frozenset[str]
    in_functions: frozenset[str]
    named: frozenset[str]
    exports: Mapping[str, str] = field(default_factory=dict)


def module_file(root: Path, module: str) -> Path | None:
    """The source file of ``module`` (``featcal.space.ui``) under ``root``, the folder holding the package.

    Returns:
        ``featcal/space/ui.py`` or ``featcal/space/__init__.py`` under ``root``; None for a module that is not
        the package's, or not there.
    """
    if module != PACKAGE and not module.startswith(f"{PACKAGE}."):
        return None
    path = root.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / INIT):
        if candidate.is_file():
            return candidate
    return None


def _absolute(name: str, level: int, package: str) -> str:
    """``name`` imported ``level`` dots up from ``package`` (``from ..x import y``), as an absolute name."""
    if level == 0:
        return name
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - level + 1])
    return f"{base}.{name}" if name else base


def _from_text(text: str, package: str) -> str | None:
    """The module a string names (``".folders:x"``, ``"featcal.a.b:y"``, ``"featcal.a"``), or None."""
    if not _MODULE_TEXT.match(text):
        return None
    module = text.partition(":")[0]
    level = len(module) - len(module.lstrip("."))
    if level:
        return _absolute(module[level:], level, package)
    return module if module == PACKAGE or module.startswith(f"{PACKAGE}.") else None


def _is_own_name(node: ast.JoinedStr) -> bool:
    """Whether an f-string is ``f"{__name__}.rest"``: a module below (or an attribute of) the module itself."""
    values = node.values
    return (
        len(values) == 2
        and isinstance(values[0], ast.FormattedValue)
        and isinstance(values[0].value, ast.Name)
        and values[0].value.id == "__name__"
        and isinstance(values[1], ast.Constant)
        and isinstance(values[1].value, str)
    )


def _lazy_exports(tree: ast.Module) -> ast.Dict | None:
    """The dict literal of a package's lazy attributes (``__getattr__ = lazy_attributes(__name__, _EXPORTS)``)."""
    name = None
    for node in tree.body:
        value = node.value if isinstance(node, ast.Assign) else None
        if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "lazy_attributes" and value.args[1:]:
            name = getattr(value.args[1], "id", None)
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            if name is not None and any(getattr(target, "id", None) == name for target in node.targets):
                return node.value
    return None


def _imported(node: ast.Import | ast.ImportFrom, package: str) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = _absolute(node.module or "", node.level, package)
    return {base, *(f"{base}.{alias.name}" for alias in node.names)}


def module_imports(source: str, module: str, *, is_package: bool) -> ModuleImports:
    """What the source of ``module`` may import (see the module's docstring).

    Args:
        source: The module's Python source.
        module: Its absolute name.
        is_package: Whether it is a package's ``__init__.py`` (relative imports start from it, not its parent).

    Returns:
        Its imports, those in functions apart, the modules its strings name and its lazy attributes.
    """
    package = module if is_package else module.rpartition(".")[0]
    tree = ast.parse(source)
    table = _lazy_exports(tree)
    exports = {}
    if table is not None:
        for key, value in zip(table.keys, table.values, strict=True):
            if isinstance(key, ast.Constant) and isinstance(value, ast.Constant):
                exports[str(key.value)] = _from_text(str(value.value), package) or str(value.value)
    skipped = set(map(id, ast.walk(table))) if table is not None else set()
    top_level: set[str] = set()
    in_functions: set[str] = set()
    named: set[str] = set()
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, deferred = stack.pop()
        if id(node) in skipped:
            continue
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            stack.extend((child, deferred) for child in node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            (in_functions if deferred else top_level).update(_imported(node, package))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if text := _from_text(node.value, package):
                named.add(text)
        elif isinstance(node, ast.JoinedStr):  # its pieces are no names of their own
            if _is_own_name(node):
                tail = node.values[1]
                assert isinstance(tail, ast.Constant)
                named.add(module + str(tail.value).partition(":")[0])
            continue
        inner = deferred or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))
    return ModuleImports(frozenset(top_level), frozenset(in_functions - top_level), frozenset(named), exports)


def _parents(module: str) -> Iterable[str]:
    parts = module.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts)))


def needed_modules(root: Path, entry_source: str, entry_modules: Sequence[str] = ()) -> dict[str, Path]:
    """The package's modules that the script ``entry_source`` (the Space's ``app.py``) imports, by name.

    Args:
        root: The folder holding the ``featcal`` package.
        entry_source: The script's source.
        entry_modules: Modules run as entry points too (``featcal.__main__``), whose functions' imports are
            followed as the Space package's are.

    Returns:
        Module name -> its source file under ``root``.

    Raises:
        FeatcalError: when a module's source cannot be read or parsed.
    """
    found: dict[str, Path] = {}
    imports: dict[str, ModuleImports] = {}
    entry = module_imports(entry_source, "__main__", is_package=False)
    queue = sorted(entry.top_level | entry.in_functions | set(entry_modules))

    def visit(module: str) -> None:
        """Read ``module`` and the packages above it, once each, and queue what they import."""
        for name in (*_parents(module), module):
            if name in found or (path := module_file(root, name)) is None:
                continue
            found[name] = path
            try:
                source = path.read_text(encoding="utf-8")
                imports[name] = module_imports(source, name, is_package=path.name == INIT)
            except (OSError, SyntaxError, UnicodeDecodeError) as exc:
                raise FeatcalError(f"Cannot read {path} to stage the Space: {exc}") from exc
            own = name == SPACE_PACKAGE or name.startswith(f"{SPACE_PACKAGE}.") or name in entry_modules
            queue.extend(imports[name].top_level | imports[name].named)
            queue.extend(imports[name].in_functions if own else ())

    while queue:
        name = queue.pop()
        visit(name)
        package, _, attribute = name.rpartition(".")
        exports = imports[package].exports if package in imports else {}
        if module_file(root, name) is None and attribute in exports:
            visit(exports[attribute])  # a lazy attribute: the module that defines it
    return found


def needed_files(root: Path, entry: Path, entry_modules: Sequence[str] = ()) -> list[Path]:
    """The package's files a Space whose app is ``entry`` needs, relative to ``root``, in order.

    Args:
        root: The folder holding the ``featcal`` package.
        entry: The Space's ``app.py``.
        entry_modules: Modules of the package run as entry points too (:func:`needed_modules`).

    Returns:
        The modules :func:`needed_modules` finds and the data files (not Python, not hidden) of every package
        among them.

    Raises:
        FeatcalError: when a module's source cannot be read or parsed.
    """
    modules = needed_modules(root, entry.read_text(encoding="utf-8"), entry_modules)
    files = {path.relative_to(root) for path in modules.values()}
    for path in modules.values():
        if path.name == INIT:
            files.update(
                data.relative_to(root)
                for data in path.parent.iterdir()
                if data.is_file() and data.suffix != ".py" and not SKIPPED_DATA.search(data.name)
            )
    return sorted(files)
