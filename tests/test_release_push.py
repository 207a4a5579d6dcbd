"""`featcal push` against a protocol double of the Hub (tests/support/hub_double.py), NOT the Hub.

The double is a local HTTP server on 127.0.0.1 that speaks the endpoints huggingface_hub's HfApi
uses for a push (whoami-v2, repos/create, repo info, branch, validate-yaml, preupload, LFS batch and
upload, NDJSON commit, tree). Nothing here talks to huggingface.co.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
from pathlib import Path

import huggingface_hub.constants
import pytest

from featcal.cli.release import register
from featcal.errors import FeatcalError
from featcal.release import export_release, push_release, write_card
from tests.support.hub_double import Account, HubDouble, isolate_from_the_real_hub
from tests.support.release_runs import make_run

TOKEN = "hf_test_write_token"
# huggingface_hub's LFS upload passes a file object as `data=`, which httpx2 deprecates: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture(autouse=True)
def hub_environment(monkeypatch, tmp_path):
    """No token from the environment or a stored login; online; LFS instead of Xet (see the double)."""
    isolate_from_the_real_hub(monkeypatch, tmp_path)


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    run, _ = make_run(tmp_path_factory.mktemp("push"))
    return export_release(run, repo_id="me/tiny-featcal")


@pytest.fixture
def hub():
    with HubDouble() as double:
        double.add_token(TOKEN, Account("me", orgs={"team": "write", "readers": "read"}))
        double.add_token("hf_read_only", Account("me", token_role="read"))
        yield double


def local_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_push_uploads_the_folder_byte_for_byte_in_one_commit(hub, release):
    result = push_release(release, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)
    received = hub.files("me/tiny-featcal")
    assert received.pop(".gitattributes")  # the Hub's own initial file
    assert received == local_files(release)
    assert len(hub.commits) == 1 and hub.commits[0].ref == "main"
    assert sorted(hub.commits[0].paths) == sorted(received)
    assert result.changed and result.commit_oid == hub.repos["me/tiny-featcal"].refs["main"]
    assert result.commit_url == f"{hub.url}/me/tiny-featcal/commit/{result.commit_oid}"
    assert not hub.repos["me/tiny-featcal"].private
    # large files went through LFS, and the card's metadata through validate-yaml
    assert set(hub.lfs_store) == {f.sha256() for f in result.files if f.path_in_repo.endswith((".safetensors", ".png"))}
    assert hub.validated_yaml == [(release / "README.md").read_text()]


def test_second_push_of_the_same_folder_makes_no_commit(hub, release):
    first = push_release(release, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)
    second = push_release(release, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)
    assert len(hub.commits) == 1
    assert not second.changed and second.commit_oid == first.commit_oid


def test_private_repo_branch_and_pull_request(hub, release, tmp_path):
    push_release(
        release,
        "team/tiny-featcal",
        token=TOKEN,
        endpoint=hub.url,
        private=True,
        revision="dev",
        commit_message="First release",
    )
    assert hub.repos["team/tiny-featcal"].private
    assert (hub.commits[-1].ref, hub.commits[-1].summary) == ("dev", "First release")
    assert set(hub.files("team/tiny-featcal", "main")) == {".gitattributes"}
    changed = Path(shutil.copytree(release, tmp_path / "release"))
    # a change made the way featcal allows: the card regenerated (its manifest entry follows)
    write_card(release.parent, changed, repo_id="team/tiny-featcal", license="apache-2.0")
    result = push_release(changed, "team/tiny-featcal", token=TOKEN, endpoint=hub.url, revision="dev", create_pr=True)
    assert result.changed and result.pr_url == f"{hub.url}/team/tiny-featcal/discussions/1"
    assert (hub.commits[-1].ref, sorted(hub.commits[-1].paths)) == ("refs/pr/1", ["README.md", "release_manifest.json"])
    assert hub.files("team/tiny-featcal", "refs/pr/1")["README.md"] == (changed / "README.md").read_bytes()


def test_token_from_env_and_from_stored_login(hub, release, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    push_release(release, "me/from-env", endpoint=hub.url)
    monkeypatch.delenv("HF_TOKEN")
    stored = tmp_path / "login" / "token"
    stored.parent.mkdir()
    stored.write_text(TOKEN)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(stored))
    push_release(release, "me/from-login", endpoint=hub.url)
    assert {c.repo_id for c in hub.commits} == {"me/from-env", "me/from-login"}


def test_dry_run_lists_files_without_contacting_the_hub(hub, release):
    result = push_release(release, "me/tiny-featcal", dry_run=True, endpoint=hub.url)
    assert result.dry_run and hub.requests == []
    assert {f.path_in_repo: f.size for f in result.files} == {k: len(v) for k, v in local_files(release).items()}


def test_push_from_a_run_folder_exports_when_missing(hub, tmp_path):
    run, _ = make_run(tmp_path)
    result = push_release(run, "me/from-run", token=TOKEN, endpoint=hub.url)
    assert result.folder == run / "release"
    received = hub.files("me/from-run")
    assert received["README.md"] == (run / "release" / "README.md").read_bytes()
    assert b'repo_id = "me/from-run"' in received["README.md"]


def test_re_exporting_the_same_run_and_pushing_again_is_a_no_op(hub, tmp_path):
    run, _ = make_run(tmp_path)
    first = push_release(run, "me/again", token=TOKEN, endpoint=hub.url)  # exports, then pushes
    export_release(run, repo_id="me/again")  # byte-identical: safetensors metadata keys are sorted
    second = push_release(run, "me/again", token=TOKEN, endpoint=hub.url)
    assert first.changed and not second.changed and len(hub.commits) == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "No Hugging Face token"),
        ({"token": "hf_wrong"}, "rejected the token"),
        ({"token": TOKEN, "repo_id": "someone/model"}, "belongs to someone else"),
        ({"token": "hf_read_only"}, "read-only"),
        ({"token": TOKEN, "repo_id": "readers/model"}, "cannot write to readers/model"),
        ({"token": TOKEN, "repo_id": "no-namespace"}, "needs a namespace"),
    ],
)
def test_refusals_publish_nothing(hub, release, kwargs, message):
    repo_id = kwargs.pop("repo_id", "me/tiny-featcal")
    with pytest.raises(FeatcalError, match=message) as err:
        push_release(release, repo_id, endpoint=hub.url, **kwargs)
    assert hub.commits == [] and hub.repos == {} and hub.lfs_store == {}
    assert "hf_" not in str(err.value)  # the token never shows up in a message


def test_existing_repo_the_token_cannot_write_gets_no_commit(hub, release):
    hub.add_token("hf_owner", Account("readers"))
    push_release(release, "readers/model", token="hf_owner", endpoint=hub.url)
    with pytest.raises(FeatcalError, match=r"cannot write to readers/model \(403"):
        push_release(release, "readers/model", token=TOKEN, endpoint=hub.url, commit_message="should not land")
    assert len(hub.commits) == 1 and hub.commits[0].summary != "should not land"


def test_incomplete_release_publishes_nothing(hub, release, tmp_path):
    broken = Path(shutil.copytree(release, tmp_path / "broken"))
    (broken / "metrics.json").unlink()
    with pytest.raises(FeatcalError, match="metrics.json missing"):
        push_release(broken, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)
    metrics = json.loads((release / "metrics.json").read_text())
    (broken / "metrics.json").write_text(json.dumps({**metrics, "run_id": "0" * 64}))
    with pytest.raises(FeatcalError, match="does not describe the weights"):
        push_release(broken, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)
    with pytest.raises(FeatcalError, match="is neither a release folder"):
        push_release(tmp_path, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_offline_mode_publishes_nothing(hub, release, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FeatcalError, match="HF_HUB_OFFLINE is set"):
        push_release(release, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)
    assert hub.requests == []


def test_unreachable_endpoint_is_a_clear_error(release):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(FeatcalError, match=f"Cannot reach the Hub at http://127.0.0.1:{port}"):
        push_release(release, "me/tiny-featcal", token=TOKEN, endpoint=f"http://127.0.0.1:{port}")


def test_a_hub_listing_that_differs_from_what_was_sent_is_reported(hub, release, monkeypatch):
    original = hub.commit

    def lossy_commit(repo_id, repo, rev, create_pr, body):  # the double "loses" the card
        kept = b"\n".join(line for line in body.splitlines() if b'"README.md"' not in line)
        return original(repo_id, repo, rev, create_pr, kept)

    monkeypatch.setattr(hub, "commit", lossy_commit)
    with pytest.raises(FeatcalError, match="differs from the release folder: README.md is missing"):
        push_release(release, "me/tiny-featcal", token=TOKEN, endpoint=hub.url)


def cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="featcal")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_push_prints_the_commit_url_and_never_the_token(hub, release, capsys):
    assert cli("push", str(release), "--repo", "me/tiny-featcal", "--token", TOKEN, "--endpoint", hub.url) == 0
    out = capsys.readouterr()
    commit = hub.commits[0]
    assert f"Commit: {hub.url}/me/tiny-featcal/commit/{commit.oid}" in out.out
    assert "sizes and hashes match" in out.out
    assert TOKEN not in out.out + out.err
    assert cli("push", str(release), "--repo", "me/tiny-featcal", "--token", TOKEN, "--endpoint", hub.url) == 0
    assert "nothing to commit" in capsys.readouterr().out


def test_cli_dry_run_lists_files_and_sizes(release, capsys):
    assert cli("push", str(release), "--repo", "me/tiny-featcal", "--dry-run") == 0
    out = capsys.readouterr().out
    size = (release / "model.safetensors").stat().st_size
    assert out.startswith(f"Dry run: would upload {release} to me/tiny-featcal:")
    assert "model.safetensors" in out and f"{size:,d} bytes" in out
