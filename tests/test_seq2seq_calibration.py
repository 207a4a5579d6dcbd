"""The T5 encoder-decoder through the calibration: the adapter's chain, the solves, and what stays merged.

A tiny random T5 built in code (d_model 64, two encoder and two decoder blocks, 4 heads, FLAN-T5's gated-GELU
feed-forward; ``tests/support/tiny_t5.py``), a base, two experts (the base plus noise) and their Task Arithmetic
merge, calibrated from right-padded batches of synthetic (input, target) pairs: inputs of 3 to 10 words, targets
of 1 to 3 (with ``</s>``), so both the encoder's and the decoder's positions are padded.

Checked: the adapter's chain of blocks is the model's own forward (eager and sdpa), encoder and decoder; a merge
equal to its only expert is a fixed point; α = 1 recovers an expert's first-layer self-attention q/k/v and its
first decoder block's cross-attention k/v (which read the encoder output); every linear solve, the cross-attention
group included, equals a float64 least-squares oracle and every T5LayerNorm a least-squares fit of its scale, on
the inputs of the models' own forwards; the forward batch size and extra padding change nothing; tied embeddings
stay tied, an untied head, the embedding, the final norms and the relative-attention tables keep their merged
values; the sweep and the drift meter run the streams as the driver does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch
from featcal.calibration.driver import featcal_calibrate
from featcal.calibration.params import FeatCalParams
from featcal.calibration.sweep import featcal_calibrate_many
from featcal.diagnostics.drift import measure_drift
from featcal.families.seq2seq.adapter import (
    ATTENTION_MASK,
    DECODER_ATTENTION_MASK,
    DECODER_INPUT_IDS,
    INPUT_IDS,
    T5Adapter,
)
from tests.support.tiny_t5 import build, encode, pairs

State = dict[str, torch.Tensor]
PARAMS = FeatCalParams(num_calibration_examples=12, calibration_batch_size=4)  # λ, ρ, α: the reference run's
TASKS = {"a": 10, "b": 11}  # task name: seed of its pairs
ENCODER_LAYERS = DECODER_LAYERS = 2


def state_of(model: nn.Module) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@dataclass
class Zoo:
    """A base, two experts (base plus noise) and their Task Arithmetic merge (scaling 0.3)."""

    tied: bool
    base: State
    experts: dict[str, State]
    merged: State

    def model(self, state: Mapping[str, torch.Tensor] | None = None, **kwargs: Any) -> nn.Module:
        return build(self.merged if state is None else state, tied=self.tied, **kwargs)


def make_zoo(tied: bool) -> Zoo:
    base_model = build(tied=tied, seed=0)
    base = state_of(base_model)
    experts = {}
    for i, task in enumerate(TASKS):
        expert = copy.deepcopy(base_model)
        generator = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():  # a tied embedding is one parameter: one draw of noise
            for p in expert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator))
        experts[task] = state_of(expert)
    merged = {k: base[k] + 0.3 * sum(experts[t][k] - base[k] for t in TASKS) for k in base}
    return Zoo(tied, base, experts, merged)


def task_batch(task: str, count: int = PARAMS.num_calibration_examples, extra_padding: int = 0) -> CalibrationBatch:
    return encode(pairs(TASKS.get(task, 12), count), extra_padding=extra_padding)


def calibrate(zoo: Zoo, params: FeatCalParams = PARAMS, *, base: State | None = None,
              experts: Mapping[str, State] | None = None, inputs: Callable[[str], CalibrationBatch] | None = None,
              **kwargs: Any) -> nn.Module:  # fmt: skip
    return featcal_calibrate(
        zoo.model(), zoo.base if base is None else base, zoo.experts if experts is None else experts,
        inputs or (lambda task: task_batch(task, params.num_calibration_examples)), params,
        adapter=T5Adapter(), progress=False, **kwargs,
    )  # fmt: skip


class Zoos:
    """Zoos and their reference calibrations (both experts, 12 pairs each, batches of 4), built once."""

    def __init__(self) -> None:
        self._zoos: dict[bool, Zoo] = {}
        self._calibrated: dict[bool, nn.Module] = {}

    def zoo(self, tied: bool = False) -> Zoo:
        if tied not in self._zoos:
            self._zoos[tied] = make_zoo(tied)
        return self._zoos[tied]

    def calibrated_model(self, tied: bool = False) -> nn.Module:
        if tied not in self._calibrated:
            self._calibrated[tied] = calibrate(self.zoo(tied))
        return self._calibrated[tied]

    def calibrated(self, tied: bool = False) -> State:
        return state_of(self.calibrated_model(tied))


@pytest.fixture(scope="module")
def zoos() -> Zoos:
    return Zoos()


def own_forward(model: nn.Module, batch: CalibrationBatch) -> Any:
    return model(
        input_ids=batch.inputs[INPUT_IDS], attention_mask=batch.context[ATTENTION_MASK],
        decoder_input_ids=batch.inputs[DECODER_INPUT_IDS], decoder_attention_mask=batch.context[DECODER_ATTENTION_MASK],
    )  # fmt: skip


def solved_keys(state: Mapping[str, torch.Tensor]) -> list[str]:
    """What FeatCal solves: every block tensor but the relative-attention tables."""
    return [k for k in state if ".block." in k and "relative_attention_bias" not in k]


# -- 1. the adapter chain is the model's own forward -----------------------------------------------------


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_the_adapter_chain_is_the_model_s_own_forward(zoos: Zoos, attn: str) -> None:
    """Stem, each block with its batch's context and its stream's carry, give every block's output of the
    model's own forward on every input and target position, the encoder output (after its final norm) and
    the logits. They run the model's own modules on the same tensors, with masks made by the model's own
    functions: they agree to float32 rounding (1e-5 on hidden states of order 1 to 10; bit for bit today),
    while a missing position bias or the wrong mask moves them by far more."""
    model = zoos.zoo().model(attn=attn)
    assert model.config._attn_implementation == attn
    adapter = T5Adapter()
    batch = task_batch("chain", 8)
    mask, target = batch.context[ATTENTION_MASK], batch.context[DECODER_ATTENTION_MASK]
    assert (mask.sum(1) < mask.shape[1]).any() and (target.sum(1) < target.shape[1]).any()  # both padded
    length = mask.shape[1]
    seen: list[torch.Tensor] = []
    hooks = [block.register_forward_hook(lambda _m, _a, out: seen.append(out[0])) for block in adapter.layers(model)]
    try:
        with torch.no_grad():
            own = own_forward(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        stem = adapter.stem(model)
        hidden, carry = adapter.run_stem(stem, batch), adapter.stem_carry(stem)
        context = adapter.layer_context(model, batch, hidden)
        chain = []
        for layer in adapter.layers(model):
            hidden, carry = adapter.run_layer_carried(layer, hidden, context, carry)
            chain.append(hidden)
        logits = model.lm_head(adapter.head(model)(hidden[:, length:]))
    assert len(chain) == len(seen) == ENCODER_LAYERS + DECODER_LAYERS
    for index, (got, want) in enumerate(zip(chain, seen)):
        part, keep = (got[:, :length], mask) if index < ENCODER_LAYERS else (got[:, length:], target)
        if index == ENCODER_LAYERS - 1:  # the stream holds the encoder's output: after its final norm
            want = model.encoder.final_layer_norm(want)
        torch.testing.assert_close(part[keep.bool()], want[keep.bool()], rtol=1.3e-6, atol=1e-5, msg=f"block {index}")
    torch.testing.assert_close(chain[-1][:, :length][mask.bool()], own.encoder_last_hidden_state[mask.bool()],
                               rtol=1.3e-6, atol=1e-5)  # fmt: skip
    torch.testing.assert_close(logits[target.bool()], own.logits[target.bool()], rtol=1.3e-6, atol=1e-5)


# -- 2. a merge equal to its only expert is a fixed point ---------------------------------------------------


def test_a_merge_equal_to_its_only_expert_is_a_fixed_point(zoos: Zoos) -> None:
    """One task whose expert is the merge, the merge as base: the streams are one and every solution is the
    merged value, to float32 rounding of the statistics (1e-5 relative, 1e-6 absolute)."""
    zoo = zoos.zoo()
    calibrated = state_of(calibrate(zoo, base=zoo.merged, experts={"a": zoo.merged}))
    for key, value in zoo.merged.items():
        torch.testing.assert_close(calibrated[key], value, rtol=1e-5, atol=1e-6, msg=key)


# -- 3. α = 1 recovers an expert's first-layer q/k/v and its first cross-attention k/v ------------------------


@pytest.mark.parametrize(
    "keys",
    [
        [f"encoder.block.0.layer.0.SelfAttention.{n}.weight" for n in "qkv"],
        [f"decoder.block.0.layer.1.EncDecAttention.{n}.weight" for n in "kv"],
    ],
    ids=["encoder self-attention q/k/v", "decoder cross-attention k/v"],
)
def test_alpha_1_recovers_the_expert_s_weights(zoos: Zoos, keys: list[str]) -> None:
    """One task, an expert that differs from the merge only in ``keys``: the student and the expert read the
    same inputs there (the encoder's first block's normed input; the encoder output, the encoders being equal),
    so with α = 1 and λ near 0 the solve gives the expert's weights back, once 60 pairs make the inputs span
    the width: to 1e-5 of the expert's change (float32 rounding of the statistics)."""
    zoo = zoos.zoo()
    expert = dict(zoo.merged)
    generator = torch.Generator().manual_seed(7)
    for key in keys:
        expert[key] = expert[key] + 0.1 * torch.randn(expert[key].shape, generator=generator)
    params = FeatCalParams(60, 4, lambda_ratio=1e-9, teacher_interp_alpha=1.0, covariance_eps=1e-12)
    calibrated = state_of(calibrate(zoo, params, base=zoo.merged, experts={"a": expert},
                                    inputs=lambda task: task_batch("wide", 60)))  # fmt: skip
    for key in keys:
        moved = float((expert[key] - zoo.merged[key]).norm())
        assert float((calibrated[key] - expert[key]).norm()) < 1e-5 * moved, key


# -- 4. every solve against a float64 least-squares oracle ------------------------------------------------------


def block_inputs(model: nn.Module, index: int, names: list[str], batch: CalibrationBatch) -> dict[str, torch.Tensor]:
    """The inputs of block ``index``'s submodules ``names`` in the model's own forward, [tokens, d], float64."""
    block = T5Adapter().layers(model)[index]
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        block.get_submodule(name).register_forward_pre_hook(
            lambda _module, args, name=name: seen.__setitem__(name, args[0].detach().reshape(-1, args[0].shape[-1]))
        )
        for name in names
    ]
    try:
        with torch.no_grad():
            own_forward(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
    return {name: x.double() for name, x in seen.items()}


def token_weights(index: int, name: str, batch: CalibrationBatch) -> torch.Tensor:
    """A submodule's token weights: the input mask in the encoder and for the cross-attention's keys and values
    (they read the encoder output), the target mask elsewhere in the decoder."""
    encoder_side = index < ENCODER_LAYERS or name.endswith(("EncDecAttention.k", "EncDecAttention.v"))
    return batch.context[ATTENTION_MASK if encoder_side else DECODER_ATTENTION_MASK].reshape(-1).double()


def prefix_of(index: int) -> str:
    return f"encoder.block.{index}." if index < ENCODER_LAYERS else f"decoder.block.{index - ENCODER_LAYERS}."


def oracle(zoo: Zoo, calibrated: State, params: FeatCalParams = PARAMS) -> State:
    """What FeatCal should give for every solved tensor, from first principles in float64, the blocks in forward
    order (encoder, then decoder): the models' own forwards give each submodule's inputs (the student's from the
    merge with the blocks before calibrated), and each objective of featcal-method.md is minimised by
    ``torch.linalg.lstsq`` on stacked rows (ε left out).

    Linear: min_W Σ_t s_t E_w‖W x_s − W_t x_τ‖² + λ‖W − A(W)‖², s_t = 1/‖E_w[x_s x_sᵀ]‖_F, x_τ = α x_e + (1 − α) x_s
    (for the cross-attention's k/v, x_s and x_e are the student's and the expert's encoder outputs).
    T5LayerNorm: min_γ Σ_t E_w‖γ⊙z − γ_t⊙z‖² + λ‖γ − A(γ)‖², z = x_s / rms(x_s).
    """
    lam, alpha, rho = params.lambda_ratio, params.teacher_interp_alpha, params.anchor_blend_rho
    model = zoo.model()
    eps = float(model.config.layer_norm_epsilon)
    adapter = T5Adapter()
    expected: State = {}

    def anchor(key: str) -> torch.Tensor:
        return rho * zoo.merged[key].double() + (1 - rho) * zoo.base[key].double()

    for index in range(ENCODER_LAYERS + DECODER_LAYERS):
        names = list(adapter.calibrated_modules(adapter.layers(model)[index]))
        earlier = {k: v for k, v in calibrated.items() if any(k.startswith(prefix_of(j)) for j in range(index))}
        student = zoo.model({**zoo.merged, **earlier})
        tasks = []
        for task, state in zoo.experts.items():
            batch = task_batch(task)
            tasks.append((block_inputs(student, index, names, batch),
                          block_inputs(zoo.model(state), index, names, batch), batch, state))  # fmt: skip
        for name in names:
            key = f"{prefix_of(index)}{name}.weight"
            if name.endswith("layer_norm"):
                design, target = [], []
                for xs_all, _, batch, state in tasks:
                    w = token_weights(index, name, batch)
                    x = xs_all[name]
                    z = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w / w.sum()).sqrt().unsqueeze(1)
                    design.append(torch.diag_embed(z).reshape(-1, z.shape[1]))
                    target.append((z * state[key].double()).reshape(-1))
                design.append(lam**0.5 * torch.eye(z.shape[1], dtype=torch.float64))
                target.append(lam**0.5 * anchor(key))
                expected[key] = torch.linalg.lstsq(torch.cat(design), torch.cat(target).unsqueeze(1)).solution[:, 0]
                continue
            rows, target = [], []
            for xs_all, xe_all, batch, state in tasks:
                xs, xe, w = xs_all[name], xe_all[name], token_weights(index, name, batch)
                scale = 1.0 / ((xs * w.unsqueeze(1)).T @ xs / w.sum()).norm()
                root = (scale * w / w.sum()).sqrt().unsqueeze(1)
                rows.append(root * xs)
                target.append(root * ((alpha * xe + (1 - alpha) * xs) @ state[key].double().T))
            rows.append(lam**0.5 * torch.eye(rows[0].shape[1], dtype=torch.float64))
            target.append(lam**0.5 * anchor(key).T)
            expected[key] = torch.linalg.lstsq(torch.cat(rows), torch.cat(target)).solution.T
    return expected


def test_every_linear_and_norm_solve_matches_a_float64_least_squares_oracle(zoos: Zoos) -> None:
    """Every solved tensor of the four blocks (self-attention q/k/v and o, the cross-attention's q and its k/v
    on the encoder output, wi_0/wi_1, wo, and every T5LayerNorm) equals the oracle's least-squares solution
    on the inputs of the models' own forwards (two tasks, padding and the positions beyond each target
    weighing 0): to 1e-5 of each tensor's size, float32 statistics against a float64 oracle, as for the causal
    LMs; and each moved from the merge. The relative-attention tables, the embedding, the final norms and the
    LM head keep their merged values."""
    zoo = zoos.zoo()
    calibrated = zoos.calibrated()
    expected = oracle(zoo, calibrated)
    assert sorted(expected) == sorted(solved_keys(zoo.merged))
    assert any("EncDecAttention.k" in k for k in expected) and any("EncDecAttention.v" in k for k in expected)
    for key, want in expected.items():
        error = float((calibrated[key].double() - want).norm() / want.norm())
        assert error < 1e-5, f"{key}: relative error {error:.2e}"
        assert float((calibrated[key] - zoo.merged[key]).norm() / zoo.merged[key].norm()) > 1e-3, key  # it moved
    for key in set(zoo.merged) - set(expected):
        assert torch.equal(calibrated[key], zoo.merged[key]), key


# -- 5. the forward batch size and extra padding change nothing ------------------------------------------------


def test_batch_size_and_extra_padding_change_nothing(zoos: Zoos) -> None:
    """Batches of 2 instead of 4, or every input and target padded 5 positions further: padding weighs 0 and the
    statistics are sums, so the weights are the reference calibration's to float32 rounding (1e-5)."""
    zoo = zoos.zoo()
    reference = zoos.calibrated()
    others = {
        "batches of 2": calibrate(zoo, FeatCalParams(12, calibration_batch_size=2)),
        "padding + 5": calibrate(zoo, inputs=lambda task: task_batch(task, extra_padding=5)),
    }
    for what, model in others.items():
        state = state_of(model)
        for key in zoo.merged:
            error = float((state[key] - reference[key]).norm() / reference[key].norm())
            assert error < 1e-5, f"{what}: {key}: relative error {error:.2e}"


def test_streams_kept_in_host_memory_give_the_same_weights(zoos: Zoos) -> None:
    """Every task's streams in host memory, copied to the device while used and back once advanced (the
    carries staying on the device): the reference calibration's weights, bit for bit on the CPU."""
    zoo = zoos.zoo()
    reference, in_host = zoos.calibrated(), state_of(calibrate(zoo, stream_storage="host"))
    assert in_host.keys() == reference.keys()
    for key, value in reference.items():
        assert torch.equal(in_host[key], value), key


# -- 6. tied embeddings stay tied, an untied head keeps the merged values ------------------------------------


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_tied_embeddings_stay_tied_and_an_untied_head_keeps_the_merge(zoos: Zoos, tied: bool) -> None:
    zoo = zoos.zoo(tied)
    model = zoos.calibrated_model(tied)
    assert torch.equal(model.shared.weight, zoo.merged["shared.weight"])
    assert model.encoder.embed_tokens.weight is model.shared.weight is model.decoder.embed_tokens.weight
    if tied:
        assert model.lm_head.weight is model.shared.weight
    else:
        assert model.lm_head.weight is not model.shared.weight
        assert torch.equal(model.lm_head.weight, zoo.merged["lm_head.weight"])
    for key in ("encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight",
                "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"):  # fmt: skip
        assert torch.equal(model.state_dict()[key], zoo.merged[key]), key


# -- the sweep and the drift meter carry each stream as the driver does ------------------------------------


def test_the_sweep_of_one_setting_is_the_driver_s_calibration(zoos: Zoos) -> None:
    zoo = zoos.zoo()
    [(_, swept)] = featcal_calibrate_many(
        zoo.model(), zoo.base, zoo.experts, task_batch, [PARAMS], adapter=T5Adapter(), progress=False
    )
    reference, state = zoos.calibrated(), state_of(swept)
    for key in zoo.merged:
        error = float((state[key] - reference[key]).norm() / reference[key].norm())
        assert error < 1e-5, f"{key}: relative error {error:.2e}"


def test_a_model_s_drift_from_itself_is_zero_and_the_calibration_reduces_it(zoos: Zoos) -> None:
    """Measured against its own tensors a model drifts by nothing at any block (each stream carries its own
    position biases and final-norm scale); the calibrated model drifts less from the experts than the merge at
    the last block."""
    zoo = zoos.zoo()
    drift = measure_drift({"merged": zoo.model()}, {"a": zoo.merged}, task_batch, adapter=T5Adapter(), batch_size=4,
                          progress=False)  # fmt: skip
    assert max(drift.drift["merged"]["a"]) < 1e-6
    both = measure_drift({"merged": zoo.model(), "calibrated": zoos.calibrated_model()}, zoo.experts, task_batch,
                         adapter=T5Adapter(), batch_size=4, progress=False)  # fmt: skip
    for task in TASKS:
        assert both.drift["calibrated"][task][-2] < both.drift["merged"][task][-2]
