"""Every architecture of the causal-LM family through the calibration: Llama, Mistral, Qwen2, Qwen3 and Gemma-2.

Per architecture a tiny random model built in code (hidden 64, two layers, 4 attention heads over 2
key-value heads), a base, two experts (the base plus noise) and their Task Arithmetic merge, calibrated
from right-padded batches of the word-level texts of ``tests/support/tiny_decoder.py`` (3 to 10 words).
Mistral slides a window of 4 over every layer; Gemma-2 slides it over layer 0 and attends fully in layer
1 (its ``layer_types`` default alternates, sliding first); Qwen3 runs a window of 4 in layer 1 (full
attention first, the other order); Llama and Qwen2 attend fully. Gemma-2 soft-caps its attention logits,
scales its embedding by sqrt(64) and its RMSNorms by (1 + w), with norms before and after its MLP; Qwen2
has q/k/v biases; Qwen3 normalises q and k per head (``q_norm``/``k_norm``, kept at their merged values).

Checked per architecture: the adapter chain is the model's own forward (eager and sdpa attention;
transformers refuses sdpa for Gemma-2, whose attention soft-caps); a merge equal to its only expert is
a fixed point; α = 1 recovers an expert's first-layer q/k/v (and Qwen2's biases); every linear solve
equals a float64 least-squares oracle, and every RMSNorm a brute-force least-squares fit of its scale,
both on the layer inputs of the models' own forwards; the results do not depend on the forward batch
size nor on extra padding; tied embeddings stay tied, untied heads keep the merged values; the sweep
and the drift meter run each expert layer as the layer it stands for.

Sliding-window layers of a type other than layer 0's (Gemma-2's and Qwen3's layer 1) found two bugs: the
adapter read the attention type from the decoder layer, where transformers 5 has none (it is on
``self_attn``), so every layer ran with the full causal mask; and the driver, the sweep and the drift
meter ran every expert layer as a copy of layer 0, so with the first layer's attention type.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch
from featcal.calibration.driver import featcal_calibrate
from featcal.calibration.params import FeatCalParams
from featcal.calibration.sweep import featcal_calibrate_many
from featcal.diagnostics.drift import measure_drift
from featcal.families.causal_lm.adapter import ATTENTION_MASK, INPUT_IDS, DecoderAdapter
from tests.support.tiny_decoder import VOCAB, encode, texts

State = dict[str, torch.Tensor]
PARAMS = FeatCalParams(num_calibration_examples=12, calibration_batch_size=4)  # λ, ρ, α: the reference run's
TASKS = {"a": 10, "b": 11}  # task name: seed of its texts
NUM_LAYERS = 2
COMMON = dict(
    vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96, num_hidden_layers=NUM_LAYERS, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
)  # fmt: skip
WINDOW = 4  # shorter than most texts: the sliding layers see less than the full ones
NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


@dataclass(frozen=True)
class Arch:
    """One architecture: its transformers classes, the options of its tiny config, whether its zoo ties the
    LM head to the embedding, the attention implementations transformers runs it with (its models run the
    last: sdpa, transformers' default, where it is allowed) and the offset of its RMSNorm scale (Gemma's
    ``1 + w``)."""

    name: str
    config_class: str
    model_class: str
    options: Mapping[str, Any] = field(default_factory=dict)
    tied: bool = False
    attentions: tuple[str, ...] = ("eager", "sdpa")
    scale_offset: float = 0.0

    @property
    def sliding(self) -> bool:
        return "sliding_window" in self.options

    def __str__(self) -> str:
        return self.name


ARCHS = [
    Arch("llama", "LlamaConfig", "LlamaForCausalLM"),
    Arch("mistral", "MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}, tied=True),
    Arch("qwen2", "Qwen2Config", "Qwen2ForCausalLM", tied=True),
    Arch("qwen3", "Qwen3Config", "Qwen3ForCausalLM",
         {"head_dim": 16, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    Arch("gemma2", "Gemma2Config", "Gemma2ForCausalLM",
         {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": WINDOW}, tied=True, attentions=("eager",),
         scale_offset=1.0),
]  # fmt: skip


def build(arch: Arch, state: Mapping[str, torch.Tensor] | None = None, *, tied: bool | None = None,
          attn: str | None = None, seed: int = 0, **overrides: Any) -> nn.Module:  # fmt: skip
    """A tiny model of ``arch`` (random from ``seed``, or holding ``state``), in eval mode. Built in code, in
    a few hundredths of a second."""
    import transformers

    options = {**COMMON, **arch.options, **overrides}
    config = getattr(transformers, arch.config_class)(
        **options, tie_word_embeddings=arch.tied if tied is None else tied,
        attn_implementation=attn or arch.attentions[-1],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, arch.model_class)(config).eval()
    if state is not None:
        model.load_state_dict(dict(state))
    return model


def state_of(model: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Zoo:
    """A base, two experts fine-tuned from it (base plus noise) and their Task Arithmetic merge (scaling 0.3)."""

    arch: Arch
    tied: bool
    base: State
    experts: dict[str, State]
    merged: State

    def model(self, state: Mapping[str, torch.Tensor] | None = None, **kwargs: Any) -> nn.Module:
        return build(self.arch, self.merged if state is None else state, tied=self.tied, **kwargs)


def make_zoo(arch: Arch, tied: bool) -> Zoo:
    base_model = build(arch, tied=tied, seed=0)
    base = state_of(base_model)
    experts = {}
    for i, task in enumerate(TASKS):
        expert = copy.deepcopy(base_model)
        generator = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():  # a tied embedding is one parameter: it gets one draw of noise
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        experts[task] = state_of(expert)
    merged = {k: base[k] + 0.3 * sum(experts[t][k] - base[k] for t in TASKS) for k in base}
    return Zoo(arch, tied, base, experts, merged)


def task_batch(task: str, count: int = PARAMS.num_calibration_examples, extra_padding: int = 0) -> CalibrationBatch:
    """The task's texts, right-padded to the longest (plus ``extra_padding``), padding weighing 0."""
    corpus = texts(TASKS.get(task, 12), count)
    if not extra_padding:
        return encode(corpus)
    return encode(corpus, max_length=encode(corpus).inputs[INPUT_IDS].shape[1] + extra_padding)


def calibrate(zoo: Zoo, params: FeatCalParams = PARAMS, *, base: State | None = None,
              experts: Mapping[str, State] | None = None, inputs: Callable[[str], CalibrationBatch] | None = None,
              **kwargs: Any) -> nn.Module:  # fmt: skip
    """The zoo's merge calibrated by the driver (by default from both experts' texts)."""
    return featcal_calibrate(
        zoo.model(), zoo.base if base is None else base, zoo.experts if experts is None else experts,
        inputs or (lambda task: task_batch(task, params.num_calibration_examples)), params,
        adapter=DecoderAdapter(), progress=False, **kwargs,
    )  # fmt: skip


class Zoos:
    """Zoos and their calibrations, built once per module (each in well under a second)."""

    def __init__(self) -> None:
        self._zoos: dict[tuple[str, bool], Zoo] = {}
        self._calibrated: dict[tuple[str, bool], nn.Module] = {}

    def zoo(self, arch: Arch, tied: bool | None = None) -> Zoo:
        key = (arch.name, arch.tied if tied is None else tied)
        if key not in self._zoos:
            self._zoos[key] = make_zoo(arch, key[1])
        return self._zoos[key]

    def calibrated_model(self, arch: Arch, tied: bool | None = None) -> nn.Module:
        """The reference calibration: both experts, 12 texts each, forward batches of 4 (not to be changed)."""
        zoo = self.zoo(arch, tied)
        key = (arch.name, zoo.tied)
        if key not in self._calibrated:
            self._calibrated[key] = calibrate(zoo)
        return self._calibrated[key]

    def calibrated(self, arch: Arch, tied: bool | None = None) -> State:
        return state_of(self.calibrated_model(arch, tied))


@pytest.fixture(scope="module")
def zoos() -> Zoos:
    return Zoos()


def solved_keys(state: Mapping[str, torch.Tensor]) -> list[str]:
    """The tensors FeatCal solves: every layer tensor but Qwen3's per-head q/k norms."""
    return [k for k in state if k.startswith("model.layers.") and ".q_norm." not in k and ".k_norm." not in k]


# -- 1. the adapter chain is the model's own forward ------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "attn"), [(arch, attn) for arch in ARCHS for attn in arch.attentions], ids=lambda v: str(v)
)
def test_the_adapter_chain_is_the_model_s_own_forward(zoos: Zoos, arch: Arch, attn: str) -> None:
    """Stem, each layer with its batch's context, and the final norm give the hidden states of the model's
    own forward on every text token. They run the model's own modules on the same tensors, with masks and
    rotary embeddings made by the model's own functions, so they agree to float32 rounding: hidden states
    here are of order 1 to 10 (Gemma-2's embedding is scaled by 8), and 1e-5 absolute with float32's 1.3e-6
    relative allows a few ulps of reassociation (they agree bit for bit today), while a mask of the wrong
    kind moved them by ~5."""
    model = zoos.zoo(arch).model(attn=attn)
    assert model.config._attn_implementation == attn
    adapter = DecoderAdapter()
    batch = task_batch("chain", 8)
    mask = batch.context[ATTENTION_MASK]
    lengths = mask.sum(1)
    assert (lengths < mask.shape[1]).any() and (lengths > WINDOW + 1).any()  # padded, and longer than the window
    with torch.no_grad():
        hidden = adapter.run_stem(adapter.stem(model), batch)
        context = adapter.layer_context(model, batch, hidden)
        chain = [hidden]
        for layer in adapter.layers(model):
            chain.append(adapter.run_layer(layer, chain[-1], context))
        chain[-1] = adapter.head(model)(chain[-1])  # the model's last hidden state is after its final norm
        own = model(input_ids=batch.inputs[INPUT_IDS], attention_mask=mask, output_hidden_states=True).hidden_states
    tokens = mask.bool()
    assert len(own) == len(chain) == NUM_LAYERS + 1
    for index, (got, want) in enumerate(zip(chain, own)):
        torch.testing.assert_close(got[tokens], want[tokens], rtol=1.3e-6, atol=1e-5, msg=f"hidden state {index}")
    if arch.sliding:  # the window matters at these lengths: without it the same weights give other states
        with torch.no_grad():
            wide = zoos.zoo(arch).model(attn=attn, sliding_window=64)
            unslid = wide(input_ids=batch.inputs[INPUT_IDS], attention_mask=mask, output_hidden_states=True)
        assert float((unslid.hidden_states[-1] - own[-1])[tokens].abs().max()) > 1e-2


# -- 2. a merge equal to its only expert is a fixed point --------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_a_merge_equal_to_its_only_expert_is_a_fixed_point(zoos: Zoos, arch: Arch) -> None:
    """One task whose expert is the merge, and the merge as base (so the anchor is the merge): the student and
    expert streams are one, every system's solution is the merged weight, and the calibration changes
    nothing but float32 rounding: the systems' sums are float32 products (float32's ε, 1.2e-7, relative to
    each), amplified by conditionings of order ten (λ = 0.05 against a normalised Gram), then written back in
    float32. 1e-5 relative and 1e-6 absolute on weights of order 0.02 to 1 is ten times what was measured
    (1.3e-6 and 1e-7 at most), and a hundredth of any real change (~1e-2 and more)."""
    zoo = zoos.zoo(arch)
    calibrated = state_of(calibrate(zoo, base=zoo.merged, experts={"a": zoo.merged}))
    for key, value in zoo.merged.items():
        torch.testing.assert_close(calibrated[key], value, rtol=1e-5, atol=1e-6, msg=key)


# -- 3. α = 1 recovers the expert's first-layer q/k/v ------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_alpha_1_recovers_the_expert_s_first_layer_qkv(zoos: Zoos, arch: Arch) -> None:
    """One task, an expert that differs from the merge only in layer 0's q/k/v (weights, and Qwen2's biases):
    its stem and first input norm are the merge's, so student and expert read the same q/k/v inputs. With
    α = 1 the targets are the expert's outputs, and with λ near 0 the solve gives the expert's q/k/v back,
    once 60 texts of about 150 distinct tokens make the inputs span the width: to 1e-5 of the expert's change
    (float32 rounding of the statistics, measured at 5e-7; λ = 1e-9 moves it by less)."""
    zoo = zoos.zoo(arch)
    expert = dict(zoo.merged)
    generator = torch.Generator().manual_seed(7)
    changed = []
    for name in ("q_proj", "k_proj", "v_proj"):
        for kind in ("weight", "bias"):
            key = f"model.layers.0.self_attn.{name}.{kind}"
            if key in expert:
                expert[key] = expert[key] + 0.1 * torch.randn(expert[key].shape, generator=generator)
                changed.append(key)
    assert len(changed) == (6 if arch.name == "qwen2" else 3)
    params = FeatCalParams(60, 4, lambda_ratio=1e-9, teacher_interp_alpha=1.0, covariance_eps=1e-12)
    calibrated = state_of(calibrate(zoo, params, base=zoo.merged, experts={"a": expert},
                                    inputs=lambda task: task_batch("wide", 60)))  # fmt: skip
    for key in changed:
        moved = float((expert[key] - zoo.merged[key]).norm())
        assert float((calibrated[key] - expert[key]).norm()) < 1e-5 * moved, key


# -- 4, 5. every solve against a float64 least-squares oracle ------------------------------------------------


def layer_inputs(model: nn.Module, index: int, names: list[str], batch: CalibrationBatch) -> dict[str, torch.Tensor]:
    """The inputs of layer ``index``'s submodules ``names`` in the model's own forward of ``batch``, flattened
    to [tokens, d] in float64."""
    layer, seen = model.model.layers[index], {}
    hooks = [
        layer.get_submodule(name).register_forward_pre_hook(
            lambda _module, args, name=name: seen.__setitem__(name, args[0].detach().reshape(-1, args[0].shape[-1]))
        )
        for name in names
    ]
    try:
        with torch.no_grad():
            model(input_ids=batch.inputs[INPUT_IDS], attention_mask=batch.context[ATTENTION_MASK])
    finally:
        for hook in hooks:
            hook.remove()
    return {name: x.double() for name, x in seen.items()}


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@dataclass
class TaskInputs:
    """One task's inputs of one layer's submodules: the student's (the calibrated earlier layers, then the
    merged layer), the expert's (its own model), and each token's weight (0 for padding)."""

    student: dict[str, torch.Tensor]
    expert: dict[str, torch.Tensor]
    weights: torch.Tensor
    expert_state: State


def oracle(zoo: Zoo, calibrated: State, params: FeatCalParams = PARAMS) -> State:
    """What FeatCal should give for every solved tensor, from first principles in float64: per layer, the
    models' own forwards give each submodule's inputs, and each objective of featcal-method.md is minimised
    by ``torch.linalg.lstsq`` on stacked rows (ε, 1e-8 against λ = 0.05, left out).

    Linear: min_W Σ_t s_t E_w‖W x_s − W_t x_τ‖² + λ‖W − A(W)‖², s_t = 1/‖E_w[x_s x_sᵀ]‖_F, then the bias
    given W: min_b Σ_t s_t E_w‖W x_s + b − W_t x_τ − b_t‖² + λ‖b − A(b)‖².
    RMSNorm: min_γ Σ_t E_w‖γ⊙z − γ_t⊙z‖² + λ‖γ − A(γ)‖² over the whole scale γ = offset + w at once (a
    block-diagonal design, one row per token and dimension), z = x_s / rms(x_s).
    """
    lam, alpha, rho = params.lambda_ratio, params.teacher_interp_alpha, params.anchor_blend_rho
    arch, eps = zoo.arch, float(zoo.model().config.rms_norm_eps)
    adapter = DecoderAdapter()
    names = list(adapter.calibrated_modules(zoo.model().model.layers[0]))
    expected: State = {}

    def anchor(key: str) -> torch.Tensor:
        return rho * zoo.merged[key].double() + (1 - rho) * zoo.base[key].double()

    for index in range(NUM_LAYERS):
        earlier = {k: v for k, v in calibrated.items() if any(k.startswith(f"model.layers.{j}.") for j in range(index))}
        student = zoo.model({**zoo.merged, **earlier})
        tasks = []
        for task, state in zoo.experts.items():
            batch = task_batch(task)
            tasks.append(TaskInputs(
                layer_inputs(student, index, names, batch), layer_inputs(zoo.model(state), index, names, batch),
                batch.token_weights.reshape(-1).double(), state,
            ))  # fmt: skip
        prefix = f"model.layers.{index}."
        for name in names:
            key = f"{prefix}{name}.weight"
            if name.split(".")[-1] in NORMS:
                design, target = [], []
                for t in tasks:
                    z = rms_normalize(t.student[name], eps) * (t.weights / t.weights.sum()).sqrt().unsqueeze(1)
                    gamma_t = arch.scale_offset + t.expert_state[key].double()
                    design.append(torch.diag_embed(z).reshape(-1, z.shape[1]))
                    target.append((z * gamma_t).reshape(-1))
                design.append(lam**0.5 * torch.eye(z.shape[1], dtype=torch.float64))
                target.append(lam**0.5 * (arch.scale_offset + anchor(key)))
                gamma = torch.linalg.lstsq(torch.cat(design), torch.cat(target).unsqueeze(1)).solution.squeeze(1)
                expected[key] = gamma - arch.scale_offset
                continue
            rows, target, roots, taus = [], [], [], []
            for t in tasks:
                xs, xe, w = t.student[name], t.expert[name], t.weights
                scale = 1.0 / ((xs * w.unsqueeze(1)).T @ xs / w.sum()).norm()
                root = (scale * w / w.sum()).sqrt().unsqueeze(1)
                tau = alpha * xe + (1 - alpha) * xs
                rows.append(root * xs)
                target.append(root * (tau @ t.expert_state[key].double().T))
                roots.append(root)
                taus.append(tau)
            rows.append(lam**0.5 * torch.eye(xs.shape[1], dtype=torch.float64))
            target.append(lam**0.5 * anchor(key).T)
            weight = torch.linalg.lstsq(torch.cat(rows), torch.cat(target)).solution.T
            expected[key] = weight
            bias_key = f"{prefix}{name}.bias"
            if bias_key in zoo.merged:
                ones, target = [], []
                for t, root, tau in zip(tasks, roots, taus):
                    xs, w_t, b_t = t.student[name], t.expert_state[key].double(), t.expert_state[bias_key].double()
                    ones.append(root)
                    target.append(root * (tau @ w_t.T + b_t - xs @ weight.T))
                ones.append(lam**0.5 * torch.ones(1, 1, dtype=torch.float64))
                target.append(lam**0.5 * anchor(bias_key).unsqueeze(0))
                expected[bias_key] = torch.linalg.lstsq(torch.cat(ones), torch.cat(target)).solution.squeeze(0)
    return expected


@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_every_linear_and_norm_solve_matches_a_float64_least_squares_oracle(zoos: Zoos, arch: Arch) -> None:
    """Every solved tensor of both layers (q/k/v with Qwen2's biases, o, gate/up, down, and every RMSNorm,
    Gemma-2's four with their (1 + w) scale) equals the oracle's least-squares solution on the inputs of the
    models' own forwards (two tasks, padding weighing 0). The driver's inputs are float32 forwards of other
    batch shapes and its Gram products float32, so its solutions differ from the float64 oracle by the
    float32 error of the statistics (float32's ε, 1.2e-7, relative) times the systems' conditioning
    (normalised Grams plus λ = 0.05: of order ten), written back in float32: 6e-7 of each tensor's size at
    most, measured. 1e-5 allows ten times that, while an error of the method moves solutions by far more
    (padding counted: 0.3 of the tensor; Gemma's anchor taken without its offset: 0.9). Qwen3's q/k norms,
    the embedding, the final norm and the LM head keep their merged values."""
    zoo = zoos.zoo(arch)
    calibrated = zoos.calibrated(arch)
    expected = oracle(zoo, calibrated)
    assert sorted(expected) == sorted(solved_keys(zoo.merged))
    for key, want in expected.items():
        error = float((calibrated[key].double() - want).norm() / want.norm())
        assert error < 1e-5, f"{key}: relative error {error:.2e}"
        assert float((calibrated[key] - zoo.merged[key]).norm() / zoo.merged[key].norm()) > 1e-3, key  # it moved
    for key in set(zoo.merged) - set(expected):
        assert torch.equal(calibrated[key], zoo.merged[key]), key


# -- 6. the forward batch size and extra padding change nothing --------------------------------------------


@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_batch_size_and_extra_padding_change_nothing(zoos: Zoos, arch: Arch) -> None:
    """Forward batches of 2 instead of 4, or every text padded 5 tokens past the longest: padding weighs 0 and
    statistics are sums, so the weights are the reference calibration's to float32 rounding: the sums are
    taken in other orders and chunks, which moved no tensor by more than 7e-7 of its size (measured); 1e-5
    allows ten times that."""
    zoo = zoos.zoo(arch)
    reference = zoos.calibrated(arch)
    others = {
        "batches of 2": calibrate(zoo, FeatCalParams(12, calibration_batch_size=2)),
        "padding + 5": calibrate(zoo, inputs=lambda task: task_batch(task, extra_padding=5)),
    }
    for what, model in others.items():
        state = state_of(model)
        for key in zoo.merged:
            error = float((state[key] - reference[key]).norm() / reference[key].norm())
            assert error < 1e-5, f"{what}: {key}: relative error {error:.2e}"


# -- 7. tied embeddings stay tied, untied heads keep the merged values ---------------------------------------


@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_streams_kept_in_host_memory_give_the_same_weights(zoos: Zoos, arch: Arch) -> None:
    """Every task's streams in host memory, copied to the device while used and back once advanced: the
    reference calibration's weights, bit for bit on the CPU."""
    reference, in_host = zoos.calibrated(arch), state_of(calibrate(zoos.zoo(arch), stream_storage="host"))
    assert in_host.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(in_host[key], value), key


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_tied_embeddings_stay_tied_and_untied_heads_keep_the_merge(zoos: Zoos, arch: Arch, tied: bool) -> None:
    zoo = zoos.zoo(arch, tied)
    model = zoos.calibrated_model(arch, tied)
    embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
    assert torch.equal(embedding, zoo.merged["model.embed_tokens.weight"])
    if tied:
        assert head is embedding
    else:
        assert head is not embedding and torch.equal(head, zoo.merged["lm_head.weight"])
        assert not torch.equal(head, embedding)
    assert torch.equal(model.model.norm.weight, zoo.merged["model.norm.weight"])


# -- the sweep and the drift meter run each expert layer as the layer it stands for -------------------------


@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_the_sweep_of_one_setting_is_the_driver_s_calibration(zoos: Zoos, arch: Arch) -> None:
    """The sweep runs its expert layers as the driver does (a copy of the layer at the same index, which a
    sliding-window layer needs): one setting gives the driver's weights, to float32 rounding."""
    zoo = zoos.zoo(arch)
    [(_, swept)] = featcal_calibrate_many(
        zoo.model(), zoo.base, zoo.experts, task_batch, [PARAMS], adapter=DecoderAdapter(), progress=False
    )
    reference, state = zoos.calibrated(arch), state_of(swept)
    for key in zoo.merged:
        error = float((state[key] - reference[key]).norm() / reference[key].norm())
        assert error < 1e-5, f"{key}: relative error {error:.2e}"


@pytest.mark.parametrize("arch", ARCHS, ids=str)
def test_a_model_s_drift_from_itself_is_zero_at_every_layer(zoos: Zoos, arch: Arch) -> None:
    """The drift meter runs the expert's layers as copies of the model's layer at the same index: a model
    measured against its own tensors drifts by nothing, in the sliding-window layers too."""
    zoo = zoos.zoo(arch)
    drift = measure_drift({"merged": zoo.model()}, {"a": zoo.merged}, task_batch, adapter=DecoderAdapter(),
                          batch_size=4, progress=False)  # fmt: skip
    assert drift.points[:-1] == tuple(f"layer {i}" for i in range(NUM_LAYERS))
    assert max(drift.drift["merged"]["a"]) < 1e-6
