"""The causal-LM family from the command line: a data file of each expert's texts, `featcal merge` and
`featcal calibrate` on tiny Llamas, and what they refuse before any work.

The models are two-layer Llamas of hidden size 64 with a word-level tokenizer, built in seconds
(``tests/support/tiny_decoder.py``); each expert's calibration texts are a local JSON-lines file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from featcal.calibration.driver import featcal_calibrate
from featcal.calibration.params import FeatCalParams
from featcal.checkpoint import Checkpoint
from featcal.cli import main
from featcal.data_file import read_data_file, task_names
from featcal.errors import InputError
from featcal.families import get_family
from featcal.families.causal_lm.texts import base_tokenizer, calibration_texts, encode_texts
from featcal.tasks import TextFormat
from tests.support.tiny_decoder import WORDS, save_model, texts, tokenizer

EXPERTS = ("math", "coding")
CALIBRATE = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]


def _rows(seed: int, count: int = 10) -> list[dict[str, str]]:
    """Rows with a query and a response, of a few words each."""
    words = texts(seed, 2 * count)
    return [{"query": words[2 * i], "response": words[2 * i + 1]} for i in range(count)]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory) -> Path:
    """A tiny Llama base (with its tokenizer), two experts fine-tuned from it, each expert's texts as a
    JSON-lines file, and the data file naming them."""
    root = tmp_path_factory.mktemp("lm")
    base = save_model(root / "base", seed=0)
    tokenizer().save_pretrained(root / "base")
    data = {"max_length": 16, "experts": {}}
    for i, name in enumerate(EXPERTS):
        expert = root / f"Llama-tiny_{name}"
        save_model(expert, seed=10 + i, base=base)
        tokenizer().save_pretrained(expert)
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(20 + i)))
        data["experts"][str(expert)] = {"dataset": f"{name}.jsonl", "text": "{query} {response}"}
    (root / "data.yaml").write_text(json.dumps(data))
    return root


def test_a_data_file_is_a_task_per_expert_named_by_what_sets_the_experts_apart(zoo) -> None:
    table = read_data_file(zoo / "data.yaml")
    assert list(table.tasks) == list(EXPERTS)
    math = table.tasks["math"]
    assert math.family == "causal_lm" and math.expert == str(zoo / "Llama-tiny_math")
    assert math.dataset.path == str(zoo / "math.jsonl")  # relative to the data file
    assert math.text == TextFormat(text="{query} {response}", max_length=16)
    assert task_names(["MergeBench/Llama-3.2-3B_math", "MergeBench/Llama-3.2-3B_coding"]) == {
        "MergeBench/Llama-3.2-3B_math": "math",
        "MergeBench/Llama-3.2-3B_coding": "coding",
    }
    assert task_names(["org/only-one"]) == {"org/only-one": "only-one"}


def test_texts_pad_right_weigh_padding_zero_and_the_response_alone_when_asked(zoo) -> None:
    tok = base_tokenizer(zoo / "base")
    pairs = [("w1 w2 ", "w3"), ("w4 ", "w5 w6 w7")]
    whole = encode_texts(tok, pairs, TextFormat(prompt="p", response="r"))
    assert whole.batch.inputs["input_ids"].shape == (2, 4)  # right-padded to the longest
    assert whole.batch.token_weights.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    response = encode_texts(tok, pairs, TextFormat(prompt="p", response="r", weigh="response"))
    assert response.batch.token_weights.tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    cut = encode_texts(tok, pairs, TextFormat(text="t", max_length=3))
    assert cut.batch.inputs["input_ids"].shape == (2, 3) and (cut.facts.cut, cut.facts.longest) == (1, 4)


@pytest.fixture(scope="module")
def merged(zoo, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("merged") / "ta"
    argv = ["-q", "merge", "--data", str(zoo / "data.yaml"), "--base-model-id", str(zoo / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(out)]) == 0
    return out


def test_featcal_merge_writes_a_language_model_with_its_tokenizer(zoo, merged) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged_state = load_file(str(merged / "model.safetensors"))
    base = load_file(str(zoo / "base" / "model.safetensors"))
    experts = [load_file(str(zoo / f"Llama-tiny_{n}" / "model.safetensors")) for n in EXPERTS]
    key = "model.layers.1.mlp.down_proj.weight"
    expected = base[key] + 0.3 * sum(e[key] - base[key] for e in experts)
    assert torch.allclose(merged_state[key], expected, atol=1e-6)
    model = AutoModelForCausalLM.from_pretrained(merged)
    ids = AutoTokenizer.from_pretrained(merged)(" ".join(WORDS[:4]), return_tensors="pt")["input_ids"]
    assert torch.isfinite(model(ids).logits).all()


@pytest.fixture(scope="module")
def calibrated(zoo, merged, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("calibrated") / "featcal-ta"
    argv = ["-q", "calibrate", "--merged", str(merged), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--output", str(out)]) == 0  # the base comes from the merged folder's recipe
    return out


def test_featcal_calibrate_from_a_data_file_writes_the_driver_s_weights(zoo, merged, calibrated) -> None:
    """The command streams the merged folder layer by layer: the tensors of calibrating the loaded merged
    model in memory on the same texts, bit for bit."""
    family = get_family("causal_lm")
    table = read_data_file(zoo / "data.yaml")
    tok = base_tokenizer(zoo / "base")
    params = FeatCalParams(num_calibration_examples=8, calibration_batch_size=4)
    calibrated_model = featcal_calibrate(
        family.load_model(merged),
        Checkpoint(zoo / "base"),
        {n: Checkpoint(zoo / f"Llama-tiny_{n}") for n in EXPERTS},
        lambda name: calibration_texts(table.tasks[name], tok, 8, 42),
        params,
        adapter=family.adapter(),
        progress=False,
    )
    expected = calibrated_model.state_dict()
    written = load_file(str(calibrated / "model.safetensors"))
    assert [k for k in written if not torch.equal(written[k], expected[k])] == []
    before = load_file(str(merged / "model.safetensors"))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(written[key], before[key])  # calibrated, not copied
    assert torch.equal(written["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


def test_the_calibrated_folder_runs_in_a_text_generation_pipeline(calibrated) -> None:
    from transformers import pipeline

    generate = pipeline("text-generation", model=str(calibrated), device="cpu")
    out = generate(" ".join(WORDS[:3]), max_new_tokens=3, do_sample=False)
    assert out[0]["generated_text"].startswith(" ".join(WORDS[:3]))
    recipe = json.loads((calibrated / "featcal_recipe.json").read_text())
    assert recipe["family"] == "causal_lm" and recipe["merge"]["method"] == "task_arithmetic"


def test_a_mergekit_output_folder_calibrates_as_featcal_s_own_merge(zoo, merged, calibrated, tmp_path) -> None:
    """A folder whose only record is mergekit's ``mergekit_config.yml`` names its base and experts as
    featcal's recipe does: the same calibrated weights."""
    mergekit = tmp_path / "mergekit-out"
    shutil.copytree(merged, mergekit)
    (mergekit / "featcal_recipe.json").unlink()
    config = yaml.safe_load((mergekit / "mergekit_config.yml").read_text())
    assert config["merge_method"] == "task_arithmetic" and config["base_model"] == str(zoo / "base")
    argv = ["-q", "calibrate", "--merged", str(mergekit), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 0
    ours, theirs = (
        load_file(str(calibrated / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


def test_calibrate_with_streams_in_host_memory_writes_the_same_weights(zoo, merged, calibrated, tmp_path) -> None:
    """``--stream-storage host`` changes where the feature streams wait between their uses, not the weights."""
    argv = ["-q", "calibrate", "--merged", str(merged), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    assert main([*argv, "--stream-storage", "host", "--output", str(tmp_path / "out")]) == 0
    ours, theirs = (
        load_file(str(calibrated / "model.safetensors")),
        load_file(str(tmp_path / "out" / "model.safetensors")),
    )
    assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []


def test_a_mergekit_merge_with_a_union_tokenizer_is_refused(zoo, merged, tmp_path, capsys) -> None:
    mergekit = tmp_path / "union"
    shutil.copytree(merged, mergekit)
    (mergekit / "featcal_recipe.json").unlink()
    config = yaml.safe_load((mergekit / "mergekit_config.yml").read_text())
    (mergekit / "mergekit_config.yml").write_text(yaml.safe_dump({**config, "tokenizer_source": "union"}))
    argv = ["calibrate", "--merged", str(mergekit), "--data", str(zoo / "data.yaml"), *CALIBRATE]
    code, err = _run_error(capsys, [*argv, "--output", str(tmp_path / "out")])
    assert code == 2 and len(err) == 1 and "union" in err[0] and "tokenizer_source: base" in err[0], err
    assert not (tmp_path / "out").exists()


def _data(zoo: Path) -> dict:
    """The data file's contents, its dataset paths absolute (to be written elsewhere)."""
    data = json.loads((zoo / "data.yaml").read_text())
    for entry in data["experts"].values():
        entry["dataset"] = str(zoo / entry["dataset"])
    return data


def _run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_a_data_file_must_list_exactly_the_merged_experts(zoo, merged, tmp_path, capsys) -> None:
    data = _data(zoo)
    first, second = list(data["experts"])
    missing = {**data, "experts": {first: data["experts"][first]}}
    (tmp_path / "missing.yaml").write_text(json.dumps(missing))
    argv = ["calibrate", "--merged", str(merged), *CALIBRATE, "--output", str(tmp_path / "out")]
    code, err = _run_error(capsys, [*argv, "--data", str(tmp_path / "missing.yaml")])
    assert code == 2 and len(err) == 1 and "lacks" in err[0] and second in err[0]
    extra = {**data, "experts": {**data["experts"], str(zoo / "base"): data["experts"][first]}}
    (tmp_path / "extra.yaml").write_text(json.dumps(extra))
    code, err = _run_error(capsys, [*argv, "--data", str(tmp_path / "extra.yaml")])
    assert code == 2 and len(err) == 1 and "also names" in err[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"text": "{query} {answer}"}, "reads column(s) ['answer']"),
        ({"text": None, "prompt": "{query}"}, "'prompt' and 'response'"),
        ({"max_length": 1}, "at least 2"),
        ({"dataset": "./nowhere.jsonl"}, "does not exist"),
    ],
)
def test_bad_data_entries_fail_in_one_line_before_any_work(zoo, merged, tmp_path, capsys, change, message) -> None:
    data = _data(zoo)
    first = next(iter(data["experts"]))
    data["experts"][first] = {k: v for k, v in {**data["experts"][first], **change}.items() if v is not None}
    (tmp_path / "bad.yaml").write_text(json.dumps(data))
    argv = ["calibrate", "--merged", str(merged), "--data", str(tmp_path / "bad.yaml"), *CALIBRATE]
    code, err = _run_error(capsys, [*argv, "--output", str(tmp_path / "out")])
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_empty_texts_and_a_limit_that_cuts_every_text_are_refused(zoo, merged, tmp_path, capsys) -> None:
    data = _data(zoo)
    first = next(iter(data["experts"]))
    rows = _rows(5, count=8)  # all of them calibrate
    rows[3]["query"] = rows[3]["response"] = ""
    (tmp_path / "empty.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data["experts"][first] = {**data["experts"][first], "dataset": str(tmp_path / "empty.jsonl")}
    (tmp_path / "empty.yaml").write_text(json.dumps(data))
    argv = ["calibrate", "--merged", str(merged), *CALIBRATE, "--output", str(tmp_path / "out")]
    code, err = _run_error(capsys, [*argv, "--data", str(tmp_path / "empty.yaml")])
    assert code == 2 and len(err) == 1 and "row 3" in err[0] and "empty text" in err[0], err
    data = _data(zoo)
    data["max_length"] = 2
    (tmp_path / "short.yaml").write_text(json.dumps(data))
    code, err = _run_error(capsys, [*argv, "--data", str(tmp_path / "short.yaml")])
    assert code == 2 and len(err) == 1 and "longer than max_length 2" in err[0], err


def test_an_expert_with_another_vocabulary_is_refused(zoo, tmp_path, capsys) -> None:
    from tests.support.tiny_decoder import tiny_config

    other = tmp_path / "wide-vocab"
    config = tiny_config()
    config.vocab_size += 8
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(config).save_pretrained(other)
    data = _data(zoo)
    first = next(iter(data["experts"]))
    data["experts"] = {str(other): data["experts"][first]}
    (tmp_path / "d.yaml").write_text(json.dumps(data))
    argv = ["merge", "--data", str(tmp_path / "d.yaml"), "--base-model-id", str(zoo / "base"), "--device", "cpu"]
    code, err = _run_error(capsys, [*argv, "--output", str(tmp_path / "m")])
    assert code == 2 and len(err) == 1 and str(other) in err[0], err


def test_a_data_file_that_is_not_one_is_named(tmp_path) -> None:
    (tmp_path / "d.yaml").write_text("tasks: {}\n")
    with pytest.raises(InputError, match="expected 'experts:'"):
        read_data_file(tmp_path / "d.yaml")
    (tmp_path / "d.yaml").write_text("experts:\n  a/b: {dataset: x.jsonl, text: t, colour: red}\n")
    with pytest.raises(InputError, match=r"unknown key\(s\) \['colour'\]"):
        read_data_file(tmp_path / "d.yaml")


def test_a_tied_bfloat16_merge_is_calibrated_and_written_tied_in_bfloat16(tmp_path) -> None:
    """Weights are stored in the base's dtype (bf16 here; the arithmetic is float32) and a tied LM head
    stays tied: stored once, as the token embedding, which the calibration leaves as merged."""
    from transformers import AutoModelForCausalLM

    base = save_model(tmp_path / "base", seed=0, tied=True)
    base.to(torch.bfloat16).save_pretrained(tmp_path / "base")
    tokenizer().save_pretrained(tmp_path / "base")
    data = {"experts": {}}
    for i, name in enumerate(EXPERTS):
        expert = save_model(tmp_path / name, seed=10 + i, base=base.float(), tied=True)
        expert.to(torch.bfloat16).save_pretrained(tmp_path / name)
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(20 + i)))
        data["experts"][str(tmp_path / name)] = {"dataset": f"{name}.jsonl", "text": "{query} {response}"}
    (tmp_path / "data.yaml").write_text(json.dumps(data))
    common = ["--data", str(tmp_path / "data.yaml"), "--device", "cpu"]
    assert (
        main(["-q", "merge", *common, "--base-model-id", str(tmp_path / "base"), "--output", str(tmp_path / "m")]) == 0
    )
    argv = ["-q", "calibrate", "--merged", str(tmp_path / "m"), *common, *CALIBRATE[:4]]
    assert main([*argv, "--output", str(tmp_path / "c")]) == 0
    for folder in ("m", "c"):
        written = load_file(str(tmp_path / folder / "model.safetensors"))
        assert "lm_head.weight" not in written and {t.dtype for t in written.values()} == {torch.bfloat16}
        model = AutoModelForCausalLM.from_pretrained(tmp_path / folder)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    merged, calibrated = (load_file(str(tmp_path / f / "model.safetensors")) for f in ("m", "c"))
    assert torch.equal(merged["model.embed_tokens.weight"], calibrated["model.embed_tokens.weight"])
    key = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(merged[key], calibrated[key])


def _bf16_zoo(root: Path) -> Path:
    """A bfloat16 tiny Llama base and two bfloat16 experts (as the MergeBench pool is stored), with their
    texts and data file; returns the data file."""
    base = save_model(root / "base", seed=0)
    base.to(torch.bfloat16).save_pretrained(root / "base")
    tokenizer().save_pretrained(root / "base")
    data = {"experts": {}}
    for i, name in enumerate(EXPERTS):
        expert = save_model(root / name, seed=10 + i, base=base.float())
        expert.to(torch.bfloat16).save_pretrained(root / name)
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in _rows(20 + i)))
        data["experts"][str(root / name)] = {"dataset": f"{name}.jsonl", "text": "{query} {response}"}
    (root / "data.yaml").write_text(json.dumps(data))
    return root / "data.yaml"


def test_output_dtype_float32_writes_float32_weights_that_the_base_dtype_rounds(tmp_path) -> None:
    """A bf16 pool is merged and calibrated into bf16 by default; ``--output-dtype float32`` keeps the
    float32 arithmetic's values: the same tensors before the storage cast (float32 rounded to bf16 is the
    default's output, bit for bit), ``config.json`` saying float32, recorded in the recipe only when set."""
    from transformers import AutoModelForCausalLM

    data = _bf16_zoo(tmp_path)
    common = ["--data", str(data), "--device", "cpu"]
    merge = ["-q", "merge", *common, "--base-model-id", str(tmp_path / "base")]
    assert main([*merge, "--output", str(tmp_path / "m16")]) == 0
    assert main([*merge, "--output-dtype", "float32", "--output", str(tmp_path / "m32")]) == 0
    calibrate = ["-q", "calibrate", "--merged", str(tmp_path / "m16"), *common, *CALIBRATE[:4]]
    assert main([*calibrate, "--output", str(tmp_path / "c16")]) == 0
    assert main([*calibrate, "--output-dtype", "float32", "--output", str(tmp_path / "c32")]) == 0
    for low, high in (("m16", "m32"), ("c16", "c32")):
        narrow, wide = (load_file(str(tmp_path / f / "model.safetensors")) for f in (low, high))
        assert {t.dtype for t in narrow.values()} == {torch.bfloat16}
        assert {t.dtype for t in wide.values()} == {torch.float32}
        assert narrow.keys() == wide.keys() and all(torch.equal(wide[k].bfloat16(), narrow[k]) for k in narrow)
        assert any(not torch.equal(wide[k], narrow[k].float()) for k in narrow)  # more than bf16's bits kept
        configs = [json.loads((tmp_path / f / "config.json").read_text()) for f in (low, high)]
        assert [c["dtype"] for c in configs] == ["bfloat16", "float32"]
        recipes = [json.loads((tmp_path / f / "featcal_recipe.json").read_text()) for f in (low, high)]
        assert "output_dtype" not in recipes[0] and recipes[1]["output_dtype"] == "float32"
        assert {k: v for k, v in recipes[1].items() if k != "output_dtype"} == recipes[0]
        model = AutoModelForCausalLM.from_pretrained(tmp_path / high)
        assert model.dtype == torch.float32
        state = model.state_dict()
        assert all(torch.equal(state[k], wide[k]) for k in wide)


@pytest.mark.parametrize("method", ["simple_average", "ties", "tsv", "iso_c", "wudi", "regmean", "regmean_plusplus"])
def test_every_merging_method_merges_language_models(zoo, tmp_path, method) -> None:
    """Task Arithmetic is checked against its formula above; the other methods write a folder that loads,
    differs from the base and records its method. RegMean and RegMean++ read the data file's texts (a
    few of them, padding weighing nothing) through the causal-LM adapter."""
    from transformers import AutoModelForCausalLM

    argv = ["-q", "merge", "--method", method, "--data", str(zoo / "data.yaml"), "--base-model-id", str(zoo / "base")]
    if method.startswith("regmean"):  # every row: 4 give fewer tokens than down_proj's 96 inputs, which is refused
        argv += ["--num-calibration-examples", "10", "--calibration-batch-size", "2"]
    assert main([*argv, "--device", "cpu", "--output", str(tmp_path / method)]) == 0
    model = AutoModelForCausalLM.from_pretrained(tmp_path / method)
    base = load_file(str(zoo / "base" / "model.safetensors"))
    key = "model.layers.0.self_attn.v_proj.weight"
    assert torch.isfinite(model.state_dict()[key]).all() and not torch.equal(model.state_dict()[key], base[key])
    assert json.loads((tmp_path / method / "featcal_recipe.json").read_text())["merge"]["method"] == method
