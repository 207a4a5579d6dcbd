"""RegMean and RegMean++ layer by layer through the family adapter: each linear's input Gram, per task.

Each task's calibration examples become a stream of hidden states (``[examples, seq, d]`` on the
device), advanced one layer at a time as in FeatCal (:mod:`featcal.calibration.driver`). At every
layer, each expert's layer is run on its task's stream while forward pre-hooks record the inputs of the
layer's ``nn.Linear`` modules; their sums of squares and products
(:class:`~featcal.calibration.statistics.SecondMoments`, float32 products in float64 sums) are summed
over processes under torchrun and folded task by task into one
:class:`~featcal.merging.regmean_solve.RegMeanSystem` per input. Linears that read one input (q, k, v)
share its Gram, computed once. Which stream feeds an expert's layer is what sets the two methods apart,
as FusionBench 0.2.33 implements them:

* RegMean (``follow="experts"``): the expert's own stream, from the expert's stem through the expert's
  layers (FusionBench's hooks on the whole expert model);
* RegMean++ (``follow="merged"``): the merged model's stream, from the merged stem through the layers
  merged so far (FusionBench's ``layer_batches_forward`` of the merged layer).

A layer's tensors other than the linears' weights (biases, norms) get the experts' mean, a linear whose
input never reached it too; a tensor whose key matches ``exclude`` keeps the base's value.

LOT Merging (:mod:`featcal.repairs.lot`) reads the same experts' streams (``follow="experts"``) with
``around`` set: each task's Gram is its sum over the tokens rather than its mean, its products are float64
(exact for float32 inputs), and each linear solves for its update from ``around``'s weight with the
pseudo-inverse (:meth:`~featcal.merging.regmean_solve.RegMeanSystem.solve_update`). The pseudo-inverse
keeps every eigenvalue of Σ_t G_t above float64's rounding: float32 products would leave, where the
tokens span fewer directions than the input has, eigenvalues of float32 rounding noise (about 1e-7 of the
largest) that it would invert into weights thousands of times the experts'. With ``norms``, LOT's hooks
also record the inputs of the layer's normalisations that the adapter solves, and each gets LOT's
per-dimension closed form (:class:`~featcal.repairs.lot_norms.NormDrift`) around ``around``'s values.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, LayerAdapter, as_batch
from featcal.calibration.layer_state import FLUSH_TOKENS, Recorder
from featcal.calibration.statistics import GramAccumulator, SecondMoments, product_dtype
from featcal.checkpoint import StateDict, load_params, reading_state
from featcal.distributed import SINGLE, World
from featcal.errors import FeatcalError
from featcal.merging.data import MergeData
from featcal.merging.regmean_solve import RegMeanSystem
from featcal.progress import Progress
from featcal.repairs.lot_norms import NormDrift

Follow = Literal["experts", "merged"]
ILL_POSED_GROWTH = 4.0  # merged weights this many times the largest expert's norm: an ill-conditioned Gram sum
logger = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One task's hidden states ``[examples, seq, d]`` and the context its layers read."""

    hidden: torch.Tensor
    batches: CalibrationBatch


class _InputGroup:
    """The linears of a layer that read one input: that input's Gram for the current task, and their system."""

    def __init__(
        self,
        names: list[str],
        linears: Mapping[str, nn.Module],
        dtype: torch.dtype,
        device: torch.device,
        exact: bool = False,
    ):
        self.names = names
        self.dim = linears[names[0]].in_features
        out_features = sum(linears[name].out_features for name in names)
        self.moments = SecondMoments.zeros(self.dim, device=device)
        products = torch.float64 if exact else product_dtype(dtype)  # float64: exact for float32 inputs
        self.gram = GramAccumulator(self.dim, 0, device=device, dtype=products)
        self.system = RegMeanSystem.empty(self.dim, out_features, device=device)
        self.tokens = torch.zeros((), device=device, dtype=torch.float64)  # this process's tokens that weigh
        self.counted = torch.zeros((), device=device, dtype=torch.float64)  # ... those of the tasks folded in
        self.total = torch.zeros((), device=device, dtype=torch.float64)  # every task's, over every process
        self.expert_norm = 0.0  # the largest Frobenius norm of the experts' stacked weights

    def add(self, x: torch.Tensor, token_weights: torch.Tensor | None) -> None:
        """One forward batch of inputs ``x`` ([rows, seq, d]), each token weighing its ``token_weights``
        entry (``[rows, seq]``; None: 1)."""
        rows = x.reshape(-1, self.dim).to(self.gram.acc[0].dtype)
        group = x.shape[-2] if x.dim() > 2 else 1
        if token_weights is None:
            self.gram.add(rows, None, rows.shape[0], group)
            self.tokens += rows.shape[0]
        else:
            self.tokens += (token_weights != 0).sum()
            root = token_weights.to(device=rows.device, dtype=rows.dtype).reshape(-1).sqrt()
            self.gram.add(rows * root.unsqueeze(1), root, root.square().sum(), group)
        if self.gram.rows >= FLUSH_TOKENS:
            self.gram.flush(self.moments)

    def fold(self, linears: Mapping[str, nn.Module], ratio: float, world: World, summed: bool = False) -> None:
        """End the task: its sums over every process, its Gram (the mean of x xᵀ, or with ``summed`` their
        sum) folded in with the expert's weights."""
        self.gram.flush(self.moments)
        tokens = self.tokens.new_zeros(()) + (self.tokens - self.counted)  # this task's, summed over processes
        world.all_reduce_sum_([*self.moments.tensors(), tokens], what="RegMean statistics")
        self.counted, self.total = self.tokens.clone(), self.total + tokens
        weight = torch.cat([linears[name].weight for name in self.names])
        self.expert_norm = max(self.expert_norm, float(weight.double().norm()))
        self.system.add_task(self.moments.sum_xx if summed else self.moments.mean(), weight, ratio)
        self.moments.zero_()

    def solved(
        self, linears: Mapping[str, nn.Module], prefix: str, around: StateDict | None = None
    ) -> tuple[dict[str, torch.Tensor], Conditioning | None]:
        """Each linear's merged weight, by ``<name>.weight``, in its own dtype, and how well posed RegMean's
        system is; with ``around`` (the layer's tensors by their names in it) the pseudo-inverse update from
        its weights instead (LOT's, well posed by construction: no conditioning).

        Raises:
            FeatcalError: for RegMean's system, when the tasks' tokens are fewer than the input's dimensions:
                the Gram matrices' sum then has rank below its size, and the regression has no one answer.
        """
        where = prefix + self.names[0]
        sizes = [linears[name].out_features for name in self.names]
        if around is not None:
            solution = self.system.solve_update(torch.cat([around[f"{name}.weight"] for name in self.names]))
            conditioning = None
        else:
            if int(self.total) < self.dim:
                raise FeatcalError(
                    f"RegMean cannot merge {where!r} from these calibration examples: every task's tokens together "
                    f"are {int(self.total)}, fewer than its {self.dim} input dimensions, so the sum of its Gram "
                    "matrices is singular, the regression has no one answer and its weights blow up: raise "
                    "--num-calibration-examples, or merge with a method that uses no data."
                )
            solution = self.system.solve()
            conditioning = Conditioning(float(solution.norm()) / max(self.expert_norm, 1e-30), where)
        parts = zip(self.names, solution.split(sizes))
        merged = {f"{name}.weight": w.to(linears[name].weight.dtype) for name, w in parts}
        return merged, conditioning


@torch.no_grad()
def merge_layers(
    base: StateDict,
    experts: Sequence[StateDict],
    data: MergeData,
    *,
    follow: Follow,
    stems: Sequence[StateDict],
    ratio: float,
    exclude: re.Pattern[str] | None,
    device: torch.device,
    world: World = SINGLE,
    around: StateDict | None = None,
    others: Sequence[StateDict] | None = None,
    norms: bool = False,
) -> dict[str, torch.Tensor]:
    """The merged tensors of every layer of the model, keyed as the checkpoints key them, on the CPU.

    Args:
        base: The base's tensors (the values of excluded tensors and integer buffers).
        experts: The experts' tensors, one per task of ``data.tasks``.
        data: The adapter, the skeleton and each task's calibration examples.
        follow: Whose stream feeds each expert's layer: the expert's own, or the merged model's.
        stems: The tensors each task's stream starts from (by the adapter's stem prefixes), one per task.
        ratio: ``reduce_non_diagonal_ratio``.
        exclude: Tensors whose key it matches (``re.match``) keep the base's value.
        device: Where the streams, statistics and solves live.
        world: Under torchrun, ``data.load_inputs`` gives each process its part of the examples and the
            statistics are summed over the processes; rank 0's merged layer is everyone's.
        around: LOT's solve: each task's Gram summed over its tokens (float64 products), each linear the
            update W_0 + G⁺ Σ_t G_t (W_t − W_0) from this state's weight W_0 (``ratio`` should be 1). None:
            RegMean's.
        others: Whose mean the layer's other floating-point tensors get; default the experts.
        norms: With ``around``, LOT's solve of the normalisations the adapter solves in each layer too
            (:mod:`featcal.repairs.lot_norms`), on the same streams, around ``around``'s weights and biases.

    Returns:
        Every tensor of every layer, merged.

    Raises:
        FeatcalError: when a task has no calibration examples, or a checkpoint lacks a layer's tensor.
    """
    adapter = data.adapter
    model = data.skeleton(device)
    streams = [
        _first_stream(model, adapter, stem, as_batch(data.load_inputs(task)), data.batch_size, device, task, world)
        for task, stem in zip(
            Progress(data.tasks, desc="RegMean: first-layer inputs", unit="tasks", enabled=data.progress), stems
        )  # fmt: skip
    ]
    layers = adapter.layers(model)
    merged: dict[str, torch.Tensor] = {}
    conditionings: list[Conditioning] = []
    for index in Progress(range(len(layers)), desc="RegMean: layers", unit="layers", enabled=data.progress):
        prefix = adapter.layer_prefix(index)
        layer = _materialised(layers[index], device)
        linears = {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}
        drifts = _norm_drifts(adapter, layer, device) if norms and around is not None else {}
        groups: list[_InputGroup] | None = None
        for expert, stream in zip(experts, streams):
            load_params(layer, expert, prefix)
            groups = _collect(
                model, adapter, layer, linears, stream, groups, data.batch_size, follow == "experts",
                around is not None, drifts,
            )  # fmt: skip
            for group in groups:
                group.fold(linears, ratio, world, summed=around is not None)
            for name, drift in drifts.items():
                drift.fold(layer.get_submodule(name), world)
        anchor = None if around is None else _layer_tensors(layer, around, prefix, device)
        solved: dict[str, torch.Tensor] = {}
        for group in groups or []:
            weights, conditioning = group.solved(linears, prefix, anchor)
            solved.update(weights)
            if conditioning is not None:
                conditionings.append(conditioning)
        for name, drift in drifts.items():
            if anchor is not None and drift.reached:
                keys = [f"{name}.weight"] + ([f"{name}.bias"] if drift.norm.has_bias else [])
                solved.update(zip(keys, drift.solved(*[anchor[key] for key in keys])))
        state = _merged_layer(layer, solved, base, experts if others is None else others, prefix, exclude)
        world.broadcast_(list(state.values()), what="RegMean weights")  # one merge, bit for bit, everywhere
        merged.update({prefix + name: tensor.cpu() for name, tensor in state.items()})
        if follow == "merged" and index < len(layers) - 1:
            load_params(layer, state, "")
            for stream in streams:
                _advance(model, adapter, layer, stream, data.batch_size)
    warn_ill_conditioned(conditionings)
    return merged


@dataclass(frozen=True)
class Conditioning:
    """How well posed one input's RegMean system was: its solution's norm over the largest expert's (the
    linears reading the input stacked; about 1 when the Gram matrices pin the weights down), and the first
    linear's key."""

    growth: float
    where: str


def warn_ill_conditioned(conditionings: Sequence[Conditioning]) -> None:
    """Say in one line when some systems' solutions exceed :data:`ILL_POSED_GROWTH` times the experts' norm: their
    Gram matrices' sum is ill-conditioned, and the solve amplified what the calibration tokens did not pin down."""
    bad = [c for c in conditionings if c.growth > ILL_POSED_GROWTH]
    if not bad:
        return
    worst = max(bad, key=lambda c: c.growth)
    logger.warning(
        "RegMean: %d of %d linear systems are ill-conditioned: their merged weights reach %.3g x the largest "
        "expert's norm (%s); raise --num-calibration-examples or lower reduce_non_diagonal_ratio, and check the "
        "merge's scores.",
        len(bad), len(conditionings), worst.growth, worst.where,
    )  # fmt: skip


@torch.no_grad()
def _first_stream(
    model: nn.Module,
    adapter: LayerAdapter,
    source: StateDict,
    batch: CalibrationBatch,
    batch_size: int,
    device: torch.device,
    task: str,
    world: World,
) -> _Stream:
    """Layer 0's input for a task's examples, through the stem holding ``source``'s tensors."""
    if len(batch) == 0:
        raise FeatcalError(f"Task {task!r} has no calibration examples (on process {world.rank}).")
    stem = copy.deepcopy(adapter.stem(model))
    for part, prefix in adapter.stem_parts().items():
        load_params(stem.get_submodule(part), source, prefix)
    dtype = next(model.parameters()).dtype
    outputs = []
    for start in range(0, len(batch), batch_size):
        rows = batch.rows(start, start + batch_size)
        inputs = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in rows.inputs.items()}
        outputs.append(adapter.run_stem(stem, CalibrationBatch(inputs)).to(dtype))
    return _Stream(torch.cat(outputs), batch.for_layers(device))


def _norm_drifts(adapter: LayerAdapter, layer: nn.Module, device: torch.device) -> dict[str, NormDrift]:
    """An empty LOT drift system for each normalisation of ``layer`` that the adapter solves, by name."""
    drifts: dict[str, NormDrift] = {}
    for name, module in adapter.calibrated_modules(layer).items():
        norm = adapter.normalization(module)
        if norm is not None:
            drifts[name] = NormDrift(norm, module.weight.shape[0], device)
    return drifts


def _layer_tensors(layer: nn.Module, source: StateDict, prefix: str, device: torch.device) -> dict[str, torch.Tensor]:
    """``source``'s floating-point tensors of one layer, by their names in it, in float64 on ``device``."""
    with reading_state(source) as tensors:
        return {
            name: tensors[prefix + name].to(device, torch.float64)
            for name, current in layer.state_dict().items()
            if current.is_floating_point()
        }


def _materialised(template: nn.Module, device: torch.device) -> nn.Module:
    """A copy of a layer of the skeleton (on the meta device) with memory on ``device``, values unset.

    Raises:
        FeatcalError: when the layer holds tensors its state dict lacks, which no checkpoint would fill.
    """
    layer = copy.deepcopy(template).to_empty(device=device)
    held = {id(t) for t in [*layer.parameters(), *layer.buffers()]}
    if held - {id(t) for t in layer.state_dict(keep_vars=True).values()}:
        raise FeatcalError(
            "The layers of this architecture hold tensors that are not in their state dict: they cannot be "
            "read from a checkpoint one layer at a time."
        )
    return layer.eval()


@torch.no_grad()
def _collect(
    model: nn.Module,
    adapter: LayerAdapter,
    layer: nn.Module,
    linears: Mapping[str, nn.Module],
    stream: _Stream,
    groups: list[_InputGroup] | None,
    batch_size: int,
    advance: bool,
    exact: bool = False,
    drifts: Mapping[str, NormDrift] | None = None,
) -> list[_InputGroup]:
    """One task's sums for every input of the layer's linears (the groups are made from the first forward
    when None, with ``exact`` their products in float64) and of the normalisations ``drifts`` names; with
    ``advance``, the stream becomes the layer's output."""
    drifts = drifts or {}
    recorder = Recorder({**linears, **{name: layer.get_submodule(name) for name in drifts}})
    try:
        for start in range(0, stream.hidden.shape[0], batch_size):
            batch = stream.batches.rows(start, start + batch_size)
            hidden = stream.hidden[start : start + batch_size]
            out = adapter.run_layer(layer, hidden, adapter.layer_context(model, batch, hidden))
            if groups is None:
                groups = _groups(recorder, linears, hidden.dtype, hidden.device, exact)
            for group in groups:
                group.add(recorder.inputs[group.names[0]], batch.token_weights)
            for name, drift in drifts.items():
                if name in recorder.inputs:
                    drift.add(recorder.inputs[name], batch.token_weights)
            recorder.clear()
            if advance:
                hidden.copy_(out)
    finally:
        recorder.remove()
    return groups or []


def _groups(
    recorder: Recorder, linears: Mapping[str, nn.Module], dtype: torch.dtype, device: torch.device, exact: bool
) -> list[_InputGroup]:
    """The linears that ran, grouped by the input they read (one tensor: one group), in firing order; with
    ``exact``, each group's products in float64."""
    by_input: dict[int, list[str]] = {}
    for name, x in recorder.inputs.items():
        if name in linears:
            by_input.setdefault(id(x), []).append(name)
    return [_InputGroup(names, linears, dtype, device, exact) for names in by_input.values()]


@torch.no_grad()
def _advance(model: nn.Module, adapter: LayerAdapter, layer: nn.Module, stream: _Stream, batch_size: int) -> None:
    """Replace the stream by ``layer``'s output, batch by batch."""
    for start in range(0, stream.hidden.shape[0], batch_size):
        hidden = stream.hidden[start : start + batch_size]
        context = adapter.layer_context(model, stream.batches.rows(start, start + batch_size), hidden)
        hidden.copy_(adapter.run_layer(layer, hidden, context))


def _merged_layer(
    layer: nn.Module,
    solved: Mapping[str, torch.Tensor],
    base: StateDict,
    experts: Sequence[StateDict],
    prefix: str,
    exclude: re.Pattern[str] | None,
) -> dict[str, torch.Tensor]:
    """The merged layer's tensors by their names in the layer, in the base's dtypes: the solved weights,
    the experts' mean for the other floating-point tensors, the base's for integer buffers and excluded
    tensors."""
    state: dict[str, torch.Tensor] = {}
    device = next(layer.parameters()).device
    with contextlib.ExitStack() as stack:
        sources = [stack.enter_context(reading_state(e)) for e in experts]
        base_tensors = stack.enter_context(reading_state(base))
        for name, current in layer.state_dict().items():
            key = prefix + name
            if (exclude is not None and exclude.match(key)) or not current.is_floating_point():
                value = base_tensors[key]
            elif name in solved:
                value = solved[name]
            else:
                value = mean_of_experts(sources, key)
            state[name] = value.to(device=device, dtype=base_tensors[key].dtype, copy=True).contiguous()
    return state


def mean_of_experts(experts: Sequence[StateDict], key: str) -> torch.Tensor:
    """The experts' mean of one tensor, ``torch.stack(...).mean(0)`` as FusionBench takes it, in the
    tensor's dtype or float32 when that is narrower."""
    tensors = [expert[key] for expert in experts]
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    return torch.stack([tensor.to(dtype) for tensor in tensors]).mean(dim=0)
