"""What a data-using merging method reads besides the weights: the model's layers and each task's examples.

A method registered with ``uses_data=True`` (RegMean, RegMean++) is called with a :class:`MergeData`.
The model family supplies its parts, as it does for FeatCal: the adapter that runs one layer at a time,
the skeleton of the base model, and each task's calibration examples (:mod:`featcal.stages` builds it
from a run's tasks; a test may build one by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, LayerAdapter
from featcal.errors import InvalidParameterError

if TYPE_CHECKING:
    from featcal.families.base import ModelFamily


def check_data_family(method: str, family: ModelFamily) -> None:
    """Refuse, before any work, a data-using merge of a family whose layers are not one plain stack.

    RegMean and RegMean++ stream each task's examples through the layers with the adapter's plain
    ``run_layer``; a family whose streams carry tensors from layer to layer (a T5: its position biases and
    encoder output; :class:`~featcal.calibration.adapters.CarryingAdapter`) is not merged that way.

    Raises:
        InvalidParameterError: naming the method and the family, for such a family.
    """
    if hasattr(family.adapter(), "run_layer_carried"):
        raise InvalidParameterError(
            "merge_method", method, f"a merging method that uses no calibration data for {family.title} models "
            f"(family {family.name}; task_arithmetic, ties, ...): {method} merges from the inputs of one plain "
            "stack of layers, which an encoder-decoder is not",
        )  # fmt: skip


@dataclass(frozen=True)
class MergeData:
    """The model's structure and the calibration examples a data-using merge streams through it.

    Attributes:
        adapter: The family's view of the model: its stem, layers, how one layer runs.
        skeleton: ``skeleton(device)``: the base model with everything but its layers on ``device`` and
            its layers on the meta device (:meth:`~featcal.families.base.ModelFamily.skeleton` of the base).
        tasks: The task names, one per expert, in the experts' order.
        load_inputs: ``load_inputs(task)``: the task's calibration examples (under torchrun, this process's
            part of them).
        batch_size: Examples per forward batch.
        progress: Show progress bars.
    """

    adapter: LayerAdapter
    skeleton: Callable[[torch.device], nn.Module]
    tasks: tuple[str, ...]
    load_inputs: Callable[[str], CalibrationBatch | torch.Tensor]
    batch_size: int = 16
    progress: bool = True
