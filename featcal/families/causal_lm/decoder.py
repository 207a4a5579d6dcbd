"""A decoder's stack of layers, and what its own forward hands each layer.

The calibration runs a causal LM layer by layer. What a layer reads besides its hidden states (the
attention masks built from the examples' padding, a sliding-window one for the layers that have one,
positions, rotary embeddings, ALiBi biases) and what layer 0 reads (the token embedding, scaled, plus
learned positions where the model has them) are taken from the model's own forward: its decoder runs with
each layer replaced by a stand-in that records its arguments and hands its hidden states on unchanged, and
stops at the last layer. No layer runs, so this costs the stem only; and the chain of layers run with
those arguments is the model's own forward, whatever the architecture builds before its first layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Call = tuple[tuple[Any, ...], dict[str, Any]]  # a layer's arguments after its hidden states, and its keywords


class _Stop(Exception):
    """Raised by the stand-in of the last layer wanted: the decoder's forward stops there."""


class _StandIn(nn.Module):
    """Takes a decoder layer's place: records its hidden states and arguments, hands the hidden states on."""

    def __init__(self, record: Callable[[int, torch.Tensor, Call], None], index: int, last: bool, as_tuple: bool):
        super().__init__()
        self.record, self.index, self.last, self.as_tuple = record, index, last, as_tuple

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.record(self.index, hidden, (args, kwargs))
        if self.last:
            raise _Stop
        return (hidden,) if self.as_tuple else hidden


@dataclass(frozen=True)
class Stack:
    """Where a ``*ForCausalLM`` keeps its decoder layers: the decoder's path in the model (``model``; ``""``
    for the model itself) and the name of its ``nn.ModuleList`` of layers (``layers``)."""

    base: str
    layers: str

    def decoder(self, model: nn.Module) -> nn.Module:
        """The module whose forward runs the layers (``model.model``)."""
        return model.get_submodule(self.base) if self.base else model

    def prefix(self, name: str) -> str:
        """The checkpoint key prefix of the decoder's child ``name`` (``model.layers.``)."""
        return f"{self.base}.{name}." if self.base else f"{name}."


def find_stack(model: nn.Module, num_layers: int) -> Stack | None:
    """The ``nn.ModuleList`` of ``num_layers`` layers in ``model`` (of those, the one whose layers hold
    ``nn.Linear`` modules, when there are several): its stack; None when there is none or no single one."""
    found = [
        (path, module)
        for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) == num_layers > 0
    ]
    if len(found) > 1:
        found = [(p, m) for p, m in found if all(any(isinstance(x, nn.Linear) for x in layer.modules()) for layer in m)]
    if len(found) != 1:
        return None
    base, _, name = found[0][0].rpartition(".")
    return Stack(base, name)


@contextmanager
def standing_in(decoder: nn.Module, layers: str, last: int, as_tuple: bool) -> Iterator[dict[int, tuple]]:
    """Within the block, ``decoder``'s layers are stand-ins recording ``{index: (hidden, call)}`` into the
    yielded dict, the one at ``last`` stopping the forward (:func:`run_until`)."""
    original = getattr(decoder, layers)
    calls: dict[int, tuple] = {}

    def record(index: int, hidden: torch.Tensor, call: Call) -> None:
        calls[index] = (hidden, call)

    stand_ins = nn.ModuleList(_StandIn(record, i, i == last, as_tuple) for i in range(len(original)))
    setattr(decoder, layers, stand_ins)
    try:
        yield calls
    finally:
        setattr(decoder, layers, original)


@contextmanager
def reading_config(decoder: nn.Module, config: Any) -> Iterator[None]:
    """Within the block, ``decoder`` reads ``config`` when its own configuration counts fewer layers than
    ``config`` (a skeleton built without its layers keeps the full configuration on the model only)."""
    own = getattr(decoder, "config", None)
    fewer = getattr(own, "num_hidden_layers", None) != getattr(config, "num_hidden_layers", None)
    if config is None or own is None or own is config or not fewer:
        yield
        return
    decoder.config = config
    try:
        yield
    finally:
        decoder.config = own


def run_until(decoder: nn.Module, **inputs: Any) -> None:
    """Run ``decoder``'s forward until its stand-in layer that stops it (:func:`standing_in`)."""
    try:
        decoder(**inputs, use_cache=False)
    except _Stop:
        return


def layer_index(layer: nn.Module) -> int | None:
    """A decoder layer's index, as transformers keeps it (``layer_idx`` on the layer or its attention)."""
    for module in layer.modules():
        value = getattr(module, "layer_idx", None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def same_calls(calls: list[Call]) -> bool:
    """Whether every layer is handed the very same arguments (the same tensors, not equal ones)."""
    first_args, first_kwargs = calls[0]
    for args, kwargs in calls[1:]:
        if len(args) != len(first_args) or any(a is not b for a, b in zip(args, first_args)):
            return False
        if kwargs.keys() != first_kwargs.keys() or any(kwargs[k] is not first_kwargs[k] for k in kwargs):
            return False
    return True
