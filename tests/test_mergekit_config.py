"""Reading mergekit's ``mergekit_config.yml``: the merges featcal can calibrate, and one line for the rest."""

from __future__ import annotations

from pathlib import Path

import pytest

from featcal.errors import ModelInputError
from featcal.families.causal_lm.mergekit import (
    MERGEKIT_CONFIG,
    MergekitMerge,
    parse_mergekit_config,
    read_mergekit_folder,
)

WHERE = "/m/mergekit_config.yml"
BASE = "meta-llama/Llama-3.2-3B"
TASKS = ("instruction", "math", "coding", "multilingual", "safety")
EXPERTS = tuple(f"MergeBench/Llama-3.2-3B_{task}" for task in TASKS)

# MergeBench's Task Arithmetic (scaling coefficient 0.4) as mergekit's to_yaml() writes it: keys sorted.
MERGEBENCH_TA = f"base_model: {BASE}\ndtype: bfloat16\nmerge_method: task_arithmetic\nmodels:\n" + "".join(
    f"- model: {expert}\n  parameters:\n    weight: 0.4\n" for expert in EXPERTS
)

TIES_WITH_BASE = f"""\
models:
  - model: {BASE}
    # no parameters necessary for base model
  - model: MergeBench/Llama-3.2-3B_math
    parameters:
      density: 0.5
      weight: 0.5
  - model: MergeBench/Llama-3.2-3B_coding
    parameters:
      density: 0.5
      weight: 0.5
merge_method: ties
base_model: {BASE}
parameters:
  normalize: true
  int8_mask: true
dtype: float16
"""


def refusal(text: str) -> str:
    """The message parse_mergekit_config refuses ``text`` with; it must be one line naming the file."""
    with pytest.raises(ModelInputError) as info:
        parse_mergekit_config(text, WHERE)
    message = info.value.message
    assert info.value.ref == WHERE
    assert message.startswith(WHERE) and "\n" not in message and message.endswith(".")
    return message


def test_mergebench_task_arithmetic() -> None:
    merge = parse_mergekit_config(MERGEBENCH_TA, WHERE)
    assert merge.method == "task_arithmetic"
    assert merge.base_model == BASE
    assert merge.models == EXPERTS
    assert {m: dict(p) for m, p in merge.model_params.items()} == {e: {"weight": 0.4} for e in EXPERTS}
    assert dict(merge.params) == {}
    assert merge.dtype == "bfloat16"
    assert merge.featcal_method == "task_arithmetic"
    assert merge.featcal_params == {"scaling_factor": pytest.approx(0.4)}
    assert merge.text == MERGEBENCH_TA


def test_task_arithmetic_weights_lambda_and_normalize_give_featcals_scaling_factor() -> None:
    lead = f"merge_method: task_arithmetic\nbase_model: {BASE}\nmodels: [{EXPERTS[0]}, {EXPERTS[1]}]\n"
    # a global weight applies to each model without its own (mergekit's lookup order)
    lam = parse_mergekit_config(lead + "parameters: {weight: 1.0, lambda: 0.3}\n", WHERE)
    assert (lam.featcal_method, dict(lam.featcal_params)) == ("task_arithmetic", {"scaling_factor": 0.3})
    normalized = parse_mergekit_config(lead + "parameters: {weight: 2.0, normalize: 1.0, lambda: 0.8}\n", WHERE)
    assert normalized.featcal_params == {"scaling_factor": pytest.approx(0.4)}  # λ/T
    uneven = parse_mergekit_config(
        f"merge_method: task_arithmetic\nbase_model: {BASE}\nmodels:\n"
        f"- {{model: {EXPERTS[0]}, parameters: {{weight: 0.3}}}}\n"
        f"- {{model: {EXPERTS[1]}, parameters: {{weight: 0.5}}}}\n",
        WHERE,
    )
    assert (uneven.featcal_method, dict(uneven.featcal_params)) == (None, {})


def test_ties_lists_the_base_among_the_models_and_it_is_left_out() -> None:
    merge = parse_mergekit_config(TIES_WITH_BASE, WHERE)
    assert merge.method == "ties"
    assert merge.base_model == BASE
    assert merge.models == ("MergeBench/Llama-3.2-3B_math", "MergeBench/Llama-3.2-3B_coding")
    assert BASE not in merge.model_params  # listed without parameters
    assert dict(merge.params) == {"normalize": True, "int8_mask": True}
    assert merge.dtype == "float16"
    assert merge.featcal_method is None  # mergekit trims per tensor, featcal's ties per whole task vector


def test_linear_with_equal_weights_and_no_base_is_a_simple_average() -> None:
    merge = parse_mergekit_config(
        "merge_method: linear\nmodels:\n- model: a/one\n  parameters: {weight: 1.0}\n"
        "- model: a/two\n  parameters: {weight: 1.0}\n",
        WHERE,
    )
    assert (merge.base_model, merge.models, merge.featcal_method) == (None, ("a/one", "a/two"), "simple_average")
    # mergekit adds a named base to a linear merge's inputs: then the base is averaged in too
    with_base = parse_mergekit_config(
        "merge_method: linear\nbase_model: a/base\nmodels: [a/one, a/two]\nparameters: {weight: 1.0}\n", WHERE
    )
    assert with_base.featcal_method is None


def test_slerp_with_the_base_listed_reads_its_global_parameter() -> None:
    merge = parse_mergekit_config(
        "merge_method: slerp\nbase_model: a/base\nmodels:\n- model: a/base\n- model: a/tuned\n"
        "parameters:\n  t: {value: 0.5}\n",
        WHERE,
    )
    assert (merge.models, dict(merge.params), merge.featcal_method) == (("a/tuned",), {"t": 0.5}, None)


def test_revisions_and_the_mapping_form_of_a_reference_are_kept_as_mergekit_writes_them() -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    merge = parse_mergekit_config(
        f"merge_method: task_arithmetic\nbase_model: {BASE}@{commit}\nmodels:\n"
        f"- model: {EXPERTS[0]}@v1.0\n  parameters: {{weight: 0.4}}\n"
        f"- model: {{model: {{path: {EXPERTS[1]}, revision: main}}}}\n  parameters: {{weight: 0.4}}\n"
        f"- model: {BASE}@{commit}\n",
        WHERE,
    )
    assert merge.base_model == f"{BASE}@{commit}"
    assert merge.models == (f"{EXPERTS[0]}@v1.0", f"{EXPERTS[1]}@main")
    assert merge.featcal_method == "task_arithmetic"


@pytest.mark.parametrize("method", ["task_arithmetic", "simple_average"])
def test_featcals_own_mergekit_config_reads_back(tmp_path: Path, method: str) -> None:
    from featcal.model_recipe import MERGE, ModelRecipe, write_model_recipe
    from featcal.runfolder.record import MergeRecord

    experts = dict(zip(TASKS, EXPERTS))
    params = {"scaling_factor": 0.4} if method == "task_arithmetic" else {}
    recipe = ModelRecipe(MERGE, "causal_lm", BASE, experts, MergeRecord(method, params))
    write_model_recipe(tmp_path, recipe)
    merge = read_mergekit_folder(tmp_path)
    assert isinstance(merge, MergekitMerge)
    assert merge.models == EXPERTS
    assert merge.featcal_method == method
    assert merge.text == (tmp_path / MERGEKIT_CONFIG).read_text(encoding="utf-8")
    if method == "task_arithmetic":
        assert (merge.method, merge.base_model) == ("task_arithmetic", BASE)
        assert dict(merge.featcal_params) == params
    else:  # mergekit's linear merge takes no base
        assert (merge.method, merge.base_model) == ("linear", None)


def test_a_folder_without_the_file_has_no_mergekit_merge(tmp_path: Path) -> None:
    assert read_mergekit_folder(tmp_path) is None


def test_a_folder_whose_file_is_not_text_is_refused(tmp_path: Path) -> None:
    (tmp_path / MERGEKIT_CONFIG).write_bytes(b"\xff\xfe merge")
    with pytest.raises(ModelInputError, match="not UTF-8 text"):
        read_mergekit_folder(tmp_path)


def test_a_folder_reads_its_file(tmp_path: Path) -> None:
    (tmp_path / MERGEKIT_CONFIG).write_text(MERGEBENCH_TA, encoding="utf-8")
    merge = read_mergekit_folder(tmp_path)
    assert merge is not None and merge.models == EXPERTS
    (tmp_path / MERGEKIT_CONFIG).write_text("merge_method: ties\n", encoding="utf-8")
    with pytest.raises(ModelInputError) as info:
        read_mergekit_folder(tmp_path)
    assert info.value.ref == str(tmp_path / MERGEKIT_CONFIG)


LEAD = f"merge_method: task_arithmetic\nbase_model: {BASE}\n"
ONE = f"models:\n- model: {EXPERTS[0]}\n  parameters: {{weight: 0.4}}\n"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param("merge_method: [unclosed\n", ["is not valid YAML"], id="yaml"),
        pytest.param("- a\n- b\n", ["is not a mergekit merge configuration"], id="not-a-mapping"),
        pytest.param("", ["is not a mergekit merge configuration"], id="empty"),
        pytest.param(LEAD + "merge_method: ties\n" + ONE, ["'merge_method' appears twice", "keep one"], id="dup"),
        pytest.param(f"base_model: {BASE}\n" + ONE, ["names no merge_method", "merge_method: task_arithmetic"], id="m"),
        pytest.param(LEAD, ["lists no models"], id="no-models"),
        pytest.param(LEAD + f"models:\n- model: {BASE}\n", ["lists no models besides the base"], id="only-base"),
        pytest.param(LEAD + ONE + f"- model: {EXPERTS[0]}\n", ["lists model", "twice"], id="twice"),
    ],
)
def test_what_is_not_a_merge_configuration_is_refused(text: str, words: list[str]) -> None:
    message = refusal(text)
    assert all(word in message for word in words), message


def test_slices_and_layer_ranges_are_refused() -> None:
    slices = (
        "merge_method: passthrough\nslices:\n- sources:\n  - model: a/one\n    layer_range: [0, 16]\n"
        "- sources:\n  - model: a/two\n    layer_range: [8, 24]\n"
    )
    assert "'slices' (layer slices) is not supported: featcal calibrates whole-model merges only" in refusal(slices)
    modules = "merge_method: linear\nmodules:\n  text_decoder:\n    models: [a/one]\n"
    assert "'modules' (per-module merge definitions) is not supported" in refusal(modules)
    ranged = LEAD + f"models:\n- model: {EXPERTS[0]}\n  layer_range: [0, 16]\n"
    assert f"model '{EXPERTS[0]}' has a layer_range: featcal calibrates whole-model merges only" in refusal(ranged)


def test_parameters_that_vary_by_tensor_or_layer_are_refused_by_name() -> None:
    filtered = LEAD + f"models:\n- model: {EXPERTS[0]}\n  parameters:\n    weight:\n"
    filtered += "    - filter: mlp\n      value: 0.5\n    - value: 0\n"
    message = refusal(filtered)
    assert f"parameter 'weight' of model '{EXPERTS[0]}' varies by tensor" in message
    assert "single number for 'weight'" in message
    one_filter = LEAD + ONE + "parameters:\n  lambda: {filter: self_attn, value: 0.5}\n"
    assert "parameter 'lambda' of the merge varies by tensor" in refusal(one_filter)
    gradient = LEAD + f"models:\n- model: {EXPERTS[0]}\n  parameters: {{weight: 0.4, density: [1, 0.7, 0.1]}}\n"
    assert f"parameter 'density' of model '{EXPERTS[0]}' is a gradient over the layers" in refusal(gradient)
    assert "parameter 'weight' of the merge is not a number" in refusal(LEAD + ONE + "parameters:\n  weight:\n")


def test_lora_models_are_refused_with_how_to_merge_them_first() -> None:
    plus = LEAD + f"models:\n- model: {EXPERTS[0]}+my/lora\n  parameters: {{weight: 0.4}}\n"
    message = refusal(plus)
    assert f"model '{EXPERTS[0]}+my/lora' is the LoRA adapter 'my/lora' applied to '{EXPERTS[0]}'" in message
    assert "PeftModel.from_pretrained(base, lora).merge_and_unload().save_pretrained(dir)" in message
    assert "then list that folder" in message
    mapping = LEAD + f"models:\n- model:\n    model: {{path: {EXPERTS[0]}}}\n    lora: {{path: my/lora}}\n"
    assert f"model '{EXPERTS[0]}' has the LoRA adapter 'my/lora'" in refusal(mapping)
    assert "base_model 'a/base+my/lora' is the LoRA adapter" in refusal(
        "merge_method: ties\nbase_model: a/base+my/lora\n" + ONE
    )


def test_references_mergekit_cannot_read_and_architecture_overrides_are_refused() -> None:
    assert "is not a model reference mergekit reads" in refusal(LEAD + "models:\n- model: a/x+b/y+c/z\n")
    assert "is not a model reference mergekit reads" in refusal(LEAD + "models:\n- model: a/x@v1@v2\n")
    assert "names no 'model'" in refusal(LEAD + "models:\n- parameters: {weight: 1}\n")
    override = LEAD + "models:\n- model: {model: a/x, override_architecture: MistralForCausalLM}\n"
    assert "sets override_architecture 'MistralForCausalLM'" in refusal(override)


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("tokenizer_source: union\n", "tokenizer_source: union builds a union of the models' vocabularies"),
        (f"tokenizer_source: {EXPERTS[1]}\n", f"tokenizer_source '{EXPERTS[1]}' is not the base model ('{BASE}')"),
        ("tokenizer:\n  pad_to_multiple_of: 64\n", "'tokenizer' has source: union (mergekit's default)"),
        ("tokenizer:\n  source: union\n", "'tokenizer' has source: union"),
        (
            "tokenizer:\n  source: base\n  tokens:\n    <|im_start|>:\n      source: a/chat\n",
            "'tokenizer' adds or sets tokens (<|im_start|>)",
        ),
        ("tokenizer:\n  source: base\n  pad_to_multiple_of: 64\n", "'tokenizer' pads the vocabulary"),
    ],
)
def test_a_vocabulary_other_than_the_bases_is_refused(setting: str, words: str) -> None:
    message = refusal(LEAD + ONE + setting)
    assert words in message
    assert "the merged vocabulary is not the base model's, so the experts' embeddings do not line up" in message


@pytest.mark.parametrize(
    "setting", ["tokenizer_source: base\n", f"tokenizer_source: {BASE}\n", "tokenizer:\n  source: base\n"]
)
def test_the_base_models_tokenizer_is_accepted(setting: str) -> None:
    assert parse_mergekit_config(LEAD + ONE + setting, WHERE).models == (EXPERTS[0],)
