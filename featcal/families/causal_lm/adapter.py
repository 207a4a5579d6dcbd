"""The calibration's view of a decoder-only causal LM of transformers 5, whatever its architecture.

Nothing here names an architecture: where the layers, the stem and the final norm are, and whether the
layers read arguments of their own, come from :func:`describe` (a tiny model of the configuration, probed
once by :func:`~featcal.families.causal_lm.shape.probe`, its chain of layers checked against its own
forward); what a layer solves comes from the layer itself (every ``nn.Linear``, and every normalisation
that is a direct child of the layer, its form found by running it: :mod:`.norms`); which linears read one
input and form one group, and in which order they run, the
calibration's hooks find (:func:`featcal.calibration.layer_state.plan_layer`).

Layer 0's input and each layer's arguments (masks built from the examples' padding, a sliding-window mask
for the layers that have one, positions, rotary embeddings) are what the model's own decoder hands its
layers (:mod:`.decoder`), so the chain of layers equals the model's own forward. Norms inside a block (q/k
norms) keep their merged values, as do the final norm and the LM head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch, Normalization, TokenWeighting
from featcal.families.causal_lm.decoder import Call, layer_index
from featcal.families.causal_lm.shape import (
    DecoderShape,
    UnsupportedArchitecture,
    first_line,
    layer_calls,
    layer_parts,
    norm_kind,
    probe,
    tiny_config,
)

INPUT_IDS = "input_ids"  # the stem's input
ATTENTION_MASK = "attention_mask"  # 1 for a token, 0 for padding: what every layer's mask is built from
CHAIN_TOLERANCE = 1e-4  # the layers run one by one against the model's forward, relative to its largest value


class _Shared:
    """A reference a deep copy shares instead of copying (the model a stem runs in)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __deepcopy__(self, memo: dict) -> _Shared:
        return self


class _Stem(nn.Module):
    """What the decoder runs before layer 0: its children holding tensors (the token embedding, learned
    positions), run in the model's own decoder forward, which stops at layer 0's input. A copy holds copies
    of those children (an expert's stem) and runs them in the same decoder."""

    def __init__(self, model: nn.Module, shape: DecoderShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = _Shared(model)
        decoder = shape.stack.decoder(model)
        for name in shape.stem:
            self.add_module(name, decoder.get_submodule(name))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        model = self.model.value
        decoder = self.shape.stack.decoder(model)
        own = {name: decoder.get_submodule(name) for name in self.shape.stem}
        try:
            for name in self.shape.stem:
                setattr(decoder, name, self.get_submodule(name))
            stack, as_tuple = self.shape.stack, self.shape.returns_tuple
            calls = layer_calls(decoder, stack, as_tuple, last=0, config=model.config, input_ids=input_ids)
        finally:
            for name, module in own.items():
                setattr(decoder, name, module)
        return calls[0][0]


@dataclass(frozen=True)
class DecoderContext:
    """What the layers of one forward batch read besides their hidden states: each layer's arguments by
    index, or one set for every layer (``shared``)."""

    calls: tuple[Call, ...]
    shared: bool


class DecoderAdapter:
    """A ``*ForCausalLM`` of transformers 5 (see the module docstring).

    Checkpoint keys are the ``ForCausalLM``'s own (``model.layers.0.self_attn.q_proj.weight``).

    Args:
        shape: The architecture's :class:`~featcal.families.causal_lm.shape.DecoderShape`; None: described
            from each model's configuration when the adapter first sees the model.
    """

    def __init__(self, shape: DecoderShape | None = None) -> None:
        self._fixed = shape
        self._shapes: WeakKeyDictionary[nn.Module, DecoderShape] = WeakKeyDictionary()
        self._last = shape

    def shape(self, model: nn.Module) -> DecoderShape:
        """``model``'s :class:`~featcal.families.causal_lm.shape.DecoderShape`.

        Raises:
            UnsupportedArchitecture: for a model the calibration cannot run.
        """
        shape = self._fixed or self._shapes.get(model)
        if shape is None:
            shape = self._shapes[model] = describe(model.config)
        self._last = shape
        return shape

    def _known(self) -> DecoderShape:
        if self._last is None:
            raise RuntimeError("the adapter has seen no model yet: call layers(model) or stem(model) first")
        return self._last

    def tower(self, model: nn.Module) -> nn.Module:
        return model

    def layers(self, model: nn.Module) -> nn.ModuleList:
        stack = self.shape(model).stack
        return getattr(stack.decoder(model), stack.layers)

    def stem(self, model: nn.Module) -> nn.Module:
        shape = self.shape(model)
        return _Stem(model, shape)

    def stem_parts(self) -> dict[str, str]:
        shape = self._known()
        return {name: shape.stack.prefix(name) for name in shape.stem}

    def layer_prefix(self, index: int) -> str:
        return f"{self._known().stack.prefix(self._known().stack.layers)}{index}."

    def run_stem(self, stem: nn.Module, batch: CalibrationBatch) -> torch.Tensor:
        return stem(batch.inputs[INPUT_IDS])

    def layer_context(self, model: nn.Module, batch: CalibrationBatch, hidden: torch.Tensor) -> DecoderContext:
        shape = self.shape(model)
        calls = layer_calls(
            shape.stack.decoder(model),
            shape.stack,
            shape.returns_tuple,
            config=model.config,
            inputs_embeds=hidden,
            attention_mask=batch.context.get(ATTENTION_MASK),
        )
        if shape.per_layer:
            return DecoderContext(tuple(call for _, call in calls), shared=False)
        return DecoderContext((calls[0][1],), shared=True)

    def run_layer(self, layer: nn.Module, hidden: torch.Tensor, context: DecoderContext) -> torch.Tensor:
        args, kwargs = context.calls[0 if context.shared else layer_index(layer)]
        out = layer(hidden, *args, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    def head(self, model: nn.Module) -> nn.Module:
        shape = self.shape(model)
        return shape.stack.decoder(model).get_submodule(shape.head) if shape.head else nn.Identity()

    def head_prefix(self) -> str:
        shape = self._known()
        return shape.stack.prefix(shape.head) if shape.head else ""

    def run_head(self, head: nn.Module, hidden: torch.Tensor, batch: CalibrationBatch) -> torch.Tensor:
        """The final norm of each example's last token (the one the next token is predicted from)."""
        mask = batch.context.get(ATTENTION_MASK)
        last = (
            torch.full((hidden.shape[0],), hidden.shape[1] - 1, device=hidden.device)
            if mask is None
            else mask.to(hidden.device).sum(1) - 1
        )
        return head(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])

    def calibrated_modules(self, layer: nn.Module) -> dict[str, nn.Module]:
        solved, _ = layer_parts(layer)
        idle = self._last.idle if self._last is not None else frozenset()
        return {name: module for name, module in solved.items() if name not in idle}

    def normalization(self, module: nn.Module) -> Normalization | None:
        if isinstance(module, nn.Linear):
            return None
        form = norm_kind(module)
        if form is None:
            raise TypeError(f"{type(module).__name__} is neither an nn.Linear nor a normalisation of a known form")
        return form.normalization()

    def token_weighting(self, module_name: str, layer_index: int, num_layers: int, seq_len: int) -> TokenWeighting:
        return TokenWeighting("ones", None)  # padding weighs 0 through the batch's own token weights


def describe(config: Any) -> DecoderShape:
    """The :class:`~featcal.families.causal_lm.shape.DecoderShape` of ``config``'s architecture, from a tiny
    model of it whose layers, run one by one by :class:`DecoderAdapter`, must give its own forward back
    (cached per configuration).

    Args:
        config: A transformers configuration of a ``*ForCausalLM``.

    Returns:
        Where its layers, stem and head are, and how its layers read their arguments.

    Raises:
        UnsupportedArchitecture: naming the model type and what the calibration cannot solve or run.
    """
    key = type(config).__name__ + config.to_json_string(use_diff=False)
    if key not in _DESCRIBED:
        _DESCRIBED[key] = _describe(config)
    found = _DESCRIBED[key]
    if isinstance(found, UnsupportedArchitecture):
        raise found
    return found


_DESCRIBED: dict[str, DecoderShape | UnsupportedArchitecture] = {}


def _describe(config: Any) -> DecoderShape | UnsupportedArchitecture:
    model_type = str(getattr(config, "model_type", type(config).__name__))
    try:
        with torch.no_grad():
            shape, model, ids, mask = probe(tiny_config(config), model_type)
            _check_chain(model, shape, ids, mask, model_type)
            return shape
    except UnsupportedArchitecture as exc:
        return exc
    except Exception as exc:  # noqa: BLE001 - whatever a tiny model of it raises is why it is refused
        return UnsupportedArchitecture(model_type, f"a tiny model of it does not run ({first_line(exc)})")


def _check_chain(model: nn.Module, shape: DecoderShape, ids, mask, model_type: str) -> None:
    """The layers run one by one, as the calibration runs them, give the model's own forward back."""
    decoder = shape.stack.decoder(model)
    captured: dict[str, torch.Tensor] = {}
    target = decoder.get_submodule(shape.head) if shape.head else None
    if target is None:
        expected = decoder(input_ids=ids, attention_mask=mask, use_cache=False)[0]
    else:
        handle = target.register_forward_pre_hook(lambda _m, args: captured.__setitem__("x", args[0]))
        try:
            model(input_ids=ids, attention_mask=mask, use_cache=False)
        finally:
            handle.remove()
        expected = captured["x"]
    adapter = DecoderAdapter(shape)
    batch = CalibrationBatch({INPUT_IDS: ids}, {ATTENTION_MASK: mask})
    hidden = adapter.run_stem(adapter.stem(model), batch)
    context = adapter.layer_context(model, batch, hidden)
    for layer in adapter.layers(model):
        hidden = adapter.run_layer(layer, hidden, context)
    real = mask.bool()
    gap = (hidden[real] - expected[real]).abs().max().item()
    if not gap <= CHAIN_TOLERANCE * max(1.0, expected[real].abs().max().item()):
        raise UnsupportedArchitecture(
            model_type, f"its layers run one by one do not give its forward back (largest difference {gap:.2e})"
        )
