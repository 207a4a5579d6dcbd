"""Every causal-LM architecture featcal lists as supported, through the adapter and the calibration.

The list is the code's (:mod:`featcal.families.causal_lm.architectures`, recorded in ``architectures.json``):
each supported model type is built here from its default configuration at a tiny width with two layers
(:func:`~featcal.families.causal_lm.shape.tiny_config`) and checked for what the calibration relies on: the
adapter's chain of layers is the model's own forward on right-padded texts (eager and sdpa attention). A
representative subset, one per layer shape the five first architectures did not have (fused q/k/v and
gate/up projections, post-norms only with q/k norms, parallel attention and MLP with a bias-free LayerNorm,
embedding/residual/attention multipliers, Gemma's (1 + w) RMSNorm, LayerNorms with biases and partial rotary
embeddings, ALiBi), is calibrated: a merge equal to its expert is a fixed point, α = 1 gives the expert's first
group of layer 0 back, every solve of layer 0 equals a float64 least-squares oracle, tied embeddings stay tied.
Refusals: a mixture-of-experts, a state-space and an encoder-decoder model are refused in one line naming the
layer kind, by the library and by ``featcal merge`` (exit 2, nothing written).
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch
from featcal.calibration.driver import featcal_calibrate
from featcal.calibration.params import FeatCalParams
from featcal.cli import main
from featcal.families import get_family
from featcal.families.causal_lm.adapter import ATTENTION_MASK, INPUT_IDS, DecoderAdapter, describe
from featcal.families.causal_lm.architectures import known, table
from featcal.families.causal_lm.shape import UnsupportedArchitecture, build_model, tiny_config
from featcal.families.causal_lm.survey import probe
from tests.support.tiny_decoder import encode, texts

SUPPORTED = sorted(t for t, a in known().items() if a.supported)
REPRESENTATIVE = ("phi3", "olmo2", "cohere", "granite", "gemma", "stablelm", "bloom")
PARAMS = FeatCalParams(num_calibration_examples=8, calibration_batch_size=4)
State = dict[str, torch.Tensor]


def config_of(model_type: str, **options):
    """The model type's default configuration at a tiny width, two layers, ``options`` set."""
    from transformers import AutoConfig

    config = tiny_config(AutoConfig.for_model(model_type), num_layers=2)
    for name, value in options.items():
        setattr(config, name, value)
    return config


def model_of(config, attention: str | None = None, state: State | None = None) -> nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build_model(config, attention)
    if state is not None:
        model.load_state_dict(state)
    return model


def batch_of(seed: int, count: int, vocab: int) -> CalibrationBatch:
    """Right-padded texts (3 to 10 words) with their ids folded into the vocabulary, padding weighing 0."""
    batch = encode(texts(seed, count))
    ids = batch.inputs[INPUT_IDS] % vocab
    return CalibrationBatch({INPUT_IDS: ids}, dict(batch.context), batch.token_weights)


def final_input(model: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
    """The hidden states the model's own forward gets from its last decoder layer."""
    last = DecoderAdapter().layers(model)[-1]
    seen = {}
    handle = last.register_forward_hook(lambda _m, _a, out: seen.__setitem__("x", out))
    try:
        model(input_ids=batch.inputs[INPUT_IDS], attention_mask=batch.context[ATTENTION_MASK], use_cache=False)
    finally:
        handle.remove()
    return seen["x"][0] if isinstance(seen["x"], tuple) else seen["x"]


def chain(model: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
    adapter = DecoderAdapter()
    hidden = adapter.run_stem(adapter.stem(model), batch)
    context = adapter.layer_context(model, batch, hidden)
    for layer in adapter.layers(model):
        hidden = adapter.run_layer(layer, hidden, context)
    return hidden


def test_the_recorded_list_covers_every_causal_lm_of_the_installed_transformers() -> None:
    """``architectures.json`` lists each model type of transformers' causal-LM mapping once, with its class;
    the supported ones include the five featcal first calibrated and the shapes issue 41 names."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    recorded = known()
    assert {t: a.model_class for t, a in recorded.items()} == dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", *REPRESENTATIVE} <= set(SUPPORTED)
    for model_type in ("mixtral", "qwen3_moe", "gpt_oss"):
        assert "mixture-of-experts" in recorded[model_type].refused, model_type
    # the family claims the decoder-only ones, refused or not: a Mixtral folder is refused with its reason, while
    # BERT's and BART's LM heads are no causal LM of featcal's
    types = get_family("causal_lm").model_types
    assert {"llama", "mixtral", "mamba"} <= set(types) and not {"bert", "bart"} & set(types)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss", "mamba", "bart", "llama"])
def test_a_probe_gives_what_the_list_records(model_type: str) -> None:
    """The recorded entries are what the probe finds (a sample; every supported one is probed below)."""
    entry = known()[model_type]
    assert probe(model_type, entry.model_class) == entry


@pytest.mark.parametrize(("model_type", "attention"), [(t, a) for t in SUPPORTED for a in ("eager", "sdpa")])
def test_the_adapter_chain_is_the_model_s_own_forward_with_padding(model_type: str, attention: str) -> None:
    """Stem, then each layer with its batch's arguments, give the hidden states the model's own forward gets
    from its last layer, on every text token of right-padded texts (padding in every batch)."""
    config = config_of(model_type)
    try:
        model = model_of(config, attention)
    except ValueError as exc:  # transformers refuses sdpa for some (Gemma-2's soft-capped attention, ALiBi)
        assert attention == "sdpa" and "scaled_dot_product_attention" in str(exc), exc
        return
    batch = batch_of(0, 6, config.vocab_size)
    mask = batch.context[ATTENTION_MASK].bool()
    assert not mask.all()
    with torch.no_grad():
        got, want = chain(model, batch), final_input(model, batch)
    scale = max(1.0, float(want[mask].abs().max()))
    torch.testing.assert_close(got[mask], want[mask], rtol=1.3e-6, atol=1e-5 * scale)


# -- calibrations of the representative subset -----------------------------------------------------------


def zoo(model_type: str, tied: bool = False) -> tuple[object, State, dict[str, State], State]:
    """A tiny base, two experts (the base plus noise: a tied embedding is one parameter, one draw) and their
    Task Arithmetic merge (scaling 0.3)."""
    config = config_of(model_type, tie_word_embeddings=tied)
    base_model = model_of(config)
    base = {k: v.detach().clone() for k, v in base_model.state_dict().items()}
    experts = {}
    for i, task in enumerate(("a", "b")):
        expert = copy.deepcopy(base_model)
        generator = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        experts[task] = {k: v.detach().clone() for k, v in expert.state_dict().items()}
    merged = {k: base[k] + 0.3 * sum(experts[t][k] - base[k] for t in experts) if base[k].is_floating_point()
              else base[k] for k in base}  # fmt: skip
    return config, base, experts, merged


def calibrate(config, merged: State, base: State, experts: dict[str, State], params=PARAMS, count: int = 8):
    vocab = config.vocab_size
    return featcal_calibrate(
        model_of(config, state=merged), base, experts, lambda task: batch_of(len(task), count, vocab), params,
        adapter=DecoderAdapter(), progress=False,
    )  # fmt: skip


@pytest.fixture(scope="module", params=REPRESENTATIVE)
def arch(request):
    return request.param, zoo(request.param)


def test_a_merge_equal_to_its_only_expert_is_a_fixed_point(arch) -> None:
    """The merge as base and as the only expert: every solve gives the merged value back, up to float32
    rounding of the statistics (1e-5 relative, 1e-6 absolute: a hundredth of any real change)."""
    _, (config, _, _, merged) = arch
    calibrated = calibrate(config, merged, merged, {"a": merged}).state_dict()
    for key, value in merged.items():
        torch.testing.assert_close(calibrated[key], value, rtol=1e-5, atol=1e-6, msg=key)


def first_group(model: nn.Module) -> list[str]:
    """Layer 0's first group of linears that read one input (q/k/v, or a fused qkv), as the driver plans it."""
    from featcal.calibration.layer_state import Recorder, plan_layer

    adapter = DecoderAdapter()
    layer = adapter.layers(model)[0]
    modules = adapter.calibrated_modules(layer)
    recorders = Recorder(modules), Recorder(modules, outputs=True)
    batch = batch_of(0, 2, model.config.vocab_size)
    try:
        with torch.no_grad():
            chain(model, batch)
    finally:
        for recorder in recorders:
            recorder.remove()
    weighting = {n: adapter.token_weighting(n, 0, 2, 1) for n in modules}
    plan = plan_layer(modules, *recorders, weighting, adapter.normalization)
    return next(g.names for g in plan.groups if g.kind != "norm" and len(g.names) >= 1)


def test_alpha_1_recovers_the_expert_s_first_group(arch) -> None:
    """An expert that differs from the merge only in layer 0's first linear group: with α = 1 and λ near 0 the
    solve gives its outputs back on the texts' inputs (to 1e-4 of the expert's change of them). Outputs, not
    weights: a group fed by a LayerNorm reads inputs in a hyperplane (zero mean, scaled), along whose normal the
    weights are unidentifiable and, with λ near 0, whatever rounding makes them."""
    model_type, (config, _, _, merged) = arch
    model = model_of(config, state=merged)
    adapter = DecoderAdapter()
    adapter.layers(model)
    prefix = adapter.layer_prefix(0)
    names = first_group(model)
    expert = dict(merged)
    generator = torch.Generator().manual_seed(7)
    changed = [f"{prefix}{n}.{kind}" for n in names for kind in ("weight", "bias") if f"{prefix}{n}.{kind}" in merged]
    for key in changed:
        expert[key] = merged[key] + 0.1 * torch.randn(merged[key].shape, generator=generator)
    params = FeatCalParams(40, 4, lambda_ratio=1e-9, teacher_interp_alpha=1.0, covariance_eps=1e-12)
    calibrated = calibrate(config, merged, merged, {"a": expert}, params, count=40).state_dict()
    modules = {n: adapter.calibrated_modules(adapter.layers(model)[0])[n] for n in names}
    inputs = layer_inputs(model, modules, 1, config, count=40)

    def outputs(state: State, name: str) -> torch.Tensor:
        bias = state.get(f"{prefix}{name}.bias")
        y = inputs[name] @ state[f"{prefix}{name}.weight"].double().T
        return y if bias is None else y + bias.double()

    for name in names:
        moved = float((outputs(expert, name) - outputs(merged, name)).norm())
        assert float((outputs(calibrated, name) - outputs(expert, name)).norm()) < 1e-4 * moved, (model_type, name)


def test_every_solve_of_layer_0_equals_a_float64_least_squares_oracle(arch) -> None:
    """Layer 0 of the reference calibration (two experts): each linear's weight (and bias) and each norm's affine
    minimise the objectives of featcal-method.md, computed here with ``torch.linalg.lstsq`` in float64 on the
    inputs the models' own forwards give (padding dropped): to 1e-4 of the tensor's norm."""
    _, (config, base, experts, merged) = arch
    p = PARAMS
    calibrated = calibrate(config, merged, base, experts).state_dict()
    adapter = DecoderAdapter()
    student = model_of(config, state=merged)
    layer = adapter.layers(student)[0]
    prefix = adapter.layer_prefix(0)
    modules = adapter.calibrated_modules(layer)
    inputs = {task: (layer_inputs(student, modules, len(task), config),
                     layer_inputs(model_of(config, state=experts[task]), modules, len(task), config))
              for task in experts}  # fmt: skip

    def anchor(key: str) -> torch.Tensor:
        return p.anchor_blend_rho * merged[key].double() + (1 - p.anchor_blend_rho) * base[key].double()

    lam, alpha = p.lambda_ratio, p.teacher_interp_alpha
    for name, module in modules.items():
        key_w, key_b = f"{prefix}{name}.weight", f"{prefix}{name}.bias"
        has_bias = key_b in merged
        norm = adapter.normalization(module)
        rows, targets = [], []
        if norm is None:
            for task, (xs, xe) in inputs.items():
                x_s, x_t = xs[name], alpha * xe[name] + (1 - alpha) * xs[name]
                w_t = experts[task][key_w].double()
                s = 1 / float((x_s.T @ x_s / len(x_s)).norm())
                rows.append((s / len(x_s)) ** 0.5 * x_s)
                targets.append((s / len(x_s)) ** 0.5 * x_t @ w_t.T)
            rows.append(lam**0.5 * torch.eye(x_s.shape[1], dtype=torch.float64))
            targets.append(lam**0.5 * anchor(key_w).T)
            weight = torch.linalg.lstsq(torch.cat(rows), torch.cat(targets)).solution.T
            torch.testing.assert_close(calibrated[key_w].double(), weight, rtol=0, atol=1e-4 * float(weight.norm()))
            continue
        offset = norm.scale_offset
        for task, (xs, _) in inputs.items():
            z = norm.normalize(xs[name]).double()
            gamma_t = experts[task][key_w].double() + offset
            beta_t = experts[task][key_b].double() if has_bias else 0.0
            rows.append(z / len(z) ** 0.5)
            targets.append((gamma_t * z + beta_t) / len(z) ** 0.5)
        # per dimension: min Σ_t E(γ z + β − γ_t z − β_t)² + λ(γ − A(γ))² [+ λ(β − A(β))²]
        z_all, y_all = torch.cat(rows), torch.cat(targets)
        for d in range(z_all.shape[1]):
            columns = [z_all[:, d]]
            if has_bias:
                columns.append(torch.cat([torch.full((len(r),), 1 / len(r) ** 0.5, dtype=torch.float64)
                                          for r in rows]))  # fmt: skip
            design = torch.stack(columns, 1)
            ridge = lam**0.5 * torch.eye(design.shape[1], dtype=torch.float64)
            a_gamma = anchor(key_w)[d] + offset
            goal = [a_gamma] + ([anchor(key_b)[d]] if has_bias else [])
            solution = torch.linalg.lstsq(
                torch.cat([design, ridge]), torch.cat([y_all[:, d], lam**0.5 * torch.stack(goal)])[:, None]
            ).solution[:, 0]
            got = [calibrated[key_w][d].double() + offset] + ([calibrated[key_b][d].double()] if has_bias else [])
            torch.testing.assert_close(torch.stack(got), solution, rtol=1e-4, atol=1e-5, msg=f"{name}[{d}]")


def layer_inputs(
    model: nn.Module, modules: dict[str, nn.Module], seed: int, config, count: int = PARAMS.num_calibration_examples
) -> dict[str, torch.Tensor]:
    """Layer 0's submodules' inputs in ``model``'s own forward of ``count`` texts of the task (``seed``), text
    tokens only, float64."""
    adapter = DecoderAdapter()
    layer = adapter.layers(model)[0]
    batch = batch_of(seed, count, config.vocab_size)
    mask = batch.context[ATTENTION_MASK].bool()
    seen = {}
    hooks = [layer.get_submodule(n).register_forward_pre_hook(lambda _m, a, n=n: seen.__setitem__(n, a[0]))
             for n in modules]  # fmt: skip
    try:
        with torch.no_grad():
            model(input_ids=batch.inputs[INPUT_IDS], attention_mask=batch.context[ATTENTION_MASK], use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return {n: x[mask].double() for n, x in seen.items()}


@pytest.mark.parametrize("model_type", ["phi3", "cohere"])
def test_tied_embeddings_stay_tied(model_type: str) -> None:
    """A merge whose LM head is its token embedding is calibrated tied: one tensor, the merged value."""
    config, base, experts, merged = zoo(model_type, tied=True)
    calibrated = calibrate(config, merged, base, experts)
    assert calibrated.lm_head.weight is calibrated.get_input_embeddings().weight
    torch.testing.assert_close(calibrated.lm_head.weight, merged["model.embed_tokens.weight"], rtol=0, atol=0)


# -- refusals ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_type", "kind"),
    [("mixtral", "mixture-of-experts"), ("qwen3_moe", "mixture-of-experts"), ("gpt_oss", "mixture-of-experts"),
     ("mamba", "convolution"), ("bart", "encoder-decoder")],
)  # fmt: skip
def test_an_architecture_the_calibration_cannot_run_is_refused_in_one_line(model_type: str, kind: str) -> None:
    from transformers import AutoConfig

    with pytest.raises(UnsupportedArchitecture) as caught:
        describe(AutoConfig.for_model(model_type))
    message = str(caught.value)
    assert "\n" not in message and repr(model_type) in message and kind in message, message


def test_featcal_merge_of_a_mixture_of_experts_base_is_refused_before_any_work(tmp_path, capsys) -> None:
    """A tiny Mixtral base: ``featcal merge`` exits 2 with one line naming the architecture and the layer kind,
    and writes nothing."""
    config = config_of("mixtral")
    for name in ("base", "a"):
        model_of(config).save_pretrained(tmp_path / name)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "one two"}) + "\n")
    data = {"experts": {str(tmp_path / "a"): {"dataset": str(tmp_path / "a.jsonl"), "text": "{text}"}}}
    (tmp_path / "d.yaml").write_text(json.dumps(data))
    out = tmp_path / "out"
    capsys.readouterr()  # the folders' writing
    argv = ["-q", "merge", "--data", str(tmp_path / "d.yaml"), "--base-model-id", str(tmp_path / "base"),
            "--device", "cpu", "--output", str(out)]  # fmt: skip
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, err
    assert "'mixtral'" in err[0] and "mixture-of-experts" in err[0], err
    assert not out.exists()


def test_featcal_architectures_prints_the_code_s_list(monkeypatch, capsys) -> None:
    """The command prints :func:`table` of the probes (here of three model types, to keep it short)."""
    import featcal.families.causal_lm.survey as survey

    sample = [probe(t, known()[t].model_class) for t in ("llama", "mixtral", "phi3")]
    monkeypatch.setattr(survey, "installed", lambda: sample)
    assert main(["architectures"]) == 0
    out = capsys.readouterr().out
    assert out.strip() == table(sample)
    assert "supported (2):" in out and "refused (1):" in out and "mixture-of-experts" in out


def test_tiny_configs_cut_the_layer_types_with_the_layers() -> None:
    """Gemma-2's layers alternate sliding and full attention: one layer keeps the first type only."""
    config = config_of("gemma2")
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.hidden_size == 32
    one = tiny_config(config, num_layers=1)
    assert one.num_hidden_layers == 1 and one.layer_types == ["sliding_attention"]
