"""The seq2seq family from the command line: a data file of each expert's (input, target) pairs, `featcal merge`
and `featcal calibrate` on tiny T5s, and what they refuse before any work.

The models are T5s of width 64 with two encoder and two decoder blocks and a word-level tokenizer, built in
a fraction of a second (``tests/support/tiny_t5.py``); each expert's pairs are a local JSON-lines file of
sentences and class ids, made targets by the data file's ``labels`` words.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from featcal.calibration.driver import featcal_calibrate
from featcal.calibration.params import FeatCalParams
from featcal.checkpoint import Checkpoint
from featcal.cli import main
from featcal.data_file import read_data_file
from featcal.families import family_of_folder, get_family
from featcal.families.seq2seq.texts import base_tokenizer, calibration_pairs, encode_pairs, render_pair
from featcal.tasks import TextPairFormat
from featcal.threads import choose_threads, torch_threads
from tests.support.tiny_t5 import WORDS, pairs, save_model

EXPERTS = ("sst", "nli")
LABELS = ["w1", "w2"]
CALIBRATE = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]


def _rows(seed: int, count: int = 12) -> list[dict]:
    return [{"sentence": text, "label": i % 2} for i, (text, _) in enumerate(pairs(seed, count))]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """A tiny FLAN-T5-like base (own LM head, with its tokenizer), two experts fine-tuned from it, each expert's
    pairs as a JSON-lines file, and the data file naming them."""
    root = tmp_path_factory.mktemp("t5")
    base = save_model(root / "base", seed=0)
    data = {"max_length": 32, "experts": {}}
    for i, name in enumerate(EXPERTS):
        save_model(root / f"t5-tiny_glue-{name}", seed=10 + i, base=base)
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(20 + i)))
        data["experts"][str(root / f"t5-tiny_glue-{name}")] = {
            "dataset": f"{name}.jsonl", "input": "classify: {sentence}", "target": "{label}", "labels": LABELS,
        }  # fmt: skip
    (root / "data.yaml").write_text(json.dumps(data))
    return root


def test_a_data_file_with_inputs_and_targets_is_a_seq2seq_task_per_expert(zoo) -> None:
    table = read_data_file(zoo / "data.yaml")
    assert list(table.tasks) == list(EXPERTS)
    sst = table.tasks["sst"]
    assert sst.family == "seq2seq" and sst.expert == str(zoo / "t5-tiny_glue-sst")
    assert sst.text == TextPairFormat("classify: {sentence}", "{label}", tuple(LABELS), max_length=32)
    assert render_pair(sst, {"sentence": "w3 w4", "label": 1}) == ("classify: w3 w4", "w2")
    assert family_of_folder(zoo / "base").name == "seq2seq"


def test_pairs_pad_right_and_the_decoder_reads_the_target_shifted_right(zoo) -> None:
    tok = base_tokenizer(zoo / "base")
    encoded = encode_pairs(tok, [("w3 w4 w5", "w1"), ("w6", "w2 w7")], max_length=3, target_max_length=8)
    batch, ids = encoded.batch, tok.convert_tokens_to_ids
    assert batch.inputs["input_ids"].tolist() == [[ids("w3"), ids("w4"), 1], [ids("w6"), 1, 0]]  # cut at 3, </s>
    assert batch.inputs["decoder_input_ids"].tolist() == [[0, ids("w1"), 1], [0, ids("w2"), ids("w7")]]
    assert batch.context["decoder_attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]  # the target's tokens
    assert batch.token_weights.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1]]  # [input | decoder]
    assert (encoded.facts.cut_inputs, encoded.facts.cut_targets) == (1, 0)


@pytest.fixture(scope="module")
def merged(zoo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("merged") / "ta"
    argv = ["-q", "merge", "--data", str(zoo / "data.yaml"), "--base-model-id", str(zoo / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(out)]) == 0
    return out


def test_featcal_merge_writes_a_t5_with_its_own_head_and_tokenizer(zoo, merged) -> None:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    state = load_file(str(merged / "model.safetensors"))
    base = load_file(str(zoo / "base" / "model.safetensors"))
    experts = [load_file(str(zoo / f"t5-tiny_glue-{n}" / "model.safetensors")) for n in EXPERTS]
    for key in ("decoder.block.1.layer.1.EncDecAttention.k.weight", "lm_head.weight", "shared.weight"):
        expected = base[key] + 0.3 * sum(e[key] - base[key] for e in experts)
        assert torch.allclose(state[key], expected, atol=1e-6), key
    model = AutoModelForSeq2SeqLM.from_pretrained(merged)
    assert model.lm_head.weight is not model.shared.weight and torch.equal(
        model.lm_head.weight, state["lm_head.weight"]
    )
    ids = AutoTokenizer.from_pretrained(merged)(" ".join(WORDS[:4]), return_tensors="pt")["input_ids"]
    assert model.generate(ids, max_length=5).shape[1] <= 5


@pytest.fixture(scope="module")
def calibrated(zoo, merged, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calibrated") / "featcal-ta"
    argv = ["-q", "calibrate", "--merged", str(merged), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--output", str(out)]) == 0  # the base comes from the merged folder's recipe
    return out


def test_featcal_calibrate_from_a_data_file_writes_the_driver_s_weights(zoo, merged, calibrated) -> None:
    """The command streams the merged folder block by block: the tensors of calibrating the loaded merged model in
    memory on the same pairs, with the command's torch threads (one, for a model this narrow: their number
    changes the rounding of the attention's sums), bit for bit; the blocks moved, the embedding and the head did
    not."""
    family = get_family("seq2seq")
    table = read_data_file(zoo / "data.yaml")
    tok = base_tokenizer(zoo / "base")
    experts = {n: Checkpoint(zoo / f"t5-tiny_glue-{n}") for n in EXPERTS}
    with torch_threads(choose_threads(None, 64)):
        expected = featcal_calibrate(
            family.load_model(merged), Checkpoint(zoo / "base"), experts,
            lambda name: calibration_pairs(table.tasks[name], tok, 8, 42), FeatCalParams(8, 4),
            adapter=family.adapter(), progress=False,
        ).state_dict()  # fmt: skip
    written = load_file(str(calibrated / "model.safetensors"))
    assert [k for k in written if not torch.equal(written[k], expected[k])] == []
    before = load_file(str(merged / "model.safetensors"))
    for key in ("encoder.block.0.layer.0.SelfAttention.q.weight", "decoder.block.1.layer.1.EncDecAttention.v.weight"):
        assert not torch.equal(written[key], before[key]), key
    for key in (
        "shared.weight",
        "lm_head.weight",
        "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    ):
        assert torch.equal(written[key], before[key]), key
    assert (calibrated / "tokenizer.json").is_file()


def test_the_calibrated_folder_generates_as_the_card_s_usage_says(calibrated) -> None:
    """transformers 5 removed the ``text2text-generation`` pipeline (``pipeline`` refuses the task name); the folder
    loads with ``AutoModelForSeq2SeqLM`` and ``AutoTokenizer`` and generates, as the card's snippet shows."""
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(calibrated)
    model = AutoModelForSeq2SeqLM.from_pretrained(calibrated)
    ids = model.generate(**tok(["classify: " + " ".join(WORDS[3:8])], return_tensors="pt"), max_length=6)
    assert isinstance(tok.batch_decode(ids, skip_special_tokens=True)[0], str)


def test_a_mergekit_output_folder_calibrates_as_featcal_s_own_merge(zoo, merged, calibrated, tmp_path) -> None:
    """A merge folder that records only a ``mergekit_config.yml`` (featcal writes one beside its own merges)."""
    folder = tmp_path / "mergekit-out"
    shutil.copytree(merged, folder)
    (folder / "featcal_recipe.json").unlink()
    argv = ["-q", "calibrate", "--merged", str(folder), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 0
    written, expected = (
        load_file(str(tmp_path / "out" / "model.safetensors")),
        load_file(str(calibrated / "model.safetensors")),
    )
    assert all(torch.equal(written[k], expected[k]) for k in expected)


# -- refused in one line, exit 2, before any work ---------------------------------------------------------------


def _data(zoo: Path) -> dict:
    data = json.loads((zoo / "data.yaml").read_text())
    for entry in data["experts"].values():
        entry["dataset"] = str(zoo / entry["dataset"])
    return data


def _run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def _merge_argv(zoo: Path, data_file: Path, out: Path) -> list[str]:
    return ["merge", "--data", str(data_file), "--base-model-id", str(zoo / "base"), "--device", "cpu",
            "--output", str(out)]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": len(WORDS) + 11}, f"({len(WORDS) + 11}, 64)"),  # another vocabulary
        ({"d_ff": 80}, "DenseReluDense"),  # another size
    ],
    ids=["vocabulary", "size"],
)
def test_a_pool_mixing_t5_sizes_or_vocabularies_is_refused(zoo, tmp_path, capsys, change, message) -> None:
    other = tmp_path / "other"
    save_model(other, seed=3, **change)
    data = _data(zoo)
    first = next(iter(data["experts"]))
    data["experts"][str(other)] = data["experts"].pop(first)
    (tmp_path / "d.yaml").write_text(json.dumps(data))
    code, err = _run_error(capsys, _merge_argv(zoo, tmp_path / "d.yaml", tmp_path / "m"))
    assert code == 2 and len(err) == 1 and str(other) in err[0] and message in err[0], err
    assert not (tmp_path / "m").exists()


def test_an_expert_that_is_a_lora_adapter_is_refused(zoo, tmp_path, capsys) -> None:
    adapter = tmp_path / "t5-tiny_lora"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 16}))
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    data = _data(zoo)
    first = next(iter(data["experts"]))
    data["experts"][str(adapter)] = data["experts"].pop(first)
    (tmp_path / "d.yaml").write_text(json.dumps(data))
    code, err = _run_error(capsys, _merge_argv(zoo, tmp_path / "d.yaml", tmp_path / "m"))
    assert code == 2 and len(err) == 1 and "LoRA adapter" in err[0] and "merge_and_unload" in err[0], err
    assert not (tmp_path / "m").exists()


def test_labels_that_do_not_match_the_dataset_s_classes_are_refused(zoo, merged, tmp_path, capsys) -> None:
    """A dataset whose label column is a ClassLabel of 3 classes, named by 2 words; and a class id beyond the
    words in a plain JSON column."""
    from datasets import ClassLabel, Dataset, Features, Value

    features = Features({"sentence": Value("string"), "label": ClassLabel(names=["a", "b", "c"])})
    rows = _rows(30)
    Dataset.from_list(rows, features=features).to_parquet(str(tmp_path / "three.parquet"))
    data = _data(zoo)
    first = next(iter(data["experts"]))
    data["experts"][first]["dataset"] = str(tmp_path / "three.parquet")
    (tmp_path / "d.yaml").write_text(json.dumps(data))
    argv = ["calibrate", "--merged", str(merged), *CALIBRATE, "--output", str(tmp_path / "out")]
    code, err = _run_error(capsys, [*argv, "--data", str(tmp_path / "d.yaml")])
    assert code == 2 and len(err) == 1 and "'labels' names 2 words" in err[0] and "3 classes" in err[0], err
    rows[2]["label"] = 5
    (tmp_path / "five.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data["experts"][first]["dataset"] = str(tmp_path / "five.jsonl")
    (tmp_path / "e.yaml").write_text(json.dumps(data))
    code, err = _run_error(capsys, [*argv, "--num-calibration-examples", "12", "--data", str(tmp_path / "e.yaml")])
    assert code == 2 and len(err) == 1 and "is 5, not a class id" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["merge", "calibrate"])
def test_a_glue_configuration_that_does_not_exist_is_refused(zoo, merged, tmp_path, capsys, command) -> None:
    data = _data(zoo)
    first = next(iter(data["experts"]))
    data["experts"][first] = {**data["experts"][first], "dataset": "nyu-mll/glue", "config": "sts-b"}
    (tmp_path / "d.yaml").write_text(json.dumps(data))
    if command == "merge":
        argv = _merge_argv(zoo, tmp_path / "d.yaml", tmp_path / "out")
    else:
        argv = ["calibrate", "--merged", str(merged), "--data", str(tmp_path / "d.yaml"), *CALIBRATE,
                "--output", str(tmp_path / "out")]  # fmt: skip
    code, err = _run_error(capsys, argv)
    assert code == 2 and len(err) == 1 and "GLUE has no configuration 'sts-b'" in err[0] and "stsb" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"target": "{answer}"}, "read column(s) ['answer']"),
        ({"input": None}, "'input' must be a template"),
        ({"labels": ["w1", "w1"]}, "a word of its own"),
        ({"metric": "f1"}, "'metric' must be one of"),
        ({"weigh": "response"}, "unknown field(s) ['weigh']"),
    ],
)
def test_bad_data_entries_fail_in_one_line_before_any_work(zoo, merged, tmp_path, capsys, change, message) -> None:
    data = _data(zoo)
    first = next(iter(data["experts"]))
    entry = {k: v for k, v in {**data["experts"][first], **change}.items() if v is not None}
    data["experts"][first] = entry
    (tmp_path / "bad.yaml").write_text(json.dumps(data))
    argv = ["calibrate", "--merged", str(merged), "--data", str(tmp_path / "bad.yaml"), *CALIBRATE]
    code, err = _run_error(capsys, [*argv, "--output", str(tmp_path / "out")])
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
@pytest.mark.parametrize("command", ["merge", "run"])
def test_a_data_using_merge_of_t5s_is_refused_in_one_line(zoo, tmp_path, capsys, method, command) -> None:
    """RegMean and RegMean++ stream examples through one plain stack of layers, which a T5 is not: refused before
    any example is read or any folder written (they ran, then failed inside the first decoder block)."""
    if command == "merge":
        argv = [*_merge_argv(zoo, zoo / "data.yaml", tmp_path / "out"), "--method", method]
    else:
        tasks = {name: task.to_dict() for name, task in read_data_file(zoo / "data.yaml").tasks.items()}
        (tmp_path / "tasks.json").write_text(json.dumps({"tasks": tasks, "base_model": str(zoo / "base")}))
        argv = ["run", "--tasks-file", str(tmp_path / "tasks.json"), "--merge-method", method, "--device", "cpu",
                "--output-dir", str(tmp_path / "out")]  # fmt: skip
    code, err = _run_error(capsys, argv)
    assert code == 2 and len(err) == 1, err
    assert f"'{method}' is invalid" in err[0] and "uses no calibration data for T5" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("method", ["simple_average", "ties", "tsv", "iso_c"])
def test_every_data_free_method_merges_t5s_into_a_folder_that_loads(zoo, tmp_path, method) -> None:
    """Beside Task Arithmetic, each data-free method merges the tiny T5s into a T5 folder with its own LM head,
    every tensor finite and of the base's shape."""
    from transformers import AutoModelForSeq2SeqLM

    out = tmp_path / method
    assert main(["-q", *_merge_argv(zoo, zoo / "data.yaml", out), "--method", method]) == 0
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    base = get_family("seq2seq").checkpoint(zoo / "base")
    assert model.lm_head.weight is not model.shared.weight
    state = model.state_dict()
    for key in base:
        assert state[key].shape == base.shape(key) and bool(torch.isfinite(state[key]).all()), key
