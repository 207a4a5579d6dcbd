"""The FeatCal driver: layer by layer, in forward order, statistics then closed-form solves.

Architecture-agnostic: everything model-specific comes from an adapter
(:mod:`featcal.calibration.adapters`). Feature streams are advanced in place, on the compute device
or in host memory, visiting the device while used (:mod:`featcal.calibration.stream_storage`);
experts are read one layer at a time from (memory-mapped) state dicts, and tasks are folded into the
normal equations one at a time, so memory does not grow with the number of tasks.

Per layer and task, the submodules' recorded inputs are copied into large joint buffers
(``[x_s | x_e]`` per distinct input) and multiplied in chunks of about ``STATISTICS_CHUNK_TOKENS``
rows, whatever the forward batch; inputs that several submodules read (q, k, v) are counted once.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from featcal.calibration.adapters import (
    CalibrationBatch,
    Carry,
    LayerAdapter,
    TokenWeighting,
    as_batch,
    run_layer,
    stem_carry,
)
from featcal.calibration.layer_state import Group, LayerPlan, LayerState, Recorder, StopForward, plan_layer
from featcal.calibration.params import FeatCalParams
from featcal.calibration.solves import anchor
from featcal.calibration.statistics import product_dtype
from featcal.calibration.stream_storage import AUTO, StreamPlacement
from featcal.calibration.workspace import Workspace
from featcal.checkpoint import StateDict, load_params, reading_state
from featcal.distributed import SINGLE, World
from featcal.errors import FeatcalError
from featcal.files.faults import fault_point
from featcal.memory import trim_heap
from featcal.precision import autocast_forwards, without_callers_autocast
from featcal.progress import Progress

logger = logging.getLogger(__name__)

STATISTICS_CHUNK_TOKENS = 4096  # rows per statistics product: large enough for full-speed matmuls


@dataclass
class Stream:
    """One task's feature streams through the layers: the merged model's (``student``) and its expert's
    (``expert``), ``[examples, seq, d]`` each, and the context its layers read (``batches``); with a
    :class:`~featcal.calibration.adapters.CarryingAdapter`, what each stream carries to its next layer
    (None for an adapter whose streams carry nothing). ``resident``: the two streams live on the compute
    device; else in host memory, copied to the device while used (the carries stay on the device)."""

    student: torch.Tensor
    expert: torch.Tensor
    batches: CalibrationBatch
    student_carry: Carry | None = None
    expert_carry: Carry | None = None
    resident: bool = True


def _cat_params(modules: Mapping[str, nn.Module], names: list[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights (and biases, zeros where a module has none) of ``names`` stacked along the outputs."""
    if len(names) == 1:
        return modules[names[0]].weight, modules[names[0]].bias
    weights = [modules[n].weight for n in names]
    if all(modules[n].bias is None for n in names):
        return torch.cat(weights), None
    return torch.cat(weights), torch.cat([_bias(modules[n]) for n in names])


def _bias(module: nn.Module) -> torch.Tensor:
    return module.bias if module.bias is not None else module.weight.new_zeros(module.weight.shape[0])


def fold_task(state: LayerState, params: FeatCalParams, modules_e: Mapping[str, nn.Module]) -> None:
    """Fold one task's moments into ``state``'s systems with the expert's parameters.

    Args:
        state: The layer's state, its moments holding the task's (all-reduced) statistics.
        params: The calibration's settings (α and ε of the linear systems).
        modules_e: The expert's calibrated submodules of the layer, by name.
    """
    for i, group in enumerate(state.plan.groups):
        system, moments = state.systems[i], state.moments[i]
        if group.kind == "norm":
            module = modules_e[group.names[0]]
            if group.norm.has_bias:
                system.add_task(moments, module.weight, module.bias)
            else:
                system.add_task(moments, module.weight + group.norm.scale_offset)
        else:
            weight, bias = _cat_params(modules_e, group.names)
            system.add_task(
                moments,
                weight,
                bias,
                alpha=params.teacher_interp_alpha,
                eps=params.covariance_eps,
                workspace=state.workspace,
            )


class LayerStore(Protocol):
    """Where a model's encoder layers live while the calibration does not need them, so that only the
    layer being calibrated is in memory (:mod:`featcal.calibration.streaming`)."""

    def load(self, index: int, layer: nn.Module) -> None:
        """Give ``layer`` (on the meta device) its merged values, on the calibration device."""

    def store(self, index: int, layer: nn.Module) -> None:
        """Take the calibrated ``layer``; the calibration does not use it again."""


class FeatCalibrator:
    """Runs FeatCal on one merged model. Use :func:`featcal_calibrate` for the one-call form."""

    def __init__(
        self,
        params: FeatCalParams,
        *,
        adapter: LayerAdapter,
        device: torch.device | str = "cpu",
        stats_dtype: torch.dtype = torch.float64,
        progress: bool = True,
        world: World = SINGLE,
        forward_dtype: torch.dtype | None = None,
        stream_storage: str = AUTO,
    ) -> None:
        self.params = params
        self.adapter = adapter
        self.device = torch.device(device)
        self.stats_dtype = stats_dtype
        self.progress = progress
        self.world = world
        self.forward_dtype = forward_dtype
        self.stream_storage = stream_storage
        StreamPlacement(stream_storage, self.device)  # a bad value fails here, before any work

    def forwards(self) -> AbstractContextManager:
        """The context of every forward pass: autocast to ``forward_dtype`` when one is set. The
        statistics, folds and solves run outside it, in float32 at least."""
        return autocast_forwards(self.device, self.forward_dtype)

    # -- streams ---------------------------------------------------------------------------
    @torch.no_grad()
    def _first_inputs(
        self, model: nn.Module, expert: StateDict, batch: CalibrationBatch, task: str, placement: StreamPlacement
    ) -> Stream:
        """``task``'s streams at layer 0 (the student's and the expert's input, and what each carries into
        it), where ``placement`` puts them."""
        stem = self.adapter.stem(model)
        expert_stem = copy.deepcopy(stem)
        for part, prefix in self.adapter.stem_parts().items():
            load_params(expert_stem.get_submodule(part), expert, prefix)
        bs = self.params.calibration_batch_size
        dtype = next(model.parameters()).dtype
        student = teacher = None
        size, resident, context = len(batch), True, batch.for_layers(self.device)
        if self.device.type == "cuda":  # page-locked, so each batch's copy to the GPU does not block
            batch = CalibrationBatch({k: v.pin_memory() for k, v in batch.inputs.items()})
        for start in range(0, size, bs):
            part = batch.rows(start, start + bs)
            part = CalibrationBatch({k: self._to_device(v, dtype) for k, v in part.inputs.items()})
            with self.forwards():
                s, t = self.adapter.run_stem(stem, part), self.adapter.run_stem(expert_stem, part)
            if student is None:  # in the model's dtype, whatever the forwards' autocast gave
                resident = placement.on_device(task, (s[0].numel() + t[0].numel()) * size * dtype.itemsize)
                home = self.device if resident else torch.device("cpu")
                student = s.new_empty(size, *s.shape[1:], dtype=dtype, device=home)
                teacher = t.new_empty(size, *t.shape[1:], dtype=dtype, device=home)
            student[start : start + bs] = s
            teacher[start : start + bs] = t
        carries = stem_carry(self.adapter, stem), stem_carry(self.adapter, expert_stem)
        return Stream(student, teacher, context, *carries, resident=resident)

    def _to_device(self, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A stem input on the device: floating-point ones (pixels) in the model's dtype, token ids as they are."""
        if tensor.is_floating_point():
            return tensor.to(self.device, dtype, non_blocking=True)
        return tensor.to(self.device, non_blocking=True)

    def _all_first_inputs(
        self, model: nn.Module, experts: Mapping[str, StateDict], load_inputs: Callable[[str], CalibrationBatch]
    ) -> dict[str, Stream]:
        """Each task's student and expert streams at layer 0, and the context its layers read. The stem's
        inputs are read here and dropped on return: the layers need only the streams and the context (at 256
        images, 154 MB a task of pixels not kept)."""
        streams: dict[str, Stream] = {}
        placement = StreamPlacement(self.stream_storage, self.device)
        for task in Progress(list(experts), desc="FeatCal: first-layer inputs", unit="tasks", enabled=self.progress):
            batch = as_batch(load_inputs(task))
            if len(batch) == 0:
                raise FeatcalError(f"Task {task!r} has no calibration examples (on process {self.world.rank}).")
            streams[task] = self._first_inputs(model, experts[task], batch, task, placement)
        return streams

    def _visiting(self, stream: Stream, tensor: torch.Tensor) -> torch.Tensor:
        """One of ``stream``'s tensors where the layers compute: itself when the stream is resident, else
        a copy on the compute device (a separate copy even when that device is the CPU)."""
        return tensor if stream.resident else tensor.to(self.device, copy=True)

    @torch.no_grad()
    def _advance(self, model: nn.Module, layer: nn.Module, stream: Stream) -> None:
        """Replace ``stream``'s student in place by ``layer``'s output, batch by batch (and its carry by
        the carry after the layer)."""
        bs, carry = self.params.calibration_batch_size, stream.student_carry
        student, after = self._visiting(stream, stream.student), carry
        for start in range(0, student.shape[0], bs):
            rows = stream.batches.rows(start, start + bs)
            context = self.adapter.layer_context(model, rows, student[start : start + bs])
            with self.forwards():
                out, after = run_layer(self.adapter, layer, student[start : start + bs], context, carry)
            student[start : start + bs] = out
        if not stream.resident:
            stream.student.copy_(student)
        stream.student_carry = after

    # -- statistics ------------------------------------------------------------------------
    @torch.no_grad()
    def _discover(
        self,
        model: nn.Module,
        layer: nn.Module,
        expert_layer: nn.Module,
        stream: Stream,
        weighting: Mapping[str, TokenWeighting],
    ) -> LayerPlan:
        """The layer's plan, from one full forward of one example (the streams are left as they are)."""
        rec_s = Recorder(self.adapter.calibrated_modules(layer))
        rec_e = Recorder(self.adapter.calibrated_modules(expert_layer), outputs=True)
        student, expert = self._visiting(stream, stream.student[:1]), self._visiting(stream, stream.expert[:1])
        context = self.adapter.layer_context(model, stream.batches.rows(0, 1), student)
        try:
            with self.forwards():
                run_layer(self.adapter, layer, student, context, stream.student_carry)
                run_layer(self.adapter, expert_layer, expert, context, stream.expert_carry)
        finally:
            rec_s.remove()
            rec_e.remove()
        return plan_layer(self.adapter.calibrated_modules(layer), rec_s, rec_e, weighting, self.adapter.normalization)

    def _new_state(
        self,
        plan: LayerPlan,
        streams: Mapping[str, Stream],
        workspace: Workspace | None = None,
    ) -> LayerState:
        """Working memory for a layer; joint buffers hold whole forward batches, about
        STATISTICS_CHUNK_TOKENS rows, never more than the largest task's tokens. Tasks may differ in length
        (texts are padded to each task's longest, on each process): the buffers hold a forward batch of the
        longest. ``workspace``: the folds' and solves' buffers, shared with other states that solve one
        after another (None: the state lends its own joint buffers)."""
        student = next(iter(streams.values())).student
        num_images = max(s.student.shape[0] for s in streams.values())
        seq_len = max(s.student.shape[1] for s in streams.values())
        bs = min(self.params.calibration_batch_size, num_images)
        batches = max(1, STATISTICS_CHUNK_TOKENS // (bs * seq_len))
        capacity = min(batches, -(-num_images // bs)) * bs * seq_len
        return LayerState(
            plan,
            capacity,
            seq_len,
            self.device,
            product_dtype(student.dtype),
            self.stats_dtype,
            workspace=workspace,
        )

    @torch.no_grad()
    def _collect(
        self, model: nn.Module, layer: nn.Module, expert_layer: nn.Module, stream: Stream, state: LayerState
    ) -> None:
        """One task's statistics for every calibrated submodule of one layer, folded into ``state``'s
        systems with the expert's parameters; advances the expert stream through its layer."""
        p = self.params
        modules = self.adapter.calibrated_modules(layer)
        modules_e = self.adapter.calibrated_modules(expert_layer)
        rec_s, rec_e = Recorder(modules), Recorder(modules_e, outputs=True)
        rec_s.stop_at = state.plan.stop_at
        state.start_task()
        bs = p.calibration_batch_size
        student, expert = self._visiting(stream, stream.student), self._visiting(stream, stream.expert)
        carry_e = stream.expert_carry
        try:
            for start in range(0, student.shape[0], bs):
                batch = stream.batches.rows(start, start + bs)
                context = self.adapter.layer_context(model, batch, student[start : start + bs])
                with self.forwards():
                    try:
                        run_layer(self.adapter, layer, student[start : start + bs], context, stream.student_carry)
                    except StopForward:
                        pass
                    out_e, carry_e = run_layer(
                        self.adapter, expert_layer, expert[start : start + bs], context, stream.expert_carry
                    )
                state.add(out_e.shape[0] * student.shape[1], rec_s, rec_e, modules_e, batch.token_weights)
                rec_s.clear()
                rec_e.clear()
                expert[start : start + bs] = out_e
            if not stream.resident:
                stream.expert.copy_(expert)
            stream.expert_carry = carry_e
            state.finish_task()
        finally:
            rec_s.remove()
            rec_e.remove()
        # Each process holds the sums of its part of the task's images: their sum is the task's.
        self.world.all_reduce_sum_(
            [t for moments in state.moments.values() for t in moments.tensors()], what="FeatCal statistics"
        )
        fold_task(state, p, modules_e)

    # -- the layer loop --------------------------------------------------------------------
    @torch.no_grad()
    @without_callers_autocast
    def calibrate(
        self,
        merged: nn.Module,
        base: StateDict,
        experts: Mapping[str, StateDict],
        load_inputs: Callable[[str], CalibrationBatch | torch.Tensor],
        *,
        in_place: bool = False,
        layer_store: LayerStore | None = None,
    ) -> nn.Module:
        """A calibrated copy of ``merged`` (``merged`` itself, moved to the device, with ``in_place``: no
        second copy of the model in memory); ``load_inputs(task)`` gives the task's calibration examples
        (a :class:`~featcal.calibration.adapters.CalibrationBatch`, or a tensor of pixels).
        An autocast the caller runs in is switched off: only ``forward_dtype`` decides the forwards'.

        With ``layer_store``, ``merged`` is calibrated in place (``in_place`` implied) and must already be
        on the device but
        for its encoder layers, which are on the meta device: each is loaded from the store when the
        calibration reaches it and handed back once calibrated (and the streams advanced through it)."""
        if layer_store is None:
            model = (merged if in_place else copy.deepcopy(merged)).to(self.device).eval()
        else:
            model = merged.eval()
        tasks = list(experts)
        streams = self._all_first_inputs(model, experts, load_inputs)
        layers = self.adapter.layers(model)
        num_layers = len(layers)
        state: LayerState | None = None
        for index in Progress(range(num_layers), desc="FeatCal: layers", unit="layers", enabled=self.progress):
            fault_point(f"calibrate:layer{index}")
            layer, prefix = layers[index], self.adapter.layer_prefix(index)
            if layer_store is not None:
                layer_store.load(index, layer)
            # The experts' layers are read into a copy of this layer, not of the first: layers can differ by
            # more than their tensors (a sliding-window layer of Gemma-2 or Qwen names its attention type), and
            # the adapter runs the copy as the layer it was copied from.
            expert_layer = copy.deepcopy(layer)
            modules = self.adapter.calibrated_modules(layer)
            seq_len = streams[tasks[0]].student.shape[1]
            weighting = {n: self.adapter.token_weighting(n, index, num_layers, seq_len) for n in modules}
            for t, task in enumerate(
                Progress(tasks, desc=f"layer {index}: statistics", unit="tasks", leave=False, enabled=self.progress)
            ):
                load_params(expert_layer, experts[task], prefix)
                if t == 0:
                    plan = self._discover(model, layer, expert_layer, streams[task], weighting)
                    if state is not None and state.plan.key() == plan.key():
                        state.start_layer(plan)
                    else:
                        state = None  # free the previous layer's memory before allocating
                        state = self._new_state(plan, streams)
                self._collect(model, layer, expert_layer, streams[task], state)
            trim_heap()  # the statistics' forward temporaries are free: their pages do not add to the solves'
            self._solve_into(modules, state, base, prefix)
            if index < num_layers - 1:
                for stream in streams.values():
                    self._advance(model, layer, stream)
            del expert_layer  # freed before the next layer's copy
            if layer_store is not None:
                layer_store.store(index, layer)
            logger.debug("FeatCal: layer %d calibrated", index)
        return model

    def _solve_scale(
        self, module: nn.Module, group: Group, index: int, state: LayerState, base: StateDict, prefix: str
    ) -> torch.Tensor:
        """The weight of a scale-only normalisation (an RMSNorm): its effective scale ``offset + w`` solved
        with the anchor ``offset + A(w)``, less the offset."""
        p, offset = self.params, group.norm.scale_offset
        dtype = product_dtype(module.weight.dtype)
        base_w = base[f"{prefix}{group.names[0]}.weight"].to(self.device, dtype)
        a_w = anchor(module.weight.to(dtype), base_w, p.anchor_blend_rho)
        scale = state.systems[index].solve(a_w + offset, lam=p.lambda_ratio, eps=p.covariance_eps)
        return scale - offset

    def _solve_into(self, modules: Mapping[str, nn.Module], state: LayerState, base: StateDict, prefix: str) -> None:
        """Solve every submodule of one layer from the un-updated values, then write all at once."""
        p = self.params
        solved: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        with reading_state(base) as base_tensors:
            for i, group in enumerate(state.plan.groups):
                if group.kind == "norm" and not group.norm.has_bias:
                    solved[group.names[0]] = (self._solve_scale(modules[group.names[0]], group, i, state, base_tensors,
                                                                prefix), None)  # fmt: skip
                    continue
                merged_w, merged_b = _cat_params(modules, group.names)
                dtype = product_dtype(merged_w.dtype)
                base_w = torch.cat([base_tensors[f"{prefix}{n}.weight"] for n in group.names])
                a_w = anchor(merged_w.to(dtype), base_w.to(self.device, dtype), p.anchor_blend_rho)
                a_b = None
                if merged_b is not None:
                    base_b = torch.cat(
                        [
                            base_tensors[f"{prefix}{n}.bias"]
                            if modules[n].bias is not None
                            else _bias(modules[n]).cpu()
                            for n in group.names
                        ]
                    )
                    a_b = anchor(merged_b.to(dtype), base_b.to(self.device, dtype), p.anchor_blend_rho)
                reuse = {} if group.kind == "norm" else {"workspace": state.workspace}
                weight, bias = state.systems[i].solve(a_w, a_b, lam=p.lambda_ratio, eps=p.covariance_eps, **reuse)
                sizes = [modules[n].weight.shape[0] for n in group.names]
                biases = bias.split(sizes) if bias is not None else [None] * len(sizes)
                for name, w, b in zip(group.names, weight.split(sizes), biases):
                    solved[name] = (w, b if modules[name].bias is not None else None)
        # A sum is non-finite exactly when some entry is (finite float64 weights cannot overflow it):
        # one reduction per tensor and a single device-to-host read per layer.
        sums = torch.stack([t.sum() for pair in solved.values() for t in pair if t is not None])
        if not torch.isfinite(sums).all():
            bad = next(
                n for n, pair in solved.items() if not all(torch.isfinite(t).all() for t in pair if t is not None)
            )
            raise FeatcalError(
                f"FeatCal produced non-finite values for {prefix}{bad}: check that the inputs are finite and that "
                "`lambda_ratio`, `anchor_blend_rho` and `teacher_interp_alpha` are of a usable size (the reference "
                "run's: 0.05, 2.2, 0.25)."
            )
        for name, (weight, bias) in solved.items():
            module = modules[name]
            module.weight.copy_(weight)
            if bias is not None:
                module.bias.copy_(bias)
        # Every process solved the same summed systems; rank 0's solution is made everyone's, so the
        # processes carry bit-identical weights into the next layer whatever their linear algebra.
        self.world.broadcast_(
            [
                t
                for name in solved
                for t in (modules[name].weight, getattr(modules[name], "bias", None))
                if t is not None
            ],
            what="FeatCal weights",
        )


def featcal_calibrate(
    merged: nn.Module,
    base: StateDict,
    experts: Mapping[str, StateDict],
    load_inputs: Callable[[str], CalibrationBatch | torch.Tensor],
    params: FeatCalParams | None = None,
    *,
    adapter: LayerAdapter | None = None,
    in_place: bool = False,
    **kwargs,
) -> nn.Module:
    """FeatCal: re-solve every calibrated linear and normalisation of ``merged``, layer by layer.

    Args:
        merged: The merged model (left unchanged).
        base: The base model's tensors as its family keys them (e.g. a lazily-read ``Checkpoint``).
        experts: Each task's expert tensors, by task name.
        load_inputs: ``load_inputs(task)`` gives that task's calibration examples: a
            :class:`~featcal.calibration.adapters.CalibrationBatch`, or pixels ``[n, 3, H, W]``.
        params: Hyper-parameters (default: the published reference run's).
        adapter: The architecture adapter (default: the one of ``merged``'s model family,
            :func:`featcal.families.adapter_for`).
        in_place: Calibrate ``merged`` itself (moved to the device) instead of a copy, when the caller
            no longer needs the merged weights: one model in memory instead of two.
        **kwargs: Passed to :class:`FeatCalibrator`: ``device``, ``progress``, ``stats_dtype``,
            ``world`` (under torchrun: ``load_inputs`` then gives this process's part of each task's
            examples, and the statistics are summed over the processes), ``forward_dtype`` (autocast
            the layers' forwards to it, e.g. ``torch.bfloat16``; statistics and solves stay float32+).

    Returns:
        A calibrated copy of ``merged`` (``merged`` itself with ``in_place``) on the calibration device.

    Raises:
        FeatcalError: when an expert lacks a tensor the calibration needs.
    """
    if adapter is None:
        from featcal.families import adapter_for

        adapter = adapter_for(merged)
    return FeatCalibrator(params or FeatCalParams(), adapter=adapter, **kwargs).calibrate(
        merged, base, experts, load_inputs, in_place=in_place
    )
