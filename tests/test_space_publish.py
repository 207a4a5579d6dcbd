"""`featcal space push`: the staged files, the app started from a copy of them, and the upload.

The upload goes to a protocol double on 127.0.0.1 that answers the few Hub endpoints
huggingface_hub calls (whoami, create repo, tree, preupload, validate-yaml, commit) and records
what it receives. It is not the Hub: it checks the client's requests, not the Hub's behaviour.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import featcal.cli
from featcal.errors import FeatcalError
from featcal.hub.verification import local_files as list_space_files
from featcal.space import SpaceModel, SpaceSettings
from featcal.space.publish import push_space, space_source

gradio_client = pytest.importorskip("gradio_client")

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
MODEL = FIXTURE / "experts" / "t0"


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """A dry-run push of the tiny tasks, kept on disk."""
    out = tmp_path_factory.mktemp("staged") / "space"
    result = push_space(
        "me/tiny-space",
        model_id="me/tiny-model",
        tasks_file=FIXTURE / "tasks.json",
        dry_run=True,
        output=out,
        progress=False,
    )
    return result


def test_dry_run_stages_exactly_the_space_files(staged):
    paths = [f.path_in_repo for f in staged.files]
    assert staged.dry_run and staged.folder is not None
    assert list_space_files(staged.folder) == staged.files
    assert {
        "app.py",
        "requirements.txt",
        "README.md",
        "space_config.json",
        "tasks.json",
        "featcal/__init__.py",
        "featcal/space/ui.py",
        "featcal/resources/ta8_tasks.json",
        "examples/t0.png",
        "examples/t1.png",
        "examples/t2.png",
    } <= set(paths)
    assert not [p for p in paths if "__pycache__" in p or p.endswith(".pyc")]
    # The featcal package's modules the app imports (a family part named by a string too), not the rest.
    assert "featcal/families/clip_vision/entries.py" in paths and "featcal/__main__.py" in paths
    assert "featcal/families/causal_lm/evaluation.py" not in paths
    assert "featcal/pipeline.py" not in paths and "featcal/sandbox/runner.py" not in paths
    assert len(paths) < 256  # huggingface_hub's commit size: one commit
    config = json.loads((staged.folder / "space_config.json").read_text())
    assert config["model_id"] == "me/tiny-model" and config["tasks_file"] == "tasks.json"
    header = (staged.folder / "README.md").read_text().split("---")[1]
    assert re.search(r"models:\n- me/tiny-model\n- openai/clip-vit-base-patch32", header)


def test_space_header_and_requirements():
    import gradio
    from huggingface_hub import SpaceCard

    data = SpaceCard.load(space_source() / "README.md").data
    assert (data.sdk, data.app_file, data.python_version) == ("gradio", "app.py", "3.11")
    assert data.sdk_version == gradio.__version__, "the tests run another Gradio than the Space declares"
    required = {
        re.split(r"[<>=!~;\[ ]", r)[0].lower().replace("_", "-")
        for r in importlib.metadata.requires("featcal") or []
        if "extra ==" not in r
    }
    listed = {
        re.split(r"[<>=!~;\[ ]", line)[0].lower().replace("_", "-")
        for line in (space_source() / "requirements.txt").read_text().splitlines()
        if line.strip() and not line.startswith(("#", "-"))
    }
    assert required and required <= listed, f"space/requirements.txt lacks {sorted(required - listed)}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _served_app(copy: Path, tmp_path: Path, **variables: str):
    """``python app.py`` in ``copy`` on a free port, its temporary files in ``tmp_path/tmp``; a client to it.
    Stopped with SIGTERM on the way out, as a Space restart or ``docker stop`` stops it."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE"}}
    # The Hub ids of space_config.json are swapped for the fixture's folders through the Space variables.
    env |= {
        "MODEL_ID": str(MODEL),
        "BASE_MODEL_ID": str(FIXTURE / "base"),
        "HF_HUB_OFFLINE": "1",
        "GRADIO_SERVER_NAME": "127.0.0.1",
        "GRADIO_SERVER_PORT": str(port),
        "GRADIO_ANALYTICS_ENABLED": "False",
        "FEATCAL_CACHE": str(tmp_path / "cache"),
        "TMPDIR": str(tmp_path / "tmp"),
        **variables,
    }
    (tmp_path / "tmp").mkdir(exist_ok=True)
    log = (tmp_path / "app.log").open("w")
    app = subprocess.Popen([sys.executable, "app.py"], cwd=copy, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 150
        while True:
            try:
                client = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
                break
            except Exception:
                if app.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"the app did not start:\n{(tmp_path / 'app.log').read_text()[-3000:]}")
                time.sleep(0.5)
        yield client
    finally:
        app.terminate()
        app.wait(timeout=20)
        log.close()


def _copy_staged(staged, copy: Path) -> None:
    for f in staged.files:
        (copy / f.path_in_repo).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(staged.folder / f.path_in_repo, copy / f.path_in_repo)


def test_the_app_starts_from_a_copy_of_the_pushed_files(staged, tmp_path):
    copy = tmp_path / "space"
    _copy_staged(staged, copy)
    with _served_app(copy, tmp_path) as client:
        reply = client.predict(
            gradio_client.handle_file(str(copy / "examples" / "t2.png")), "all", 5, False, api_name="/predict"
        )
    assert reply["error"] is None and list(reply["results"]) == ["t0", "t1", "t2"]
    # every example shipped: the app made no temporary example folder, so a stop leaves none behind
    assert not list((tmp_path / "tmp").glob("featcal-space-examples-*"))
    settings = SpaceSettings(
        model_id=str(MODEL),
        base_model_id=str(FIXTURE / "base"),
        tasks_file=str(copy / "tasks.json"),
        device="auto",  # the app's: a Space picks its device itself, CUDA where torch sees a GPU
        heads_cache=str(tmp_path / "cache"),
    )
    from PIL import Image

    expected = SpaceModel(settings, progress=False).top_classes(Image.open(copy / "examples" / "t2.png"), ["t2"], 5)
    assert reply["results"]["t2"]["model"] == pytest.approx(expected["t2"], abs=2e-6)
    # It ran the featcal shipped in the Space (Python left bytecode there), not the installed one.
    assert list((copy / "featcal" / "space" / "__pycache__").glob("ui.*.pyc"))


def test_an_app_that_cannot_serve_says_why_in_one_line(staged, tmp_path):
    """A Space whose model cannot be served logs one line and exits 2, as the CLI would: no traceback."""
    copy = tmp_path / "space"
    _copy_staged(staged, copy)
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "PYTHONDONTWRITEBYTECODE"}}
    env |= {"MODEL_ID": str(tmp_path / "no-such-release"), "BASE_MODEL_ID": str(FIXTURE / "base"),
            "HF_HUB_OFFLINE": "1", "FEATCAL_CACHE": str(tmp_path / "cache")}  # fmt: skip
    app = subprocess.run([sys.executable, "app.py"], cwd=copy, env=env, capture_output=True, text=True, timeout=120)
    assert app.returncode == 2, app.stderr[-2000:]
    errors = [line for line in app.stderr.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "no-such-release" in errors[0], app.stderr[-2000:]
    assert "Traceback" not in app.stderr


def test_a_stopped_app_removes_the_examples_it_gathered(staged, tmp_path):
    """Without shipped examples the app takes one image per task from the (here local) test splits into
    a temporary folder; SIGTERM ends it through its clean-up, which removes that folder."""
    copy = tmp_path / "space"
    _copy_staged(staged, copy)
    shutil.rmtree(copy / "examples")
    with _served_app(copy, tmp_path, TASKS_FILE=str(FIXTURE / "tasks.json")):
        gathered = list((tmp_path / "tmp").glob("featcal-space-examples-*"))
        assert len(gathered) == 1 and sorted(p.name for p in gathered[0].iterdir()) == ["t0.png", "t1.png", "t2.png"]
    assert not gathered[0].exists()


class HubDouble(BaseHTTPRequestHandler):
    """Answers huggingface_hub's push requests like the Hub does, and records them."""

    calls: list[tuple[str, str, object]] = []

    def log_message(self, *args) -> None:
        pass

    def _base(self) -> str:
        return f"http://{self.headers['Host']}"

    def _reply(self, body: object, status: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self.calls.append(("GET", self.path, None))
        if self.path.startswith("/api/whoami-v2"):
            return self._reply({"name": "me", "orgs": [], "auth": {"accessToken": {"role": "write"}}})
        if "/tree/" in self.path:
            return self._reply(
                [
                    {"type": "file", "path": "featcal/old_module.py", "size": 3, "oid": "0" * 40},
                    {"type": "file", "path": "notes.md", "size": 3, "oid": "1" * 40},
                ]
            )
        self._reply({"error": "not found"}, 404)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if "/commit/" in self.path:
            lines = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
            self.calls.append(("POST", self.path, lines))
            return self._reply({"commitUrl": f"{self._base()}/spaces/me/tiny-space/commit/abc", "commitOid": "a" * 40})
        body = json.loads(raw or b"{}")
        self.calls.append(("POST", self.path, body))
        if self.path == "/api/repos/create":
            return self._reply({"url": f"{self._base()}/spaces/me/tiny-space"})
        if "/preupload/" in self.path:
            return self._reply(
                {"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False} for f in body["files"]]}
            )
        if self.path == "/api/validate-yaml":
            return self._reply({"errors": [], "warnings": []})
        self._reply({"error": "not found"}, 404)


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    HubDouble.calls = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubDouble)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_push_creates_a_gradio_space_and_commits_the_staged_files(hub, tmp_path):
    result = push_space(
        "me/tiny-space",
        model_id="me/tiny-model",
        tasks_file=FIXTURE / "tasks.json",
        token="hf_test_token",
        endpoint=hub,
        output=tmp_path / "space",
        progress=False,
    )
    create = next(body for method, path, body in HubDouble.calls if path == "/api/repos/create")
    assert create["type"] == "space" and create["sdk"] == "gradio" and create["name"] == "tiny-space"
    # One commit on main: the staged Space holds fewer files than huggingface_hub puts in a commit (256).
    commits = [(path, body) for method, path, body in HubDouble.calls if "/commit/" in path]
    assert [p for p, _ in commits] == ["/api/spaces/me/tiny-space/commit/main"]
    commit = commits[0][1]
    sent = {
        line["value"]["path"]: base64.b64decode(line["value"]["content"]) for line in commit if line["key"] == "file"
    }
    assert sorted(sent) == [f.path_in_repo for f in result.files]
    assert json.loads(sent["space_config.json"])["model_id"] == "me/tiny-model"
    # Stale files in folders the push owns are removed; the owner's other files are left alone.
    assert [line["value"]["path"] for line in commit if line["key"] == "deletedFile"] == ["featcal/old_module.py"]
    assert result.commit_url.endswith("/commit/abc") and "tiny-space" in result.space_url


def _cli(argv: list[str], monkeypatch) -> int:
    if "featcal.cli.space" not in featcal.cli.COMMAND_MODULES:
        monkeypatch.setattr(featcal.cli, "COMMAND_MODULES", (*featcal.cli.COMMAND_MODULES, "featcal.cli.space"))
    return featcal.cli.main(argv)


def test_cli_dry_run_lists_the_files(monkeypatch, capsys):
    assert _cli(["-q", "space", "push", "--repo", "me/demo", "--dry-run", "--no-examples"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert "Dry run: would upload to the Space me/demo" in out
    for name in ("app.py", "requirements.txt", "README.md", "space_config.json", "featcal/space/model.py"):
        assert re.search(rf"^  {re.escape(name)} ", out, re.M), name


def test_cli_refuses_a_local_model_for_the_space(monkeypatch, capsys):
    assert _cli(["space", "push", "--repo", "me/demo", "--dry-run", "--model-id", str(MODEL)], monkeypatch) == 2
    assert "must be a Hub model id" in capsys.readouterr().err
    with pytest.raises(FeatcalError, match="needs a namespace"):
        push_space("demo", dry_run=True)


def test_cli_launch_options_reach_the_app(monkeypatch, tmp_path, device):
    seen = {}
    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path))

    def fake_launch(self, **kwargs):
        seen.update(kwargs, space=self)

    monkeypatch.setattr("featcal.space.Space.launch", fake_launch)
    code = _cli(
        [
            "-q",
            "space",
            "--model",
            str(MODEL),
            "--base-model-id",
            str(FIXTURE / "base"),
            "--tasks-file",
            str(FIXTURE / "tasks.json"),
            "--port",
            "7999",
            "--device",
            device,
        ],
        monkeypatch,
    )
    assert code == 0 and seen["port"] == 7999 and seen["host"] == "127.0.0.1" and seen["share"] is False
    assert seen["space"].model.settings.model_id == str(MODEL)
    assert next(seen["space"].model.vision.parameters()).device.type == device
    seen["space"].close()


def test_push_checks_offline_mode_and_token_before_staging(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FeatcalError, match="HF_HUB_OFFLINE is set"):
        push_space("me/demo", token="hf_test_token", output=tmp_path / "space")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr("featcal.hub.publishing.get_token", lambda: None)
    with pytest.raises(FeatcalError, match="No Hugging Face token"):
        push_space("me/demo", output=tmp_path / "space")
    assert not (tmp_path / "space").exists()
