"""Issue 44's second half: inputs a new user gives the T5, language-model and RegMean paths, each a family.

The models are the tiny T5s of ``tests/support/tiny_t5.py``; each case builds its own pool in a few seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from featcal.cli import main
from tests.support.tiny_t5 import WORDS, pairs, save_model

LABELS = ["w1", "w2"]
CALIBRATE = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
INPUT = "classify: " + " ".join(WORDS[3:9])


def run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    capsys.readouterr()  # what building the inputs printed
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# -- T5 head forms: tied or not, decoder outputs rescaled or not, the head stored or not -------------------------


def save_t5_form(folder: Path, seed: int, base: torch.nn.Module | None, *, scaled: bool, head: str) -> torch.nn.Module:
    """A tiny T5 saved in one form: ``scaled`` (``T5Config(tie_word_embeddings=scaled)``, which transformers 5
    records as ``scale_decoder_outputs``), and its ``head``: ``tied`` (only ``shared.weight`` stored), ``own``
    (``lm_head.weight`` stored with values of its own) or ``copy`` (stored, equal to ``shared.weight``)."""
    model = save_model(folder, seed, base=base, tied=scaled)
    state = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(seed + 100)
    state.pop("lm_head.weight", None)
    if head == "own":
        if base is None:
            start = torch.randn(state["shared.weight"].shape, generator=generator)
        else:  # the base's own head, or its embedding when tied
            start = getattr(base, "own_head", base.shared.weight.detach())
        model.own_head = start + (0 if base is None else 0.05 * torch.randn(start.shape, generator=generator))
        state["lm_head.weight"] = model.own_head
    elif head == "copy":
        state["lm_head.weight"] = state["shared.weight"].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return model


def t5_pool(root: Path, forms: list[tuple[bool, str]]) -> Path:
    """A base in ``forms[0]``, an expert in each later form, their pairs, and the data file naming them."""
    base = save_t5_form(root / "base", 0, None, scaled=forms[0][0], head=forms[0][1])
    data = {"max_length": 32, "experts": {}}
    for i, (scaled, head) in enumerate(forms[1:]):
        name = f"task{i}"
        save_t5_form(root / name, 10 + i, base, scaled=scaled, head=head)
        rows = [{"sentence": text, "label": j % 2} for j, (text, _) in enumerate(pairs(20 + i, 12))]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data["experts"][str(root / name)] = {
            "dataset": str(root / f"{name}.jsonl"), "input": "classify: {sentence}", "target": "{label}",
            "labels": LABELS,
        }  # fmt: skip
    (root / "data.yaml").write_text(json.dumps(data))
    return root / "data.yaml"


def load_t5(folder: Path) -> torch.nn.Module:
    from transformers import T5ForConditionalGeneration

    return T5ForConditionalGeneration.from_pretrained(folder).eval()


def logits(model: torch.nn.Module) -> torch.Tensor:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model.name_or_path)
    with torch.no_grad():
        return model(**tok([INPUT], return_tensors="pt"), decoder_input_ids=torch.tensor([[0, 4, 5, 6]])).logits


def reference(config_folder: Path, state: dict[str, torch.Tensor], head: torch.Tensor) -> torch.nn.Module:
    """transformers' T5 of ``config_folder``'s configuration holding ``state`` with the LM head ``head``."""
    from transformers import AutoConfig, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(AutoConfig.from_pretrained(config_folder)).eval()
    model.lm_head.weight = torch.nn.Parameter(head.clone())
    model.load_state_dict({k: v for k, v in state.items() if k != "lm_head.weight"}, strict=False)
    model.name_or_path = str(config_folder)
    return model


FORMS = [(scaled, head) for scaled in (True, False) for head in ("tied", "own", "copy")]


@pytest.mark.parametrize(("scaled", "head"), FORMS, ids=[f"{'scaled' if s else 'unscaled'}-{h}" for s, h in FORMS])
def test_every_t5_head_form_merges_calibrates_and_releases_with_transformers_logits(tmp_path, scaled, head) -> None:
    """The merged folder computes, in transformers, the logits of Task Arithmetic on what transformers loads
    (each model's own head: its stored one, or its embedding when tied) with the base's scaling; the calibrated
    folder keeps that head and scaling; the release gives the calibrated folder's logits."""
    data = t5_pool(tmp_path, [(scaled, head)] * 3)
    merged, calibrated = tmp_path / "merged", tmp_path / "calibrated"
    argv = ["-q", "merge", "--data", str(data), "--base-model-id", str(tmp_path / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(merged)]) == 0
    models = [load_t5(tmp_path / name) for name in ("base", "task0", "task1")]
    states = [{**m.state_dict(), "lm_head.weight": m.lm_head.weight.detach()} for m in models]
    expected = {k: states[0][k] + 0.3 * sum(s[k] - states[0][k] for s in states[1:]) for k in states[0]}
    loaded = load_t5(merged)
    assert loaded.config.scale_decoder_outputs is scaled
    assert torch.allclose(loaded.lm_head.weight, expected["lm_head.weight"], atol=1e-6)
    want = logits(reference(tmp_path / "base", expected, expected["lm_head.weight"]))
    assert torch.allclose(logits(loaded), want, atol=1e-5)

    argv = ["-q", "calibrate", "--merged", str(merged), "--data", str(data), *CALIBRATE]
    assert main([*argv, "--output", str(calibrated)]) == 0
    out = load_t5(calibrated)
    assert out.config.scale_decoder_outputs is scaled and torch.equal(out.lm_head.weight, loaded.lm_head.weight)
    key = "decoder.block.1.layer.1.EncDecAttention.v.weight"
    assert not torch.equal(out.state_dict()[key], loaded.state_dict()[key])  # calibrated
    assert torch.equal(logits(out), logits(reference(tmp_path / "base", out.state_dict(), out.lm_head.weight)))

    assert main(["-q", "export", str(calibrated), "--repo", "me/t5-form"]) == 0
    assert torch.equal(logits(load_t5(tmp_path / "calibrated-release")), logits(out))


@pytest.mark.parametrize(
    ("base_form", "expert_form"),
    [((True, "tied"), (True, "own")), ((True, "own"), (True, "tied")), ((False, "tied"), (True, "tied"))],
    ids=["tied-base-own-expert", "own-base-tied-expert", "unscaled-base-scaled-expert"],
)
def test_a_pool_mixing_t5_head_forms_is_refused_naming_the_folder(tmp_path, capsys, base_form, expert_form) -> None:
    data = t5_pool(tmp_path, [base_form, base_form, expert_form])
    out = tmp_path / "merged"
    argv = ["merge", "--data", str(data), "--base-model-id", str(tmp_path / "base"), "--device", "cpu"]
    code, err = run_error(capsys, [*argv, "--output", str(out)])
    assert code == 2 and len(err) == 1, err
    assert str(tmp_path / "task1") in err[0] and "LM head" in err[0] and "lm_head.weight" in err[0], err
    assert not out.exists()


# -- RegMean and RegMean++ on too few tokens, or without regularisation ------------------------------------------


def regmean_argv(world, method: str, examples: int, ratio: float, out: Path) -> list[str]:
    return ["merge", "--method", method, "--tasks-file", str(world["tasks_file"]), "--num-calibration-examples",
            str(examples), "--calibration-batch-size", "1", "--merge-param", f"reduce_non_diagonal_ratio={ratio}",
            "--device", "cpu", "--output", str(out)]  # fmt: skip


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_a_data_using_merge_on_fewer_tokens_than_a_linear_s_inputs_is_refused(world, tmp_path, capsys, method):
    """One image of 17 tokens per task, two tasks: 34 tokens, fewer than the 37 inputs of the tiny CLIP's fc2,
    so the Gram matrices' sum is singular whatever ``reduce_non_diagonal_ratio``."""
    out = tmp_path / "merged"
    code, err = run_error(capsys, regmean_argv(world, method, 1, 0.95, out))
    assert code == 2 and len(err) == 1, err
    assert "34" in err[0] and "fewer than its 37 input dimensions" in err[0] and "--num-calibration-examples" in err[0]
    assert not out.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_an_ill_conditioned_regmean_says_so_in_one_line(world, tmp_path, capsys, caplog, method) -> None:
    """Without regularisation (ratio 1) the tiny CLIP's q/k/v and fc1 systems are near-singular: the merge is
    written, and one warning line names how far its weights grew; with FusionBench's 0.95 there is none."""
    code, _ = run_error(capsys, regmean_argv(world, method, 4, 1.0, tmp_path / "plain"))
    warnings = [r.getMessage() for r in caplog.records if "ill-conditioned" in r.getMessage()]
    assert code == 0 and len(warnings) == 1 and "x the largest expert's norm" in warnings[0], warnings
    caplog.clear()
    merged = load_file(str(tmp_path / "plain" / "model.safetensors"))
    expert = load_file(str(world["root"] / "experts" / world["tasks"][0] / "model.safetensors"))
    key = "encoder.layers.1.self_attn.q_proj.weight"
    assert merged[key].norm() > 4 * expert[key].norm()  # what the line says: the weights blew up
    code, _ = run_error(capsys, regmean_argv(world, method, 4, 0.95, tmp_path / "regularised"))
    assert code == 0 and not [r for r in caplog.records if "ill-conditioned" in r.getMessage()]


# -- evaluation on rows the calibration read ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def t5_file_run(tmp_path_factory) -> tuple[Path, Path]:
    """`featcal run --data` on two tiny T5 experts whose datasets are JSON-lines files of 16 rows (no test split:
    each file is every split at once), one of them given ``split: validation`` as a data file allows."""
    root = tmp_path_factory.mktemp("t5file")
    base = save_model(root / "base", seed=0)
    data = {"max_length": 32, "experts": {}}
    for i, name in enumerate(("alpha", "beta")):
        save_model(root / name, seed=10 + i, base=base)
        rows = [{"sentence": text, "label": j % 2} for j, (text, _) in enumerate(pairs(20 + i, 16))]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data["experts"][str(root / name)] = {
            "dataset": str(root / f"{name}.jsonl"), "input": "classify: {sentence}", "target": "{label}",
            "labels": LABELS, "task": name, **({"split": "validation"} if i else {}),
        }  # fmt: skip
    (root / "data.yaml").write_text(json.dumps(data))
    out = root / "run"
    argv = ["run", "--data", str(root / "data.yaml"), "--base-model-id", str(root / "base"), "--output-dir", str(out)]
    assert main([*argv, *CALIBRATE, "--seed", "5", "--eval-num-workers", "0"]) == 0
    return root, out


def test_a_t5_task_evaluated_on_its_calibration_file_is_evaluated_on_rows_the_calibration_did_not_read(
    t5_file_run,
) -> None:
    from featcal.data import calibration_indices, held_out_indices

    _, out = t5_file_run
    drawn = set(calibration_indices(16, 8, 5))
    evaluated = set(held_out_indices(16, 8, 5))
    assert drawn.isdisjoint(evaluated) and len(evaluated) == 8
    for stage in ("ta", "featcal-ta"):
        metrics = json.loads((out / stage / "metrics.json").read_text())
        for task in ("alpha", "beta"):
            assert metrics[task]["num_samples"] == 8
            assert metrics[task]["held_out"] == {"split": "train", "seed": 5, "rows": [8, 16]}
    record = json.loads((out / "run_config.json").read_text())
    assert record["evaluation"]["held_out"] == {"seed": 5, "after": 8, "tasks": ["alpha", "beta"]}
    recipe = json.loads((out / "featcal-ta" / "featcal_recipe.json").read_text())
    assert [entry["split"] for entry in recipe["calibration_data"].values()] == ["train", "train"]  # a file's rows


def test_the_card_names_the_rows_evaluated_and_claims_no_split_that_was_not_read(t5_file_run) -> None:
    _, out = t5_file_run
    card = (out / "release" / "README.md").read_text()
    assert "train (positions 8+ of the seed-5 shuffle)" in card
    assert "split: test" not in card and "validation" not in card and "`test`" not in card


def test_a_clip_task_evaluated_on_its_calibration_split_is_evaluated_on_the_images_after_the_draw(world, tmp_path):
    """A tasks file naming ``train`` as the test split too: the 12 training images, less the 4 the calibration
    draws, are evaluated; the card says which."""
    table = json.loads(Path(world["tasks_file"]).read_text())
    for entry in table["tasks"].values():
        entry["dataset"] = {**entry["dataset"], "path": str(world["root"] / entry["dataset"]["path"]),
                            "test_split": "train"}  # fmt: skip
        entry["expert"] = str(world["root"] / entry["expert"])
    table["base_model"] = str(world["root"] / table["base_model"])
    (tmp_path / "tasks.json").write_text(json.dumps(table))
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(tmp_path / "tasks.json"), "--output-dir", str(out), "--device", "cpu"]
    assert main([*argv, "--num-calibration-examples", "4", "--calibration-batch-size", "2", "--seed", "3"]) == 0
    record = json.loads((out / "run_config.json").read_text())
    assert record["evaluation"]["held_out"] == {"seed": 3, "after": 4, "tasks": world["tasks"]}
    metrics = json.loads((out / "ta" / "metrics.json").read_text())
    assert all(metrics[task]["num_samples"] == 8 for task in world["tasks"])
    assert "train (positions 4+ of the seed-3 shuffle)" in (out / "release" / "README.md").read_text()


# -- the smaller ones ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flan_pool(tmp_path_factory) -> Path:
    """A FLAN-T5-like pool (own heads, outputs not rescaled) with its data file, and its Task Arithmetic merge."""
    root = tmp_path_factory.mktemp("flan")
    data = t5_pool(root, [(False, "own")] * 3)
    argv = ["-q", "merge", "--data", str(data), "--base-model-id", str(root / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(root / "merged")]) == 0
    return root


def _data_with(root: Path, tmp_path: Path, text: str) -> Path:
    """The pool's data file as YAML, each expert's entry's ``labels`` line replaced by ``text``."""
    data = json.loads((root / "data.yaml").read_text())
    lines = ["max_length: 32", "experts:"]
    for ref, entry in data["experts"].items():
        lines.append(f"  {json.dumps(ref)}:")
        lines += [f"    {key}: {json.dumps(value)}" for key, value in entry.items() if key != "labels"]
        lines.append(f"    labels: {text}")
    path = tmp_path / "data.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _calibrate(root: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["calibrate", "--merged", str(root / "merged"), "--data", str(data), *CALIBRATE, "--output", str(out),
            *extra]  # fmt: skip


def test_unquoted_yaml_label_words_read_as_booleans_are_named(flan_pool, tmp_path, capsys) -> None:
    data = _data_with(flan_pool, tmp_path, "[yes, no]")
    code, err = run_error(capsys, _calibrate(flan_pool, data, tmp_path / "out"))
    assert code == 2 and len(err) == 1, err
    assert "[True, False]" in err[0] and "bool" in err[0] and 'labels: ["yes", "no"]' in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.yaml"]


@pytest.mark.parametrize(
    ("labels", "named"), [('["w1", "zzz"]', "['zzz']"), ('["w1", "w1 "]', "['w1 ']")], ids=["unknown", "same-tokens"]
)
def test_t5_label_words_the_tokenizer_cannot_tell_apart_are_refused(flan_pool, tmp_path, capsys, labels, named):
    data = _data_with(flan_pool, tmp_path, labels)
    code, err = run_error(capsys, _calibrate(flan_pool, data, tmp_path / "out"))
    assert code == 2 and len(err) == 1 and named in err[0] and "tokenizer" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.yaml"]


def test_a_mergekit_base_folder_that_is_gone_is_named_with_its_record_and_the_override(flan_pool, tmp_path, capsys):
    import shutil

    import yaml

    folder = tmp_path / "mergekit-out"
    shutil.copytree(flan_pool / "merged", folder)
    (folder / "featcal_recipe.json").unlink()
    config = yaml.safe_load((folder / "mergekit_config.yml").read_text())
    config["base_model"] = str(tmp_path / "gone")
    (folder / "mergekit_config.yml").write_text(yaml.safe_dump(config))
    argv = ["calibrate", "--merged", str(folder), "--data", str(flan_pool / "data.yaml"), *CALIBRATE]
    code, err = run_error(capsys, [*argv, "--output", str(tmp_path / "out")])
    assert code == 2 and len(err) == 1, err
    assert str(tmp_path / "gone") in err[0] and "mergekit_config.yml" in err[0] and "--base-model-id" in err[0]
    assert not (tmp_path / "out").exists()
    argv = [*argv, "--base-model-id", str(flan_pool / "base"), "--output", str(tmp_path / "out")]
    assert main(["-q", *argv]) == 0  # the override


def _tied_lm_pool(root: Path, expert_head: str) -> Path:
    """A tiny tied Llama base and two tied experts, the second storing ``lm_head.weight`` too: a ``copy`` of its
    embedding, or ``other`` values."""
    from tests.support.tiny_decoder import save_model as save_lm
    from tests.support.tiny_decoder import texts, tokenizer

    base = save_lm(root / "base", seed=0, tied=True)
    tokenizer().save_pretrained(root / "base")
    data = {"max_length": 16, "experts": {}}
    for i, name in enumerate(("math", "coding")):
        save_lm(root / name, seed=10 + i, base=base, tied=True)
        tokenizer().save_pretrained(root / name)
        words = texts(20 + i, 20)
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": w}) + "\n" for w in words))
        data["experts"][str(root / name)] = {"dataset": str(root / f"{name}.jsonl"), "text": "{text}", "task": name}
    state = load_file(str(root / "coding" / "model.safetensors"))
    embedding = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = embedding.clone() if expert_head == "copy" else embedding + 0.01
    save_file(state, str(root / "coding" / "model.safetensors"), metadata={"format": "pt"})
    (root / "data.yaml").write_text(json.dumps(data))
    return root / "data.yaml"


def test_a_tied_language_model_storing_a_copy_of_its_head_merges_as_transformers_loads_it(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    data = _tied_lm_pool(tmp_path, "copy")
    argv = ["-q", "merge", "--data", str(data), "--base-model-id", str(tmp_path / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    models = [AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in ("base", "math", "coding")]
    base, *experts = (m.model.embed_tokens.weight.detach() for m in models)
    expected = base + 0.3 * sum(e - base for e in experts)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert torch.allclose(merged.model.embed_tokens.weight, expected, atol=1e-6)


def test_a_tied_language_model_storing_a_head_of_its_own_is_refused_naming_the_tensor(tmp_path, capsys) -> None:
    data = _tied_lm_pool(tmp_path, "other")
    out = tmp_path / "merged"
    argv = ["merge", "--data", str(data), "--base-model-id", str(tmp_path / "base"), "--device", "cpu"]
    code, err = run_error(capsys, [*argv, "--output", str(out)])
    assert code == 2 and len(err) == 1, err
    assert str(tmp_path / "coding") in err[0] and "'lm_head.weight'" in err[0] and "tie_word_embeddings" in err[0]
    assert not out.exists()


def test_language_model_texts_longer_than_the_model_s_positions_are_cut_at_them(tmp_path, caplog) -> None:
    """A tiny Llama of 64 positions and a data file allowing 200 tokens: texts of 100 words are read (calibrated
    and evaluated) as their first 64 tokens, and the cut is said."""
    from featcal.data_file import read_data_file
    from featcal.families.causal_lm.texts import base_tokenizer, calibration_texts
    from tests.support.tiny_decoder import WORDS, tokenizer
    from tests.support.tiny_decoder import save_model as save_lm

    save_lm(tmp_path / "base", seed=0)
    tokenizer().save_pretrained(tmp_path / "base")
    rows = [{"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(100))} for i in range(6)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    entry = {"dataset": str(tmp_path / "t.jsonl"), "text": "{text}", "task": "long"}
    (tmp_path / "data.yaml").write_text(json.dumps({"max_length": 200, "experts": {str(tmp_path / "base"): entry}}))
    task = read_data_file(tmp_path / "data.yaml").tasks["long"]
    tok = base_tokenizer(tmp_path / "base")
    assert tok.model_max_length == 64
    with caplog.at_level("INFO", logger="featcal"):
        batch = calibration_texts(task, tok, 4, 0)
    assert batch.inputs["input_ids"].shape == (4, 64)
    assert any("cut at 64 tokens" in r.getMessage() for r in caplog.records)


def test_a_calibration_that_leaves_no_row_to_evaluate_on_is_refused_before_any_work(t5_file_run, tmp_path, capsys):
    root, _ = t5_file_run
    out = tmp_path / "run"
    argv = ["run", "--data", str(root / "data.yaml"), "--base-model-id", str(root / "base"), "--output-dir", str(out)]
    code, err = run_error(capsys, [*argv, "--num-calibration-examples", "16", "--device", "cpu"])
    assert code == 2 and len(err) == 1, err
    assert "alpha" in err[0] and "16 rows leave none after the 16 calibration rows" in err[0], err
    assert not out.exists()
