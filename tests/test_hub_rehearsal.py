"""The user's real path, rehearsed over HTTP against the Hub protocol double (tests/support/hub_double.py).

Not the Hub: a server on 127.0.0.1 serving tiny stand-ins (tests/support/hub_world.py) under the ids
featcal uses by default: ``openai/clip-vit-base-patch32``, ``tanganke/clip-vit-base-patch32_<task>``
and the eight datasets of ``featcal/resources/ta8_tasks.json``. Each command runs as a user would run
it, in a fresh process whose only link to the double is ``HF_ENDPOINT``, with an empty ``HF_HOME``:

1. ``featcal run`` with no input flag downloads everything, merges, calibrates, evaluates, exports;
2. the same command with ``HF_HUB_OFFLINE=1`` runs from the cache alone, to identical weights;
3. ``featcal run --recipe recipes/wudi-featcal-b32-ta8.yaml`` does the same for the named release;
4. ``featcal push`` publishes it, and ``CLIPVisionModel.from_pretrained`` loads it back over HTTP;
5. ``featcal space push`` publishes the Space, and ``featcal space --model`` serves the published
   model from the pushed files, answering one ``/predict`` call;
6. after the Hub's repositories move on, a run pinned to the commits the first run recorded
   (``namespace/name@commit``, ``revision`` in a tasks file) reads those commits again.

The Hub's refusals (429, 503, gated, 404, a missing split, a cut-off download) are in
tests/faults/test_hub_faults.py.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.hub_double import Account, HubDouble
from tests.support.hub_world import (
    PLACEHOLDER_WEIGHTS,
    REPO_ROOT,
    SMALL,
    build_world,
    cache_problems,
    featcal_cli,
    same_tensors,
    ta8_table,
    tensors,
    user_env,
)

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")]

TOKEN = "hf_yanggangu_write"
RELEASE_REPO = "yanggangu/wudi-featcal-b32-ta8"
SPACE_REPO = "yanggangu/featcal-ta8"
RECIPE = REPO_ROOT / "recipes" / "wudi-featcal-b32-ta8.yaml"
TIMINGS: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def report_timings(pytestconfig):
    """After the module, one line of what it measured (docs/reliability.md records it)."""
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and TIMINGS:
        reporter.write_line("Hub rehearsal: " + ", ".join(f"{k} {v:.1f}" for k, v in TIMINGS.items()))


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("standins"))


@pytest.fixture(scope="module")
def hub(standins):
    with HubDouble() as double:
        double.add_token(TOKEN, Account("yanggangu"))
        standins.publish(double)
        yield double


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    """The user's HF_HOME and caches, empty before the first run, shared by the runs of this module."""
    return tmp_path_factory.mktemp("user")


def timed(name: str, args: list[str], env: dict[str, str], **kwargs):
    start = time.perf_counter()
    result = featcal_cli(args, env, **kwargs)
    TIMINGS[name] = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def online(hub, home):
    """`featcal run` with no input flag, from an empty HF_HOME."""
    run = home / "run"
    before = len(hub.served)
    result = timed("online run", ["run", *SMALL, "--output-dir", str(run)], user_env(hub.url, home))
    return run, result, hub.served[before:]


def test_a_default_run_downloads_every_standin_and_exports(online, hub, home, standins):
    run, result, served = online
    fetched = {s.path for s in served if s.method == "GET" and s.status == 200}
    table = ta8_table()
    # every model: its info, its listing, its files (safetensors through the CDN redirect)
    for repo_id in standins.models:
        assert f"/api/models/{repo_id}/revision/main" in fetched
        assert any(p.startswith(f"/{repo_id}/resolve/") and p.endswith("/config.json") for p in fetched)
        assert any(p.startswith(f"/cdn-lfs/models/{repo_id}/") for p in fetched), repo_id
    # every dataset: its card, then the parquet files of the configuration the table names
    for entry in table["tasks"].values():
        repo_id, config = entry["dataset"]["path"], entry["dataset"]["name"]
        assert any(p.startswith(f"/datasets/{repo_id}/resolve/") and p.endswith("/README.md") for p in fetched)
        parquet = [s.path for s in served if s.method == "HEAD" and s.path.endswith(".parquet") and repo_id in s.path]
        assert parquet, repo_id
        if config:  # only that configuration's files
            assert all(f"/{config}/" in p for p in parquet), parquet
    # never a pickle nor another framework's weights
    assert not [s for s in served if s.path.endswith(tuple(PLACEHOLDER_WEIGHTS))]
    assert (run / "release" / "model.safetensors").is_file() and (run / "featcal-ta" / "model.safetensors").is_file()
    recorded = json.loads((run / "run_config.json").read_text())
    assert recorded["base_model_id"] == table["base_model"] and recorded["tasks"] == list(table["tasks"])
    assert recorded["experts"] == {t: e["expert"] for t, e in table["tasks"].items()}
    assert recorded["hub_commits"] == head_commits(hub, table)  # every input, at the commit it was read at
    assert cache_problems(home) == []
    files = [s for s in served if s.method == "GET" and ("/resolve/" in s.path or s.path.startswith("/cdn-lfs/"))]
    TIMINGS["requests"] = len(served)
    TIMINGS["files downloaded"] = len(files)
    TIMINGS["MB downloaded"] = sum(s.sent for s in files) / 1e6


def test_the_same_run_offline_uses_the_cache_alone_with_identical_weights(online, hub, home):
    run, _, _ = online
    again = home / "run-offline"
    before = len(hub.served)
    timed("offline run", ["run", *SMALL, "--output-dir", str(again)], user_env(hub.url, home, offline=True))
    assert hub.served[before:] == [], "the offline run asked the Hub"
    for stage in ("ta", "featcal-ta", "release"):
        assert same_tensors(run / stage / "model.safetensors", again / stage / "model.safetensors"), stage
    assert json.loads((run / "featcal-ta" / "metrics.json").read_text()) == json.loads(
        (again / "featcal-ta" / "metrics.json").read_text()
    )
    assert json.loads((again / "run_config.json").read_text())["hub_commits"] == head_commits(hub, ta8_table())


def head_commits(hub: HubDouble, table: dict) -> dict[str, dict[str, str]]:
    """The commit on ``main`` of each model (by id) and each task's dataset (by task) the table names."""
    refs = [table["base_model"], *(e["expert"] for e in table["tasks"].values())]
    models = {ref: hub.store("model")[ref].refs["main"] for ref in refs}
    datasets = {t: hub.store("dataset")[e["dataset"]["path"]].refs["main"] for t, e in table["tasks"].items()}
    return {"models": models, "datasets": datasets}


@pytest.fixture(scope="module")
def recipe_run(online, hub, home) -> Path:
    """The named release's recipe, sizes cut down the same way; the cache already holds the downloads."""
    run = home / "wudi-featcal-b32-ta8"
    timed("recipe run", ["run", "--recipe", str(RECIPE), *SMALL, "--output-dir", str(run)], user_env(hub.url, home))
    return run


def test_the_release_recipe_runs_from_the_hub(recipe_run):
    recorded = json.loads((recipe_run / "run_config.json").read_text())
    assert recorded["merge"]["method"] == "wudi" and recorded["featcal"]["lambda_ratio"] == 0.05
    assert (recipe_run / "featcal-wudi" / "model.safetensors").is_file()
    assert (recipe_run / "release" / "model.safetensors").is_file()


@pytest.fixture(scope="module")
def pushed(recipe_run, hub, home):
    timed("push", ["push", str(recipe_run), "--repo", RELEASE_REPO], user_env(hub.url, home, token=TOKEN))
    return recipe_run / "release"


def test_push_then_from_pretrained_loads_it_back_over_http(pushed, hub, tmp_path):
    received = hub.files(RELEASE_REPO)
    assert received["model.safetensors"] == (pushed / "model.safetensors").read_bytes()
    loaded = tmp_path / "loaded.safetensors"
    script = (
        "import sys; from transformers import CLIPVisionModel; from safetensors.torch import save_file\n"
        f"model = CLIPVisionModel.from_pretrained({RELEASE_REPO!r})\n"
        "save_file({k: v.contiguous() for k, v in model.state_dict().items()}, sys.argv[1])\n"
    )
    env = user_env(hub.url, tmp_path / "reader")  # another user, another empty cache, no token
    before = len(hub.served)
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script, str(loaded)], env=env, capture_output=True, text=True)
    TIMINGS["from_pretrained"] = time.perf_counter() - start
    assert result.returncode == 0, result.stderr[-3000:]
    assert any(s.path.startswith(f"/{RELEASE_REPO}/resolve/") for s in hub.served[before:])
    released, back = tensors(pushed / "model.safetensors"), tensors(loaded)
    assert released.keys() == back.keys() and all(released[k].equal(back[k]) for k in released)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_space_push_then_featcal_space_serves_the_published_model(pushed, hub, home, standins, tmp_path):
    gradio_client = pytest.importorskip("gradio_client")
    before = len(hub.served)
    timed("space push", ["space", "push", "--repo", SPACE_REPO], user_env(hub.url, home, token=TOKEN))
    assert any(s.status == 206 for s in hub.served[before:]), "the examples are streamed with Range reads"
    files = hub.files(SPACE_REPO, repo_type="space")
    tasks = list(ta8_table()["tasks"])
    assert {f"examples/{t}.png" for t in tasks} <= set(files), "an example image per task, from its test split"
    assert json.loads(files["space_config.json"])["model_id"] == RELEASE_REPO
    # The pushed files, served by `featcal space` as a new user would from a checkout of the Space.
    space = tmp_path / "space"
    for path, data in files.items():
        (space / path).parent.mkdir(parents=True, exist_ok=True)
        (space / path).write_bytes(data)
    port = _free_port()
    args = ["space", "--model", RELEASE_REPO, "--device", "cpu", "--port", str(port)]
    env = user_env(hub.url, tmp_path / "visitor")
    env["TMPDIR"] = str(tmp_path / "visitor-tmp")
    (tmp_path / "visitor-tmp").mkdir()
    log = (tmp_path / "space.log").open("w")
    start = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "featcal", *args], cwd=space, env=env, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 150
        while True:
            try:
                client = gradio_client.Client(f"http://127.0.0.1:{port}/", verbose=False)
                break
            except Exception:
                if server.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"featcal space did not start:\n{(tmp_path / 'space.log').read_text()[-3000:]}")
                time.sleep(0.5)
        image = space / "examples" / "mnist.png"
        reply = client.predict(gradio_client.handle_file(str(image)), "all", 3, True, api_name="/predict")
        TIMINGS["space start and one /predict"] = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
    assert reply["error"] is None and list(reply["results"]) == tasks
    assert server.returncode == 128 + signal.SIGTERM, "a stop request ends `featcal space` through its clean-up"
    assert not list((tmp_path / "visitor-tmp").glob("featcal-space-*")), "the temporary example folder is removed"
    # The numbers are those of the released weights beside the stand-in base, computed here from folders.
    from PIL import Image

    from featcal.space import SpaceModel, SpaceSettings

    settings = SpaceSettings(
        model_id=str(pushed),
        base_model_id=str(standins.models[ta8_table()["base_model"]]),
        device="cpu",
        heads_cache=str(tmp_path / "heads"),
    )
    expected = SpaceModel(settings, progress=False).top_classes(Image.open(image), ["mnist"], 3)
    assert reply["results"]["mnist"]["model"] == pytest.approx(expected["mnist"], abs=2e-6)


def test_a_run_pinned_to_recorded_commits_reads_them_after_the_hub_moves_on(online, hub, home, tmp_path):
    """Runs last: it adds a commit to the base's and MNIST's repositories."""
    run, _, _ = online
    table = ta8_table()
    recorded = json.loads((run / "run_config.json").read_text())["hub_commits"]
    base, mnist = table["base_model"], table["tasks"]["mnist"]
    old_base, old_mnist = recorded["models"][base], recorded["datasets"]["mnist"]
    new_base = hub.publish(base, {"NOTES.md": b"a later commit"})
    new_mnist = hub.publish(mnist["dataset"]["path"], {"NOTES.md": b"a later commit"}, repo_type="dataset")
    pins = tmp_path / "pinned.json"
    pinned_entry = {**mnist, "dataset": {**mnist["dataset"], "revision": old_mnist}}
    pins.write_text(json.dumps({"tasks": {"mnist": pinned_entry}}))
    again = tmp_path / "pinned-run"
    args = ["run", *SMALL, "--tasks", "mnist", "--tasks-file", str(pins), "--base-model-id", f"{base}@{old_base}"]
    before = len(hub.served)
    timed("pinned run", [*args, "--no-export", "--output-dir", str(again)], user_env(hub.url, home))
    commits = json.loads((again / "run_config.json").read_text())["hub_commits"]
    assert commits["models"][f"{base}@{old_base}"] == old_base and commits["datasets"] == {"mnist": old_mnist}
    asked = [s.path for s in hub.served[before:]]
    assert not [p for p in asked if new_base in p or new_mnist in p], "a pinned run asked for the new commits"
