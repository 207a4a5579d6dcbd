"""The Hub's answers that users do meet, injected by the Hub protocol double (tests/support/hub_double.py).

Not the Hub: a server on 127.0.0.1 serving the tiny stand-ins of tests/support/hub_world.py under the
default ids. Each case runs `featcal run` (or `evaluate`) in a fresh process pointed at the double by
``HF_ENDPOINT``, with an empty ``HF_HOME``, and ends either in success (passing refusals, retried) or
in one ``featcal: error:`` line naming the repository and the fix; either way the run folder holds
nothing half-made and the caches hold no partial file a rerun would trust.

The happy path (download, offline rerun, recipe, push, Space) is tests/test_hub_rehearsal.py.
"""

from __future__ import annotations

import json

import pytest

from tests.support.hub_double import Account, HubDouble
from tests.support.hub_world import (
    DATASETS,
    SMALL,
    Config,
    build_world,
    cache_problems,
    error_line,
    featcal_cli,
    same_tensors,
    ta8_table,
    user_env,
    write_dataset,
)

pytestmark = pytest.mark.slow

BASE = "openai/clip-vit-base-patch32"
TOKEN = "hf_someone_read"


@pytest.fixture(scope="module")
def standins(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("standins"))


@pytest.fixture
def hub(standins):
    with HubDouble() as double:
        double.add_token(TOKEN, Account("someone", token_role="read"))
        standins.publish(double)
        yield double


def run(hub, home, *extra: str, env: dict | None = None):
    """The default command (no input flag but ``extra``), into ``home/run``."""
    return featcal_cli(["run", *SMALL, "--output-dir", str(home / "run"), *extra], env or user_env(hub.url, home))


@pytest.fixture(scope="module")
def passing_refusals(standins, tmp_path_factory):
    """A default run that meets 429s, 503s and one cut-off download, each once: its result and folder."""
    home = tmp_path_factory.mktemp("passing")
    with HubDouble() as hub:
        standins.publish(hub)
        faults = [
            # repo info: huggingface_hub asks once, featcal retries
            hub.fail("GET", f"/api/models/{BASE}/revision/main", 503),
            hub.fail("GET", "/api/datasets/tanganke/gtsrb/revision/*", 503),
            # listings, metadata and downloads: huggingface_hub retries itself
            hub.fail("GET", "/api/models/tanganke/clip-vit-base-patch32_sun397/tree/*", 429),
            hub.fail("HEAD", "/tanganke/clip-vit-base-patch32_svhn/resolve/*/config.json", 503),
            hub.fail("GET", "/cdn-lfs/models/tanganke/clip-vit-base-patch32_dtd/*", 429),
            # cut off once: huggingface_hub asks again
            hub.cut("/cdn-lfs/models/tanganke/clip-vit-base-patch32_mnist/*"),
        ]
        result = run(hub, home)
        return result, home, faults, list(hub.served)


def test_429_503_and_a_cut_once_are_retried_to_success(passing_refusals):
    result, home, faults, served = passing_refusals
    assert result.returncode == 0, result.stderr[-4000:]
    assert [f.hits for f in faults] == [1] * len(faults), "every fault was met"
    assert f"The Hub answered 503 for base model {BASE}; retrying in 1 s (retry 1 of 3)" in result.stderr
    assert "The Hub answered 503 for dataset tanganke/gtsrb; retrying" in result.stderr
    # the cut-off download was asked again (from the start: huggingface_hub resumes with a Range request
    # only past the bytes it has written, in 10 MB chunks, and these files are smaller) and completed
    mnist = [
        s
        for s in served
        if s.method == "GET" and s.path.startswith("/cdn-lfs/models/tanganke/clip-vit-base-patch32_mnist/")
    ]
    assert len(mnist) == 2 and mnist[0].sent < mnist[1].sent, mnist
    assert (home / "run" / "release" / "model.safetensors").is_file()
    assert cache_problems(home) == []


def test_a_download_cut_off_for_good_fails_cleanly_and_a_rerun_completes_it(hub, passing_refusals, tmp_path):
    mnist = "/cdn-lfs/models/tanganke/clip-vit-base-patch32_mnist/"
    hub.cut(f"{mnist}*", times=100)
    failed = run(hub, tmp_path)
    line = error_line(failed)
    assert "expert for task 'mnist'" in line and "tanganke/clip-vit-base-patch32_mnist" in line
    assert "the connection to the Hub broke off" in line and "run again" in line
    assert not (tmp_path / "run").exists()
    assert cache_problems(tmp_path) == []  # the partial file was removed, not left for a rerun to trust
    blobs = (tmp_path / "hf" / "hub").glob("models--tanganke--clip-vit-base-patch32_mnist/blobs/*")
    assert not [b for b in blobs if len(b.name) == 64], "no weights blob (named by its sha256) for the cut file"
    downloaded = {s.path for s in hub.served if s.path.startswith("/cdn-lfs/") and not s.path.startswith(mnist)}

    hub.clear_faults()
    before = len(hub.served)
    again = run(hub, tmp_path)
    assert again.returncode == 0, again.stderr[-4000:]
    fetched = {s.path for s in hub.served[before:] if s.path.startswith("/cdn-lfs/")}
    assert downloaded and not downloaded & fetched, "files downloaded before the cut are not fetched again"
    assert any(p.startswith(mnist) for p in fetched)
    _, reference, _, _ = passing_refusals
    assert same_tensors(
        tmp_path / "run" / "release" / "model.safetensors", reference / "run" / "release" / "model.safetensors"
    )
    assert cache_problems(tmp_path) == []


def test_a_gated_repository_is_one_line_naming_where_to_ask_for_access(hub, tmp_path):
    hub.repos[BASE].gated = True
    line = error_line(run(hub, tmp_path))
    assert line == (
        f"featcal: error: The base model '{BASE}' is a gated repository: ask for access at {hub.url}/{BASE} "
        "(accept its conditions), then log in with `hf auth login` or set HF_TOKEN to a token of that account."
    )
    assert ("HEAD", 401) in {(s.method, s.status) for s in hub.served}
    # logged in, but not granted access: the Hub answers 403, the advice is the same
    line = error_line(run(hub, tmp_path, env=user_env(hub.url, tmp_path, token=TOKEN)))
    assert "is a gated repository: ask for access" in line and ("HEAD", 403) in {
        (s.method, s.status) for s in hub.served
    }
    # a gated dataset
    hub.repos[BASE].gated = False
    hub.dataset_repos["tanganke/dtd"].gated = True
    line = error_line(featcal_cli(["evaluate", "--tasks", "dtd", *SMALL[:2]], user_env(hub.url, tmp_path)))
    assert line == (
        "featcal: error: Task 'dtd': The dataset 'tanganke/dtd' is a gated repository: ask for access at "
        f"{hub.url}/datasets/tanganke/dtd (accept its conditions), then log in with `hf auth login` or set "
        "HF_TOKEN to a token of that account."
    )
    assert not (tmp_path / "run").exists() and cache_problems(tmp_path) == []


def test_a_typo_in_an_id_is_one_line_naming_it(hub, tmp_path):
    line = error_line(run(hub, tmp_path, "--base-model-id", "openai/clip-vit-base-patch23"))
    assert line == (
        "featcal: error: The base model 'openai/clip-vit-base-patch23' is neither a local folder nor a Hub "
        "repository you can access (check the id, or log in with `hf auth login` for a private or gated one)."
    )
    line = error_line(run(hub, tmp_path, "--expert-model-format", "tanganke/clip-vit-base-patch32-{task}"))
    assert "The expert for task 'sun397' 'tanganke/clip-vit-base-patch32-sun397' is neither" in line
    assert ("GET", 404) in {(s.method, s.status) for s in hub.served}
    # a dataset id with a typo, in a tasks file
    entry = ta8_table()["tasks"]["dtd"] | {"dataset": {"path": "tanganke/dtdd"}}
    (tmp_path / "tasks.json").write_text(json.dumps({"tasks": {"textures": entry}}))
    args = ["evaluate", "--tasks-file", str(tmp_path / "tasks.json"), "--tasks", "textures", *SMALL[:2]]
    line = error_line(featcal_cli(args, user_env(hub.url, tmp_path)))
    assert line == (
        "featcal: error: Task 'textures': The dataset 'tanganke/dtdd' is not on the Hub, or not visible to you: "
        "check its id in the tasks file, or log in with `hf auth login` for a private or gated one."
    )
    assert not (tmp_path / "run").exists() and cache_problems(tmp_path) == []


def test_a_dataset_without_its_test_split_is_one_line_naming_task_and_split(hub, tmp_path):
    entry = ta8_table()["tasks"]["dtd"]
    (config,) = DATASETS["tanganke/dtd"]
    write_dataset(tmp_path / "dtd", (Config(config.name, config.folder, ("train",)),), entry["classnames"], seed=1)
    hub.publish_folder("tanganke/dtd", tmp_path / "dtd", repo_type="dataset", replace=True, summary="Drop test")
    line = error_line(run(hub, tmp_path, "--tasks", "dtd"))
    assert line == (
        "featcal: error: Task 'dtd': dataset 'tanganke/dtd' has no split 'test' "
        """(Unknown split "test". Should be one of ['train'].)."""
    )
    assert not (tmp_path / "run").exists() and cache_problems(tmp_path) == []
    recorded = hub.files("tanganke/dtd", repo_type="dataset")
    assert not [p for p in recorded if "test" in p]
