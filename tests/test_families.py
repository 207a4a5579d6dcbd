"""Model families: the registry, and the proof that the calibration knows no model.

A tiny two-layer ``LlamaForCausalLM`` family (``tests/support/tiny_decoder.py``: causal mask, rotary
embeddings, grouped-query attention, RMSNorm, right padding weighing 0) runs through the unchanged
calibration driver, the streamed calibration and the pipeline's calibrate stage; its adapter chain is
the model's own forward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file

from featcal.calibration.driver import featcal_calibrate
from featcal.calibration.params import FeatCalParams
from featcal.checkpoint import Checkpoint
from featcal.errors import ModelInputError, UnknownNameError
from featcal.families import (
    DEFAULT_FAMILY,
    command_modules,
    data_file_defaults,
    data_file_family,
    family_names,
    family_of_folder,
    get_family,
    mergekit_reader,
    register_family,
    task_entry_reader,
    task_schema,
    tasks_hint,
    unregister_family,
)
from featcal.families.causal_lm.adapter import DecoderAdapter
from featcal.resolve import RunInputs
from featcal.stages import calibrate
from tests.support.builders import FIXTURE
from tests.support.tiny_decoder import WORDS, TinyDecoderFamily, encode, save_model, texts

PARAMS = FeatCalParams(num_calibration_examples=12, calibration_batch_size=4)


def test_the_registry_knows_clip_and_names_the_known_families() -> None:
    assert "clip_vision" in family_names() and get_family("clip_vision").noun == "image"
    assert family_of_folder(FIXTURE / "base").name == "clip_vision"
    with pytest.raises(UnknownNameError, match="model family") as info:
        get_family("t5")
    assert "clip_vision" in info.value.known


def test_a_folder_of_no_known_family_is_named(tmp_path) -> None:
    (tmp_path / "bert").mkdir()
    (tmp_path / "bert" / "config.json").write_text('{"model_type": "bert"}')
    with pytest.raises(ModelInputError, match="'bert' model, of no model family featcal knows"):
        family_of_folder(tmp_path / "bert")
    family = TinyDecoderFamily({}, model_types=("bert",))
    register_family(family)
    try:
        assert family_of_folder(tmp_path / "bert") is family
        with pytest.raises(ValueError, match="registered twice"):
            register_family(family)
    finally:
        unregister_family(family.name)
    save_model(tmp_path / "llama", seed=0)
    assert family_of_folder(tmp_path / "llama").name == "causal_lm"


def test_the_registry_answers_for_each_family_what_generic_modules_ask() -> None:
    schemas = {name: task_schema(name) for name in family_names()}
    assert schemas == {"causal_lm": "text", "clip_vision": "image", "seq2seq": "pair"}
    assert DEFAULT_FAMILY == "clip_vision" and task_schema("no_such_family") == "image"
    assert [task_entry_reader(n).name for n in family_names()] == family_names()  # each reads its own entries
    assert task_entry_reader("no_such_family").name == DEFAULT_FAMILY
    assert [data_file_family(e) for e in ({"text": "x"}, {"input": "{a}"}, {"target": "{b}"}, {})] == [
        "causal_lm", "seq2seq", "seq2seq", "causal_lm",
    ]  # fmt: skip
    assert data_file_defaults("seq2seq") == ("max_length", "target_max_length")
    assert data_file_defaults("clip_vision") == data_file_defaults("causal_lm") == ("weigh", "max_length")
    assert "family: seq2seq" in tasks_hint(get_family("seq2seq"))
    assert command_modules() == ["featcal.families.causal_lm.cli"]
    assert mergekit_reader().__name__ == "featcal.families.causal_lm.mergekit"
    assert [n for n in family_names() if get_family(n).release.run_as_model_folder] == ["causal_lm"]


def test_every_built_in_family_s_table_resolves_every_member_of_the_interface() -> None:
    import inspect

    from featcal.families.base import ModelFamily

    members = [name for name, value in vars(ModelFamily).items() if inspect.isfunction(value)]
    assert {"checkpoint", "adapter", "calibration_inputs", "evaluator", "card_context"} <= set(members)
    for name in family_names():
        family = get_family(name)
        assert all(callable(getattr(family, member)) for member in members), name
        assert callable(family.parse_task_fields) and family.task_fields, name
        with pytest.raises(AttributeError, match="no attribute 'no_such_member'"):
            family.no_such_member  # noqa: B018


def test_a_family_that_declares_none_of_the_optional_facts_gets_the_defaults() -> None:
    family = TinyDecoderFamily({})
    register_family(family)
    try:
        assert task_schema(family.name) == "image" and task_entry_reader(family.name).name == DEFAULT_FAMILY
        assert tasks_hint(family) == f"tasks of family {family.name}"
        assert command_modules() == ["featcal.families.causal_lm.cli"]
    finally:
        unregister_family(family.name)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_adapter_chain_is_the_model_s_own_forward_with_padding(tmp_path, attn) -> None:
    model = save_model(tmp_path / "m", seed=1, attn=attn)
    adapter = DecoderAdapter()
    batch = encode(texts(0, 5))
    assert (batch.context["attention_mask"] == 0).any()  # some texts are padded
    with torch.no_grad():
        hidden = adapter.run_stem(adapter.stem(model), batch)
        context = adapter.layer_context(model, batch, hidden)
        for layer in adapter.layers(model):
            hidden = adapter.run_layer(layer, hidden, context)
        logits = model.lm_head(adapter.head(model)(hidden))
        expected = model(**batch.inputs, attention_mask=batch.context["attention_mask"]).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def llama_zoo(tmp_path_factory):
    """A base, two experts (base plus noise) and their Task Arithmetic merge, as folders, and the family."""
    root = tmp_path_factory.mktemp("llama")
    base = save_model(root / "base", seed=0)
    for t, seed in (("a", 1), ("b", 2)):
        save_model(root / t, seed=seed, base=base)
    checkpoints = {t: Checkpoint(root / t) for t in ("a", "b")}
    base_ckpt = Checkpoint(root / "base")
    merged = copy.deepcopy(base)
    with torch.no_grad():
        state = merged.state_dict()
        for key in state:
            state[key] += 0.3 * sum(checkpoints[t][key] - base_ckpt[key] for t in checkpoints)
    merged.save_pretrained(root / "merged")
    family = TinyDecoderFamily({"a": texts(10, 20), "b": texts(11, 20)})
    return root, family, base_ckpt, checkpoints


def _inputs(family, n=PARAMS.num_calibration_examples, seed=42):
    return lambda task: family.calibration_inputs(family.task(task), None, n, seed)


def _calibrated(root, family, base, experts, params=PARAMS, **kwargs):
    merged = family.load_model(root / "merged")
    return featcal_calibrate(merged, base, experts, _inputs(family, params.num_calibration_examples), params,
                             adapter=family.adapter(), progress=False, **kwargs)  # fmt: skip


def test_the_driver_calibrates_every_submodule_and_padding_weighs_nothing(llama_zoo) -> None:
    """Every linear and RMSNorm of each layer moves; padding the texts further changes nothing (it weighs
    0), and neither does the forward batch size."""
    root, family, base, experts = llama_zoo
    merged = family.load_model(root / "merged").state_dict()
    calibrated = _calibrated(root, family, base, experts).state_dict()
    layer_keys = [k for k in merged if ".layers." in k]
    assert layer_keys and all(not torch.equal(calibrated[k], merged[k]) for k in layer_keys)
    outside = [k for k in merged if ".layers." not in k]  # embedding, final norm, head: the merged values
    assert all(torch.equal(calibrated[k], merged[k]) for k in outside)
    padded = TinyDecoderFamily(family.corpora, max_length=16)
    for other in (_calibrated(root, padded, base, experts),
                  _calibrated(root, family, base, experts, FeatCalParams(12, calibration_batch_size=5))):  # fmt: skip
        state = other.state_dict()
        worst = max(float((state[k] - calibrated[k]).norm() / (calibrated[k] - merged[k]).norm()) for k in layer_keys)
        assert worst < 1e-4


def test_a_task_of_longer_texts_after_a_shorter_one_fits_the_statistics_buffers(llama_zoo) -> None:
    """Each task's texts are padded to its own longest (on each process, to that process's longest). A task
    longer than the first, whose texts are one forward batch, once overflowed buffers sized for the first
    task's length; now either order calibrates, to the same weights up to the float rounding of the folds."""
    root, family, base, experts = llama_zoo
    short = [" ".join(WORDS[i : i + 3]) for i in range(4)]
    long = [" ".join(WORDS[i : i + 10]) for i in range(4)]
    lengths = TinyDecoderFamily({"a": short, "b": long})
    params = FeatCalParams(num_calibration_examples=4, calibration_batch_size=4)
    merged = family.load_model(root / "merged").state_dict()
    states = [
        _calibrated(root, lengths, base, {name: experts[name] for name in order}, params).state_dict()
        for order in (("a", "b"), ("b", "a"))
    ]
    layer_keys = [k for k in merged if ".layers." in k]
    worst = max(float((states[1][k] - states[0][k]).norm() / (states[0][k] - merged[k]).norm()) for k in layer_keys)
    assert worst < 1e-6


def test_a_merge_equal_to_its_only_expert_is_a_fixed_point(llama_zoo) -> None:
    root, family, _, experts = llama_zoo
    merged_ckpt = Checkpoint(root / "merged")
    calibrated = featcal_calibrate(
        family.load_model(root / "merged"), merged_ckpt, {"a": merged_ckpt}, _inputs(family), PARAMS,
        adapter=family.adapter(), progress=False,
    ).state_dict()  # fmt: skip
    for key, value in family.load_model(root / "merged").state_dict().items():
        torch.testing.assert_close(calibrated[key], value, rtol=1e-4, atol=1e-5, msg=key)


def test_alpha_1_recovers_the_expert_s_first_layer_qkv(llama_zoo, tmp_path) -> None:
    """One task, an expert that differs from the merge only in layer 0's q/k/v, α = 1 and λ near 0: the
    solve gives the expert's q/k/v back (the inputs of both are the same, the targets the expert's)."""
    root, family, base, _ = llama_zoo
    merged = family.load_model(root / "merged")
    expert = copy.deepcopy(merged)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            weight = getattr(expert.model.layers[0].self_attn, name).weight
            weight.add_(0.1 * torch.randn_like(weight))
    expert.save_pretrained(tmp_path / "expert")
    params = FeatCalParams(60, 4, lambda_ratio=1e-9, teacher_interp_alpha=1.0, covariance_eps=1e-12)
    wide = TinyDecoderFamily({"a": texts(12, 60)})  # about 150 distinct tokens: their inputs span the width
    calibrated = featcal_calibrate(
        merged, Checkpoint(root / "merged"), {"a": Checkpoint(tmp_path / "expert")}, _inputs(wide, 60), params,
        adapter=family.adapter(), progress=False, stats_dtype=torch.float64,
    )  # fmt: skip
    for name in ("q_proj", "k_proj", "v_proj"):
        got = getattr(calibrated.model.layers[0].self_attn, name).weight
        want = getattr(expert.model.layers[0].self_attn, name).weight
        before = getattr(merged.model.layers[0].self_attn, name).weight
        assert float((got - want).norm()) < 1e-3 * float((want - before).norm()), name


def test_the_pipeline_s_calibrate_stage_writes_the_driver_s_weights(llama_zoo, tmp_path) -> None:
    """The stage streams the merged folder one layer at a time into the output folder: the same tensors as
    calibrating the loaded model in memory, bit for bit."""
    root, family, base, experts = llama_zoo
    expected = _calibrated(root, family, base, experts).state_dict()
    tasks = [family.task("a"), family.task("b")]
    inputs = RunInputs(family, tasks, str(root / "base"), root / "base", {}, experts, base)
    calibrate(inputs, root / "merged", tmp_path / "out", PARAMS, seed=42, device=torch.device("cpu"),
              preprocessor=None, progress=False)  # fmt: skip
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert written.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(written[k], expected[k])] == []
    assert family.load_model(tmp_path / "out").config.num_hidden_layers == 2
