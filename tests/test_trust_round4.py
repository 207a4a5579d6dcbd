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
