"""The sandbox's first process inside its namespaces: it confines the file system, then runs the program.

:mod:`featcal.sandbox.runner` starts this file as a script, ``python -I -S confine.py CONFIG STATUS_FD``,
under ``unshare --net --pid --fork --mount`` (and ``--user --map-root-user`` when not root), so it is
process 1 of a fresh PID namespace, in a fresh network namespace (only a loopback that is down) and a
private mount namespace. It uses the standard library only (``-I -S``: no site-packages, no
``PYTHON*`` variables, no script folder on ``sys.path``), and then:

1. reads the program and its settings (the JSON file ``CONFIG``);
2. remounts every mount it can see read-only (in this namespace only), hides the user's home folders
   (``HOME``, ``/root``, ``/home``) under empty read-only tmpfs mounts, shows the folders the config shares
   (an installed package such as numpy, wherever it lies) read-only under ``/run``, mounts a fresh proc
   for the new PID namespace, and a fresh, size-limited, writable tmpfs on ``/tmp``, the program's only
   writable folder, its cwd and HOME; any step failing stops here, before the program runs;
3. forks the program: it drops to the unprivileged uid/gid the config names (when started as root),
   sets the resource limits and execs ``python -I -S program.py`` with an environment of its own;
4. waits for it (reaping the orphans it leaves meanwhile), and writes the line ``exit N`` or ``signal N``
   to ``STATUS_FD`` (after ``start ERROR`` when the program could not be started). When it returns, the
   kernel kills every process left in the namespace, and the tmpfs goes with it.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 1, 2, 4, 8, 32, 4096
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs flags of a mount, and the mount flag that keeps each (a remount inside a user namespace must keep them).
KEPT_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
WORK = "/tmp"
# Emptied (an empty read-only tmpfs on each) besides the home folders: the run-time folder of the system's
# services, with their Unix sockets (a socket file can be connected to on a read-only mount).
EMPTIED = ("/run",)
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
CAPABILITY_VERSION_3 = 0x20080522
RLIMITS = {
    "cpu_s": resource.RLIMIT_CPU,
    "memory_bytes": resource.RLIMIT_AS,
    "processes": resource.RLIMIT_NPROC,
    "file_bytes": resource.RLIMIT_FSIZE,
}

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def encode(text: str | None) -> bytes | None:
        return None if text is None else os.fsencode(text)

    if _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount of {target}: {os.strerror(errno)}")


def _mount_points() -> list[str]:
    """Every mount point this namespace sees, in mount order (octal escapes like ``\\040`` decoded)."""
    with open("/proc/self/mountinfo", encoding="utf-8") as lines:
        points = [line.split()[4] for line in lines]
    return [re.sub(r"\\([0-7]{3})", lambda octal: chr(int(octal.group(1), 8)), point) for point in points]


def _read_only_remount(point: str, kept: int, flags: int) -> None:
    """Remount the mount at ``point`` read-only with ``flags``, keeping the flags ``kept`` (its statvfs flags)
    says it has: a remount inside a user namespace may add flags, never drop them."""
    flags |= MS_REMOUNT | MS_BIND | MS_RDONLY
    for stat_flag, mount_flag in KEPT_FLAGS:
        if kept & stat_flag:
            flags |= mount_flag
    _mount(None, point, None, flags)


def _read_only_everywhere() -> None:
    """Remount each visible mount read-only and nosuid, keeping its other flags; ones that vanished are skipped."""
    for point in _mount_points():
        try:
            kept = os.statvfs(point).f_flag
        except OSError:  # hidden under a later mount, or gone
            continue
        _read_only_remount(point, kept, MS_NOSUID)


def _open_shared(shared: list[list[str]]) -> list[tuple[str, int]]:
    """Each shared folder's name and a handle on it (``O_PATH``, not inherited), taken before any folder is
    hidden, so that one lying in a hidden folder can still be bound."""
    return [(name, os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)) for name, path in shared]


def _show_shared(site: str, handles: list[tuple[str, int]]) -> None:
    """Bind each shared folder at ``site/NAME`` read-only, nosuid and nodev, on a tmpfs mounted over ``site``'s
    parent (``/run``, already emptied) that is read-only once they are in place: the program sees those
    folders and nothing beside them (``..`` of a bind is the tmpfs, not the folder's real parent)."""
    parent = os.path.dirname(site)
    if not os.path.isdir(parent) or os.path.islink(parent):
        raise OSError(f"no folder {parent} to show the shared folders under")
    _mount("tmpfs", parent, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")
    os.mkdir(site)
    os.chmod(site, 0o755)
    for name, handle in handles:
        target = os.path.join(site, name)
        os.mkdir(target)
        _mount(f"/proc/self/fd/{handle}", target, None, MS_BIND)
        os.close(handle)
        _read_only_remount(target, os.statvfs(target).f_flag, MS_NOSUID | MS_NODEV)
    _mount(None, parent, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")


def _confine(config: dict) -> None:
    """The file-system confinement of step 2 (module docstring)."""
    handles = _open_shared(config["shared"])
    _read_only_everywhere()
    for folder in [*config["hidden"], *EMPTIED]:
        if os.path.isdir(folder) and not os.path.islink(folder):
            _mount("tmpfs", folder, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")
    if handles:
        _show_shared(config["site"], handles)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    size = config["work_bytes"]
    _mount("tmpfs", WORK, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size},mode=0700")


def _drop_privileges(uid: int | None, gid: int | None, last_cap: int) -> None:
    """No capability now or after exec (the bounding set emptied: also for the user namespace's root, which
    could otherwise undo the mounts), no privilege gained by exec (no_new_privs), and, given a uid, that
    uid and gid with no supplementary group."""
    for cap in range(last_cap + 1):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"dropping capability {cap}")
    if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "setting no_new_privs")
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    if _libc.capset(header, (ctypes.c_uint32 * 6)()) != 0:  # effective, permitted, inheritable: all empty
        raise OSError(ctypes.get_errno(), "clearing the capability sets")


def _run_program(config: dict, program: bytes, status_fd: int, last_cap: int) -> int:
    """Fork and exec the program with its limits; return its wait status."""
    path = os.path.join(WORK, "program.py")
    with open(path, "wb") as file:
        file.write(program)
    uid, gid = config["uid"], config["gid"]
    if uid is not None:
        os.chown(WORK, uid, gid)
        os.chown(path, uid, gid)
    child = os.fork()
    if child == 0:
        try:
            os.set_inheritable(status_fd, False)  # closed by the exec, kept to report a failed start
            _drop_privileges(uid, gid, last_cap)
            for name, limit in RLIMITS.items():
                value = config["limits"][name]  # CPU: SIGXCPU at the limit, SIGKILL a second later
                resource.setrlimit(limit, (value, value + 1 if name == "cpu_s" else value))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            os.chdir(WORK)
            env = {"HOME": WORK, "TMPDIR": WORK, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
            os.execve(config["python"], [config["python"], "-I", "-S", path], env)
        except BaseException as exc:  # noqa: BLE001  (the child must never return into the caller's code)
            os.write(status_fd, f"start {exc}\n".encode())
        os._exit(126)
    while True:  # reap orphans until the program itself ends; the rest die with the namespace
        pid, waited = os.wait()
        if pid == child:
            return waited


def main(argv: list[str]) -> int:
    """Step 1 to 4 of the module docstring; the exit status is 0, or 125 when the sandbox failed to set up."""
    config_path, status_fd = argv[1], int(argv[2])
    with open(config_path, encoding="utf-8") as file:
        config = json.load(file)
    with open(config["program"], "rb") as file:
        program = file.read()
    with open("/proc/sys/kernel/cap_last_cap", "rb") as file:
        last_cap = int(file.read())
    try:
        _confine(config)
    except OSError as exc:
        os.write(status_fd, f"setup {exc}\n".encode())
        return 125
    status = _run_program(config, program, status_fd, last_cap)  # a failed start has written "start ..." already
    if os.WIFSIGNALED(status):
        os.write(status_fd, f"signal {os.WTERMSIG(status)}\n".encode())
    else:
        os.write(status_fd, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
