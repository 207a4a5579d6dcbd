"""Release faults: a release publishes no local path, and push refuses one that is not what export wrote.

Each refusal is checked through the CLI (`featcal push FOLDER --repo me/x --dry-run`): exit status 2,
one `featcal: error:` line naming the file, and the release folder left exactly as it was.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from featcal.cli import main
from featcal.release import check_release, export_release, read_run
from featcal.release.published import published_config, published_ref
from featcal.runfolder import recipe_sha256
from tests.support.release_runs import FIXTURE, make_run, ta8_config, tiny_config, with_run_id

REPO = "me/x"
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
