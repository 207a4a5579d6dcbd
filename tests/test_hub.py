"""featcal.hub, the one Hub layer: the local-or-Hub rule, the publishers' shared client and errors.

The Hub here is the protocol double of tests/support/hub_double.py on 127.0.0.1, never huggingface.co.
"""

from __future__ import annotations

from pathlib import Path

import huggingface_hub.constants
import pytest

import featcal.cli
import featcal.cli.release
import featcal.cli.space
from featcal.data import load_dataset_split
from featcal.errors import DatasetInputError, HubError, InvalidParameterError, ModelInputError
from featcal.hub import HubFile, check_repo_id, is_hub_id, local_files, local_path, resolve_model_folder
from featcal.release import export_release, push_release
from featcal.space.publish import push_space
from tests.support.hub_double import Account, HubDouble
from tests.support.release_runs import make_run

TOKEN = "hf_test_write_token"
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture
def online(monkeypatch, tmp_path):
    """No token from the environment or a stored login, and HF_HUB_OFFLINE unset (conftest sets it)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no-login" / "token"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)


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


def test_every_caller_uses_the_rule(places, tmp_path):
    from featcal.release import card, export
    from featcal.space import examples, model, publish
    from featcal.tasks import load_task_file

    for module in (card, export, model, publish, examples):
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
