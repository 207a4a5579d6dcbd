"""FeatCal for several settings at once: one merged model calibrated with each of several
:class:`FeatCalParams` (calibration sizes n, λ, ρ, α, ε), together, layer by layer.

What the settings share, and what they cannot:

- the expert streams E_t depend only on the expert and the images, so one expert stream per task,
  over the largest n, serves every setting: setting v reads its first n_v rows (the calibration
  subsets are nested: the first n images of one seeded shuffle, :func:`featcal.data.calibration_pixels`).
  Each expert layer is loaded once per task and run once per batch for all settings;
- the student streams S_t differ per setting from layer 1 on (each setting calibrates layer 0
  differently), so each setting keeps its own student streams, its own statistics and its own
  normal equations, exactly as a separate run would.

Each setting's statistics are accumulated in the same batches and chunks as a separate
:class:`~featcal.calibration.driver.FeatCalibrator` run with its parameters, so the weights equal a
separate run's up to the forward passes' dependence on the batch shape (an expert batch holds the
rows of the largest setting; the tests measure the difference). Layer 0's student statistics of
nested subsets would be prefix sums of one pass; they are computed per setting all the same, since
layer 0 is one layer of many and sharing it would change the accumulation order.

Memory: settings calibrated together hold one model copy, one student stream per task (n_v images)
and one set of layer statistics each, besides the shared expert streams; :func:`featcal_calibrate_many`
takes ``together`` to bound how many are held at once.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, LayerAdapter, TokenWeighting, as_batch, run_layer
from featcal.calibration.driver import FeatCalibrator, Stream, fold_task
from featcal.calibration.layer_state import LayerState, Recorder, StopForward
from featcal.calibration.params import FeatCalParams
from featcal.calibration.stream_storage import DEVICE, StreamPlacement
from featcal.calibration.workspace import Workspace
from featcal.checkpoint import StateDict, load_params
from featcal.errors import FeatcalError
from featcal.memory import trim_heap
from featcal.precision import autocast_forwards, without_callers_autocast
from featcal.progress import Progress

logger = logging.getLogger(__name__)


class _FirstRows:
    """A recorder's inputs and outputs cut to their first ``rows`` images (a setting with fewer
    calibration images than the shared expert batch)."""

    def __init__(self, recorder: Recorder, rows: int) -> None:
        self.inputs = {name: x[:rows] for name, x in recorder.inputs.items()}
        self.outputs = {name: x[:rows] for name, x in recorder.outputs.items()}


@dataclass
class _Setting:
    """One setting being calibrated: its driver (for its parameters), model and student streams."""

    calibrator: FeatCalibrator
    model: nn.Module
    students: dict[str, Stream]
    state: LayerState | None = None

    @property
    def params(self) -> FeatCalParams:
        return self.calibrator.params

    @property
    def size(self) -> int:
        return self.params.num_calibration_examples


class SweepCalibrator:
    """Calibrates one merged model with each of several FeatCal settings, sharing the expert work.

    Args:
        settings: The settings; they must share ``calibration_batch_size``.
        adapter: The architecture adapter (:meth:`featcal.families.ModelFamily.adapter`).
        device: The compute device.
        stats_dtype: The dtype of the statistics sums.
        progress: Show progress bars.
        forward_dtype: Autocast the layers' forwards to this dtype (``torch.bfloat16``); None: float32.

    Raises:
        FeatcalError: when there is no setting, or the settings' batch sizes differ.
    """

    def __init__(
        self,
        settings: Sequence[FeatCalParams],
        *,
        adapter: LayerAdapter,
        device: torch.device | str = "cpu",
        stats_dtype: torch.dtype = torch.float64,
        progress: bool = True,
        forward_dtype: torch.dtype | None = None,
    ) -> None:
        if not settings:
            raise FeatcalError("A FeatCal sweep needs at least one setting.")
        batch_sizes = {p.calibration_batch_size for p in settings}
        if len(batch_sizes) > 1:
            raise FeatcalError(
                f"The settings of a FeatCal sweep must share calibration_batch_size; got {sorted(batch_sizes)}."
            )
        self.settings = list(settings)
        self.adapter = adapter
        self.device = torch.device(device)
        self.stats_dtype = stats_dtype
        self.progress = progress
        self.forward_dtype = forward_dtype
        self.workspace = Workspace()  # the settings solve one after another: one set of solve buffers
        self.batch_size = batch_sizes.pop()

    def _driver(self, params: FeatCalParams) -> FeatCalibrator:
        return FeatCalibrator(
            params,
            adapter=self.adapter,
            device=self.device,
            stats_dtype=self.stats_dtype,
            progress=False,
            forward_dtype=self.forward_dtype,
        )

    @torch.no_grad()
    @without_callers_autocast
    def calibrate(
        self,
        merged: nn.Module,
        base: StateDict,
        experts: Mapping[str, StateDict],
        load_inputs: Callable[[str], CalibrationBatch | torch.Tensor],
    ) -> list[nn.Module]:
        """A calibrated copy of ``merged`` per setting, in the settings' order.

        ``load_inputs(task)`` gives the task's calibration examples for the largest n; the first n_v
        rows must be the calibration examples of a setting with n_v (nested subsets). An autocast the
        caller runs in is switched off: only ``forward_dtype`` decides the forwards'.
        """
        largest = max(self.settings, key=lambda p: p.num_calibration_examples)
        shared = self._driver(largest)
        settings = [_Setting(self._driver(p), copy.deepcopy(merged).to(self.device).eval(), {}) for p in self.settings]
        tasks = list(experts)
        expert_streams: dict[str, Stream] = {}
        on_device = StreamPlacement(DEVICE, self.device)  # the sweep's streams stay on the device
        for task in Progress(tasks, desc="FeatCal sweep: first-layer inputs", unit="tasks", enabled=self.progress):
            first = shared._first_inputs(settings[0].model, experts[task], as_batch(load_inputs(task)), task, on_device)
            student, expert, batches = first.student, first.expert, first.batches
            carry_s, carry_e = first.student_carry, first.expert_carry
            del first  # the stem's inputs were not kept through the layers
            # its students are the settings'
            expert_streams[task] = Stream(expert[:0], expert, batches, expert_carry=carry_e)
            for setting in settings:
                rows = batches.rows(0, setting.size)
                setting.students[task] = Stream(
                    student[: setting.size].clone(), expert[: setting.size], rows, student_carry=carry_s
                )
            del student
        layers = [self.adapter.layers(s.model) for s in settings]
        num_layers = len(layers[0])
        for index in Progress(range(num_layers), desc="FeatCal sweep: layers", unit="layers", enabled=self.progress):
            prefix = self.adapter.layer_prefix(index)
            # as the driver: the experts' layers are read into a copy of this very layer, not of the first
            expert_layer = copy.deepcopy(layers[0][index])
            seq_len = expert_streams[tasks[0]].expert.shape[1]
            names = self.adapter.calibrated_modules(layers[0][index])
            weighting = {n: self.adapter.token_weighting(n, index, num_layers, seq_len) for n in names}
            for t, task in enumerate(
                Progress(tasks, desc=f"layer {index}: statistics", unit="tasks", leave=False, enabled=self.progress)
            ):
                load_params(expert_layer, experts[task], prefix)
                if t == 0:
                    for setting, setting_layers in zip(settings, layers):
                        self._prepare(setting, setting_layers[index], expert_layer, expert_streams[task], weighting)
                self._collect([lay[index] for lay in layers], expert_layer, expert_streams[task], settings, task)
            trim_heap()  # as the driver does before its solves
            for setting, setting_layers in zip(settings, layers):
                modules = self.adapter.calibrated_modules(setting_layers[index])
                setting.calibrator._solve_into(modules, setting.state, base, prefix)
                if index < num_layers - 1:
                    layer = setting_layers[index]
                    for stream in setting.students.values():
                        setting.calibrator._advance(setting.model, layer, stream)
            del expert_layer  # freed before the next layer's copy
            logger.debug("FeatCal sweep: layer %d calibrated for %d settings", index, len(settings))
        return [s.model for s in settings]

    def _prepare(
        self,
        setting: _Setting,
        layer: nn.Module,
        expert_layer: nn.Module,
        expert: Stream,
        weighting: Mapping[str, TokenWeighting],
    ) -> None:
        """The setting's layer plan and working memory, as its own driver would make them."""
        first = next(iter(setting.students.values()))
        stream = Stream(first.student, expert.expert, first.batches, first.student_carry, expert.expert_carry)
        plan = setting.calibrator._discover(setting.model, layer, expert_layer, stream, weighting)
        if setting.state is not None and setting.state.plan.key() == plan.key():
            setting.state.start_layer(plan)
        else:
            setting.state = None  # free the previous layer's memory before allocating
            setting.state = setting.calibrator._new_state(plan, setting.students, self.workspace)

    @torch.no_grad()
    def _collect(
        self,
        layers: Sequence[nn.Module],
        expert_layer: nn.Module,
        stream: Stream,
        settings: Sequence[_Setting],
        task: str,
    ) -> None:
        """One task's statistics for every setting at one layer: each expert batch runs once and
        feeds every setting whose calibration set reaches it; advances the expert stream through its layer."""
        modules_e = self.adapter.calibrated_modules(expert_layer)
        rec_e = Recorder(modules_e, outputs=True)
        recorders = []
        try:
            for setting, layer in zip(settings, layers):
                recorder = Recorder(self.adapter.calibrated_modules(layer))
                recorder.stop_at = setting.state.plan.stop_at
                recorders.append(recorder)
                setting.state.start_task()
            bs = self.batch_size
            expert = stream.expert
            seq_len = expert.shape[1]
            carry_e = stream.expert_carry
            for start in range(0, expert.shape[0], bs):
                batch = stream.batches.rows(start, start + bs)
                context = self.adapter.layer_context(settings[0].model, batch, expert[start : start + bs])
                with autocast_forwards(self.device, self.forward_dtype):
                    out_e, carry_e = run_layer(
                        self.adapter, expert_layer, expert[start : start + bs], context, stream.expert_carry
                    )
                for setting, layer, recorder in zip(settings, layers, recorders):
                    own = setting.students[task]
                    student = own.student
                    rows = min(bs, student.shape[0] - start)
                    if rows <= 0:
                        continue
                    part = batch if rows == out_e.shape[0] else batch.rows(0, rows)
                    part_context = (
                        context
                        if part is batch
                        else self.adapter.layer_context(setting.model, part, student[start : start + rows])
                    )
                    try:
                        with autocast_forwards(self.device, self.forward_dtype):
                            run_layer(self.adapter, layer, student[start : start + rows], part_context,
                                      own.student_carry)  # fmt: skip
                    except StopForward:
                        pass
                    expert_rows = rec_e if rows == out_e.shape[0] else _FirstRows(rec_e, rows)
                    setting.state.add(rows * seq_len, recorder, expert_rows, modules_e, part.token_weights)
                    recorder.clear()
                rec_e.clear()
                expert[start : start + bs] = out_e
            stream.expert_carry = carry_e
            for setting in settings:
                setting.state.finish_task()
        finally:
            rec_e.remove()
            for recorder in recorders:
                recorder.remove()
        for setting in settings:
            fold_task(setting.state, setting.params, modules_e)


def setting_groups(settings: Sequence[FeatCalParams], together: int | None) -> Iterator[list[int]]:
    """Indices of ``settings`` in groups of at most ``together`` (all at once when None), each
    group of similar calibration sizes, so that a group's shared expert streams are no longer than
    its members need."""
    order = sorted(range(len(settings)), key=lambda i: settings[i].num_calibration_examples)
    size = len(order) if together is None else max(1, together)
    for start in range(0, len(order), size):
        yield order[start : start + size]


def featcal_calibrate_many(
    merged: nn.Module,
    base: StateDict,
    experts: Mapping[str, StateDict],
    load_inputs: Callable[[str], CalibrationBatch | torch.Tensor],
    settings: Sequence[FeatCalParams],
    *,
    together: int | None = None,
    adapter: LayerAdapter | None = None,
    **kwargs,
) -> Iterator[tuple[int, nn.Module]]:
    """FeatCal of ``merged`` with each of ``settings``, calibrated together in groups.

    Args:
        merged: The merged model (left unchanged).
        base: The base model's tensors as its family keys them.
        experts: Each task's expert tensors, by task name.
        load_inputs: ``load_inputs(task)`` gives the task's calibration examples for the largest n of
            the settings; the first n rows must be those of a setting with n (nested subsets).
        settings: The FeatCal settings; they must share ``calibration_batch_size``.
        together: At most this many settings are calibrated (and held in memory) at once; None: all.
        adapter: The architecture adapter (default: the one of ``merged``'s model family).
        **kwargs: Passed to :class:`SweepCalibrator`: ``device``, ``progress``, ``stats_dtype``,
            ``forward_dtype``.

    Yields:
        ``(index into settings, calibrated model)``, a group at a time; a model is not kept after
        it is yielded, so a caller that evaluates and drops it bounds memory by ``together``.

    Raises:
        FeatcalError: when there is no setting, the batch sizes differ, or an expert lacks a tensor.
    """
    if together is not None and together < 1:
        raise FeatcalError(f"together={together} is invalid: it must be a whole number >= 1.")
    settings = list(settings)
    groups = list(setting_groups(settings, together))
    # Several groups read each task's pixels again: keep them (the largest n of every task, 0.6 MB an
    # image at 224 px). One group reads them once: keep nothing.
    if adapter is None:
        from featcal.families import adapter_for

        adapter = adapter_for(merged)
    inputs: dict[str, CalibrationBatch] = {}

    def cached(task: str) -> CalibrationBatch:  # the examples of the largest n, sliced by smaller groups
        if len(groups) == 1:
            return as_batch(load_inputs(task))
        if task not in inputs:
            inputs[task] = as_batch(load_inputs(task))
        return inputs[task]

    for group in groups:
        chosen = [settings[i] for i in group]
        largest = max(p.num_calibration_examples for p in chosen)
        models = SweepCalibrator(chosen, adapter=adapter, **kwargs).calibrate(
            merged, base, experts, lambda task, n=largest: cached(task).rows(0, n)
        )
        for i in group:
            yield i, models.pop(0)
