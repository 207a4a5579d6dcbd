"""The sandbox for generated code (featcal.sandbox): hostile programs are contained and scored as failures,
the test process unharmed; pass@k against hand-computed values; running code is opt-in.

Each hostile program runs the way the caller runs: as root (this process, when root: the program gets a
random uid of its own), and as an unprivileged user (``nobody``, started with ``setpriv`` and the system
``python3`` on a world-readable copy of the package: the program then runs in a user namespace).
numpy, copied into a virtual environment's layout under a HOME the sandbox hides, is shown to the programs
read-only, and nothing beside it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from importlib.metadata import distribution
from pathlib import Path

import pytest

from featcal.errors import CodeExecutionNotAllowedError, InvalidParameterError, SandboxUnavailableError
from featcal.sandbox import packages, runner
from featcal.sandbox.packages import check_extensions, package_folders
from featcal.sandbox.passk import mean_pass_at_k, pass_at_k
from featcal.sandbox.runner import SITE, Limits, Outcome, run_program
from featcal.sandbox.scoring import Problem, score_completions

PACKAGE = Path(__file__).resolve().parent.parent / "featcal"
FAST = Limits(wall_s=2.0, cpu_s=2, memory_bytes=512 << 20, processes=32, file_bytes=1 << 20, work_bytes=8 << 20)
SECRET = "hf_sandboxTestSecret0123456789"
MODES = ["caller", "nobody"] if os.geteuid() == 0 else ["caller"]
AS_NOBODY = """
import json, sys
from featcal.sandbox.runner import Limits, run_program
source, limits, shared = json.loads(sys.stdin.read())
outcome = run_program(source, Limits(**limits), allow_code_execution=True, shared=shared)
print(json.dumps(outcome.__dict__))
"""


@pytest.fixture(scope="module")
def readable_package():
    """A copy of the modules the sandbox needs that ``nobody`` can read (the checkout may lie under /root)."""
    root = Path(tempfile.mkdtemp(prefix="featcal-readable-"))
    os.chmod(root, 0o755)
    (root / "featcal").mkdir()
    for name in ("__init__.py", "version.py", "errors.py", "progress.py"):
        shutil.copy(PACKAGE / name, root / "featcal" / name)
    shutil.copytree(PACKAGE / "sandbox", root / "featcal" / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
    for path in root.rglob("*"):
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    yield root
    shutil.rmtree(root)


@pytest.fixture
def fake_home(tmp_path, monkeypatch):
    """A HOME holding a Hub token at its real place, and HF_TOKEN in this process's environment."""
    home = tmp_path / "home"
    token = home / ".cache" / "huggingface" / "token"
    token.parent.mkdir(parents=True)
    token.write_text(SECRET)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", SECRET)
    return home


@pytest.fixture(scope="module")
def venv_home():
    """A HOME outside /tmp holding a virtual environment's site-packages with a copy of this Python's numpy (its
    package, ``numpy.libs`` and metadata) beside another package, and a token file beside the environment: all
    world-readable, so that only the sandbox's hiding keeps them from ``nobody`` and the random uid, and (as
    root) owned by ``nobody``, so that only the read-only mount keeps ``nobody``'s program from changing them."""
    home = Path(tempfile.mkdtemp(prefix="featcal-home-", dir="/var/tmp"))
    installed = Path(distribution("numpy").locate_file(""))
    site = home / "venv" / "lib" / "python3" / "site-packages"
    site.mkdir(parents=True)
    for folder in [*installed.glob("numpy-*.dist-info"), installed / "numpy", installed / "numpy.libs"]:
        if folder.is_dir():
            shutil.copytree(folder, site / folder.name, ignore=shutil.ignore_patterns("__pycache__"))
    (site / "other").mkdir()
    (site / "other" / "__init__.py").write_text(f"TOKEN = {SECRET!r}\n")
    (home / "token").write_text(SECRET)
    for path in [home, *home.rglob("*")]:
        if os.geteuid() == 0:  # owned by nobody, as a user's own environment: only the mount keeps it unchanged
            os.lchown(path, 65534, 65534)
        if path.is_dir():
            os.chmod(path, 0o755)
        elif path.name in ("token", "__init__.py"):
            os.chmod(path, 0o644)
    yield home, site
    shutil.rmtree(home)


@pytest.fixture
def hidden_venv(venv_home, monkeypatch):
    """``venv_home`` as this process's HOME (hidden from the programs), and the folders of its numpy."""
    home, site = venv_home
    monkeypatch.setenv("HOME", str(home))
    return home, site, package_folders("numpy", [str(site)])


def run_as(
    mode: str, source: str, package: Path, limits: Limits = FAST, shared: tuple[str, ...] | list[str] = ()
) -> Outcome:
    """Run ``source`` in the sandbox started by this process (``caller``) or by ``nobody``."""
    if mode == "caller":
        return run_program(source, limits, allow_code_execution=True, shared=shared)
    command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-c", AS_NOBODY]
    env = {"PYTHONPATH": str(package), "HOME": os.environ["HOME"], "HF_TOKEN": os.environ.get("HF_TOKEN", "")}
    done = subprocess.run(
        command,
        input=json.dumps([source, limits.__dict__, list(shared)]),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return Outcome(**json.loads(done.stdout))


def named(source: str) -> tuple[str, str]:
    """``source`` that first names its process (``/proc/PID/comm``, inherited by forks) with a unique name."""
    name = f"fc{secrets.token_hex(6)}"
    return f"import ctypes\nctypes.CDLL(None).prctl(15, {name.encode()!r})\n{source}", name


def processes_named(name: str) -> list[str]:
    """The processes of this machine named ``name``."""
    found = []
    for pid in (pid for pid in os.listdir("/proc") if pid.isdigit()):
        try:
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
        except OSError:  # ended meanwhile
            continue
    return found


@pytest.mark.parametrize("mode", MODES)
def test_correct_program_passes_and_wrong_one_fails(mode, readable_package):
    problem = Problem("t/0", "def add(a, b):\n", "def check(f):\n    assert f(2, 3) == 5\n", "add")
    before = set(Path(tempfile.gettempdir()).glob("featcal-sandbox-*"))
    passed = run_as(mode, problem.program("    return a + b\n"), readable_package)
    failed = run_as(mode, problem.program("    return a - b\n"), readable_package)
    assert (passed.status, passed.reason) == ("passed", "exit status 0")
    assert failed.status == "failed" and failed.reason == "exit status 1: AssertionError"
    assert set(Path(tempfile.gettempdir()).glob("featcal-sandbox-*")) == before  # its private folder is gone


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_is_stopped_by_a_limit(mode, readable_package):
    started = time.monotonic()
    outcome = run_as(mode, "while True:\n    pass\n", readable_package)
    assert outcome.status in ("timeout", "killed") and not outcome.passed
    assert outcome.reason in ("ran past the wall-time limit of 2 s", "killed by the CPU-time limit")
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_contained_and_leaves_no_process(mode, readable_package):
    bomb, name = named(
        "import os, time\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        time.sleep(0.01)\n"
    )
    outcome = run_as(mode, bomb, readable_package)
    assert outcome.status in ("timeout", "killed") and not outcome.passed
    time.sleep(0.2)
    assert processes_named(name) == []
    assert subprocess.run(["true"]).returncode == 0


@pytest.mark.parametrize("mode", MODES)
def test_process_count_is_limited(mode, readable_package):
    program = (
        "import os, time\nforked = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(5)\n            os._exit(0)\n        forked += 1\nexcept OSError as exc:\n"
        "    print('forked', forked, exc.errno)\n"
    )
    outcome = run_as(mode, program, readable_package, Limits(wall_s=3.0, cpu_s=2, processes=8))
    assert outcome.passed, outcome
    forked, errno = map(int, outcome.stdout.split()[1:])
    assert 1 <= forked <= 7 and errno == 11  # EAGAIN: the program and its children stay within 8 processes


@pytest.mark.parametrize("mode", MODES)
def test_ten_gigabyte_allocation_fails(mode, readable_package):
    outcome = run_as(mode, "data = bytearray(10 * 2**30)\nprint('allocated')\n", readable_package)
    assert outcome.status == "failed" and outcome.reason == "exit status 1: MemoryError"
    assert "allocated" not in outcome.stdout


@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_its_folder_fail(mode, readable_package, fake_home, tmp_path):
    outside, in_home = tmp_path / "escaped.txt", fake_home / "escaped.txt"
    program = (
        "import os\nwrote = []\n"
        f"for path in [{str(outside)!r}, {str(in_home)!r}, '/var/tmp/escaped.txt', '/dev/shm/escaped.txt']:\n"
        "    try:\n        open(path, 'w').write('x')\n        wrote.append(path)\n    except OSError as exc:\n"
        "        print(type(exc).__name__, path)\n"
        "open(os.path.join(os.environ['HOME'], 'own.txt'), 'w').write('mine')\n"
        "assert not wrote, wrote\n"
    )
    outcome = run_as(mode, program, readable_package)
    assert outcome.passed, outcome  # every write outside failed; its own HOME is writable
    assert not outside.exists() and not in_home.exists()
    assert not Path("/var/tmp/escaped.txt").exists() and not Path("/dev/shm/escaped.txt").exists()
    escape = run_as(mode, f"open({str(outside)!r}, 'w').write('x')\n", readable_package)
    assert escape.status == "failed" and not outside.exists()


@pytest.mark.parametrize("mode", MODES)
def test_socket_to_a_listening_port_fails(mode, readable_package):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n"
        outcome = run_as(mode, program, readable_package)
        assert outcome.status == "failed" and "Network is unreachable" in outcome.reason
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize("mode", MODES)
def test_secrets_of_the_caller_cannot_be_read(mode, readable_package, fake_home):
    token = fake_home / ".cache" / "huggingface" / "token"
    program = (
        "import os\n"
        f"for path in [{str(token)!r}, '/root/.cache/huggingface/token']:\n"
        "    try:\n        print(open(path).read())\n    except OSError as exc:\n        print(type(exc).__name__)\n"
        "print(os.environ.get('HF_TOKEN'), sorted(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    if pid.isdigit():\n"
        "        try:\n            print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "        except OSError:\n            pass\n"
        "assert False\n"
    )
    outcome = run_as(mode, program, readable_package)
    assert outcome.status == "failed"
    assert SECRET not in outcome.stdout and SECRET not in outcome.stderr
    assert "None ['HOME', 'LANG', 'PATH', 'TMPDIR']" in outcome.stdout
    assert token.read_text() == SECRET


@pytest.mark.parametrize("mode", MODES)
def test_program_holds_no_privilege_and_cannot_undo_the_mounts(mode, readable_package, fake_home):
    token = fake_home / ".cache" / "huggingface" / "token"
    program = (
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print([line.strip() for line in open('/proc/self/status') if line.startswith(('Cap', 'NoNewPrivs'))])\n"
        f"print('umount', libc.umount2({str(fake_home).encode()!r}, 2), libc.umount2(b'/tmp', 2))\n"
        "print('remount', libc.mount(None, b'/', None, 32 | 4096, None))\n"
        f"print(open({str(token)!r}).read())\n"
    )
    outcome = run_as(mode, program, readable_package)
    assert outcome.status == "failed" and SECRET not in outcome.stdout + outcome.stderr
    for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert f"'{field}:\\t0000000000000000'" in outcome.stdout
    assert "'NoNewPrivs:\\t1'" in outcome.stdout
    assert "umount -1 -1" in outcome.stdout and "remount -1" in outcome.stdout


def test_an_interrupted_caller_leaves_no_program_running(monkeypatch):
    program, name = named("while True:\n    pass\n")
    wait, seen = subprocess.Popen.wait, []

    def interrupted(self, timeout=None):
        if timeout is None:
            return wait(self)
        time.sleep(0.5)
        seen.extend(processes_named(name))
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_program(program, FAST, allow_code_execution=True)
    time.sleep(0.2)
    assert seen and processes_named(name) == []  # it ran, and ended with the interrupted wait


@pytest.mark.parametrize("mode", MODES)
def test_huge_file_write_hits_the_file_size_limit(mode, readable_package):
    outcome = run_as(mode, "open('big', 'wb').write(b'x' * (8 << 20))\n", readable_package)
    assert outcome.status == "failed" and "File too large" in outcome.reason


def test_running_code_is_opt_in(tmp_path):
    marker = tmp_path / "ran"
    program = f"open({str(marker)!r}, 'w').close()\n"
    for consent in (False, 1, "yes"):
        with pytest.raises(CodeExecutionNotAllowedError, match=r"only when `allow_code_execution` is given\.$"):
            run_program(program, FAST, allow_code_execution=consent)
    with pytest.raises(CodeExecutionNotAllowedError):
        score_completions([Problem("t/0", "", "")], {"t/0": [program]})
    assert not marker.exists()


def test_refuses_where_namespaces_cannot_be_made(monkeypatch, tmp_path):
    monkeypatch.setattr(runner.sys, "platform", "darwin")
    with pytest.raises(SandboxUnavailableError, match=r"needs Linux namespaces; this is darwin"):
        run_program("print(1)", FAST, allow_code_execution=True)
    monkeypatch.setattr(runner.sys, "platform", "linux")
    monkeypatch.setattr(runner, "UNSHARE_PATHS", (str(tmp_path / "unshare"),))
    with pytest.raises(SandboxUnavailableError, match=r"needs util-linux's unshare"):
        run_program("print(1)", FAST, allow_code_execution=True)
    refused = tmp_path / "unshare"  # as where namespaces are refused (a container without CAP_SYS_ADMIN)
    refused.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    refused.chmod(0o755)
    with pytest.raises(SandboxUnavailableError) as caught:
        run_program("print(1)", FAST, allow_code_execution=True)
    assert caught.value.message == (
        "The sandbox for generated code could not be set up here: unshare: unshare failed: Operation not "
        "permitted; no code ran."
    )


def test_an_interpreter_the_program_cannot_reach_is_refused(fake_home, request):
    with pytest.raises(SandboxUnavailableError, match=r"^No Python interpreter for generated code outside the folders"):
        run_program("print(1)", FAST, allow_code_execution=True, python=str(fake_home / "bin" / "python3"))
    folder = Path(tempfile.mkdtemp(dir="/tmp"))  # outside HOME, but under /tmp, which the sandbox replaces
    hidden = folder / "python3"
    shutil.copy(os.path.realpath("/usr/bin/python3"), hidden)
    request.addfinalizer(lambda: shutil.rmtree(folder))
    with pytest.raises(
        SandboxUnavailableError,
        match=r"set up here: \[Errno 2\] No such file or directory: '/tmp/\S+/python3'; no code ran\.$",
    ):
        run_program("print(1)", FAST, allow_code_execution=True, python=str(hidden))


def test_pass_at_k_matches_hand_computed_values():
    assert pass_at_k(10, 0, 1) == 0.0
    assert pass_at_k(10, 3, 1) == 0.3  # 1 - 7/10
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)  # 1 - C(7,2)/C(10,2) = 8/15
    assert pass_at_k(5, 2, 4) == 1.0  # fewer than 4 failures among 5
    assert pass_at_k(10, 10, 10) == 1.0
    assert mean_pass_at_k([(10, 3), (10, 0), (10, 10)], 1) == pytest.approx((0.3 + 0 + 1) / 3)
    for n, c, k, name in ((0, 0, 1, "n"), (5, 6, 1, "c"), (5, 1, 6, "k"), (5, 1, 0, "k")):
        with pytest.raises(InvalidParameterError, match=rf"^pass@k: {name}="):
            pass_at_k(n, c, k)


def test_score_completions_counts_each_sample(readable_package):
    problems = [
        Problem("t/add", "def add(a, b):\n", "def check(f):\n    assert f(1, 2) == 3\n", "add"),
        Problem("t/mbpp", "", "assert double(4) == 8\n"),
    ]
    completions = {
        "t/add": ["    return a + b\n", "    return a * b\n", "    while True: pass\n"],
        "t/mbpp": ["def double(x):\n    return 2 * x\n", "def double(x):\n    return x\n", "raise SystemExit(0)\n"],
    }
    quick = Limits(wall_s=1.0, cpu_s=1, memory_bytes=512 << 20, processes=16, file_bytes=1 << 20)
    score = score_completions(problems, completions, (1, 2), quick, allow_code_execution=True, progress=False)
    # t/mbpp's third sample exits 0 before its assertion: a passing program, as bigcode counts it.
    assert score.counts() == {"t/add": (3, 1), "t/mbpp": (3, 2)}
    assert [o.status for o in score.outcomes["t/add"]] in (
        ["passed", "failed", "timeout"],
        ["passed", "failed", "killed"],
    )
    assert score.pass_at_k["pass@1"] == pytest.approx((1 / 3 + 2 / 3) / 2)
    assert score.pass_at_k["pass@2"] == pytest.approx(((1 - 1 / 3) + (1 - 0 / 3)) / 2)  # C(2,2)/C(3,2); C(1,2)=0


def test_score_completions_validates_before_running(tmp_path):
    marker = tmp_path / "ran"
    problems = [Problem("t/0", f"open({str(marker)!r}, 'w').close()\n", "")]
    with pytest.raises(InvalidParameterError, match=r"^completions\['t/0'\]=1 is invalid: it must be at least"):
        score_completions(problems, {"t/0": [""]}, (1, 2), allow_code_execution=True)
    with pytest.raises(InvalidParameterError, match=r"^problems=\['t/0'\] is invalid: it must be unique task_ids"):
        score_completions(problems * 2, {"t/0": [""]}, allow_code_execution=True)
    assert not marker.exists()


def test_the_folders_of_an_installed_package_are_its_own(hidden_venv):
    home, site, folders = hidden_venv
    assert folders == [str(site / "numpy"), str(site / "numpy.libs")]  # not its metadata, nor another package


@pytest.mark.parametrize("mode", MODES)
def test_numpy_under_a_hidden_home_imports_and_computes_when_shared(mode, readable_package, hidden_venv):
    home, site, folders = hidden_venv
    program = (
        f"import sys\nsys.path.append({SITE!r})\nimport numpy as np\nprint(np.__file__)\n"
        "print(int(np.arange(10).sum()), round(float(np.linalg.det(np.eye(3) * 2)), 6))\n"
    )
    limits = Limits(wall_s=20.0, cpu_s=10, memory_bytes=1 << 30, processes=32, file_bytes=1 << 20, work_bytes=8 << 20)
    outcome = run_as(mode, program, readable_package, limits, folders)
    assert outcome.passed, outcome
    assert outcome.stdout.splitlines() == [f"{SITE}/numpy/__init__.py", "45 8.0"]
    unshared = run_as(mode, program.replace(repr(SITE), repr(str(site))), readable_package, limits)
    assert unshared.reason == "exit status 1: ModuleNotFoundError: No module named 'numpy'"  # its folder is hidden


@pytest.mark.parametrize("mode", MODES)
def test_a_shared_folder_is_read_only_and_shows_nothing_beside_it(mode, readable_package, hidden_venv):
    home, site, folders = hidden_venv
    before = sorted((p.relative_to(site), p.stat().st_mode, p.stat().st_mtime_ns) for p in site.rglob("*"))
    program = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        f"shared, site, home = {SITE!r}, {str(site)!r}, {str(home)!r}\n"
        "numpy = shared + '/numpy'\nchanged = []\n"
        "def attempt(name, action):\n"
        "    try:\n        action()\n        changed.append(name)\n    except OSError as exc:\n"
        "        print('refused', name, exc.errno)\n"
        "attempt('write', lambda: open(numpy + '/planted.py', 'w').write('x'))\n"
        "attempt('append', lambda: open(numpy + '/version.py', 'a').write('x'))\n"
        "attempt('libs', lambda: open(shared + '/numpy.libs/planted.so', 'w').write('x'))\n"
        "attempt('beside', lambda: open(shared + '/planted', 'w').write('x'))\n"
        "attempt('mkdir', lambda: os.mkdir(numpy + '/planted'))\n"
        "attempt('chmod', lambda: os.chmod(numpy + '/__init__.py', 0o777))\n"
        "attempt('unlink', lambda: os.unlink(numpy + '/version.py'))\n"
        "attempt('rename', lambda: os.rename(numpy + '/version.py', numpy + '/moved.py'))\n"
        "print('changed', changed)\n"
        "print('listed', sorted(os.listdir(shared)), sorted(os.listdir(numpy + '/..')), os.listdir(home))\n"
        "print('remount', libc.mount(None, numpy.encode(), None, 32 | 4096, None), libc.umount2(numpy.encode(), 2))\n"
        "for path in [site, site + '/other', site + '/other/__init__.py', home + '/token', home + '/venv']:\n"
        "    try:\n        print(os.listdir(path) if os.path.isdir(path) else open(path).read())\n"
        "    except OSError as exc:\n        print('hidden', path, type(exc).__name__)\n"
        "links = []\n"
        "for pid in (pid for pid in os.listdir('/proc') if pid.isdigit()):\n"
        "    try:\n        links += [os.readlink(f'/proc/{pid}/fd/{fd}') for fd in os.listdir(f'/proc/{pid}/fd')]\n"
        "    except OSError:\n        pass\n"
        "print('links into the real site', [link for link in links if link.startswith(site)])\n"
        "for line in open('/proc/self/mountinfo'):\n"
        "    if line.split()[4].startswith(shared + '/'):\n"
        "        print('mount', line.split()[4], sorted(set(line.split()[5].split(',')) & {'ro', 'nosuid', 'nodev'}))\n"
    )
    outcome = run_as(mode, program, readable_package, FAST, folders)
    assert outcome.passed, outcome
    out = outcome.stdout
    assert SECRET not in out + outcome.stderr
    assert "changed []" in out and out.count("refused ") == 8
    assert "listed ['numpy', 'numpy.libs'] ['numpy', 'numpy.libs'] []" in out  # nothing of the real parent
    assert "remount -1 -1" in out
    for path in [site, site / "other", site / "other" / "__init__.py", home / "token", home / "venv"]:
        assert f"hidden {path} FileNotFoundError" in out
    assert "links into the real site []" in out
    for name in ("numpy", "numpy.libs"):
        assert f"mount {SITE}/{name} ['nodev', 'nosuid', 'ro']" in out
    assert sorted((p.relative_to(site), p.stat().st_mode, p.stat().st_mtime_ns) for p in site.rglob("*")) == before


def test_a_shared_folder_that_is_a_link_keeps_its_name(tmp_path):
    (tmp_path / "pkg-1.0").mkdir()
    (tmp_path / "pkg").symlink_to(tmp_path / "pkg-1.0")
    outcome = run_program(
        f"import os\nprint(os.listdir({SITE!r}))\n", FAST, allow_code_execution=True, shared=[tmp_path / "pkg"]
    )
    assert outcome.passed and outcome.stdout == "['pkg']\n"


def test_shared_folders_without_a_folder_to_show_them_under_stop_the_set_up(tmp_path, monkeypatch):
    """Where the site's parent (``/run``) is missing, the sandbox stops before the program runs."""
    marker = tmp_path / "ran"
    monkeypatch.setattr(runner, "SITE", "/nonexistent-featcal-run/featcal-site")
    with pytest.raises(SandboxUnavailableError) as caught:
        run_program(f"open({str(marker)!r}, 'w').close()\n", FAST, allow_code_execution=True, shared=[tmp_path])
    assert caught.value.message == (
        "The sandbox for generated code could not be set up here: no folder /nonexistent-featcal-run to show the "
        "shared folders under; no code ran."
    )
    assert not marker.exists()


def test_shared_folders_are_validated_before_anything_runs(tmp_path):
    marker = tmp_path / "ran"
    program = f"open({str(marker)!r}, 'w').close()\n"
    with pytest.raises(InvalidParameterError) as caught:
        run_program(program, FAST, allow_code_execution=True, shared=[tmp_path / "missing"])
    assert caught.value.message == f"sandbox: shared='{tmp_path / 'missing'}' is invalid: it must be existing folders."
    (tmp_path / "a" / "numpy").mkdir(parents=True)
    (tmp_path / "b" / "numpy").mkdir(parents=True)
    with pytest.raises(InvalidParameterError, match=r"shared=\['numpy', 'numpy'\] is invalid: it must be folders with"):
        score_completions(
            [Problem("t/0", program, "")], {"t/0": [""]}, allow_code_execution=True,
            shared=[tmp_path / "a" / "numpy", tmp_path / "b" / "numpy"],
        )  # fmt: skip
    assert not marker.exists()


def test_a_package_that_is_not_there_or_built_for_another_python_is_refused(tmp_path):
    with pytest.raises(SandboxUnavailableError) as caught:
        package_folders("numpy", [str(tmp_path)])
    assert caught.value.message == f"No package 'numpy' installed in {tmp_path} to show to the sandbox's programs."
    core = tmp_path / "numpy" / "_core"
    core.mkdir(parents=True)
    (tmp_path / "numpy" / "__init__.py").write_text("")
    (core / "_multiarray_umath.cpython-399-x86_64-linux-gnu.so").write_bytes(b"")
    assert package_folders("numpy", [str(tmp_path)]) == [str(tmp_path / "numpy")]  # no RECORD: the package alone
    python = runner.program_python()
    suffix = packages._extension_suffixes(python)[0]
    with pytest.raises(SandboxUnavailableError) as caught:
        check_extensions(str(tmp_path / "numpy"))
    assert caught.value.message == (
        f"The package in {tmp_path / 'numpy'} is built for cpython-399-x86_64-linux-gnu, but the sandbox's Python "
        f"{python} loads {suffix} extensions: install one built for it, or run featcal with a Python of the same "
        "version outside the folders the sandbox hides."
    )
    (core / f"_multiarray_umath{suffix}").write_bytes(b"")
    check_extensions(str(tmp_path / "numpy"))  # one built for it among them: accepted


def test_a_record_s_absolute_or_outside_paths_are_never_shared(tmp_path):
    """Only the top-level folders a distribution's RECORD installed inside its site are shared: an absolute
    entry (``/etc/passwd``) or one above the site (``../../bin/f2py``) never makes ``/`` or another folder
    shared."""
    (tmp_path / "numpy").mkdir()
    (tmp_path / "numpy" / "__init__.py").write_text("")
    (tmp_path / "numpy.libs").mkdir()
    info = tmp_path / "numpy-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: numpy\nVersion: 9.9\n")
    (info / "RECORD").write_text(
        "numpy/__init__.py,,\nnumpy.libs/libx.so,,\nnumpy-9.9.dist-info/RECORD,,\n/etc/passwd,,\n../../bin/f2py,,\n"
    )
    assert package_folders("numpy", [str(tmp_path)]) == [str(tmp_path / "numpy"), str(tmp_path / "numpy.libs")]
