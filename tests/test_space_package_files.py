"""The featcal modules a staged Space holds: the import graph walked from ``app.py`` over a small package written
here (the staged Space itself, and that it runs, are tests/test_space_publish.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from featcal.errors import FeatcalError
from featcal.space.package_files import module_imports, needed_files

PACKAGE = {
    "__init__.py": "",
    "errors.py": "class FeatcalError(Exception):\n    pass\n",
    "lazy.py": "def lazy_attributes(package, exports):\n    return None\n",
    "space/__init__.py": "from featcal.space.ui import create_space\n",
    "space/ui.py": (
        "from typing import TYPE_CHECKING\n"
        "import featcal.tasks\n"
        "if TYPE_CHECKING:\n    from featcal.typing_only import X\n"
        "def create_space():\n    from featcal.space.lazy_use import f\n    from featcal.tools import used\n"
    ),
    "space/lazy_use.py": "f = 1\n",
    "space/publish.py": "import featcal.heavy\n",
    "tasks.py": (
        "import featcal.families\n"
        "def merge():\n    from featcal.heavy import run  # a function the Space does not call\n"
    ),
    "families/__init__.py": "BUILTIN = ('featcal.families.clip',)\n",
    "families/clip/__init__.py": "parts = {'entries': '.entries:TASK_FIELDS'}\ncli = f'{__name__}.cli'\n",
    "families/clip/entries.py": "TASK_FIELDS = ()\n",
    "families/clip/cli.py": "",
    "families/clip/card.md.j2": "card",
    "families/clip/.hidden": "",
    "tools/__init__.py": (
        "from featcal.lazy import lazy_attributes\n"
        "_EXPORTS = {'used': 'featcal.tools.used', 'unused': 'featcal.tools.unused'}\n"
        "__getattr__ = lazy_attributes(__name__, _EXPORTS)\n"
    ),
    "tools/used.py": "used = 1\n",
    "tools/unused.py": "import featcal.heavy\n",
    "heavy.py": "",
    "typing_only.py": "",
    "unreached/__init__.py": "",
    "unreached/data.json": "{}",
}
APP = "from featcal.errors import FeatcalError\nfrom featcal.space import create_space\n"


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / "featcal" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "app.py").write_text(APP)
    return root / "app.py"


def test_the_space_holds_the_modules_its_app_imports_and_their_packages_data(tmp_path) -> None:
    app = _write(tmp_path, PACKAGE)
    staged = {str(path) for path in needed_files(tmp_path, app)}
    assert staged == {
        f"featcal/{name}"
        for name in (
            "__init__.py", "errors.py", "lazy.py", "space/__init__.py", "space/ui.py", "space/lazy_use.py",
            "tasks.py", "families/__init__.py", "families/clip/__init__.py", "families/clip/entries.py",
            "families/clip/cli.py", "families/clip/card.md.j2", "tools/__init__.py", "tools/used.py",
        )
    }  # fmt: skip
    # not: a TYPE_CHECKING import, one inside a function outside featcal.space, a lazy attribute not imported,
    # a module nothing imports, nor a package's hidden file


def test_a_module_s_imports_are_told_apart() -> None:
    source = (
        "import featcal.a\nfrom . import b\nfrom .c import d\n"
        "def f():\n    import featcal.e\n"
        "PARTS = {'x': '.g:h', 'y': 'featcal.i.j:k', 'z': 'not a module', 'w': 'json'}\n"
        "CLI = f'{__name__}.cli'\n"
    )
    imports = module_imports(source, "featcal.pkg.mod", is_package=False)
    assert imports.top_level == {"featcal.a", "featcal.pkg", "featcal.pkg.b", "featcal.pkg.c", "featcal.pkg.c.d"}
    assert imports.in_functions == {"featcal.e"}
    assert imports.named == {"featcal.pkg.g", "featcal.i.j", "featcal.pkg.mod.cli"}
    package = module_imports("from .sub import x\n", "featcal.pkg", is_package=True)
    assert package.top_level == {"featcal.pkg.sub", "featcal.pkg.sub.x"}  # relative to the package itself


def test_a_module_that_cannot_be_parsed_is_named(tmp_path) -> None:
    app = _write(tmp_path, {**PACKAGE, "tasks.py": "def broken(:\n"})
    with pytest.raises(FeatcalError, match=r"Cannot read .*featcal/tasks\.py to stage the Space"):
        needed_files(tmp_path, app)


def test_staging_reads_the_package_before_writing_anything(tmp_path, monkeypatch) -> None:
    from featcal.space import publish

    def broken(root: Path, entry: Path, entry_modules: tuple[str, ...]) -> list[Path]:
        raise FeatcalError("Cannot read featcal/x.py to stage the Space: invalid syntax")

    monkeypatch.setattr(publish, "needed_files", broken)
    out = tmp_path / "space"
    with pytest.raises(FeatcalError, match="to stage the Space"):
        publish.stage_space(out, suite="ta8", examples=False)
    assert not out.exists()


def test_an_entry_module_s_imports_in_functions_are_followed(tmp_path) -> None:
    """``python -m featcal space`` from a checkout of the Space: the command's lazy imports are staged too."""
    main = {"__main__.py": "import featcal.cli\n", "cli/__init__.py": "def main():\n    import featcal.heavy\n"}
    files = {**PACKAGE, **main}
    app = _write(tmp_path, files)
    assert "featcal/heavy.py" not in {str(p) for p in needed_files(tmp_path, app, ("featcal.__main__",))}
    staged = {str(p) for p in needed_files(tmp_path, app, ("featcal.__main__", "featcal.cli"))}
    assert {"featcal/__main__.py", "featcal/cli/__init__.py", "featcal/heavy.py"} <= staged
