"""Feature drift: how far a merged model's features lie from each expert's, layer by layer.

For a task t, a model M (the merged model, or the calibrated one) and expert t, all run on the
same images of task t, the relative drift of a feature f is::

    drift(f) = sqrt( Σ ‖f_M − f_t‖² ) / sqrt( Σ ‖f_t‖² )

with the sums over every example and every token (a padding token, weighing 0 in its batch, is left
out). It is measured at the output of each encoder
layer (``f`` = the hidden states, every token) and at the end on the pooled output the zero-shot
heads read (for CLIP: ``post_layernorm`` of the CLS token), each model with its own layers and
head. 0 means the model reproduces the expert's features exactly on these images.

Streaming, like the calibration: one task at a time, each model's stream (``[n, seq, d]``) is
advanced in place through one layer at a time, and the expert's layers are read one at a time from
its (memory-mapped) checkpoint into a copy of the model's layer at the same index, so memory holds one
layer's features per model and one expert layer, whatever the number of layers and tasks. Each model
runs one forward pass over each task's images; sums are kept in float64.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, LayerAdapter, as_batch, run_layer, stem_carry
from featcal.checkpoint import StateDict, load_params
from featcal.errors import FeatcalError
from featcal.progress import Progress

logger = logging.getLogger(__name__)

POOLED = "pooled"  # the name of the last measuring point: the pooled (CLS) output


@dataclass(frozen=True)
class FeatureDrift:
    """Relative drift of each model from each task's expert, per measuring point.

    Attributes:
        points: The measuring points in forward order: ``layer 0`` … ``layer L-1``, then ``pooled``.
        drift: ``drift[model][task]`` has one value per point (see the module docstring).
        num_images: The images each task was measured on.
    """

    points: tuple[str, ...]
    drift: Mapping[str, Mapping[str, tuple[float, ...]]]
    num_images: Mapping[str, int]

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(self.drift)

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(self.num_images)

    def layer_drift(self, model: str, task: str) -> tuple[float, ...]:
        """The drift at each encoder layer's output (the pooled point left out)."""
        return self.drift[model][task][:-1]

    def pooled_drift(self, model: str, task: str) -> float:
        """The drift of the pooled (CLS) output."""
        return self.drift[model][task][-1]

    def summed_layer_drift(self, model: str) -> float:
        """The sum over tasks and encoder layers of the layer drifts of ``model``."""
        return math.fsum(v for task in self.tasks for v in self.layer_drift(model, task))

    def mean_layer_drift(self, model: str) -> float:
        """The mean over tasks and encoder layers of the layer drifts of ``model``."""
        return self.summed_layer_drift(model) / (len(self.tasks) * (len(self.points) - 1))

    def mean_pooled_drift(self, model: str) -> float:
        """The mean over tasks of the pooled-output drift of ``model``."""
        return math.fsum(self.pooled_drift(model, task) for task in self.tasks) / len(self.tasks)


class _Sums:
    """Σ‖f_M − f_t‖² per model and Σ‖f_t‖² at each point, in float64."""

    def __init__(self, models: list[str], num_points: int, device: torch.device) -> None:
        self.diff = {m: torch.zeros(num_points, dtype=torch.float64, device=device) for m in models}
        self.expert = torch.zeros(num_points, dtype=torch.float64, device=device)

    def add(
        self,
        point: int,
        expert: torch.Tensor,
        outputs: Mapping[str, torch.Tensor],
        token_weights: torch.Tensor | None = None,
    ) -> None:
        """One batch's squared norms at ``point``; ``token_weights`` ``[batch, seq]`` (0 on padding) leave
        tokens out of per-token features (pooled features, one per example, have none)."""
        mask = None if token_weights is None or expert.dim() < 3 else (token_weights > 0).unsqueeze(-1)
        expert = expert.double() if mask is None else expert.double() * mask
        self.expert[point] += expert.pow(2).sum()
        for name, out in outputs.items():
            out = out.double() if mask is None else out.double() * mask
            self.diff[name][point] += (out - expert).pow(2).sum()

    def relative(self, task: str) -> dict[str, tuple[float, ...]]:
        """``sqrt(diff / expert)`` per model and point; raises when the expert's features are all zero."""
        expert = self.expert.cpu()
        if not bool(torch.isfinite(expert).all()) or not bool((expert > 0).all()):
            raise FeatcalError(
                f"Feature drift: the expert of task {task!r} gives all-zero or non-finite features on its "
                "images; check the expert's weights and the images."
            )
        drift = {name: (diff.cpu() / expert).sqrt() for name, diff in self.diff.items()}
        bad = next((name for name, values in drift.items() if not bool(torch.isfinite(values).all())), None)
        if bad is not None:
            raise FeatcalError(f"Feature drift: the model {bad!r} gives non-finite features on task {task!r}.")
        return {name: tuple(float(v) for v in values) for name, values in drift.items()}


class DriftMeter:
    """Measures :class:`FeatureDrift` of models against experts. See :func:`measure_drift`."""

    def __init__(
        self,
        *,
        adapter: LayerAdapter,
        device: torch.device | str = "cpu",
        batch_size: int = 64,
        progress: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.adapter = adapter
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.progress = progress

    def _on_device(self, model: nn.Module) -> nn.Module:
        """``model`` on the device in eval mode; a copy when it lives elsewhere, so the caller's is not moved."""
        where = next(model.parameters()).device
        if where.type != self.device.type or (self.device.index is not None and where.index != self.device.index):
            model = copy.deepcopy(model).to(self.device)
        return model.eval()

    def _expert_copy(self, module: nn.Module, expert: StateDict, prefix: str) -> nn.Module:
        """A copy of ``module`` holding the expert's parameters named ``prefix``…"""
        module = copy.deepcopy(module)
        load_params(module, expert, prefix)
        return module

    @torch.no_grad()
    def _stem(self, stem: nn.Module, batch: CalibrationBatch, dtype: torch.dtype) -> torch.Tensor:
        """The first layer's input for every example, ``[n, seq, d]``, computed batch by batch."""
        stream = None
        size = len(batch)
        for start in range(0, size, self.batch_size):
            rows = batch.rows(start, start + self.batch_size).inputs
            part = {
                k: v.to(self.device, dtype) if v.is_floating_point() else v.to(self.device) for k, v in rows.items()
            }
            out = self.adapter.run_stem(stem, CalibrationBatch(part))
            if stream is None:
                stream = out.new_empty(size, *out.shape[1:])
            stream[start : start + self.batch_size] = out
        assert stream is not None
        return stream

    @torch.no_grad()
    def _task(self, models: Mapping[str, nn.Module], expert: StateDict, batch: CalibrationBatch) -> tuple[_Sums, int]:
        """The drift sums of every model against one expert on one task's examples."""
        first = next(iter(models.values()))
        dtype = next(first.parameters()).dtype
        stem = self.adapter.stem(first)
        expert_stem = copy.deepcopy(stem)
        for part, prefix in self.adapter.stem_parts().items():
            load_params(expert_stem.get_submodule(part), expert, prefix)
        expert_stream = self._stem(expert_stem, batch, dtype)
        expert_carry = stem_carry(self.adapter, expert_stem)
        del expert_stem
        stems = {name: self.adapter.stem(model) for name, model in models.items()}
        streams = {name: self._stem(stem, batch, dtype) for name, stem in stems.items()}
        carries = {name: stem_carry(self.adapter, stem) for name, stem in stems.items()}
        layer_batches = batch.for_layers(self.device)
        layers = {name: self.adapter.layers(model) for name, model in models.items()}
        num_layers = len(layers[next(iter(models))])
        sums = _Sums(list(models), num_layers + 1, self.device)
        for index in range(num_layers):
            # a copy of this very layer (not of the first): layers can differ by more than their tensors
            # (the attention type of a sliding-window layer), and the adapter runs the copy as that layer
            expert_layer = copy.deepcopy(self.adapter.layers(first)[index])
            load_params(expert_layer, expert, self.adapter.layer_prefix(index))
            expert_after, after = expert_carry, dict(carries)  # each stream's carry past this layer
            for start in range(0, expert_stream.shape[0], self.batch_size):
                rows = slice(start, start + self.batch_size)
                part = layer_batches.rows(start, start + self.batch_size)
                context = self.adapter.layer_context(first, part, expert_stream[rows])
                expert_stream[rows], expert_after = run_layer(
                    self.adapter, expert_layer, expert_stream[rows], context, expert_carry
                )
                for name in models:
                    streams[name][rows], after[name] = run_layer(
                        self.adapter, layers[name][index], streams[name][rows], context, carries[name]
                    )
                outputs = {name: streams[name][rows] for name in models}
                sums.add(index, expert_stream[rows], outputs, part.token_weights)
            expert_carry, carries = expert_after, after
            del expert_layer  # freed before the next layer's copy
        heads = {name: self.adapter.head(model) for name, model in models.items()}
        expert_head = self._expert_copy(self.adapter.head(first), expert, self.adapter.head_prefix())
        for start in range(0, expert_stream.shape[0], self.batch_size):
            rows = slice(start, start + self.batch_size)
            part = layer_batches.rows(start, start + self.batch_size)
            pooled = {name: self.adapter.run_head(heads[name], streams[name][rows], part) for name in models}
            sums.add(num_layers, self.adapter.run_head(expert_head, expert_stream[rows], part), pooled)
        return sums, num_layers

    def measure(
        self,
        models: Mapping[str, nn.Module],
        experts: Mapping[str, StateDict],
        load_inputs: Callable[[str], CalibrationBatch | torch.Tensor],
    ) -> FeatureDrift:
        """The drift of each model in ``models`` from each expert, on that expert's task's examples."""
        if not models or not experts:
            raise ValueError("measure_drift needs at least one model and one expert")
        models = {name: self._on_device(model) for name, model in models.items()}
        drift: dict[str, dict[str, tuple[float, ...]]] = {name: {} for name in models}
        counts: dict[str, int] = {}
        num_layers = 0
        for task in Progress(list(experts), desc="Feature drift", unit="tasks", enabled=self.progress):
            batch = as_batch(load_inputs(task))
            if len(batch) == 0:
                raise FeatcalError(f"Feature drift: task {task!r} has no images to measure on.")
            sums, num_layers = self._task(models, experts[task], batch)
            for name, values in sums.relative(task).items():
                drift[name][task] = values
            counts[task] = len(batch)
            logger.debug("Feature drift: task %s measured on %d images", task, counts[task])
        points = (*(f"layer {i}" for i in range(num_layers)), POOLED)
        return FeatureDrift(points, drift, counts)


def measure_drift(
    models: Mapping[str, nn.Module],
    experts: Mapping[str, StateDict],
    load_inputs: Callable[[str], CalibrationBatch | torch.Tensor],
    *,
    adapter: LayerAdapter | None = None,
    **kwargs,
) -> FeatureDrift:
    """The relative feature drift of each model from each task's expert, per layer and task.

    Args:
        models: The models to measure, by name (e.g. ``{"merged": ta, "calibrated": featcal_ta}``);
            left unchanged (copied to the device when they live elsewhere).
        experts: Each task's expert tensors, by task name (e.g. a lazily-read ``Checkpoint``).
        load_inputs: ``load_inputs(task)`` gives that task's examples: a
            :class:`~featcal.calibration.adapters.CalibrationBatch`, or pixels ``[n, 3, H, W]``.
        adapter: The architecture adapter (default: the one of the models' family).
        **kwargs: Passed to :class:`DriftMeter`: ``device``, ``batch_size``, ``progress``.

    Returns:
        The drift per model, task and measuring point (see the module docstring for its definition).

    Raises:
        FeatcalError: when an expert lacks a tensor, a task has no images, or the features are
            all zero or not finite.
    """
    if adapter is None:
        from featcal.families import adapter_for

        adapter = adapter_for(next(iter(models.values())))
    return DriftMeter(adapter=adapter, **kwargs).measure(models, experts, load_inputs)
