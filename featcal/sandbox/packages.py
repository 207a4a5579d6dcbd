"""The folders of an installed package that a sandboxed program needs to import it, wherever it lies.

A package installed in a virtual environment under ``HOME`` or ``/tmp`` lies in a folder the sandbox hides;
:func:`package_folders` names the folders of that package alone (its package folder, and the folders its
wheel installs beside it, such as ``numpy.libs`` with the libraries its compiled extensions load), which
:func:`~featcal.sandbox.runner.run_program` then shows read-only at ``SITE/NAME``
(:data:`~featcal.sandbox.runner.SITE`), and checks that the sandbox's Python can load its compiled extensions.
"""

from __future__ import annotations

import importlib.machinery
import importlib.metadata
import os
import re
import subprocess
from collections.abc import Sequence

from featcal.errors import SandboxUnavailableError
from featcal.sandbox.runner import program_python

# A compiled extension's name with the ABI tag it was built for: ``_multiarray_umath.cpython-311-x86_64-linux-gnu.so``.
TAGGED_EXTENSION = re.compile(r"\.((?:cpython|pypy)[^.]*|abi3)\.so$")
SUFFIXES_OF = "import importlib.machinery as m; print('\\n'.join(m.EXTENSION_SUFFIXES))"


def _installed_files_folders(name: str, site: str) -> list[str]:
    """The top-level folders in ``site`` that the distribution of ``name`` installed (from its RECORD), its
    metadata folder and files outside ``site`` (scripts, or any absolute path a RECORD may hold) left out; none
    when it has no RECORD."""
    found = next(iter(importlib.metadata.distributions(name=name, path=[site])), None)
    files = (found.files or []) if found is not None else []
    tops = {f.parts[0] for f in files if len(f.parts) > 1 and f.parts[0] != ".." and not f.is_absolute()}
    folders = [os.path.join(site, top) for top in sorted(tops) if not top.endswith((".dist-info", ".egg-info"))]
    return [folder for folder in folders if os.path.isdir(folder)]


def package_folders(name: str, search_path: Sequence[str] | None = None) -> list[str]:
    """The folders a program needs to import the installed package ``name``.

    Args:
        name: The import name of a package that is also its distribution's name (``numpy``).
        search_path: The folders to look for it in (default: this process's ``sys.path``).

    Returns:
        Its package folder first, then the other folders its distribution installed beside it (RECORD), as
        absolute paths (a folder that is a link keeps its name).

    Raises:
        SandboxUnavailableError: when it is not installed there.
    """
    spec = importlib.machinery.PathFinder.find_spec(name, None if search_path is None else list(search_path))
    if spec is None or not spec.submodule_search_locations:
        where = ", ".join(search_path) if search_path is not None else "this Python's module path"
        raise SandboxUnavailableError(f"No package {name!r} installed in {where} to show to the sandbox's programs.")
    package = os.path.abspath(next(iter(spec.submodule_search_locations)))
    others = [f for f in _installed_files_folders(name, os.path.dirname(package)) if f != package]
    return [package, *others]


def _extension_suffixes(python: str) -> list[str]:
    """The file suffixes of the compiled extensions ``python`` loads (``importlib.machinery.EXTENSION_SUFFIXES``)."""
    done = subprocess.run(
        [python, "-I", "-S", "-c", SUFFIXES_OF], capture_output=True, text=True, env={}, timeout=60, check=False
    )
    if done.returncode != 0:
        raise SandboxUnavailableError(f"The sandbox's Python {python} did not start: {done.stderr.strip()[-300:]}")
    return done.stdout.split()


def check_extensions(package: str, python: str | None = None) -> None:
    """Check that the sandbox's Python can load ``package``'s compiled extensions: built for its version and ABI.

    Args:
        package: A package folder.
        python: The sandbox's interpreter (default: :func:`~featcal.sandbox.runner.program_python`'s choice).

    Raises:
        SandboxUnavailableError: when its extensions are built for another Python than the sandbox runs.
    """
    interpreter = program_python(python)
    tags = {match.group(1) for _, _, files in os.walk(package) for f in files if (match := TAGGED_EXTENSION.search(f))}
    if not tags:
        return
    suffixes = _extension_suffixes(interpreter)
    if not any(f".{tag}.so" in suffixes for tag in tags):
        built = ", ".join(sorted(tags))
        raise SandboxUnavailableError(
            f"The package in {package} is built for {built}, but the sandbox's Python {interpreter} loads "
            f"{suffixes[0] if suffixes else 'no compiled'} extensions: install one built for it, or run featcal "
            "with a Python of the same version outside the folders the sandbox hides."
        )
