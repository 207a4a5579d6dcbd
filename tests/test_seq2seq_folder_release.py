"""Releases of T5 model folders: `featcal export DIR` and `featcal push REL` on a folder of `featcal calibrate`.

The models are the tiny T5s of ``tests/support/tiny_t5.py`` (own LM head, as FLAN-T5's), merged and calibrated
by the commands a user runs from a data file of (input, target) pairs, as ``tests/test_seq2seq_cli.py`` does.
Pushes go to the Hub protocol double (``tests/support/hub_double.py``), NOT the Hub.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard

from featcal.cli import main
from featcal.release import push_release
from featcal.release.check import check_release
from featcal.release.manifest import read_manifest
from tests.support.hub_double import Account, HubDouble, isolate_from_the_real_hub
from tests.support.hub_world import user_env
from tests.support.tiny_t5 import WORDS, pairs, save_model

EXPERTS = ("sst", "nli")
LABELS = ["w1", "w2"]
CALIBRATE = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
REPO = "me/tiny-t5-featcal"
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
INPUT = "classify: " + " ".join(WORDS[3:8])
# huggingface_hub's LFS upload passes a file object as `data=`, which httpx2 deprecates: not ours to fix.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """A tiny FLAN-T5-like base, two experts fine-tuned from it, their pairs and the data file naming them."""
    root = tmp_path_factory.mktemp("t5rel")
    base = save_model(root / "base", seed=0)
    data = {"max_length": 32, "experts": {}}
    for i, name in enumerate(EXPERTS):
        save_model(root / f"t5-tiny_glue-{name}", seed=10 + i, base=base)
        rows = [{"sentence": text, "label": j % 2} for j, (text, _) in enumerate(pairs(20 + i, 12))]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data["experts"][str(root / f"t5-tiny_glue-{name}")] = {
            "dataset": f"{name}.jsonl", "input": "classify: {sentence}", "target": "{label}", "labels": LABELS,
        }  # fmt: skip
    (root / "data.yaml").write_text(json.dumps(data))
    return root


@pytest.fixture(scope="module")
def calibrated(zoo) -> Path:
    merged = zoo / "models" / "t5-tiny-ta"
    argv = ["-q", "merge", "--data", str(zoo / "data.yaml"), "--base-model-id", str(zoo / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(merged)]) == 0
    out = zoo / "models" / "t5-tiny-ta-featcal"
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
    """The calibrated folder's release at the default place (no license given), and the folder before it."""
    before = snapshot(calibrated)
    assert main(["-q", "export", str(calibrated), "--repo", REPO]) == 0
    return calibrated.parent / f"{calibrated.name}-release", before


def run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _logits(folder: Path) -> torch.Tensor:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    enc = tok([INPUT], return_tensors="pt")
    with torch.no_grad():
        return model(**enc, decoder_input_ids=torch.tensor([[0, 4, 5]])).logits


def test_the_release_holds_the_folder_s_files_and_loads_with_its_logits(calibrated, release) -> None:
    out, before = release
    assert sorted(p.name for p in out.iterdir()) == RELEASE_FILES
    assert torch.equal(_logits(out), _logits(calibrated))
    manifest = read_manifest(out)
    assert set(manifest.files) == set(RELEASE_FILES) - {"release_manifest.json"}
    assert check_release(out).recipe_sha256 == manifest.recipe_sha256


def test_the_released_config_goes_through_the_family_s_edit_and_the_folder_is_untouched(calibrated, release) -> None:
    """The tiny T5 has a head of its own (FLAN-T5's): its released configuration says ``tie_word_embeddings:
    false``, written as a new file; the weights are the folder's own file (one inode); nothing in the folder
    changed, not its bytes, times, modes nor inodes."""
    out, before = release
    folder_config = json.loads((calibrated / "config.json").read_text())
    released = json.loads((out / "config.json").read_text())
    assert folder_config.get("scale_decoder_outputs") is False and folder_config.get("tie_word_embeddings") is True
    assert released == {**folder_config, "tie_word_embeddings": False}
    assert (out / "config.json").stat().st_ino != (calibrated / "config.json").stat().st_ino
    assert (out / "model.safetensors").stat().st_ino == (calibrated / "model.safetensors").stat().st_ino
    assert snapshot(calibrated) == before


def test_the_card_is_a_t5_folder_card(release) -> None:
    out, _ = release
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["pipeline_tag"] == "text2text-generation" and data["library_name"] == "transformers"
    assert data["license"] == "other"
    assert "base_model" not in data and "base_model_relation" not in data  # local inputs only: no Hub model to name
    assert {"t5", "featcal", "task-arithmetic"} <= set(data["tags"])
    text = card.text
    assert "none was given when this release was made" in text
    assert "| `classify: {sentence}` | `{label}` | `w1`, `w2` |" in text
    assert "No result of this model was measured by featcal" in text and "model-index" not in str(data)
    assert "AutoModelForSeq2SeqLM" in text and "model.generate(" in text and "pipeline(" in text  # transformers 4
    assert "### FeatCal parameters" in text and "task_arithmetic" in text


def test_hub_bases_are_the_card_s_base_models(calibrated, tmp_path) -> None:
    """Inputs named by Hub ids become the card's ``base_model`` list, with ``base_model_relation: merge``."""
    folder = Path(shutil.copytree(calibrated, tmp_path / "t5-hub"))
    recipe = json.loads((folder / "featcal_recipe.json").read_text())
    recipe["base_model"] = "google/flan-t5-base"
    recipe["experts"] = {task: f"tanganke/flan-t5-base_glue-{task}" for task in recipe["experts"]}
    (folder / "featcal_recipe.json").write_text(json.dumps(recipe))
    assert main(["-q", "export", str(folder), "--license", "apache-2.0"]) == 0
    data = ModelCard.load(tmp_path / "t5-hub-release" / "README.md").data.to_dict()
    assert data["base_model"] == ["google/flan-t5-base", *recipe["experts"].values()]
    assert data["base_model_relation"] == "merge" and data["license"] == "apache-2.0"


def test_a_sentencepiece_t5_s_tokenizer_files_travel_into_the_release(calibrated, tmp_path) -> None:
    folder = Path(shutil.copytree(calibrated, tmp_path / "t5-spm"))
    (folder / "spiece.model").write_bytes(b"sentencepiece model bytes")
    (folder / "added_tokens.json").write_text("{}")
    (folder / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    assert main(["-q", "export", str(folder)]) == 0
    out = tmp_path / "t5-spm-release"
    for name in ("spiece.model", "added_tokens.json", "special_tokens_map.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes(), name
    assert {"spiece.model", "added_tokens.json"} <= set(read_manifest(out).files)
    check_release(out)
    assert main(["-q", "export", str(folder)]) == 0  # an earlier release with those names is replaced


def test_a_clip_stage_folder_is_still_refused(calibrated, tmp_path, capsys) -> None:
    folder = Path(shutil.copytree(calibrated, tmp_path / "clip-like"))
    recipe = json.loads((folder / "featcal_recipe.json").read_text())
    (folder / "featcal_recipe.json").write_text(json.dumps({**recipe, "family": "clip_vision"}))
    code, err = run_error(capsys, ["export", str(folder), "--output", str(tmp_path / "out")])
    assert code == 2 and len(err) == 1, err
    assert "holds a clip_vision model: such a model is released from the run folder that made it" in err[0]
    assert "only for causal_lm and seq2seq models" in err[0]
    assert not (tmp_path / "out").exists()


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
    assert result.changed and len(hub.commits) == 1
    script = (
        "import sys, torch; from transformers import AutoModelForSeq2SeqLM, AutoTokenizer\n"
        f"tok = AutoTokenizer.from_pretrained({REPO!r}); model = AutoModelForSeq2SeqLM.from_pretrained({REPO!r})\n"
        f"enc = tok([{INPUT!r}], return_tensors='pt')\n"
        "torch.save({'ids': enc['input_ids'], 'state': model.state_dict()}, sys.argv[1])\n"
    )
    env = user_env(hub.url, tmp_path / "reader")  # another user, an empty cache, no token
    argv = [sys.executable, "-c", script, str(tmp_path / "loaded.pt")]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    loaded = torch.load(tmp_path / "loaded.pt")
    assert torch.equal(loaded["ids"], AutoTokenizer.from_pretrained(out)([INPUT], return_tensors="pt")["input_ids"])
    state = AutoModelForSeq2SeqLM.from_pretrained(out).state_dict()
    assert loaded["state"].keys() == state.keys() and all(torch.equal(loaded["state"][k], v) for k, v in state.items())
    assert not push_release(out, REPO, token=TOKEN, endpoint=hub.url).changed and len(hub.commits) == 1


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("config", "config.json differs from what `featcal export` wrote"),
        ("weights", "model.safetensors differs from what `featcal export` wrote"),
        ("extra", "holds notes.txt, which `featcal export` did not write"),
        ("missing", "tokenizer.json missing"),
        ("header", "is not a readable safetensors file"),
        ("family", "whose folder is not released on its own"),
    ],
)
def test_a_release_changed_after_export_is_refused_by_push(hub, release, tmp_path, capsys, change, message):
    out = Path(shutil.copytree(release[0], tmp_path / "release"))  # copies: the folder's own files stay as they are
    if change == "config":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
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
    elif change == "family":
        recipe = json.loads((out / "featcal_recipe.json").read_text())
        (out / "featcal_recipe.json").write_text(json.dumps({**recipe, "family": "clip_vision"}))
    code, err = run_error(capsys, ["push", str(out), "--repo", REPO, "--dry-run"])
    assert code == 2 and len(err) == 1 and message in err[0], err
    code, err = run_error(capsys, ["push", str(out), "--repo", REPO, "--token", TOKEN, "--endpoint", hub.url])
    assert code == 2 and message in err[0] and hub.requests == []


def test_an_svc_repaired_t5_is_released_with_only_its_matrices_changed(calibrated, tmp_path) -> None:
    """SVC on a T5 merge (data-free): 2-D tensors move, the norms and 1-D tensors do not; it releases as a merge."""
    from safetensors.torch import load_file

    merged = calibrated.parent / "t5-tiny-ta"
    out = tmp_path / "t5-tiny-ta-svc"
    assert main(["-q", "calibrate", "--method", "svc", "--merged", str(merged), "--output", str(out)]) == 0
    before, after = load_file(merged / "model.safetensors"), load_file(out / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items() if v.dim() != 2)
    assert any(not torch.equal(after[k], v) for k, v in before.items() if v.dim() == 2)
    assert main(["-q", "export", str(out), "--repo", REPO, "--output", str(tmp_path / "release")]) == 0
    check_release(tmp_path / "release")
    assert read_manifest(tmp_path / "release").source["kind"] == "repair"
    assert "then repaired with **Singular Value Calibration (SVC)**" in (tmp_path / "release" / "README.md").read_text()
