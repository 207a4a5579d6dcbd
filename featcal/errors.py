"""Typed exceptions for problems the user can fix; each carries the offending value.

Library code raises these and never prints; the CLI (:mod:`featcal.cli.errors`) words them on one
line and exits with status 2. Messages speak of parameters and inputs by their Python names
(``lambda_ratio``), never by command-line flags: the CLI maps a parameter to its flag when it words
the error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# The longest number, and the longest other value (a path, a list of tasks), a message shows whole.
SHOWN_DIGITS = 60
SHOWN_CHARACTERS = 1000


def shown(value: Any) -> str:
    """``repr(value)`` as a message shows it: whole, or its start and its length when longer than
    :data:`SHOWN_DIGITS` for a number (``10**400`` stays one short line) or :data:`SHOWN_CHARACTERS` else.

    Args:
        value: The value a message quotes.

    Returns:
        Its ``repr``, perhaps shortened.
    """
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        text = repr(value)
    except ValueError:  # an integer past Python's limit on digits converted to text
        return f"<an integer of about {int(value.bit_length() * math.log10(2)) + 1} digits>"
    limit = SHOWN_DIGITS if number else SHOWN_CHARACTERS
    if len(text) <= limit:
        return text
    return f"{text[: limit * 2 // 3]}… ({len(text)} characters)"


class FeatcalError(Exception):
    """A problem with the user's input or environment, with a message that names the fix.

    Args:
        message: One line that names the input and how to fix it.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidParameterError(FeatcalError, ValueError):
    """A run option or method hyper-parameter with a value of the wrong type or outside its range.

    Args:
        name: The parameter's name (``lambda_ratio``, ``top_k``).
        value: The value given.
        expected: What the value must be, e.g. ``"a number >= 0"``.
        owner: Whose parameter it is when not a run option, e.g. ``"merging method 'ties'"``.
    """

    def __init__(self, name: str, value: Any, expected: str, *, owner: str | None = None) -> None:
        self.name = name
        self.value = value
        self.expected = expected
        self.owner = owner
        where = f"{owner}: " if owner else ""
        super().__init__(f"{where}{name}={shown(value)} is invalid: it must be {expected}.")


class UnknownNameError(FeatcalError, KeyError):
    """A name that is not among the known ones (a task, a merging method, a parameter, a recipe key).

    Args:
        kind: What was named, e.g. ``"task"`` or ``"merging method"``.
        names: The unknown name(s).
        known: The names that would have been accepted.
        hint: A sentence saying how to add or find one.
        where: The file or source the name came from, e.g. ``"Recipe r.yaml"``.
    """

    def __init__(
        self, kind: str, names: str | Sequence[str], known: Sequence[str], *, hint: str = "", where: str = ""
    ) -> None:
        self.kind = kind
        self.names = [names] if isinstance(names, str) else list(names)
        self.known = list(known)
        self.hint = hint
        shown = names if isinstance(names, str) else self.names
        lead = f"{where}: unknown {kind} {shown!r}" if where else f"Unknown {kind} {shown!r}"
        message = f"{lead}; known: {', '.join(self.known) or 'none'}."
        super().__init__(f"{message} {hint}".strip())

    def __str__(self) -> str:  # KeyError would quote the message
        return self.message


class InputError(FeatcalError):
    """An input (file, folder, model, dataset) that cannot be used as it is.

    Args:
        ref: The input as the user gave it (a path or a Hub id).
        message: One line naming the input and the fix.
    """

    def __init__(self, ref: str | Path | None, message: str) -> None:
        self.ref = None if ref is None else str(ref)
        super().__init__(message)


class ModelInputError(InputError):
    """A model folder, checkpoint or Hub model that is missing, unreadable or does not fit the run."""


class DatasetInputError(InputError):
    """A task's dataset that is missing, lacks a split or column, or holds labels outside its classes.

    Args:
        task: The task whose dataset it is.
        ref: The dataset's path or Hub id.
        message: One line naming the dataset and the fix.
    """

    def __init__(self, task: str, ref: str | None, message: str) -> None:
        self.task = task
        super().__init__(ref, message)


class RunFolderError(InputError):
    """A run folder (or a file in it) that is missing, damaged or belongs to another run."""


class RunLockedError(RunFolderError):
    """Another live process is writing the run folder.

    Args:
        ref: The run folder.
        message: One line naming the holder.
        holder: What the holder recorded: ``pid``, ``host``, ``started``, ``command``.
    """

    def __init__(self, ref: str | Path, message: str, holder: dict[str, Any]) -> None:
        self.holder = holder
        super().__init__(ref, message)


class ReleaseError(InputError):
    """A release folder that is incomplete or differs from what export wrote."""


class OutputPathError(FeatcalError):
    """An output path that cannot be written, or whose writing would destroy something else.

    Args:
        path: The output path as the user gave it.
        message: One line naming the path and the fix.
    """

    def __init__(self, path: str | Path, message: str) -> None:
        self.path = str(path)
        super().__init__(message)


class NoSpaceError(OutputPathError):
    """Too little free space where an output is to be written; checked before anything is written.

    Args:
        path: The output folder.
        needed: The bytes the command would write there.
        free: The bytes free on its file system.
    """

    def __init__(self, path: str | Path, needed: int, free: int) -> None:
        self.needed = needed
        self.free = free
        super().__init__(
            path,
            f"Not enough free space for {path}: it needs {needed:,d} bytes and {free:,d} are free there; free some "
            "space, or write it on another file system.",
        )


class HubError(FeatcalError):
    """The Hub refused a request, or could not be reached; nothing was published.

    Args:
        repo_id: The repository concerned, when there is one.
        message: One line saying what happened and what to do.
        status: The HTTP status of the refusal, when there was one.
    """

    def __init__(self, repo_id: str | None, message: str, *, status: int | None = None) -> None:
        self.repo_id = repo_id
        self.status = status
        super().__init__(message)


class ServeError(FeatcalError, OSError):
    """The Space cannot serve on the address asked for: the port is taken (perhaps since it was checked)
    or the host is not an address of this machine. Also an ``OSError``, as the failed bind is one.

    Args:
        host: The address to serve on.
        port: The port asked for (None: Gradio's, 7860 or the next free one).
        message: One line naming the address and the fix.
    """

    def __init__(self, host: str, port: int | None, message: str) -> None:
        self.host = host
        self.port = port
        super().__init__(message)


class DistributedError(FeatcalError):
    """A multi-process run (``torchrun``) whose processes cannot work together: the process group did
    not start, or a collective failed or timed out because another process stopped or hung.

    Args:
        rank: The rank of the process that saw the failure.
        message: One line saying what happened and what to do.
    """

    def __init__(self, rank: int, message: str) -> None:
        self.rank = rank
        super().__init__(message)


class CodeExecutionNotAllowedError(FeatcalError):
    """Generated code would run, but the caller did not opt in (``allow_code_execution=True``)."""


class SandboxUnavailableError(FeatcalError):
    """The sandbox for generated code cannot be set up here (not Linux, no ``unshare``, namespaces refused);
    no code was run."""
