"""Releases of language-model folders: `featcal export DIR`, `featcal card DIR` and `featcal push REL`.

The models are two-layer Llamas of hidden size 64 with a word-level tokenizer, built in seconds
(``tests/support/tiny_decoder.py``), merged and calibrated by the commands a user runs, each expert's
calibration texts a local JSON-lines file. Pushes go to the Hub protocol double
(``tests/support/hub_double.py``), NOT the Hub.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file

from featcal.cli import main
from featcal.errors import ModelInputError, NoSpaceError, OutputPathError, ReleaseError
from featcal.files.hashing import config_hash, file_sha256
from featcal.release import export_release, push_release
from featcal.release import folder_release as folder_release_module
from featcal.release import push as push_module
from featcal.release.check import check_release
from featcal.release.manifest import read_manifest, tensors_sha256
from featcal.release.tensors import tensors_sha256_of
from tests.support.hub_double import Account, HubDouble, isolate_from_the_real_hub
from tests.support.hub_world import user_env
from tests.support.tiny_decoder import WORDS, save_model, texts, tokenizer

EXPERTS = ("math", "coding")
CALIBRATE = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
REPO = "me/tiny-lm-featcal"
TOKEN = "hf_test_write_token"
RELEASE_FILES = [
    "README.md",
    "config.json",
    "featcal_recipe.json",
    "generation_config.json",
    "model.safetensors",
    "release_manifest.json",
    "tokenizer.json",
    "tokenizer_config.json",
]
# huggingface_hub's LFS upload passes a file object as `data=`, which httpx2 deprecates: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


def _rows(seed: int, count: int = 10) -> list[dict[str, str]]:
    words = texts(seed, 2 * count)
    return [{"query": words[2 * i], "response": words[2 * i + 1]} for i in range(count)]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """A tiny Llama base (with its tokenizer and a generation config), two experts, their texts and the data file."""
    from transformers import GenerationConfig

    root = tmp_path_factory.mktemp("lm")
    base = save_model(root / "base", seed=0)
    tokenizer().save_pretrained(root / "base")
    GenerationConfig(max_new_tokens=4, pad_token_id=0).save_pretrained(root / "base")
    data = {"max_length": 16, "experts": {}}
    for i, name in enumerate(EXPERTS):
        expert = root / f"Llama-tiny_{name}"
        save_model(expert, seed=10 + i, base=base)
        tokenizer().save_pretrained(expert)
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(20 + i)))
        data["experts"][str(expert)] = {"dataset": f"{name}.jsonl", "text": "{query} {response}"}
    (root / "data.yaml").write_text(json.dumps(data))
    return root


@pytest.fixture(scope="module")
def merged(zoo) -> Path:
    out = zoo / "models" / "llama-tiny-ta"
    argv = ["-q", "merge", "--data", str(zoo / "data.yaml"), "--base-model-id", str(zoo / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def calibrated(zoo, merged) -> Path:
    out = zoo / "models" / "llama-tiny-ta-featcal"
    argv = ["-q", "calibrate", "--merged", str(merged), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--output", str(out)]) == 0
    return out


def snapshot(folder: Path) -> dict[str, tuple[bytes, int, int, int]]:
    """Every file of a folder: its bytes, mtime, mode and inode."""
    return {
        p.relative_to(folder).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns, p.stat().st_mode, p.stat().st_ino)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def release(calibrated) -> tuple[Path, dict]:
    """The calibrated folder's release at the default place, and the folder as it was before the export."""
    before = snapshot(calibrated)
    assert main(["-q", "export", str(calibrated), "--repo", REPO, "--license", "apache-2.0"]) == 0
    return calibrated.parent / f"{calibrated.name}-release", before


def run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# --- the recipe a calibration writes ------------------------------------------------------------------


def test_a_calibrated_folder_records_each_expert_s_calibration_data(zoo, calibrated) -> None:
    recipe = json.loads((calibrated / "featcal_recipe.json").read_text())
    assert recipe["calibration_data"] == {
        name: {
            "expert": str(zoo / f"Llama-tiny_{name}"),
            "dataset": str(zoo / f"{name}.jsonl"),
            "split": "train",
            "text": "{query} {response}",
            "weigh": "all",
            "max_length": 16,
            "examples": 8,
        }
        for name in EXPERTS
    }
    assert "mergekit_config" not in recipe  # featcal's own merge: its recipe says it all


# --- export -------------------------------------------------------------------------------------------


def test_export_writes_the_release_beside_the_folder_with_exactly_its_files(calibrated, release) -> None:
    out, _ = release
    assert sorted(p.name for p in out.iterdir()) == RELEASE_FILES
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")], "temporaries left behind"
    manifest = read_manifest(out)
    recorded = [name for name in RELEASE_FILES if name != "release_manifest.json"]
    assert manifest.files == {name: file_sha256(out / name) for name in recorded}
    assert manifest.recipe_sha256 == config_hash(json.loads((calibrated / "featcal_recipe.json").read_text()))
    assert manifest.tensors_sha256 == tensors_sha256(out / "model.safetensors")
    assert manifest.source == {"model_folder": "local:llama-tiny-ta-featcal", "kind": "calibration"}
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (calibrated / name).read_bytes()
    # the published recipe: the folder's, with every local input named by its folder name only
    published = json.loads((out / "featcal_recipe.json").read_text())
    assert published["base_model"] == "local:base"
    assert published["experts"] == {name: f"local:Llama-tiny_{name}" for name in EXPERTS}
    assert published["calibration_data"]["math"]["dataset"] == "local:math.jsonl"
    root = str(calibrated.parents[1])
    for name in RELEASE_FILES:
        if not name.endswith(".safetensors"):
            assert root not in (out / name).read_text(), f"{name} names a local path"


def test_the_release_loads_and_generates_like_the_calibrated_folder(calibrated, release) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    out, _ = release
    ids = AutoTokenizer.from_pretrained(out)(" ".join(WORDS[:5]), return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours = AutoModelForCausalLM.from_pretrained(out)(ids).logits
        theirs = AutoModelForCausalLM.from_pretrained(calibrated)(ids).logits
    assert torch.equal(ours, theirs)
    generated = pipeline("text-generation", model=str(out), device="cpu")(" ".join(WORDS[:3]), do_sample=False)
    assert generated[0]["generated_text"].startswith(" ".join(WORDS[:3]))


def test_weights_are_hard_links_and_the_model_folder_is_left_untouched(calibrated, release, tmp_path) -> None:
    out, before = release
    assert (out / "model.safetensors").stat().st_ino == (calibrated / "model.safetensors").stat().st_ino
    assert (out / "config.json").stat().st_ino != (calibrated / "config.json").stat().st_ino  # small files: copies
    assert snapshot(calibrated) == before  # bytes, mtime, permissions and inode of every file
    # exporting again over the release replaces it whole, and still writes nothing in the folder
    export_release(calibrated, repo_id=REPO, license="apache-2.0")
    assert snapshot(calibrated) == before
    assert (out / "model.safetensors").stat().st_ino == (calibrated / "model.safetensors").stat().st_ino


def test_weights_are_copied_across_file_systems(calibrated, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(folder_release_module, "same_file_system", lambda a, b: False)
    out = export_release(calibrated, tmp_path / "copied", repo_id=REPO)
    assert (out / "model.safetensors").stat().st_ino != (calibrated / "model.safetensors").stat().st_ino
    assert (out / "model.safetensors").read_bytes() == (calibrated / "model.safetensors").read_bytes()
    check_release(out)


def test_a_failed_link_falls_back_to_a_copy(calibrated, tmp_path, monkeypatch) -> None:
    import errno

    def no_link(source, target):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_link)
    out = export_release(calibrated, tmp_path / "copied", repo_id=REPO)
    assert (out / "model.safetensors").stat().st_nlink == 1
    check_release(out)


def test_too_little_free_space_is_refused_before_anything_is_written(calibrated, tmp_path, capsys, monkeypatch) -> None:
    from featcal.files import placing

    monkeypatch.setattr(folder_release_module, "same_file_system", lambda a, b: False)
    monkeypatch.setattr(placing.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100, 90, 10))
    out = tmp_path / "nested" / "release"
    code, err = run_error(capsys, ["export", str(calibrated), "--output", str(out)])
    size = (calibrated / "model.safetensors").stat().st_size
    assert code == 2 and len(err) == 1, err
    assert "Not enough free space for" in err[0] and str(out) in err[0] and "10 are free" in err[0]
    needed = int(err[0].split("it needs ")[1].split(" bytes")[0].replace(",", ""))
    assert needed > size
    assert not out.exists() and not (tmp_path / "nested").exists()
    with pytest.raises(NoSpaceError) as caught:
        export_release(calibrated, out)
    assert (caught.value.needed, caught.value.free) == (needed, 10)


def test_a_sharded_folder_is_released_with_its_index_and_every_shard_linked(calibrated, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(calibrated).save_pretrained(sharded, max_shard_size="100KB")
    for name in ("featcal_recipe.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(calibrated / name, sharded / name)
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert len(shards) > 2
    out = export_release(sharded, repo_id=REPO)
    assert out == tmp_path / "sharded-release"
    assert {p.name for p in out.glob("*.safetensors")} == set(shards)
    assert (out / "model.safetensors.index.json").is_file()
    assert all((out / s).stat().st_ino == (sharded / s).stat().st_ino for s in shards)
    # the tensors' hash does not depend on how they are sharded
    assert read_manifest(out).tensors_sha256 == tensors_sha256_of([calibrated / "model.safetensors"])
    assert check_release(out).recipe_sha256 == read_manifest(out).recipe_sha256
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(model.model.norm.weight, load_file(str(calibrated / "model.safetensors"))["model.norm.weight"])
    # a missing shard: refused at export and at push
    broken = tmp_path / "broken-release"
    shutil.copytree(out, broken)
    (broken / shards[1]).unlink()
    with pytest.raises(ReleaseError, match=f"{shards[1]} missing"):
        check_release(broken)
    (sharded / shards[1]).unlink()
    with pytest.raises(ModelInputError, match=rf"lacks the shard\(s\) {shards[1]}"):
        export_release(sharded, tmp_path / "again")
    assert not (tmp_path / "again").exists()


# --- the card -----------------------------------------------------------------------------------------


def test_the_card_metadata_names_the_model_s_kind_license_and_no_local_folder(release) -> None:
    out, _ = release
    card = ModelCard.load(out / "README.md")
    data = card.data
    assert (data.library_name, data.pipeline_tag, data.license, data.model_name) == (
        "transformers", "text-generation", "apache-2.0", REPO,
    )  # fmt: skip
    assert data.base_model is None and data.datasets is None  # every input was a local folder
    assert data.tags == ["merge", "featcal", "model-merging", "text-generation", "task-arithmetic"]
    text = card.text
    assert "`base` (local folder)" in text and "`Llama-tiny_math` (local folder)" in text
    assert "| lambda_ratio (λ) | `0.05` |" in text
    for symbol in ("(λ)", "(ρ)", "(α)", "(ε)", "| seed | `42` |"):
        assert symbol in text, symbol
    assert "training texts per task used for calibration" in text and "images" not in text
    data_rows = [line for line in text.splitlines() if line.startswith("| `Llama-tiny_")]
    assert data_rows == [
        f"| `Llama-tiny_{name}` (local folder) | `{name}.jsonl` (local file) | `train` | `{{query}} {{response}}` "
        "| `all` | 16 | 8 |"
        for name in EXPERTS
    ]
    assert "No result of this model folder was measured by featcal" in text and "lm_eval --model hf" in text
    assert "does not evaluate language models" not in text  # it does, in a run or `featcal evaluate`
    assert "task_arithmetic" in text and "merge_method: task_arithmetic" in text  # the merge in mergekit's words
    assert "none was given" not in text


def test_the_card_s_usage_snippet_runs_on_the_release(release, capsys) -> None:
    out, _ = release
    snippet = ModelCard.load(out / "README.md").text.split("```python\n")[1].split("```")[0]
    assert f'repo_id = "{REPO}"' in snippet
    exec(compile(snippet.replace(f'"{REPO}"', repr(str(out))), "card-snippet", "exec"), {})
    assert capsys.readouterr().out.startswith("Write a haiku")


def _hub_named(calibrated: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the calibrated folder whose recipe names Hub ids (base pinned to a revision) instead of folders."""
    folder = Path(shutil.copytree(calibrated, tmp_path / "hub-named"))
    recipe = json.loads((folder / "featcal_recipe.json").read_text())
    experts = {name: f"MergeBench/Llama-tiny_{name}" for name in EXPERTS}
    recipe |= {"base_model": "meta-llama/Llama-tiny@v1.0", "experts": experts}
    for name, entry in recipe["calibration_data"].items():
        entry |= {"expert": experts[name], "dataset": f"MergeBench/{name}_val"}
    recipe |= changes
    (folder / "featcal_recipe.json").write_text(json.dumps(recipe))
    return folder


def test_hub_inputs_are_the_card_s_base_models_and_datasets(calibrated, tmp_path) -> None:
    folder = _hub_named(calibrated, tmp_path)
    card = ModelCard.load(export_release(folder, repo_id=REPO) / "README.md")
    experts = [f"MergeBench/Llama-tiny_{name}" for name in EXPERTS]
    assert card.data.base_model == ["meta-llama/Llama-tiny", *experts]  # the base's @revision stripped
    assert card.data.base_model_relation == "merge"
    assert card.data.datasets == ["MergeBench/math_val", "MergeBench/coding_val"]
    assert card.data.license == "other" and "none was given" in card.text  # no --license: said so
    assert "[MergeBench/math_val](https://huggingface.co/datasets/MergeBench/math_val)" in card.text


def test_a_mergekit_merge_s_card_quotes_its_configuration_verbatim(calibrated, tmp_path) -> None:
    config = (
        "# made with mergekit-yaml\n"
        "merge_method: task_arithmetic\n"
        "base_model: meta-llama/Llama-tiny\n"
        "models:\n"
        "  - model: MergeBench/Llama-tiny_math\n    parameters: {weight: 0.4}\n"
        "  - model: MergeBench/Llama-tiny_coding\n    parameters: {weight: 0.4}\n"
        "dtype: bfloat16\n"
    )
    merge = {"method": "", "params": {}, "from": str(tmp_path / "mergekit-out")}
    folder = _hub_named(calibrated, tmp_path, merge=merge, mergekit_config=config)
    out = export_release(folder, repo_id=REPO)
    card = ModelCard.load(out / "README.md")
    assert f"```yaml\n{config}```" in card.text and "verbatim" in card.text
    assert {"mergekit", "task-arithmetic"} <= set(card.data.tags)
    assert str(tmp_path) not in (out / "featcal_recipe.json").read_text()


def test_featcal_calibrate_keeps_a_mergekit_merge_s_configuration_and_the_card_quotes_it(zoo, merged, tmp_path) -> None:
    mergekit = tmp_path / "mergekit-out"
    shutil.copytree(merged, mergekit)
    (mergekit / "featcal_recipe.json").unlink()
    text = (mergekit / "mergekit_config.yml").read_text()
    argv = ["-q", "calibrate", "--merged", str(mergekit), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--output", str(tmp_path / "calibrated")]) == 0
    recipe = json.loads((tmp_path / "calibrated" / "featcal_recipe.json").read_text())
    assert recipe["mergekit_config"] == text and recipe["merge"]["method"] == ""
    out = export_release(tmp_path / "calibrated", repo_id=REPO)
    card = ModelCard.load(out / "README.md")
    quoted = card.text.split("```yaml\n")[1].split("```")[0]
    # the local folders it names are published by their folder name, the rest verbatim
    assert yaml.safe_load(quoted) == {
        **yaml.safe_load(text),
        "base_model": "local:base",
        "models": [{"model": f"local:Llama-tiny_{n}", "parameters": {"weight": 0.3}} for n in EXPERTS],
    }
    assert (
        "local folders and files named by their name" in card.text and str(zoo) not in (out / "README.md").read_text()
    )
    assert "mergekit" in card.data.tags


def test_a_merged_folder_is_released_too(merged, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = export_release(merged, tmp_path / "merge-release", repo_id=REPO)
    card = ModelCard.load(out / "README.md")
    assert "FeatCal parameters" not in card.text and "Calibration data" not in card.text
    assert "| task_arithmetic.scaling_factor | `0.3` |" in card.text
    assert read_manifest(out).source["kind"] == "merge"
    assert "mergekit_config.yml" not in {p.name for p in out.iterdir()}  # the card quotes it
    AutoModelForCausalLM.from_pretrained(out)


# --- a merge repaired with SVC (docs/repairs.md) ------------------------------------------------------


@pytest.fixture(scope="module")
def repaired(merged) -> Path:
    """The merge repaired with SVC (data-free: no --data), as `featcal calibrate --method svc` writes it."""
    out = merged.parent / "llama-tiny-ta-svc"
    assert main(["-q", "calibrate", "--method", "svc", "--merged", str(merged), "--output", str(out)]) == 0
    return out


def test_an_svc_folder_is_released_and_pushed_like_a_merge(repaired, hub, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM

    out = export_release(repaired, tmp_path / "svc-release", repo_id=REPO)
    check_release(out)
    assert read_manifest(out).source["kind"] == "repair"
    recipe = json.loads((out / "featcal_recipe.json").read_text())
    assert recipe["repairs"] == [{"method": "svc", "params": {"alpha": 0.1}}] and "featcal" not in recipe
    card = ModelCard.load(out / "README.md")
    assert (
        "then repaired with **Singular Value Calibration (SVC)** (alpha = 0.1; [reference](https://arxiv.org/abs/2602.05536))"
        in card.text
    )
    assert "calibrated with **FeatCal**" not in card.text
    assert "mergekit_config.yml" not in {p.name for p in out.iterdir()}  # mergekit cannot make this model
    AutoModelForCausalLM.from_pretrained(out)
    capsys.readouterr()
    assert main(["push", str(out), "--repo", REPO, "--dry-run", "--endpoint", hub.url]) == 0
    assert capsys.readouterr().out.startswith(f"Dry run: would upload {out} to {REPO}:") and hub.requests == []


def test_svc_then_featcal_is_released_with_both_in_its_recipe_and_card(zoo, repaired, tmp_path) -> None:
    out = tmp_path / "svc-featcal"
    argv = ["-q", "calibrate", "--merged", str(repaired), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--output", str(out)]) == 0
    recipe = json.loads((out / "featcal_recipe.json").read_text())
    assert recipe["kind"] == "calibration" and recipe["repairs"] == [{"method": "svc", "params": {"alpha": 0.1}}]
    assert recipe["merge"]["method"] == "task_arithmetic" and recipe["featcal"]["num_calibration_examples"] == 8
    release = export_release(out, tmp_path / "release", repo_id=REPO)
    check_release(release)
    text = ModelCard.load(release / "README.md").text
    assert "then repaired with **Singular Value Calibration (SVC)**" in text
    assert "and the merged model was then calibrated with **FeatCal**" in text


def test_svc_repairs_a_mergekit_merge_from_its_configuration(merged, tmp_path) -> None:
    mergekit = tmp_path / "mergekit-out"
    shutil.copytree(merged, mergekit)
    (mergekit / "featcal_recipe.json").unlink()
    text = (mergekit / "mergekit_config.yml").read_text()
    out = tmp_path / "mergekit-svc"
    assert main(["-q", "calibrate", "--method", "svc", "--merged", str(mergekit), "--output", str(out)]) == 0
    recipe = json.loads((out / "featcal_recipe.json").read_text())
    assert recipe["mergekit_config"] == text and recipe["merge"] == {"method": "", "params": {}, "from": str(mergekit)}
    assert recipe["family"] == "causal_lm" and len(recipe["experts"]) == len(EXPERTS)
    assert load_file(out / "model.safetensors").keys() == load_file(merged / "model.safetensors").keys()


def test_featcal_card_regenerates_only_the_card(calibrated, release, tmp_path, capsys) -> None:
    out = Path(shutil.copytree(release[0], tmp_path / "release"))
    before = snapshot(out)
    assert main(["-q", "card", str(calibrated), "--output", str(out), "--repo", "me/renamed"]) == 0
    after = snapshot(out)
    assert {k for k in after if after[k][0] != before[k][0]} == {"README.md", "release_manifest.json"}
    assert ModelCard.load(out / "README.md").data.model_name == "me/renamed"
    check_release(out)  # the manifest follows the new card
    before = snapshot(calibrated)
    for inside in (calibrated, calibrated / "card"):
        code, err = run_error(capsys, ["card", str(calibrated), "--output", str(inside)])
        assert code == 2 and len(err) == 1 and "model folder" in err[0], err
    assert snapshot(calibrated) == before


# --- refusals -----------------------------------------------------------------------------------------


def _copy(calibrated: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(calibrated, tmp_path / "model"))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("no-recipe", "has no featcal_recipe.json"),
        ("clip", "holds a clip_vision model"),
        ("no-weights", "holds no weights"),
        ("no-config", "config.json is not readable"),
        ("release", "is a release already"),
    ],
)
def test_a_folder_that_is_not_a_featcal_lm_folder_is_refused(calibrated, release, tmp_path, capsys, damage, message):
    folder = release[0] if damage == "release" else _copy(calibrated, tmp_path)
    if damage == "no-recipe":
        (folder / "featcal_recipe.json").unlink()
    elif damage == "clip":
        recipe = json.loads((folder / "featcal_recipe.json").read_text())
        (folder / "featcal_recipe.json").write_text(json.dumps({**recipe, "family": "clip_vision"}))
    elif damage == "no-weights":
        (folder / "model.safetensors").unlink()
    elif damage == "no-config":
        (folder / "config.json").write_text("{not json")
    before = snapshot(folder)
    code, err = run_error(capsys, ["export", str(folder), "--output", str(tmp_path / "out")])
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists() and snapshot(folder) == before


@pytest.mark.parametrize("where", ["itself", "inside", "base", "other-model"])
def test_an_output_that_would_replace_an_input_or_a_model_is_refused(calibrated, zoo, tmp_path, capsys, where):
    folder = _copy(calibrated, tmp_path)
    out = {"itself": folder, "inside": folder / "release", "base": zoo / "base", "other-model": calibrated}[where]
    before, untouched = snapshot(folder), snapshot(out) if out.is_dir() else None
    code, err = run_error(capsys, ["export", str(folder), "--output", str(out)])
    assert code == 2 and len(err) == 1, err
    expected = "exists and is not a featcal release" if where == "other-model" else "would replace the input"
    assert expected in err[0], err
    assert snapshot(folder) == before and (untouched is None or snapshot(out) == untouched)
    with pytest.raises(OutputPathError):
        export_release(folder, out)


# --- push ---------------------------------------------------------------------------------------------


@pytest.fixture
def hub(monkeypatch, tmp_path):
    isolate_from_the_real_hub(monkeypatch, tmp_path)
    with HubDouble() as double:
        double.add_token(TOKEN, Account("me"))
        yield double


def test_push_uploads_the_release_and_from_pretrained_loads_it_back_over_http(hub, release, tmp_path) -> None:
    out, _ = release
    result = push_release(out, REPO, token=TOKEN, endpoint=hub.url)
    received = hub.files(REPO)
    received.pop(".gitattributes")
    assert received == {name: (out / name).read_bytes() for name in RELEASE_FILES}
    assert result.changed and len(hub.commits) == 1 and hub.commits[0].summary.startswith("Upload tiny-lm-featcal")
    script = (
        "import sys, torch; from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({REPO!r}); model = AutoModelForCausalLM.from_pretrained({REPO!r})\n"
        f"ids = tok({' '.join(WORDS[:5])!r}, return_tensors='pt')['input_ids']\n"
        "torch.save({'ids': ids, 'logits': model(ids).logits.detach(), 'state': model.state_dict()}, sys.argv[1])\n"
    )
    env = user_env(hub.url, tmp_path / "reader")  # another user, an empty cache, no token
    argv = [sys.executable, "-c", script, str(tmp_path / "loaded.pt")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = torch.load(tmp_path / "loaded.pt")
    ids = AutoTokenizer.from_pretrained(out)(" ".join(WORDS[:5]), return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(loaded["ids"], ids)
    assert all(torch.equal(loaded["state"][k], v) for k, v in model.state_dict().items())
    with torch.no_grad():  # another process, another thread count: equal up to the order of sums
        assert torch.allclose(loaded["logits"], model(ids).logits, atol=1e-5)
    again = push_release(out, REPO, token=TOKEN, endpoint=hub.url)
    assert not again.changed and len(hub.commits) == 1


def test_a_large_release_goes_through_upload_folder(hub, release, monkeypatch) -> None:
    """Against the double (no Xet) upload_folder makes one commit; its Xet pipeline is not exercised here."""
    from huggingface_hub import HfApi

    calls = []
    original = HfApi.upload_folder

    def spy(self, **kwargs):
        calls.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(HfApi, "upload_folder", spy)
    monkeypatch.setattr(push_module, "LARGE_UPLOAD_FILES", 3)
    out, _ = release
    (out / ".cache").mkdir(exist_ok=True)  # hidden: never sent
    (out / ".cache" / "note").write_text("local")
    try:
        push_release(out, REPO, token=TOKEN, endpoint=hub.url)
    finally:
        shutil.rmtree(out / ".cache")
    assert len(calls) == 1 and sorted(calls[0]["allow_patterns"]) == RELEASE_FILES
    received = hub.files(REPO)
    assert set(received) == {".gitattributes", *RELEASE_FILES}


def test_dry_run_checks_and_lists_without_writing_or_contacting_the_hub(hub, release, capsys) -> None:
    out, _ = release
    before = snapshot(out)
    assert main(["push", str(out), "--repo", REPO, "--dry-run", "--endpoint", hub.url]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"Dry run: would upload {out} to {REPO}:") and "model.safetensors" in printed
    assert hub.requests == [] and snapshot(out) == before
    assert sorted(p.name for p in out.iterdir()) == RELEASE_FILES


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("config", "config.json differs from what `featcal export` wrote"),
        ("weights", "model.safetensors differs from what `featcal export` wrote"),
        ("extra", "holds notes.txt, which `featcal export` did not write"),
        ("missing", "tokenizer.json missing"),
        ("header", "is not a readable safetensors file"),
    ],
)
def test_a_release_changed_after_export_is_refused_by_push(hub, release, tmp_path, capsys, change, message):
    out = Path(shutil.copytree(release[0], tmp_path / "release"))  # copies: the folder's own files stay as they are
    if change == "config":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    elif change == "weights":
        data = bytearray((out / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (out / "model.safetensors").write_bytes(bytes(data))
    elif change == "extra":
        (out / "notes.txt").write_text("mine")
    elif change == "missing":
        (out / "tokenizer.json").unlink()
    elif change == "header":
        (out / "model.safetensors").write_bytes(b"\xff" * 64)
    code, err = run_error(capsys, ["push", str(out), "--repo", REPO, "--dry-run"])
    assert code == 2 and len(err) == 1 and message in err[0], err
    code, err = run_error(capsys, ["push", str(out), "--repo", REPO, "--token", TOKEN, "--endpoint", hub.url])
    assert code == 2 and message in err[0] and hub.requests == []


def test_pushing_the_model_folder_itself_says_to_export_it_first(hub, calibrated, capsys) -> None:
    code, err = run_error(capsys, ["push", str(calibrated), "--repo", REPO, "--dry-run"])
    assert code == 2 and len(err) == 1 and "is a model folder, not a release" in err[0], err
    assert f"{calibrated}-release" in err[0]
