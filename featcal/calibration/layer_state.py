"""One layer's statistics for the FeatCal driver: input recording, grouping, buffers and systems.

A :class:`Recorder` keeps the inputs (and outputs) of the calibrated submodules during a forward and
can cut the student's statistics pass short. :func:`plan_layer` groups the submodules that read one
input with one set of token weights. A :class:`LayerState` holds a layer's working memory: joint
buffers ``[x_s | x_e]`` filled batch by batch and multiplied in chunks of large matmuls, float32 Gram
accumulators, the current task's moments and the normal-equation systems over tasks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from featcal.calibration.adapters import Normalization, TokenWeighting
from featcal.calibration.solves import LayerNormSystem, LinearSystem, ScaleNormSystem
from featcal.calibration.statistics import GramAccumulator, LinearMoments, NormMoments, ProjectedLinearMoments
from featcal.calibration.workspace import Workspace, carved_bytes
from featcal.errors import FeatcalError

FLUSH_TOKENS = 1 << 15  # float32 product sums are flushed into the float64 moments this often


class StopForward(Exception):
    """Raised by a pre-hook to cut a forward short once every needed input is recorded."""


class Recorder:
    """Forward hooks that keep the latest input (and, with ``outputs``, output) of each named
    submodule, in firing order; the forward stops after ``stop_at``'s input is recorded."""

    def __init__(self, modules: Mapping[str, nn.Module], *, outputs: bool = False) -> None:
        self.inputs: dict[str, torch.Tensor] = {}
        self.outputs: dict[str, torch.Tensor] = {}
        self.stop_at: str | None = None
        self._handles = [m.register_forward_pre_hook(self._pre_hook(name)) for name, m in modules.items()]
        if outputs:
            self._handles += [m.register_forward_hook(self._hook(name)) for name, m in modules.items()]

    def _pre_hook(self, name: str):
        def hook(_module: nn.Module, args: tuple) -> None:
            self.inputs[name] = args[0]
            if name == self.stop_at:
                raise StopForward

        return hook

    def _hook(self, name: str):
        def hook(_module: nn.Module, _args: tuple, output: torch.Tensor) -> None:
            self.outputs[name] = output

        return hook

    def clear(self) -> None:
        self.inputs, self.outputs = {}, {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class Group:
    """Submodules of one layer whose statistics are one set of sums: a normalisation alone, or the
    linears that read the very same input with the same token weights (q, k, v). ``kind`` is ``"norm"``
    (with its :class:`~featcal.calibration.adapters.Normalization`), ``"linear"`` (crossed with the
    expert's inputs) or ``"projected"`` (one linear narrower than its input, crossed with the expert's
    outputs). Linears are solved together: their outputs stack."""

    kind: str
    names: list[str]
    dim: int
    cross: int
    out_features: int
    has_bias: bool
    weighting: TokenWeighting
    norm: Normalization | None = None


@dataclass
class LayerPlan:
    groups: list[Group]
    stop_at: str  # the last submodule to fire: the student's statistics pass can stop at its input

    def key(self) -> tuple:
        """Equal for layers whose statistics and systems have the same shapes and token weights."""
        return tuple(
            (g.kind, tuple(g.names), g.dim, g.cross, g.out_features, g.has_bias, g.weighting.key, g.weighting.positions)
            for g in self.groups
        )


def plan_layer(
    modules: Mapping[str, nn.Module],
    rec_s: Recorder,
    rec_e: Recorder,
    weighting: Mapping[str, TokenWeighting],
    normalization: Callable[[nn.Module], Normalization | None],
) -> LayerPlan:
    """Group one layer's submodules from the inputs recorded in one full forward; ``normalization``
    says how a submodule normalises (None for an ``nn.Linear``)."""
    missing = [name for name in modules if name not in rec_s.inputs or name not in rec_e.inputs]
    if missing:
        raise FeatcalError(
            f"Calibrated submodules {missing} never ran in the layer's forward; the "
            "architecture adapter lists modules the layer does not call."
        )
    groups: list[Group] = []
    shared: dict[tuple, Group] = {}
    for name in rec_s.inputs:  # firing order
        module = modules[name]
        norm = normalization(module)
        if norm is not None:
            dim = module.weight.shape[0]
            groups.append(Group("norm", [name], dim, 0, dim, norm.has_bias, weighting[name], norm))
            continue
        if not isinstance(module, nn.Linear):
            raise FeatcalError(
                f"Calibrated submodule {name!r} is a {type(module).__name__}, neither an nn.Linear nor a "
                "normalisation the architecture adapter describes."
            )
        key = (id(rec_s.inputs[name]), id(rec_e.inputs[name]), weighting[name].key)
        group = shared.get(key)
        if group is None:
            group = shared[key] = Group("linear", [], module.in_features, module.in_features, 0, False, weighting[name])
            groups.append(group)
        group.names.append(name)
        group.out_features += module.out_features
        group.has_bias = group.has_bias or module.bias is not None
    for group in groups:
        if group.kind == "linear" and len(group.names) == 1 and group.out_features < group.dim:
            group.kind, group.cross = "projected", group.out_features
    return LayerPlan(groups, next(reversed(rec_s.inputs)))


@dataclass
class LayerState:
    """One layer's working memory: per group a joint buffer, a float32 Gram accumulator, the moments
    of the current task and the normal-equation system over tasks. Allocated once, reused for every
    task and for every following layer with the same plan."""

    plan: LayerPlan
    capacity: int
    seq_len: int  # tokens per example: the longest task's (every task's, where positions have weights)
    device: torch.device
    dtype: torch.dtype
    stats_dtype: torch.dtype
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)
    grams: dict[int, GramAccumulator] = field(default_factory=dict)
    moments: dict[int, LinearMoments | ProjectedLinearMoments | NormMoments] = field(default_factory=dict)
    systems: dict[int, LinearSystem | LayerNormSystem | ScaleNormSystem] = field(default_factory=dict)
    weights: dict[int, torch.Tensor | None] = field(default_factory=dict)
    roots: dict[int, torch.Tensor | None] = field(default_factory=dict)
    scratch: torch.Tensor | None = None
    # The folds' and solves' temporaries: by default carved from this state's joint buffers (idle between
    # products); several states that solve one after another (a sweep's settings) can share one instead.
    workspace: Workspace | None = None
    filled: int = 0  # tokens buffered, of the stream's positions
    # Rows buffered per linear group: ``filled``, but for a group that reads some of the stream's positions.
    group_rows: dict[int, int] = field(default_factory=dict)
    # Tokens per example of each group's buffered rows (one task's at a time: texts are padded per task).
    group_seq: dict[int, int] = field(default_factory=dict)
    flushed: set[int] = field(default_factory=set)  # groups whose moments hold this task's first flush
    # Batches with token weights of their own (padding): each buffered row's root weight, and the
    # weights not yet multiplied, per linear group; allocated with the first such batch.
    row_roots: dict[int, torch.Tensor] = field(default_factory=dict)
    pending_weight: dict[int, torch.Tensor | float] = field(default_factory=dict)
    weighted_rows: bool = False

    def __post_init__(self) -> None:
        kw = dict(device=self.device, dtype=self.stats_dtype)
        shared = self.workspace is not None
        arena = torch.empty(self._arena_bytes(lend=not shared), device=self.device, dtype=torch.uint8)
        if not shared:
            self.workspace = Workspace(lent=arena)
        offset, widest = 0, 0
        for i, g in enumerate(self.plan.groups):
            w = g.weighting.weights
            self.weights[i] = None if w is None else w.to(device=self.device, dtype=self.dtype)
            self.roots[i] = None if w is None else self.weights[i].sqrt().repeat(self.capacity // self.seq_len)
            if g.kind == "norm":
                self.moments[i] = NormMoments.zeros(g.dim, **kw)
                self.systems[i] = (LayerNormSystem if g.has_bias else ScaleNormSystem).empty(g.dim, **kw)
                continue
            nbytes = self.capacity * (g.dim + g.cross) * self.dtype.itemsize
            self.buffers[i] = arena[offset : offset + nbytes].view(self.dtype).view(self.capacity, g.dim + g.cross)
            offset += nbytes
            self.grams[i] = GramAccumulator(
                g.dim, g.cross, device=self.device, dtype=self.dtype, sum_dtype=self.stats_dtype
            )
            self.moments[i] = (
                LinearMoments.zeros(g.dim, **kw)
                if g.kind == "linear"
                else ProjectedLinearMoments.zeros(g.dim, g.cross, **kw)
            )
            self.systems[i] = LinearSystem.empty(g.out_features, g.dim, g.has_bias, **kw)
            widest = max(widest, max(acc.numel() for acc in self.grams[i].acc))
        if self.dtype != self.stats_dtype:
            self.scratch = torch.empty(widest, device=self.device, dtype=self.stats_dtype)

    def _arena_bytes(self, lend: bool) -> int:
        """One allocation for the joint buffers; with ``lend``, large enough for the task folds and solves
        to borrow between products (the fc2 system's float64 factor and float32 cast at ViT-B/32: 113 MB
        of the buffers' 135)."""
        joint = sum(
            self.capacity * (g.dim + g.cross) * self.dtype.itemsize for g in self.plan.groups if g.kind != "norm"
        )
        if not lend:
            return joint
        dims = {g.dim for g in self.plan.groups if g.kind != "norm"}
        borrowed = [(d * d, self.stats_dtype) for d in dims] + [(1, torch.int32)]  # solves: factors, status
        if self.dtype != self.stats_dtype:  # folds: the projected groups' casts of C_ss
            borrowed += [(g.dim * g.dim, self.dtype) for g in self.plan.groups if g.kind == "projected"]
        return max(joint, carved_bytes(borrowed))

    def start_layer(self, plan: LayerPlan) -> None:
        """Reuse this memory for another layer with the same plan key."""
        self.plan = plan
        for system in self.systems.values():
            system.zero_()

    def start_task(self) -> None:
        """Linear moments are overwritten by the task's first flush; normalisation sums start at zero."""
        self.flushed.clear()
        self.pending_weight = {i: 0.0 for i in self.grams}
        for i, group in enumerate(self.plan.groups):
            if group.kind == "norm":
                self.moments[i].zero_()

    def add(
        self,
        rows: int,
        rec_s: Recorder,
        rec_e: Recorder,
        modules_e: Mapping[str, nn.Module],
        token_weights: torch.Tensor | None = None,
    ) -> None:
        """One forward batch of ``rows`` tokens: normalisation sums at once, linear inputs into the buffers.

        ``token_weights``: the batch's own ``[batch, seq]`` weights (0 for padding), multiplying each
        group's per-position weights; None when every token weighs 1.
        """
        weighted = token_weights is not None
        counts = {i: self._input_rows(i, rec_s, rows) for i in self.buffers}
        full = any(self.group_rows.get(i, 0) + count > self.capacity for i, count in counts.items())
        if full or (self.filled and weighted != self.weighted_rows):
            self.multiply()
        if any(count > self.capacity for count in counts.values()):
            raise FeatcalError(
                f"A forward batch of {max(counts.values())} tokens does not fit the statistics buffers "
                f"({self.capacity} rows)."
            )
        for i, g in enumerate(self.plan.groups):
            name = g.names[0]
            xs = rec_s.inputs[name]
            weights = self._positions(g, self._batch_weights(i, token_weights), xs)
            if g.kind == "norm":
                self.moments[i].add(xs, g.norm.normalize, weights)
                continue
            top, count = self.group_rows.get(i, 0), counts[i]
            self.group_rows[i] = top + count
            self.group_seq[i] = xs.shape[-2] if xs.dim() > 2 else 1
            buf = self.buffers[i][top : top + count]
            scale = None  # each row's √w, multiplied in as the row is copied (one pass over the buffer)
            if weighted:  # rows weigh by their batch: their roots are kept beside them
                if i not in self.row_roots:
                    self.row_roots[i] = torch.empty(self.capacity, device=self.device, dtype=self.dtype)
                root = self.row_roots[i][top : top + count]
                torch.sqrt(weights.reshape(count), out=root)
                scale = root.unsqueeze(1)
                self.pending_weight[i] = self.pending_weight[i] + weights.sum()  # on the device: no sync
            elif self.roots[i] is not None:
                scale = self.roots[i][:count].unsqueeze(1)
            _put(buf[:, : g.dim], xs.reshape(count, g.dim), scale)
            if g.kind == "projected":  # y_e = W_t x_e, the expert's output without its bias
                outputs, bias = rec_e.outputs[name].reshape(count, g.cross), modules_e[name].bias
                if bias is None:
                    _put(buf[:, g.dim :], outputs, scale)
                else:
                    _put(buf[:, g.dim :].copy_(outputs).sub_(bias), None, scale)
            else:
                _put(buf[:, g.dim :], rec_e.inputs[name].reshape(count, g.dim), scale)
        self.filled += rows
        self.weighted_rows = weighted

    def _input_rows(self, i: int, rec_s: Recorder, rows: int) -> int:
        """The tokens of group ``i``'s input in this batch: ``rows`` (the stream's) unless it reads some of the
        stream's positions."""
        group = self.plan.groups[i]
        if group.weighting.positions == "all":
            return rows
        return rec_s.inputs[group.names[0]].numel() // group.dim

    @staticmethod
    def _positions(group: Group, weights: torch.Tensor | None, xs: torch.Tensor) -> torch.Tensor | None:
        """A batch's ``[batch, seq]`` weights at the positions of the stream ``group``'s input ``xs`` reads."""
        if group.weighting.positions == "all" or weights is None:
            return weights
        length = xs.shape[-2]
        return weights[:, :length] if group.weighting.positions == "first" else weights[:, weights.shape[1] - length :]

    def _batch_weights(self, i: int, token_weights: torch.Tensor | None) -> torch.Tensor | None:
        """Group ``i``'s weights for one batch: its per-position weights times the batch's token weights."""
        if token_weights is None:
            return self.weights[i]
        batch = token_weights.to(device=self.device, dtype=self.dtype)
        return batch if self.weights[i] is None else batch * self.weights[i]

    def multiply(self) -> None:
        """The statistics products of everything buffered."""
        if self.filled == 0:
            return
        for i, gram in self.grams.items():
            rows = self.group_rows.get(i, 0)
            if self.weighted_rows:
                root, weight_sum = self.row_roots[i][:rows], self.pending_weight[i]
                self.pending_weight[i] = 0.0
            else:
                weights, root = self.plan.groups[i].weighting.weights, self.roots[i]  # the adapter's, on the host
                weight_sum = rows if weights is None else rows // self.group_seq[i] * float(weights.sum())
                root = None if root is None else root[:rows]
            gram.add(self.buffers[i][:rows], root, weight_sum, self.group_seq[i])
            if gram.rows >= FLUSH_TOKENS:
                self._flush(i)
        self.filled = 0
        self.group_rows.clear()
        self.weighted_rows = False

    def finish_task(self) -> None:
        self.multiply()
        for i in self.grams:
            self._flush(i)

    def _flush(self, i: int) -> None:
        gram = self.grams[i]
        gram.flush(self.moments[i], self._scratch(gram), overwrite=i not in self.flushed)
        self.flushed.add(i)

    def _scratch(self, gram: GramAccumulator) -> torch.Tensor | None:
        if self.scratch is None:
            return None
        widest = gram.acc[0].shape[1]
        return self.scratch[: gram.acc[0].numel()].view(-1, widest)


def _put(target: torch.Tensor, rows: torch.Tensor | None, scale: torch.Tensor | None) -> None:
    """``target`` = ``rows`` (``target`` itself when None) times ``scale`` (a column: each row's factor), in
    one pass; a plain copy when ``scale`` is None."""
    if scale is None:
        if rows is not None:
            target.copy_(rows)
    elif rows is None:
        target.mul_(scale)
    else:
        torch.mul(rows, scale, out=target)
