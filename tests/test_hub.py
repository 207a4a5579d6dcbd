"""featcal.hub, the one Hub layer: the local-or-Hub rule, the publishers' shared client and errors.

The Hub here is the protocol double of tests/support/hub_double.py on 127.0.0.1, never huggingface.co.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import featcal.cli
import featcal.cli.release
import featcal.cli.space
import featcal.hub
import featcal.hub.retries
from featcal.data import load_dataset_split
from featcal.errors import DatasetInputError, HubError, InvalidParameterError, ModelInputError
from featcal.hub.downloads import download_failure, resolve_model_folder, snapshot_commit
from featcal.hub.refs import check_repo_id, is_hub_id, local_path, split_revision
from featcal.hub.retries import retry_transient
from featcal.hub.verification import HubFile, local_files
from featcal.release import export_release, push_release
from featcal.space.publish import push_space
from tests.support.hub_double import Account, HubDouble, isolate_from_the_real_hub
from tests.support.release_runs import make_run

TOKEN = "hf_test_write_token"
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture
def online(monkeypatch, tmp_path):
    """No token from the environment or a stored login, and HF_HUB_OFFLINE unset (conftest sets it)."""
    isolate_from_the_real_hub(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    run, _ = make_run(tmp_path_factory.mktemp("hub"))
    return export_release(run, repo_id="me/tiny-featcal")


# -- one rule: local folder or Hub id -----------------------------------------------------------


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A working directory holding ``here/model`` and ``ns/local``, and a root holding ``data/t0``."""
    cwd, root = tmp_path / "cwd", tmp_path / "root"
    for folder in (cwd / "here" / "model", cwd / "ns" / "local", root / "data" / "t0"):
        folder.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    return cwd, root


@pytest.mark.parametrize(
    ("ref", "with_root", "expected", "hub"),
    [
        # Absolute, ./, ../ and ~ are local whether or not they exist; a root does not change them.
        ("/nowhere/model", False, "/nowhere/model", False),
        ("/nowhere/model", True, "/nowhere/model", False),
        ("./missing", False, "missing", False),
        ("../missing", False, "../missing", False),
        ("~/models/clip", False, "~/models/clip", False),
        ("~/models/clip", True, "~/models/clip", False),
        # An existing folder is local, even one that looks like a Hub id.
        ("here/model", False, "here/model", False),
        ("ns/local", False, "ns/local", False),
        # Relative references resolve against the root first; ./ and ../ always do.
        ("data/t0", True, "{root}/data/t0", False),
        ("./missing", True, "{root}/missing", False),
        ("../missing", True, "{tmp}/missing", False),
        ("here/model", True, "here/model", False),  # not under the root, but existing here
        # Anything else is a Hub id when the Hub accepts it as a repository id.
        ("openai/clip-vit-base-patch32", False, None, True),
        ("openai/clip-vit-base-patch32", True, None, True),
        ("data/t0", False, None, True),  # exists under the root only: without it, a Hub id
        ("gpt2", False, None, True),  # a legacy id without a namespace
        ("no//good", False, None, False),
        ("a/b/c", True, None, False),
        (".hidden", False, None, False),
        ("", False, None, False),
        (None, False, None, False),
        # A Hub id may be pinned to a branch, tag or commit; a local folder's '@' is part of its name.
        ("openai/clip-vit-base-patch32@v1.0", False, None, True),
        ("openai/clip-vit-base-patch32@" + "ab" * 20, False, None, True),
        ("./models/clip@v1", False, "models/clip@v1", False),
        ("no//good@v1", False, None, False),
    ],
)
def test_one_rule_decides_local_or_hub(places, ref, with_root, expected, hub):
    cwd, root = places
    root_arg = root if with_root else None
    if expected is not None:
        anchored = "{" in expected  # found under the root: returned resolved
        expected = Path(expected.format(root=root, tmp=root.parent)).expanduser()
        expected = expected.resolve() if anchored else expected
    assert local_path(ref, root_arg) == expected
    assert is_hub_id(ref, root_arg) is hub


@pytest.mark.parametrize(
    ("ref", "split"),
    [
        ("ns/name@v1.0", ("ns/name", "v1.0")),
        ("ns/name@refs/pr/3", ("ns/name", "refs/pr/3")),
        ("ns/name@" + "0" * 40, ("ns/name", "0" * 40)),
        ("ns/name", ("ns/name", None)),
        ("ns/name@", ("ns/name@", None)),  # no revision after the '@': not a pin (and no valid id)
        ("ns/name@a b", ("ns/name@a b", None)),
        ("./here/x@v1", ("./here/x@v1", None)),  # local: never split
        ("/abs/x@v1", ("/abs/x@v1", None)),
    ],
)
def test_a_pinned_hub_id_splits_into_its_repository_and_revision(ref, split):
    assert split_revision(ref) == split


def test_a_snapshot_folder_names_the_commit_it_holds(tmp_path):
    commit = "0123456789abcdef" * 2 + "01234567"
    assert snapshot_commit(tmp_path / "models--ns--m" / "snapshots" / commit) == commit
    assert snapshot_commit(tmp_path / "snapshots" / "main") is None  # a branch name is no commit
    assert snapshot_commit(tmp_path / "model") is None


def test_every_caller_uses_the_rule(places, tmp_path):
    from featcal.release import card_template, export, folder_card, run_card
    from featcal.space import examples, model, publish
    from featcal.tasks import load_task_file

    for module in (card_template, run_card, folder_card, export, model, publish, examples):
        assert not hasattr(module, "is_hub_id") or module.is_hub_id is is_hub_id
    cwd, root = places
    (root / "tasks.yaml").write_text(
        "tasks:\n  t0:\n    dataset: data/t0\n    classnames: [a, b]\n    templates: ['{}']\n    expert: ns/remote\n"
    )
    task = load_task_file(root / "tasks.yaml").tasks["t0"]
    assert task.dataset.path == str((root / "data" / "t0").resolve()) and task.expert == "ns/remote"


def test_loaders_refuse_what_is_neither_local_nor_a_hub_id(tmp_path):
    with pytest.raises(ModelInputError, match="folder ./missing does not exist") as err:
        resolve_model_folder("./missing", what="base model")
    assert err.value.ref == "./missing"
    with pytest.raises(ModelInputError, match="neither an existing folder nor a Hub id") as err:
        resolve_model_folder("no//good")
    assert err.value.ref == "no//good"
    with pytest.raises(DatasetInputError, match="dataset folder .* does not exist") as err:
        load_dataset_split(str(tmp_path / "none"), "test", task="t9")
    assert (err.value.task, err.value.ref) == ("t9", str(tmp_path / "none"))


def test_repo_ids_are_checked_with_the_parameter_named():
    assert check_repo_id("gpt2") == "gpt2"
    with pytest.raises(InvalidParameterError, match="needs a namespace") as err:
        check_repo_id("gpt2", namespace=True)
    assert (err.value.name, err.value.value) == ("repo_id", "gpt2")
    assert "--" not in str(err.value)
    with pytest.raises(InvalidParameterError, match="not a valid Hub repository id") as err:
        check_repo_id("no//good", name="model_id")
    assert (err.value.name, err.value.value) == ("model_id", "no//good")


# -- both publishers go through the same client and errors --------------------------------------


def _refusal(call) -> HubError:
    with pytest.raises(HubError) as err:
        call()
    return err.value


def test_both_publishers_refuse_offline_mode_and_a_missing_token_alike(online, release, monkeypatch, tmp_path):
    def both():
        return (
            _refusal(lambda: push_release(release, "me/tiny-featcal", endpoint="http://127.0.0.1:9")),
            _refusal(lambda: push_space("me/tiny-featcal", endpoint="http://127.0.0.1:9", output=tmp_path / "s")),
        )

    released, space = both()  # no token anywhere
    assert str(released) == str(space) and "No Hugging Face token" in str(space)
    assert "`token`" in str(space) and "--token" not in str(space)
    assert released.repo_id == space.repo_id == "me/tiny-featcal"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    released, space = both()
    assert str(released) == str(space) and "HF_HUB_OFFLINE is set" in str(space)
    assert not (tmp_path / "s").exists()


def test_a_403_is_a_hub_error_with_the_repository_and_the_status(online, release):
    with HubDouble() as hub:
        hub.add_token(TOKEN, Account("me", orgs={"readers": "read"}))
        refusal = _refusal(lambda: push_release(release, "readers/model", token=TOKEN, endpoint=hub.url))
        assert (refusal.repo_id, refusal.status) == ("readers/model", 403)
        assert "cannot write to readers/model (403" in str(refusal)
        refusal = _refusal(lambda: push_release(release, "someone/model", token=TOKEN, endpoint=hub.url))
        assert (refusal.repo_id, refusal.status) == ("someone/model", None)  # refused before asking the Hub
        assert "`repo_id`" in str(refusal) and "me/model" in str(refusal)
        refusal = _refusal(lambda: push_release(release, "me/model", token="hf_wrong", endpoint=hub.url))
        assert refusal.status == 401 and "`token`" in str(refusal)
        assert hub.commits == []


def test_publishers_share_the_file_record_and_table(release, tmp_path):
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("bb")
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / ".env").write_text("secret")
    files = local_files(tmp_path)
    assert files == (HubFile("a.txt", tmp_path / "a.txt", 1), HubFile("sub/b.txt", tmp_path / "sub" / "b.txt", 2))
    assert push_release(release, "me/tiny-featcal", dry_run=True).files == local_files(release)
    assert featcal.cli.release.file_table is featcal.cli.space.file_table


# -- the CLI words the parameters as flags ------------------------------------------------------


def test_the_cli_names_flags_where_the_api_names_parameters(online, release, capsys):
    assert featcal.cli.main(["push", str(release), "--repo", "tiny", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--repo 'tiny' is invalid" in err and "needs a namespace" in err and "repo_id" not in err
    assert featcal.cli.main(["push", str(release), "--repo", "me/tiny", "--endpoint", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert "No Hugging Face token: pass --token," in err and "`token`" not in err


# -- passing refusals are retried; failed downloads are worded ----------------------------------


def _http_error(status: int, headers: dict[str, str] | None = None, cls=None):
    from huggingface_hub.errors import HfHubHTTPError

    try:
        import httpx2 as httpx
    except ImportError:  # huggingface_hub 1.x talks through httpx
        import httpx

    response = httpx.Response(status, headers=headers or {}, request=httpx.Request("GET", "http://127.0.0.1:9/api"))
    return (cls or HfHubHTTPError)(f"{status} error", response=response)


@pytest.fixture
def waits(monkeypatch) -> list[float]:
    """The waits of :func:`featcal.hub.retry_transient`, recorded instead of slept."""
    slept: list[float] = []
    monkeypatch.setattr(featcal.hub.retries.time, "sleep", slept.append)
    return slept


def test_passing_refusals_are_retried_then_succeed(waits, caplog):
    answers = [_http_error(503), _http_error(429), "done"]

    def call():
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert retry_transient(call, what="base model x/y") == "done"
    assert waits == [1.0, 2.0]
    assert "The Hub answered 503 for base model x/y; retrying in 1 s (retry 1 of 3)" in caplog.text


def test_a_refusal_behind_another_error_is_found_and_retried(waits):
    """snapshot_download turns a refused repository-information request into LocalEntryNotFoundError."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    def wrapped():
        try:
            raise _http_error(502)
        except Exception as exc:
            raise LocalEntryNotFoundError("An error happened while trying to locate the files") from exc

    with pytest.raises(LocalEntryNotFoundError) as caught:
        retry_transient(wrapped, what="x")
    assert waits == list(featcal.hub.RETRY_WAITS), "retried, then the last error raised"
    assert "still answered 502" in download_failure(caught.value, "base model", "x/y")


def test_rate_limits_are_waited_for_up_to_the_cap(waits):
    limited = _http_error(429, {"RateLimit": '"api";r=0;t=7', "RateLimit-Policy": '"fixed window";"api";q=500;w=300'})
    calls = iter([limited, None])

    def call():
        error = next(calls)
        if error is not None:
            raise error
        return "ok"

    assert retry_transient(call, what="x") == "ok" and waits == [8.0]
    waits.clear()
    later = _http_error(429, {"Retry-After": "300"})
    with pytest.raises(type(later)):
        retry_transient(lambda: (_ for _ in ()).throw(later), what="x")
    assert waits == [], "a wait longer than MAX_RETRY_WAIT is not waited for"
    assert "asks to wait 301 s" in download_failure(later, "base model", "x/y")


def test_other_errors_are_not_retried(waits):
    from huggingface_hub.errors import RepositoryNotFoundError

    for error in (_http_error(404, cls=RepositoryNotFoundError), _http_error(401), ValueError("no")):
        with pytest.raises(type(error)):
            retry_transient(lambda error=error: (_ for _ in ()).throw(error), what="x")
    assert waits == []


def test_download_failures_are_worded_with_the_repository_and_the_fix():
    from huggingface_hub.errors import GatedRepoError, IncompleteSnapshotError

    try:
        from httpx2 import RemoteProtocolError
    except ImportError:
        from httpx import RemoteProtocolError

    gated = download_failure(_http_error(401, cls=GatedRepoError), "base model", "org/clip")
    assert gated.startswith("The base model 'org/clip' is a gated repository: ask for access at ")
    assert "/org/clip (accept its conditions)" in gated and "`hf auth login`" in gated
    assert "/datasets/org/data " in download_failure(
        _http_error(403, cls=GatedRepoError), "dataset", "org/data", repo_type="dataset"
    )
    cut = download_failure(RemoteProtocolError("peer closed connection"), "expert for task 'mnist'", "a/b")
    assert cut.startswith("Cannot download expert for task 'mnist' 'a/b': the connection to the Hub broke off")
    short = download_failure(OSError("Consistency check failed: file should be of size 9 but has size 4"), "m", "a/b")
    assert "broke off (Consistency check failed" in short
    partial = download_failure(
        IncompleteSnapshotError("2 file(s) are missing", snapshot_path="/x"), "base model", "a/b"
    )
    assert partial.startswith("Only part of base model 'a/b' is in the cache")
    assert download_failure(KeyError("x"), "m", "a/b") is None
