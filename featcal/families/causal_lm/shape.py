"""What the calibration needs of a causal LM's architecture, found by running a tiny model of it.

:func:`probe` builds a model of the configuration at a tiny width (same layer count, layer types and
options, random weights), runs its own forward on a right-padded batch and records:

- where its decoder layers are (the one ``nn.ModuleList`` of ``num_hidden_layers`` layers holding
  ``nn.Linear``), what its decoder reads before layer 0 that holds tensors (the stem: the token embedding,
  learned positions) and what it runs after the last layer (the head: the final norm);
- what each layer is made of: every ``nn.Linear`` is solved, every normalisation that is a direct child
  of the layer (before or after the block it normalises) is solved, a normalisation inside a block (q/k
  norms) keeps its merged value. Which linears read one input (q/k/v, fused or not), and the order, are
  found by the calibration's own hooks (:func:`featcal.calibration.layer_state.plan_layer`);
- whether the layers read the same arguments (masks, positions, rotary embeddings) or each its own
  (a sliding-window layer's mask): then a layer's ``layer_idx`` says which.

:func:`featcal.families.causal_lm.adapter.describe` then runs the layers one by one, as the calibration does,
and requires the model's own forward back.
An architecture is refused, in one line naming it and the layer or module kind, when a layer holds a
parameter of another kind (mixture-of-experts experts stored as 3-D tensors, convolutions, recurrent or
state-space blocks, a norm of another form), a solved submodule reads some of the tokens only (routed
experts) or runs more than once, or the chain of layers does not give the model's forward back.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from featcal.errors import FeatcalError
from featcal.families.causal_lm.architectures import ENCODER, ENCODER_DECODER
from featcal.families.causal_lm.decoder import (
    Stack,
    find_stack,
    layer_index,
    reading_config,
    run_until,
    same_calls,
    standing_in,
)
from featcal.families.causal_lm.norms import NormForm, module_eps, norm_form

# Tiny widths for a probe: attribute -> value, set where a configuration has the attribute (an int there).
TINY_WIDTHS = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "ffn_hidden_size": 48,
    "n_inner": 48,
    "num_attention_heads": 4,
    "head_dim": 8,
    "vocab_size": 96,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 4,
    "v_head_dim": 8,
    "word_embed_proj_dim": 32,
    "rotary_dim": 4,
    "sliding_window": 4,
    "attention_window_size": 4,
}
RECURRENT = ("mamba", "ssm", "rwkv", "lstm", "recurrent", "mixer")  # class names of such blocks
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
PROBE_LENGTHS = (7, 4)  # two right-padded examples
TINY_PARAMETERS = 16_000_000  # a probe's model at most: seconds on a CPU


class UnsupportedArchitecture(FeatcalError):
    """A causal-LM architecture the calibration cannot run, with the reason.

    Args:
        model_type: The configuration's ``model_type``.
        reason: What in its layers the calibration cannot solve or run.
    """

    def __init__(self, model_type: str, reason: str) -> None:
        self.model_type, self.reason = model_type, reason
        super().__init__(f"featcal cannot calibrate {model_type!r} models: {reason}.")


@dataclass(frozen=True)
class DecoderShape:
    """What :func:`probe` found of an architecture (see the module docstring).

    Attributes:
        stack: Where the decoder layers are (``model`` / ``layers``).
        stem: The decoder's children read before layer 0 that hold tensors (``embed_tokens``).
        head: The decoder's child run right after the last layer (``norm``), or None.
        per_layer: Layers read arguments of their own (a layer's ``layer_idx`` picks them).
        idle: Submodules a layer holds but never runs (not solved).
        returns_tuple: A layer returns a tuple whose first item is its hidden states.
    """

    stack: Stack
    stem: tuple[str, ...]
    head: str | None
    per_layer: bool
    idle: frozenset[str] = frozenset()
    returns_tuple: bool = False


def tiny_config(config: Any, num_layers: int | None = None) -> Any:
    """``config`` at the tiny widths of :data:`TINY_WIDTHS` (its options, layer count and layer types kept;
    ``num_layers`` layers when given, the layer types cut to as many)."""
    tiny = copy.deepcopy(config)
    for name, value in TINY_WIDTHS.items():
        current = getattr(tiny, name, None)
        if isinstance(current, int) and not isinstance(current, bool):
            try:
                setattr(tiny, name, value)
            except AttributeError:  # a value the configuration derives (Falcon's head_dim)
                continue
    heads = getattr(tiny, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if isinstance(kv, int) and isinstance(heads, int):  # grouped attention stays grouped
        tiny.num_key_value_heads = heads if kv >= getattr(config, "num_attention_heads", kv) else 2
    for name in TOKEN_IDS:
        if isinstance(getattr(tiny, name, None), int):
            setattr(tiny, name, 0)
    if num_layers is not None:
        tiny.num_hidden_layers = num_layers
        if isinstance(getattr(tiny, "layer_types", None), list):
            tiny.layer_types = tiny.layer_types[:num_layers]
    return tiny


def probe_batch(vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded token ids and their attention mask for a probe."""
    generator = torch.Generator().manual_seed(0)
    length = max(PROBE_LENGTHS)
    ids = torch.randint(1, vocab_size, (len(PROBE_LENGTHS), length), generator=generator)
    mask = torch.tensor([[1] * n + [0] * (length - n) for n in PROBE_LENGTHS])
    return ids * mask, mask


def build_model(config: Any, attention: str | None = None) -> nn.Module:
    """A random ``*ForCausalLM`` of ``config`` in float32, eval mode (``attention``: its implementation)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    kwargs = {} if attention is None else {"attn_implementation": attention}
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()


def first_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def layer_parts(layer: nn.Module) -> tuple[dict[str, nn.Module], str | None]:
    """A decoder layer's solved submodules by name (every ``nn.Linear``; every normalisation that is a
    direct child of the layer), and the first module holding a parameter of no such kind (None when none)."""
    solved: dict[str, nn.Module] = {}
    for name, module in layer.named_modules():
        if any(p.dim() == 3 for p in module.parameters(recurse=False)):
            return solved, _odd_module(name, module)
    for name, module in layer.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        if isinstance(module, nn.Linear):
            solved[name] = module
        elif norm_kind(module) is not None:
            if "." not in name:
                solved[name] = module
        else:
            return solved, _odd_module(name, module)
    return solved, None


def norm_kind(module: nn.Module) -> NormForm | None:
    """The normalisation ``module`` computes (:func:`~featcal.families.causal_lm.norms.norm_form`, found once
    per class, eps and parameter names), or None."""
    key = (type(module), module_eps(module), tuple(name for name, _ in module.named_parameters()))
    if key not in _FORMS:
        _FORMS[key] = norm_form(module)
    return _FORMS[key]


_FORMS: dict[tuple, NormForm | None] = {}


def _odd_module(name: str, module: nn.Module) -> str:
    """Why a layer's module with parameters is neither a linear nor a norm the calibration solves."""
    params = dict(module.named_parameters(recurse=False))
    kind = type(module).__name__
    if isinstance(module, nn.Conv1d | nn.Conv2d) or "conv" in kind.lower():
        return f"convolution ({name}: {kind}; a state-space or recurrent block)"
    if any(word in kind.lower() for word in RECURRENT):
        return f"state-space or recurrent block ({name}: {kind})"
    if any(p.dim() == 3 for p in params.values()):
        if "expert" in f"{name} {kind}".lower():
            return f"mixture-of-experts layer: experts stored as 3-D parameters ({name}: {kind})"
        return f"{kind} with 3-D parameters ({name}), no nn.Linear"
    if isinstance(module, nn.Embedding):
        return f"embedding inside its layers ({name}: {kind})"
    listed = ", ".join(f"{n} {tuple(p.shape)}" for n, p in params.items())
    return (
        f"{kind} ({name or 'the layer itself'}: {listed}), neither an nn.Linear nor a norm of the forms "
        "x/rms(x)·w, x/rms(x)·(1+w), LayerNorm"
    )


def probe(config: Any, model_type: str) -> tuple[DecoderShape, nn.Module, torch.Tensor, torch.Tensor]:
    """Build a model of ``config`` (already tiny: :func:`tiny_config`) and describe it (see the module docstring).

    Returns:
        Its shape, the model, and the right-padded batch it was run on (token ids and attention mask), for
        the check that its layers run one by one give its forward back.

    Raises:
        UnsupportedArchitecture: naming the model type and what the calibration cannot solve or run.
    """
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedArchitecture(model_type, ENCODER_DECODER)
    with torch.device("meta"):
        size = sum(p.numel() for p in build_model(config).parameters())
    if size > TINY_PARAMETERS:
        raise UnsupportedArchitecture(
            model_type, f"its configuration does not shrink to a tiny model ({size:,d} parameters)"
        )
    implementation = getattr(config, "_attn_implementation", None)  # flash kernels: not on every machine
    model = build_model(config, None if implementation in (None, "eager", "sdpa") else "eager")
    num_layers = getattr(config, "num_hidden_layers", None)
    stack = find_stack(model, num_layers) if isinstance(num_layers, int) else None
    if stack is None:
        raise UnsupportedArchitecture(model_type, f"no single list of its {num_layers} decoder layers")
    decoder = stack.decoder(model)
    if not {"input_ids", "inputs_embeds"} <= set(inspect.signature(decoder.forward).parameters):
        raise UnsupportedArchitecture(
            model_type, f"its layers are run by {type(decoder).__name__}, which reads no token ids: {ENCODER}"
        )
    layers = getattr(decoder, stack.layers)
    for index, layer in enumerate(layers):
        _, odd = layer_parts(layer)
        if odd is not None:
            raise UnsupportedArchitecture(model_type, f"layer {index} holds a {odd}")
    ids, mask = probe_batch(config.vocab_size)
    order, fired, inputs = _run_recorded(model, decoder, stack, ids, mask)
    stem, head = _stem_and_head(decoder, stack, order, model_type)
    idle = _idle(layers, fired, inputs, ids.shape, model_type)
    as_tuple = isinstance(inputs.get("output"), tuple)
    per_layer = _per_layer(decoder, stack, ids, mask, layers, as_tuple, model_type)
    return DecoderShape(stack, stem, head, per_layer, idle, as_tuple), model, ids, mask


def _run_recorded(model: nn.Module, decoder: nn.Module, stack: Stack, ids: torch.Tensor, mask: torch.Tensor):
    """The model's own forward with hooks: the order in which the decoder's children run, how often each
    layer submodule runs (``"index:name"``), and their inputs' shapes."""
    order: list[str] = []
    fired: dict[str, int] = {}
    inputs: dict[str, Any] = {}
    handles = []
    for name, child in decoder.named_children():
        if name != stack.layers:
            handles.append(child.register_forward_pre_hook(lambda *_, n=name: order.append(n)))
    layers = getattr(decoder, stack.layers)
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda *_, i=index: order.append(f"{stack.layers}.{i}")))
        solved, _ = layer_parts(layer)
        for name, module in solved.items():
            key = f"{index}:{name}"

            def hook(_m, args, key=key):
                fired[key] = fired.get(key, 0) + 1
                inputs[key] = tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else None

            handles.append(module.register_forward_pre_hook(hook))
    handles.append(layers[0].register_forward_hook(lambda _m, _a, out: inputs.__setitem__("output", out)))
    try:
        model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    return order, fired, inputs


def _stem_and_head(decoder: nn.Module, stack: Stack, order: list[str], model_type: str):
    """The decoder's children with tensors run before layer 0 (the stem), and the one run right after the
    last layer (the head)."""
    first = order.index(f"{stack.layers}.0")
    last = max(i for i, name in enumerate(order) if name.startswith(f"{stack.layers}."))
    children = dict(decoder.named_children())
    holding = {n for n, c in children.items() if n != stack.layers and c.state_dict()}
    stem = tuple(dict.fromkeys(n for n in order[:first] if n in holding))
    between = {n for n in order[first:last] if not n.startswith(f"{stack.layers}.")}
    if between:
        raise UnsupportedArchitecture(model_type, f"its decoder runs {sorted(between)} between its layers")
    after = order[last + 1 :]
    head = after[0] if after else None
    unread = holding - set(stem) - set(after)
    if unread or any(True for _ in decoder.parameters(recurse=False)):
        raise UnsupportedArchitecture(
            model_type, f"its decoder holds tensors outside its layers, stem and head ({sorted(unread)})"
        )
    return stem, head


def _idle(layers: nn.ModuleList, fired: dict[str, int], inputs: dict[str, Any], ids: torch.Size, model_type: str):
    """The solved submodules no layer runs; refused: one that runs more than once, runs in some layers only,
    or reads some of the tokens only (routed experts)."""
    rows = ids[0] * ids[1]
    idle_by_layer = []
    for index, layer in enumerate(layers):
        solved, _ = layer_parts(layer)
        idle = set()
        for name in solved:
            key = f"{index}:{name}"
            count = fired.get(key, 0)
            if count == 0:
                idle.add(name)
                continue
            if count > 1:
                raise UnsupportedArchitecture(model_type, f"layer {index} runs its {name} {count} times")
            shape = inputs.get(key)
            if shape is None or len(shape) < 2 or (shape[0] * shape[1] != rows and shape[0] != rows):
                raise UnsupportedArchitecture(
                    model_type,
                    f"layer {index}'s {name} ({type(solved[name]).__name__}) reads some of the tokens only "
                    f"(input {shape}): a mixture-of-experts layer",
                )
        idle_by_layer.append(frozenset(idle))
    if len(set(idle_by_layer)) > 1:
        raise UnsupportedArchitecture(model_type, "its layers run different submodules")
    return idle_by_layer[0] if idle_by_layer else frozenset()


def _per_layer(
    decoder: nn.Module, stack: Stack, ids, mask, layers: nn.ModuleList, as_tuple: bool, model_type: str
) -> bool:
    """Whether the layers are handed arguments of their own; refused when they are and a layer's
    ``layer_idx`` does not say which."""
    calls = layer_calls(decoder, stack, as_tuple, input_ids=ids, attention_mask=mask)
    if same_calls([call for _, call in calls]):
        return False
    if any(layer_index(layer) != i for i, layer in enumerate(layers)):
        raise UnsupportedArchitecture(model_type, "its layers read arguments of their own and do not know their index")
    return True


def layer_calls(
    decoder: nn.Module, stack: Stack, as_tuple: bool, last: int | None = None, config: Any = None, **inputs: Any
) -> list[tuple[torch.Tensor, Any]]:
    """What the decoder's own forward on ``inputs`` hands its layers up to ``last`` (all: None):
    ``(hidden states, (args, kwargs))`` by index (a layer returning a tuple when ``as_tuple``). ``config``:
    the model's configuration, which the decoder reads instead of its own where its own counts fewer layers
    than it holds (a skeleton built without layers, which were added after)."""
    count = len(getattr(decoder, stack.layers)) if last is None else last + 1
    with reading_config(decoder, config), standing_in(decoder, stack.layers, count - 1, as_tuple) as calls:
        run_until(decoder, **inputs)
    return [calls[i] for i in range(count)]
