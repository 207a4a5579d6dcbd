"""Run one generated Python program in the sandbox, with limits, and say how it ended.

The program runs in a separate process tree started by ``unshare`` (util-linux) in fresh network, PID
and mount namespaces; :mod:`featcal.sandbox.confine` sets up the file system and the limits inside
them (what each step guarantees is in ``docs/code-eval.md``). As root the program runs under a random
unprivileged uid/gid of its own; as another user, in a user namespace of its own (``--user
--map-root-user``), as that user. Nothing runs unless the caller passes ``allow_code_execution=True``,
and on a system where the namespaces cannot be made (not Linux, no ``unshare``, user namespaces
refused) :func:`run_program` refuses with :class:`~featcal.errors.SandboxUnavailableError`: it never
falls back to running the program unconfined.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from featcal.errors import CodeExecutionNotAllowedError, InvalidParameterError, SandboxUnavailableError

CONFINE = Path(__file__).with_name("confine.py")
# The folders the program must not see, besides the caller's HOME.
HIDDEN = ("/root", "/home")
# Where the program sees the folders shared with it (``shared=``), each under its own name, read-only: a folder on
# its module path (``sys.path.append(SITE)``) when they are installed packages.
SITE = "/run/featcal-site"
SYSTEM_PYTHONS = ("/usr/bin/python3", "/usr/local/bin/python3")
UNSHARE_PATHS = ("/usr/bin/unshare", "/bin/unshare")
# The random uids (and gids) a program run as root gets: high, so that no account or process has them.
UID_RANGE = (1 << 30, (1 << 31) - 2)
SHOWN_OUTPUT = 4000  # characters of the program's stdout and stderr kept, from the end
Status = Literal["passed", "failed", "timeout", "killed"]
SIGNAL_REASONS = {  # by name: SIGXCPU and SIGXFSZ do not exist on every system
    "SIGXCPU": "the CPU-time limit",
    "SIGXFSZ": "the file-size limit",
    "SIGKILL": "SIGKILL (the CPU-time hard limit, or the kernel's out-of-memory killer)",
}


@dataclass(frozen=True)
class Limits:
    """What one program may use.

    Args:
        wall_s: Seconds of wall time, from start to end (the whole process tree is killed then).
        cpu_s: Seconds of CPU time of each process (``RLIMIT_CPU``; SIGXCPU, then SIGKILL a second later).
        memory_bytes: Address space of each process (``RLIMIT_AS``); past it allocations fail.
        processes: Processes and threads of the program's uid at once (``RLIMIT_NPROC``).
        file_bytes: Size of any one file it writes, stdout and stderr included (``RLIMIT_FSIZE``).
        work_bytes: Size of its writable folder (a tmpfs, counted in memory).
    """

    wall_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    processes: int = 64
    file_bytes: int = 16 << 20
    work_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("wall_s", "cpu_s", "memory_bytes", "processes", "file_bytes", "work_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidParameterError(name, value, "a number > 0", owner="sandbox limits")
            if name != "wall_s" and not isinstance(value, int):
                raise InvalidParameterError(name, value, "a whole number > 0", owner="sandbox limits")


@dataclass(frozen=True)
class Outcome:
    """How one program ended.

    Args:
        status: ``passed`` (exit status 0), ``failed`` (another exit status: an exception, a failed
            assertion), ``timeout`` (past the wall time) or ``killed`` (by a signal: a limit, a crash).
        reason: One line saying why, e.g. ``"exit status 1: AssertionError"``.
        stdout: The end of what it printed.
        stderr: The end of what it wrote to stderr.
        seconds: Wall time it took.
    """

    status: Status
    reason: str
    stdout: str
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        """Whether the program passed."""
        return self.status == "passed"


def require_opt_in(allow_code_execution: bool) -> None:
    """Refuse unless the caller opted in to running generated code.

    Args:
        allow_code_execution: The caller's explicit consent; only ``True`` is.

    Raises:
        CodeExecutionNotAllowedError: when it is anything else.
    """
    if allow_code_execution is not True:
        raise CodeExecutionNotAllowedError(
            "Running model-generated code is off: it runs, in featcal's sandbox (docs/code-eval.md), only when "
            "`allow_code_execution` is given."
        )


def hidden_folders() -> list[str]:
    """The folders hidden from the program: the caller's HOME (as ``$HOME`` and the password file say), ``/root``
    and ``/home``, as real paths."""
    import pwd  # POSIX only; reached on Linux alone

    try:
        account_home = pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:  # a uid without an account
        account_home = None
    homes = [os.environ.get("HOME"), account_home, *HIDDEN]
    return list(dict.fromkeys(os.path.realpath(home) for home in homes if home))


def _inside(path: str, folders: list[str]) -> bool:
    return any(path == folder or path.startswith(folder.rstrip("/") + "/") for folder in folders)


def program_python(python: str | None = None) -> str:
    """The interpreter that runs programs: ``python``, else this one or a system ``python3``, whichever lies
    outside the hidden folders (a pyenv or virtual environment under HOME is hidden from the program).

    Args:
        python: An interpreter's path, or None to choose one.

    Returns:
        Its real path.

    Raises:
        SandboxUnavailableError: when none is outside the hidden folders.
    """
    hidden = hidden_folders()
    candidates = [python] if python else [sys.executable, *SYSTEM_PYTHONS]
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if os.access(real, os.X_OK) and not _inside(real, hidden):
            return real
    raise SandboxUnavailableError(
        f"No Python interpreter for generated code outside the folders hidden from it ({', '.join(hidden)}): "
        f"tried {', '.join(candidates)}; install a system python3 (/usr/bin/python3) or pass python=."
    )


def shared_folders(folders: Sequence[str | os.PathLike[str]]) -> list[list[str]]:
    """Each folder to share with the program as ``[name, real path]``, the name the one it has under :data:`SITE`.

    Args:
        folders: Existing folders with distinct names (their last path component, kept where it is a link).

    Returns:
        Their names and real paths, in the order given.

    Raises:
        InvalidParameterError: for a folder that does not exist, or two with the same name.
    """
    shared: list[list[str]] = []
    for folder in folders:
        real = os.path.realpath(folder)
        if not os.path.isdir(real):
            raise InvalidParameterError("shared", str(folder), "existing folders", owner="sandbox")
        shared.append([os.path.basename(os.path.normpath(folder)), real])
    names = [name for name, _ in shared]
    if len(set(names)) != len(names):
        raise InvalidParameterError("shared", names, "folders with distinct names", owner="sandbox")
    return shared


def _unshare_command() -> list[str]:
    """``unshare`` with the namespaces the sandbox needs, or a refusal naming what is missing."""
    if not sys.platform.startswith("linux"):
        raise SandboxUnavailableError(
            f"The sandbox for generated code needs Linux namespaces; this is {sys.platform}: run code "
            "evaluation on Linux (a container or VM will do)."
        )
    unshare = next((path for path in UNSHARE_PATHS if os.access(path, os.X_OK)), None)
    if unshare is None:
        raise SandboxUnavailableError(
            "The sandbox for generated code needs util-linux's unshare, not found in /usr/bin or /bin: "
            "install util-linux."
        )
    command = [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount", "--propagation", "private"]
    return command if os.geteuid() == 0 else [*command[:1], "--user", "--map-root-user", *command[1:]]


def _tail(path: Path) -> str:
    with open(path, "rb") as file:
        file.seek(max(0, os.path.getsize(path) - SHOWN_OUTPUT * 4))
        return file.read().decode("utf-8", errors="replace")[-SHOWN_OUTPUT:]


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    """Kill ``unshare`` and the namespace's first process (its process group); the kernel kills the rest."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _outcome(report: str, stdout: str, stderr: str, seconds: float, limits: Limits) -> Outcome:
    """The outcome the first process's report's first line (``exit N``, ``signal N``) says, or a refusal for a
    failed set-up."""
    word, _, value = (report.splitlines() or [""])[0].partition(" ")
    if word not in ("exit", "signal"):  # "setup ERROR", "start ERROR", or nothing: unshare itself failed
        said = value if word in ("setup", "start") else (stderr.strip().splitlines() or ["no report"])[-1]
        raise SandboxUnavailableError(f"The sandbox for generated code could not be set up here: {said}; no code ran.")
    if word == "signal":
        number = int(value)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        why = SIGNAL_REASONS.get(name, f"{name} (a crash, or the memory limit of {limits.memory_bytes:,d} bytes)")
        return Outcome("killed", f"killed by {why}", stdout, stderr, seconds)
    code = int(value)
    if code == 0:
        return Outcome("passed", "exit status 0", stdout, stderr, seconds)
    last = next((line.strip() for line in reversed(stderr.splitlines()) if line.strip()), "")
    return Outcome("failed", f"exit status {code}" + (f": {last[:300]}" if last else ""), stdout, stderr, seconds)


def run_program(
    source: str,
    limits: Limits | None = None,
    *,
    allow_code_execution: bool = False,
    python: str | None = None,
    shared: Sequence[str | os.PathLike[str]] = (),
) -> Outcome:
    """Run one Python program in the sandbox and say how it ended.

    Args:
        source: The program's text (a completed function and its tests).
        limits: What it may use (default :class:`Limits`).
        allow_code_execution: Must be True: running generated code is opt-in.
        python: The interpreter (default: :func:`program_python`'s choice).
        shared: Folders the program sees read-only at ``SITE/NAME`` (:data:`SITE`), wherever they lie, hidden
            folders included; nothing beside them is shown (e.g. :func:`~featcal.sandbox.packages.package_folders`'s
            of numpy, for a program that appends :data:`SITE` to ``sys.path``).

    Returns:
        Its :class:`Outcome`.

    Raises:
        CodeExecutionNotAllowedError: without the opt-in.
        InvalidParameterError: for a shared folder that does not exist, or two with the same name; nothing ran.
        SandboxUnavailableError: when the sandbox cannot be set up here; nothing ran then.
    """
    require_opt_in(allow_code_execution)
    limits = limits or Limits()
    share = shared_folders(shared)
    command = _unshare_command()
    interpreter = program_python(python)
    uid = None if os.geteuid() != 0 else UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
    with tempfile.TemporaryDirectory(prefix="featcal-sandbox-") as private:
        folder = Path(private)  # mode 0700: the program's source and output, out of its reach
        (folder / "program.py").write_text(source, encoding="utf-8")
        config = {
            "program": str(folder / "program.py"),
            "hidden": hidden_folders(),
            "shared": share,
            "site": SITE,
            "work_bytes": limits.work_bytes,
            "uid": uid,
            "gid": uid,
            "python": interpreter,
            "limits": {
                "cpu_s": limits.cpu_s,
                "memory_bytes": limits.memory_bytes,
                "processes": limits.processes,
                "file_bytes": limits.file_bytes,
            },
        }
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
        read_end, write_end = os.pipe()
        started = time.monotonic()
        timed_out = False
        try:
            with open(folder / "stdout", "wb") as out, open(folder / "stderr", "wb") as err:
                confine = [interpreter, "-I", "-S", str(CONFINE)]  # outside the folders it hides
                process = subprocess.Popen(
                    [*command, *confine, str(folder / "config.json"), str(write_end)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env={},
                    pass_fds=(write_end,),
                    start_new_session=True,
                )
            os.close(write_end)
            write_end = -1
            try:
                process.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_tree(process)
            except BaseException:  # interrupted (Ctrl-C): the program must not outlive its caller's wait
                _kill_tree(process)
                raise
            seconds = time.monotonic() - started
            with os.fdopen(read_end, "rb") as reader:
                read_end = -1
                report = reader.read().decode("utf-8", errors="replace")
        finally:
            for fd in (read_end, write_end):
                if fd >= 0:
                    os.close(fd)
        stdout, stderr = _tail(folder / "stdout"), _tail(folder / "stderr")
    if timed_out:
        return Outcome("timeout", f"ran past the wall-time limit of {limits.wall_s:g} s", stdout, stderr, seconds)
    return _outcome(report, stdout, stderr, seconds, limits)
