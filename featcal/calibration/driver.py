"""The FeatCal driver: layer by layer, in forward order, statistics then closed-form solves.

Architecture-agnostic: everything model-specific comes from an adapter
(:mod:`featcal.calibration.adapters`). Feature streams stay on the compute device and are advanced in
place; experts are read one layer at a time from (memory-mapped) state dicts, and tasks are folded
into the normal equations one at a time, so memory does not grow with the number of tasks.

Per layer and task, the submodules' recorded inputs are copied into large joint buffers
(``[x_s | x_e]`` per distinct input) and multiplied in chunks of about ``STATISTICS_CHUNK_TOKENS``
rows, whatever the forward batch; inputs that several submodules read (q, k, v) are counted once.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

import torch
from torch import nn

from featcal.calibration.adapters import ArchitectureAdapter, CLIPVisionAdapter, TokenWeighting
from featcal.calibration.layer_state import LayerPlan, LayerState, Recorder, StopForward, plan_layer
from featcal.calibration.params import FeatCalParams
from featcal.calibration.solves import anchor
from featcal.calibration.statistics import product_dtype
from featcal.calibration.workspace import Workspace
from featcal.checkpoint import Checkpoint
from featcal.distributed import SINGLE, World
from featcal.errors import FeatcalError
from featcal.io import fault_point
from featcal.memory import trim_heap
from featcal.precision import autocast_forwards, without_callers_autocast
from featcal.progress import Progress

logger = logging.getLogger(__name__)

StateDict = Mapping[str, torch.Tensor]

STATISTICS_CHUNK_TOKENS = 4096  # rows per statistics product: large enough for full-speed matmuls


@contextmanager
def _reading(source: StateDict) -> Iterator[StateDict]:
    """``source`` for one layer's reads: a :class:`Checkpoint`'s files stay mapped for the block and
    are unmapped after, so memory stays flat in the number of experts."""
    if isinstance(source, Checkpoint):
        with source.reading():
            yield source
    else:
        yield source


def _load_params(module: nn.Module, source: StateDict, prefix: str) -> None:
    """Copy ``source[prefix + name]`` into each parameter and buffer of ``module`` (strict)."""
    with _reading(source) as tensors:
        with torch.no_grad():
            for name, current in module.state_dict().items():
                key = prefix + name
                if key not in tensors:
                    raise FeatcalError(f"Checkpoint has no tensor {key!r} needed for calibration.")
                current.copy_(tensors[key])


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
        if group.kind == "layernorm":
            module = modules_e[group.names[0]]
            system.add_task(moments, module.weight, module.bias)
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
        adapter: ArchitectureAdapter | None = None,
        device: torch.device | str = "cpu",
        stats_dtype: torch.dtype = torch.float64,
        progress: bool = True,
        world: World = SINGLE,
        forward_dtype: torch.dtype | None = None,
    ) -> None:
        self.params = params
        self.adapter = adapter or CLIPVisionAdapter()
        self.device = torch.device(device)
        self.stats_dtype = stats_dtype
        self.progress = progress
        self.world = world
        self.forward_dtype = forward_dtype

    def forwards(self) -> AbstractContextManager:
        """The context of every forward pass: autocast to ``forward_dtype`` when one is set. The
        statistics, folds and solves run outside it, in float32 at least."""
        return autocast_forwards(self.device, self.forward_dtype)

    # -- streams ---------------------------------------------------------------------------
    @torch.no_grad()
    def _first_inputs(
        self, model: nn.Module, expert: StateDict, pixels: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stem = self.adapter.stem(model)
        expert_stem = copy.deepcopy(stem)
        for prefix in self.adapter.stem_prefixes():
            _load_params(getattr(expert_stem, prefix.rstrip(".")), expert, prefix)
        bs = self.params.calibration_batch_size
        dtype = next(model.parameters()).dtype
        student = teacher = None
        if self.device.type == "cuda":  # page-locked, so each batch's copy to the GPU does not block
            pixels = pixels.pin_memory()
        for start in range(0, pixels.shape[0], bs):
            px = pixels[start : start + bs].to(self.device, dtype, non_blocking=True)
            with self.forwards():
                s, t = self.adapter.run_stem(stem, px), self.adapter.run_stem(expert_stem, px)
            if student is None:  # in the model's dtype, whatever the forwards' autocast gave
                student = s.new_empty(pixels.shape[0], *s.shape[1:], dtype=dtype)
                teacher = t.new_empty(pixels.shape[0], *t.shape[1:], dtype=dtype)
            student[start : start + bs] = s
            teacher[start : start + bs] = t
        return student, teacher

    def _all_first_inputs(
        self, model: nn.Module, experts: Mapping[str, StateDict], load_images: Callable[[str], torch.Tensor]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each task's student and expert streams at layer 0. The images are read here and dropped on
        return: the layers need only the streams (at 256 images, 154 MB a task of pixels not kept)."""
        streams: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for task in Progress(list(experts), desc="FeatCal: first-layer inputs", unit="tasks", enabled=self.progress):
            pixels = load_images(task)
            if pixels.shape[0] == 0:
                raise FeatcalError(f"Task {task!r} has no calibration images (on process {self.world.rank}).")
            streams[task] = self._first_inputs(model, experts[task], pixels)
        return streams

    @torch.no_grad()
    def _advance(self, layer: nn.Module, stream: torch.Tensor) -> None:
        """Replace ``stream`` in place by ``layer``'s output, batch by batch."""
        bs = self.params.calibration_batch_size
        for start in range(0, stream.shape[0], bs):
            with self.forwards():
                out = self.adapter.run_layer(layer, stream[start : start + bs])
            stream[start : start + bs] = out

    # -- statistics ------------------------------------------------------------------------
    @torch.no_grad()
    def _discover(
        self,
        layer: nn.Module,
        expert_layer: nn.Module,
        student: torch.Tensor,
        expert: torch.Tensor,
        weighting: Mapping[str, TokenWeighting],
    ) -> LayerPlan:
        """The layer's plan, from one full forward of one image (the streams are left as they are)."""
        rec_s = Recorder(self.adapter.calibrated_modules(layer))
        rec_e = Recorder(self.adapter.calibrated_modules(expert_layer), outputs=True)
        try:
            with self.forwards():
                self.adapter.run_layer(layer, student[:1])
                self.adapter.run_layer(expert_layer, expert[:1])
        finally:
            rec_s.remove()
            rec_e.remove()
        return plan_layer(self.adapter.calibrated_modules(layer), rec_s, rec_e, weighting)

    def _new_state(
        self,
        plan: LayerPlan,
        streams: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
        workspace: Workspace | None = None,
    ) -> LayerState:
        """Working memory for a layer; joint buffers hold whole forward batches, about
        STATISTICS_CHUNK_TOKENS rows, never more than the largest task's tokens. ``workspace``: the folds'
        and solves' buffers, shared with other states that solve one after another (None: the state
        lends its own joint buffers)."""
        student = next(iter(streams.values()))[0]
        num_images, seq_len = max(s.shape[0] for s, _ in streams.values()), student.shape[1]
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
        self, layer: nn.Module, expert_layer: nn.Module, student: torch.Tensor, expert: torch.Tensor, state: LayerState
    ) -> None:
        """One task's statistics for every calibrated submodule of one layer, folded into ``state``'s
        systems with the expert's parameters; advances ``expert`` through its layer."""
        p = self.params
        modules = self.adapter.calibrated_modules(layer)
        modules_e = self.adapter.calibrated_modules(expert_layer)
        eps = {name: m.eps for name, m in modules.items() if isinstance(m, nn.LayerNorm)}
        rec_s, rec_e = Recorder(modules), Recorder(modules_e, outputs=True)
        rec_s.stop_at = state.plan.stop_at
        state.start_task()
        bs = p.calibration_batch_size
        try:
            for start in range(0, student.shape[0], bs):
                with self.forwards():
                    try:
                        self.adapter.run_layer(layer, student[start : start + bs])
                    except StopForward:
                        pass
                    out_e = self.adapter.run_layer(expert_layer, expert[start : start + bs])
                state.add(out_e.shape[0] * student.shape[1], rec_s, rec_e, modules_e, eps)
                rec_s.clear()
                rec_e.clear()
                expert[start : start + bs] = out_e
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
        load_images: Callable[[str], torch.Tensor],
        *,
        in_place: bool = False,
        layer_store: LayerStore | None = None,
    ) -> nn.Module:
        """A calibrated copy of ``merged`` (``merged`` itself, moved to the device, with ``in_place``: no
        second copy of the model in memory); ``load_images(task)`` gives the task's calibration pixels.
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
        streams = self._all_first_inputs(model, experts, load_images)
        layers = self.adapter.layers(model)
        num_layers = len(layers)
        expert_layer: nn.Module | None = None
        state: LayerState | None = None
        for index in Progress(range(num_layers), desc="FeatCal: layers", unit="layers", enabled=self.progress):
            fault_point(f"calibrate:layer{index}")
            layer, prefix = layers[index], self.adapter.layer_prefix(index)
            if layer_store is not None:
                layer_store.load(index, layer)
            if expert_layer is None:  # the experts' layers are read into a copy of the first
                expert_layer = copy.deepcopy(layer)
            modules = self.adapter.calibrated_modules(layer)
            seq_len = streams[tasks[0]][0].shape[1]
            weighting = {n: self.adapter.token_weighting(n, index, num_layers, seq_len) for n in modules}
            for t, task in enumerate(
                Progress(tasks, desc=f"layer {index}: statistics", unit="tasks", leave=False, enabled=self.progress)
            ):
                _load_params(expert_layer, experts[task], prefix)
                student, expert = streams[task]
                if t == 0:
                    plan = self._discover(layer, expert_layer, student, expert, weighting)
                    if state is not None and state.plan.key() == plan.key():
                        state.start_layer(plan)
                    else:
                        state = None  # free the previous layer's memory before allocating
                        state = self._new_state(plan, streams)
                self._collect(layer, expert_layer, student, expert, state)
            trim_heap()  # the statistics' forward temporaries are free: their pages do not add to the solves'
            self._solve_into(modules, state, base, prefix)
            if index < num_layers - 1:
                for student, _ in streams.values():
                    self._advance(layer, student)
            if layer_store is not None:
                layer_store.store(index, layer)
            logger.debug("FeatCal: layer %d calibrated", index)
        return model

    def _solve_into(self, modules: Mapping[str, nn.Module], state: LayerState, base: StateDict, prefix: str) -> None:
        """Solve every submodule of one layer from the un-updated values, then write all at once."""
        p = self.params
        solved: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        with _reading(base) as base_tensors:
            for i, group in enumerate(state.plan.groups):
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
                reuse = {} if group.kind == "layernorm" else {"workspace": state.workspace}
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
            [t for name in solved for t in (modules[name].weight, modules[name].bias) if t is not None],
            what="FeatCal weights",
        )


def featcal_calibrate(
    merged: nn.Module,
    base: StateDict,
    experts: Mapping[str, StateDict],
    load_images: Callable[[str], torch.Tensor],
    params: FeatCalParams | None = None,
    *,
    in_place: bool = False,
    **kwargs,
) -> nn.Module:
    """FeatCal: re-solve every calibrated linear and LayerNorm of ``merged``, layer by layer.

    Args:
        merged: The merged vision tower (left unchanged).
        base: The base model's vision-tower tensors (e.g. a lazily-read ``Checkpoint``).
        experts: Each task's expert tensors, by task name.
        load_images: ``load_images(task)`` gives that task's calibration pixels, ``[n, 3, H, W]``.
        params: Hyper-parameters (default: the published reference run's).
        in_place: Calibrate ``merged`` itself (moved to the device) instead of a copy, when the caller
            no longer needs the merged weights: one model in memory instead of two.
        **kwargs: Passed to :class:`FeatCalibrator`: ``device``, ``progress``, ``adapter``, ``stats_dtype``,
            ``world`` (under torchrun: ``load_images`` then gives this process's part of each task's
            images, and the statistics are summed over the processes), ``forward_dtype`` (autocast
            the layers' forwards to it, e.g. ``torch.bfloat16``; statistics and solves stay float32+).

    Returns:
        A calibrated copy of ``merged`` (``merged`` itself with ``in_place``) on the calibration device.

    Raises:
        FeatcalError: when an expert lacks a tensor the calibration needs.
    """
    return FeatCalibrator(params or FeatCalParams(), **kwargs).calibrate(
        merged, base, experts, load_images, in_place=in_place
    )
