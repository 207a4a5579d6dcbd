"""Release faults: a release publishes no local path, and push refuses one that is not what export wrote.

Each refusal is checked through the CLI (`featcal push FOLDER --repo me/x --dry-run`): exit status 2,
one `featcal: error:` line naming the file, and the release folder left exactly as it was.
"""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

from featcal.cli import main
from featcal.errors import ReleaseError
from featcal.release import check_release, export_release, read_run, write_card
from featcal.release.export import stamp_safetensors
from featcal.release.manifest import MANIFEST, file_sha256, tensors_sha256
from featcal.release.published import published_config, published_ref
from featcal.runfolder.record import recipe_sha256
from tests.support.hub_double import Account, HubDouble, isolate_from_the_real_hub
from tests.support.release_runs import FIXTURE, make_run, ta8_config, tiny_config, with_run_id

REPO = "me/x"
TOKEN = "hf_test_write_token"
# An absolute path of a usual home, temporary or data folder, not inside a URL.
ABSOLUTE_PATH = re.compile(r"(?<![\w.:/])(~/|/(home|Users|root|tmp|var|private|mnt|media|work|data|opt|srv)/)")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    run, info = make_run(root)
    return root, run, export_release(run, repo_id=REPO)


@pytest.fixture
def release(exported, tmp_path) -> Path:
    """A copy of the export, free to damage."""
    return Path(shutil.copytree(exported[2], tmp_path / "release"))


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused_dry_run(folder: Path, capsys) -> str:
    """Run `featcal push FOLDER --dry-run`; check it exits 2 with one error line; return the line."""
    before = snapshot(folder)
    code = main(["-q", "push", str(folder), "--repo", REPO, "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("featcal: error: "), err
    assert snapshot(folder) == before, "the release folder changed"
    return lines[0]


def text_files(folder: Path) -> dict[str, str]:
    """Every text file of a release, and the weights' safetensors header (JSON)."""
    texts = {p.name: p.read_text(encoding="utf-8") for p in folder.iterdir() if p.suffix in {".md", ".json"}}
    raw = (folder / "model.safetensors").read_bytes()
    texts["model.safetensors header"] = raw[8 : 8 + int.from_bytes(raw[:8], "little")].decode()
    return texts


def recorded_files(folder: Path) -> dict[str, str]:
    return json.loads((folder / MANIFEST).read_text())["files"]


# --- the weights' content ------------------------------------------------------------------------


def edit_one_tensor_value(path: Path) -> str:
    """Change one float of one tensor in place: same size, same header and metadata byte for byte."""
    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + size])
    name = "vision_model.post_layernorm.weight"
    assert header[name]["dtype"] == "F32"
    at = 8 + size + header[name]["data_offsets"][0]
    assert struct.unpack("<f", raw[at : at + 4])[0] != 2.5
    raw[at : at + 4] = struct.pack("<f", 2.5)
    path.write_bytes(bytes(raw))
    return name


def test_weights_changed_in_place_are_refused_by_dry_run(release, capsys):
    weights = release / "model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        metadata = f.metadata()
    before = weights.read_bytes()
    header = 8 + int.from_bytes(before[:8], "little")
    edit_one_tensor_value(weights)
    after = weights.read_bytes()
    assert after[:header] == before[:header] and len(after) == len(before)  # header and metadata untouched
    assert after != before
    line = refused_dry_run(release, capsys)
    actual = tensors_sha256(weights)
    assert f"{weights}: its tensor data (sha256 {actual[:12]}) is not what `featcal export` wrote" in line
    assert f"(tensors_sha256 {metadata['tensors_sha256'][:12]} in its metadata)" in line
    assert actual != metadata["tensors_sha256"]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The local Hub protocol double (tests/support/hub_double.py), with no token from the environment."""
    isolate_from_the_real_hub(monkeypatch, tmp_path)
    with HubDouble() as double:
        double.add_token(TOKEN, Account("me"))
        yield double


def test_weights_changed_in_place_are_not_published(release, hub, capsys):
    edit_one_tensor_value(release / "model.safetensors")
    before = snapshot(release)
    code = main(["-q", "push", str(release), "--repo", REPO, "--token", TOKEN, "--endpoint", hub.url])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"featcal: error: {release / 'model.safetensors'}: its tensor data")
    assert hub.commits == [] and hub.repos == {} and hub.requests == []
    assert snapshot(release) == before


def test_the_tensor_hash_ignores_metadata_and_layout_but_not_values(release):
    weights = release / "model.safetensors"
    recorded = tensors_sha256(weights)
    stamp_safetensors(weights, {"note": "restamped"})  # rewrites the file: other header, same tensors
    assert tensors_sha256(weights) == recorded
    edit_one_tensor_value(weights)
    assert tensors_sha256(weights) != recorded


def test_weights_metadata_changed_by_hand_is_refused(release, capsys):
    weights = release / "model.safetensors"
    stamp_safetensors(weights, {"featcal_version": "9.9.9"})  # same tensors, other header
    line = refused_dry_run(release, capsys)
    assert f"{weights} differs from what `featcal export` wrote" in line
    assert f"recorded {recorded_files(release)['model.safetensors'][:12]} in {MANIFEST}" in line


# --- every file as export wrote it ---------------------------------------------------------------


def doctor_card(folder: Path) -> None:
    card = folder / "README.md"
    text = card.read_text()
    assert "**70.00**" in text
    card.write_text(text.replace("**70.00**", "**75.00**"))  # a better number, by hand


def doctor_metrics(folder: Path) -> None:
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["t0"]["accuracy"] = 0.75  # run_id unchanged: only the manifest can tell
    (folder / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")


def reindent(name: str):
    def change(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps(data, indent=4) + "\n")  # same content, other bytes

    return change


def doctor_config(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    config["layer_norm_eps"] = 1e-3  # still loads, computes something else
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def replace_plot(folder: Path) -> None:
    (folder / "results.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("README.md", doctor_card),
        ("metrics.json", doctor_metrics),
        ("run_config.json", reindent("run_config.json")),
        ("config.json", doctor_config),
        ("preprocessor_config.json", reindent("preprocessor_config.json")),
        ("results.png", replace_plot),
    ],
)
def test_a_file_changed_by_hand_is_refused(release, capsys, name, change):
    recorded = recorded_files(release)[name]
    change(release)
    line = refused_dry_run(release, capsys)
    actual = file_sha256(release / name)
    assert line == (
        f"featcal: error: {release / name} differs from what `featcal export` wrote (sha256 {actual[:12]}, "
        f"recorded {recorded[:12]} in {MANIFEST}): restore it, or rebuild the release with `featcal export RUN_FOLDER`"
        + (" (`featcal card RUN_FOLDER` regenerates the card)." if name == "README.md" else ".")
    )


@pytest.mark.parametrize("name", ["results.png", "preprocessor_config.json", MANIFEST])
def test_a_missing_file_is_refused(release, capsys, name):
    (release / name).unlink()
    line = refused_dry_run(release, capsys)
    assert line == (
        f"featcal: error: {release} is not a complete release: {name} missing; "
        "rebuild it with `featcal export RUN_FOLDER`."
    )


@pytest.mark.parametrize("extra", ["notes.txt", "checkpoints/old.safetensors"])
def test_an_extra_file_is_refused(release, capsys, extra):
    (release / extra).parent.mkdir(exist_ok=True)
    (release / extra).write_text("not from export")
    line = refused_dry_run(release, capsys)
    assert line == (
        f"featcal: error: {release} holds {extra}, which `featcal export` did not write (a push uploads every "
        "file of the folder): remove it, or rebuild the release with `featcal export RUN_FOLDER`."
    )


def test_hidden_files_are_not_uploaded_so_they_are_not_refused(release, capsys):
    (release / ".DS_Store").write_bytes(b"\0")
    assert main(["-q", "push", str(release), "--repo", REPO, "--dry-run"]) == 0
    assert ".DS_Store" not in capsys.readouterr().out


def test_a_damaged_manifest_is_refused(release, capsys):
    (release / MANIFEST).write_text("{not json")
    assert f"{release / MANIFEST} is not valid JSON" in refused_dry_run(release, capsys)
    (release / MANIFEST).write_text(json.dumps({"files": {}}))
    assert f"{release / MANIFEST} is not a featcal release manifest" in refused_dry_run(release, capsys)


def test_a_manifest_of_other_weights_is_refused(release, exported, tmp_path, capsys):
    other_run, _ = make_run(tmp_path / "other", calibrated=False)
    other = export_release(other_run, tmp_path / "other-release", repo_id=REPO)
    shutil.copyfile(other / MANIFEST, release / MANIFEST)
    line = refused_dry_run(release, capsys)
    assert f"{release / MANIFEST} describes other weights" in line


def test_a_card_regenerated_by_featcal_card_is_accepted(release, exported, capsys):
    _, run, _ = exported
    before = recorded_files(release)
    assert main(["-q", "card", str(run), "--output", str(release), "--repo", "me/renamed", "--license", "mit"]) == 0
    after = recorded_files(release)
    assert after["README.md"] == file_sha256(release / "README.md") != before["README.md"]
    assert {k: v for k, v in after.items() if k != "README.md"} == {k: v for k, v in before.items() if k != "README.md"}
    capsys.readouterr()
    assert main(["-q", "push", str(release), "--repo", "me/renamed", "--dry-run"]) == 0
    assert "release_manifest.json" in capsys.readouterr().out
    # and a hand edit of the regenerated card is refused again
    (release / "README.md").write_text((release / "README.md").read_text() + "\nEdited.\n")
    assert "README.md differs from what `featcal export` wrote" in refused_dry_run(release, capsys)


def test_featcal_card_refuses_to_write_into_the_release_of_another_run(release, tmp_path, capsys):
    other_run, _ = make_run(tmp_path / "other", calibrated=False)
    before = snapshot(release)
    code = main(["-q", "card", str(other_run), "--output", str(release)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert err.startswith(f"featcal: error: {release} holds the release of another run")
    assert snapshot(release) == before
    with pytest.raises(ReleaseError, match="release of another run"):
        write_card(other_run, release)


def test_re_exporting_the_same_run_gives_the_same_bytes(exported, tmp_path):
    _, run, release = exported
    again = export_release(run, tmp_path / "again", repo_id=REPO)
    assert snapshot(again) == snapshot(release)
    assert check_release(again).recipe_sha256 == read_run(run).recipe_sha256


# --- no local path in what is published ----------------------------------------------------------


def test_a_release_of_local_folders_publishes_no_absolute_path(exported):
    root, run, release = exported
    texts = text_files(release)
    assert set(texts) >= {"README.md", "run_config.json", "metrics.json", "config.json", "preprocessor_config.json"}
    local = {str(root), str(root.resolve()), str(FIXTURE), str(FIXTURE.resolve()), str(Path.home())}
    for name, text in texts.items():
        assert not [p for p in local if p in text], f"{name} names a local path"
        assert not ABSOLUTE_PATH.search(text), f"{name}: {ABSOLUTE_PATH.search(text)}"
    # the run folder keeps its full recipe: export and the Space find the base there
    assert json.loads((run / "run_config.json").read_text())["base_model_id"] == str(FIXTURE.resolve() / "base")


def test_the_published_recipe_names_local_inputs_by_folder(exported):
    _, run, release = exported
    published = json.loads((release / "run_config.json").read_text())
    assert published["base_model_id"] == "local:base"
    assert published["experts"] == {"t0": "local:t0", "t1": "local:t1", "t2": "local:t2"}
    assert {t: e["dataset"]["path"] for t, e in published["tasks_table"].items()} == {
        "t0": "local:t0",
        "t1": "local:t1",
        "t2": "local:t2",
    }
    # everything else is the run's recipe, and run_id still names the run
    original = json.loads((run / "run_config.json").read_text())
    assert published["run_id"] == original["run_id"] == read_run(run).recipe_sha256
    assert published["tasks_table"]["t0"]["classnames"] == original["tasks_table"]["t0"]["classnames"]
    assert {k: v for k, v in published.items() if k not in {"base_model_id", "experts", "tasks_table"}} == {
        k: v for k, v in original.items() if k not in {"base_model_id", "experts", "tasks_table"}
    }


def test_published_refs_keep_hub_ids_and_any_absolute_path_is_named_by_folder():
    hub_only = with_run_id(ta8_config())
    assert published_config(hub_only) == hub_only  # nothing local: the run's recipe as it is
    assert recipe_sha256(published_config(hub_only)) == hub_only["run_id"]
    config = with_run_id(tiny_config())
    config["base_model_id"] = "openai/clip-vit-base-patch32"
    config["merge"]["from"] = "/home/me/runs/old/ta/"
    config["notes"] = {"cache": "~/.cache/featcal", "windows": "C:\\Users\\me\\clip", "text": "a /home/ inside"}
    published = published_config(config)
    assert published["base_model_id"] == "openai/clip-vit-base-patch32"
    assert published["merge"]["from"] == "local:ta"
    assert published["notes"] == {"cache": "local:featcal", "windows": "local:clip", "text": "a /home/ inside"}
    assert config["merge"]["from"] == "/home/me/runs/old/ta/"  # the run's own recipe is not modified
    assert [published_ref(r) for r in (None, "", "ylecun/mnist", "./data/t0", "local:t0")] == [
        None,
        "",
        "ylecun/mnist",
        "local:t0",
        "local:t0",
    ]


def test_the_card_names_local_inputs_by_folder_and_its_snippet_loads_no_local_dataset(exported):
    _, _, release = exported
    card = (release / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]
    assert "load_dataset" not in snippet and "from datasets" not in snippet
    assert 'image = Image.open("path/to/image.png")' in snippet
    assert 'base_id = "base"  # a local folder in this run: use its Hub id' in snippet
    assert "| base model | `base` (local folder) |" in card
    assert "| t0 | `t0` (local folder) | `test` | 5 | `t0` (local folder) |" in card
    assert "`local:<folder name>`" in card


def test_the_full_recipe_in_place_of_the_published_one_is_refused(release, exported, capsys):
    _, run, _ = exported
    shutil.copyfile(run / "run_config.json", release / "run_config.json")  # same run_id, local paths
    line = refused_dry_run(release, capsys)
    assert f"{release / 'run_config.json'} is not the recipe of the weights" in line
    assert "recorded at export" in line


def test_the_space_finds_the_base_in_the_run_folder_not_in_the_published_recipe(exported):
    from featcal.space.model import base_model_ref, resolve_model_source
    from featcal.space.settings import SpaceSettings

    _, run, release = exported
    source = resolve_model_source(str(run))
    assert source.folder == release
    assert base_model_ref(SpaceSettings(model_id=str(run)), source) == str(FIXTURE.resolve() / "base")
    assert check_release(release).recipe_sha256 == read_run(run).recipe_sha256
