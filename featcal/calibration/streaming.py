"""FeatCal from a merged model's folder to the calibrated model's folder, one layer at a time.

The merged model is never whole in memory: what lies outside its layers (a CLIP's stem and final
LayerNorm) is read at the start, each layer just before the calibration reaches it, and each
calibrated layer is written into the output file and dropped as soon as the feature streams have
moved past it. At ViT-B/32 this keeps
0.33 GiB of the model out of the calibration's peak memory (benchmarks/README.md, "Streaming").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, LayerAdapter
from featcal.calibration.driver import FeatCalibrator
from featcal.calibration.params import FeatCalParams
from featcal.checkpoint import Checkpoint, StateDict, load_params
from featcal.errors import FeatcalError
from featcal.files.safetensors_writer import TensorWriter
from featcal.precision import BASE_DTYPE

if TYPE_CHECKING:
    from featcal.families.base import ModelFamily

# Each tensor of a loaded layer starts where a fresh allocation would: CUDA's caching allocator hands
# out 512-byte-aligned blocks, and a kernel chosen by pointer alignment must not differ between paths.
ALIGN_BYTES = 512


class CheckpointLayers:
    """A :class:`~featcal.calibration.driver.LayerStore` that reads the merged layers from a checkpoint
    and writes the calibrated ones through ``writer`` (or drops them when None: a process that does
    not write), leaving each on the meta device after."""

    def __init__(
        self,
        merged: Checkpoint,
        writer: TensorWriter | None,
        device: torch.device,
        adapter: LayerAdapter,
        key_prefix: str = "",
    ) -> None:
        self.merged, self.writer, self.device, self.adapter = merged, writer, device, adapter
        self.key_prefix = key_prefix
        self._block: torch.Tensor | None = None

    def load(self, index: int, layer: nn.Module) -> None:
        self._materialise(layer)
        load_params(layer, self.merged, self.adapter.layer_prefix(index))

    def _materialise(self, layer: nn.Module) -> None:
        """Give ``layer``'s parameters and buffers memory: views of one block, reused for every layer
        (one allocation instead of a dozen per layer, no holes left in the heap from layer to layer)."""
        tensors = [
            (module, table, name, tensor)
            for module in layer.modules()
            for table in (module._parameters, module._buffers)
            for name, tensor in table.items()
            if tensor is not None
        ]
        saved = layer.state_dict(keep_vars=True).values()
        if len(tensors) != len(saved) or len({id(t) for *_, t in tensors}) != len(tensors):
            raise FeatcalError(
                "The layers of this architecture hold tensors that are not in their state dict, or share "
                "one: they cannot be read from a checkpoint one layer at a time."
            )
        dtype = tensors[0][3].dtype
        if any(tensor.dtype != dtype for *_, tensor in tensors):
            layer.to_empty(device=self.device)  # mixed dtypes: one allocation per tensor
            return
        align = ALIGN_BYTES // dtype.itemsize
        sizes = [-(-tensor.numel() // align) * align for *_, tensor in tensors]
        if self._block is None or self._block.numel() < sum(sizes) or self._block.dtype != dtype:
            self._block = torch.empty(sum(sizes), device=self.device, dtype=dtype)
        offset = 0
        for (module, table, name, tensor), size in zip(tensors, sizes):
            view = self._block[offset : offset + tensor.numel()].view(tensor.shape)
            is_parameter = table is module._parameters
            table[name] = nn.Parameter(view, requires_grad=tensor.requires_grad) if is_parameter else view
            offset += size

    def store(self, index: int, layer: nn.Module) -> None:
        if self.writer is not None:
            prefix = self.key_prefix + self.adapter.layer_prefix(index)
            for name, tensor in layer.state_dict().items():
                self.writer.write(prefix + name, tensor)
        layer.to_empty(device="meta")


def featcal_calibrate_folder(
    family: ModelFamily,
    merged_folder: str | Path,
    output: str | Path | None,
    base: StateDict,
    experts: Mapping[str, StateDict],
    load_inputs: Callable[[str], CalibrationBatch],
    params: FeatCalParams,
    *,
    config: Any,
    device: torch.device | str = "cpu",
    output_dtype: str = BASE_DTYPE,
    **kwargs: Any,
) -> None:
    """FeatCal of the merged model in ``merged_folder``, written to ``output`` layer by layer.

    Gives the weights :func:`~featcal.calibration.featcal_calibrate` gives, with one layer of the model
    in memory instead of all of them.

    Args:
        family: The model family (its skeleton, adapter and folder writer).
        merged_folder: The merged model (a folder the family's checkpoint reads), checked by the caller
            (architecture, finite values) or written from values it checked.
        output: The calibrated model's folder, which appears whole when the calibration ends and not
            at all when it fails; None calibrates without writing (the other processes of a torchrun).
        base: The base model's tensors, as the family keys them.
        experts: Each task's expert tensors, by task name.
        load_inputs: ``load_inputs(task)`` gives the task's calibration examples.
        params: FeatCal's hyper-parameters.
        config: The configuration written with the calibrated model (the base's).
        device: Where the calibration computes.
        output_dtype: The dtype the weights are stored in (one of the family's ``output_dtypes``).
        **kwargs: Passed to :class:`~featcal.calibration.FeatCalibrator`: ``progress``, ``world``,
            ``forward_dtype``, ``stats_dtype``, ``stream_storage``.

    Raises:
        FeatcalError: when a checkpoint lacks a tensor the calibration needs, or a solve gives
            non-finite weights.
        OSError: when the output folder cannot be written.
    """
    device = torch.device(device)
    adapter = family.adapter()
    merged = family.checkpoint(Path(merged_folder), name="merged model")
    model = family.skeleton(Path(merged_folder), merged, device)
    tower = adapter.tower(model)
    # The writer's keys are the model's state dict's: the tower's, under the prefix it has in the model.
    key_prefix = next((f"{name}." for name, module in model.named_modules() if module is tower and name), "")
    writing = output is not None
    with family.streamed_model(config, output, output_dtype=output_dtype) if writing else nullcontext() as writer:
        if writer is not None:
            for name, tensor in tower.state_dict().items():
                if tensor.device.type != "meta":  # everything but the layers: the merged values
                    writer.write(key_prefix + name, tensor)
        store = CheckpointLayers(merged, writer, device, adapter, key_prefix)
        FeatCalibrator(params, adapter=adapter, device=device, **kwargs).calibrate(
            model, base, experts, load_inputs, layer_store=store
        )
