"""The registry of merging methods: a decorator turns a typed function into a named method.

A method is a pure function ``fn(base, experts, *, <hyper-parameters>) -> merged`` over state dicts
(``Mapping[str, Tensor]``; usually lazily-read :class:`~featcal.checkpoint.Checkpoint` objects, so
experts stream one tensor at a time). It must not modify its inputs. Hyper-parameters are the
function's keyword-only arguments; their defaults are the method's defaults.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from featcal.errors import FeatcalError

StateDict = Mapping[str, torch.Tensor]
MergeFn = Callable[..., dict[str, torch.Tensor]]


@dataclass(frozen=True)
class MergeMethod:
    """A registered merging method."""

    name: str
    pretty_name: str
    reference_url: str
    fn: MergeFn
    defaults: Mapping[str, Any]

    def __call__(self, base: StateDict, experts: Sequence[StateDict], **params: Any) -> dict[str, torch.Tensor]:
        params = self.checked_params(params)
        if not experts:
            raise FeatcalError(f"Merging method {self.name!r} needs at least one expert.")
        return self.fn(base, list(experts), **params)

    def checked_params(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """``params`` with numbers given as text (YAML reads ``1e-4`` as a string) made numbers;
        a FeatcalError for an unknown name or a value of the wrong kind."""
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise FeatcalError(
                f"Merging method {self.name!r} has no parameter(s) {sorted(unknown)}; "
                f"its parameters: {dict(self.defaults)}."
            )
        return {key: _checked_value(self.name, key, value, self.defaults[key]) for key, value in params.items()}

    def resolved_params(self, **params: Any) -> dict[str, Any]:
        """The defaults overridden by ``params`` (for recipes and model cards)."""
        given = {k: v for k, v in params.items() if v is not None}
        return {**self.defaults, **self.checked_params(given)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _checked_value(method: str, key: str, value: Any, default: Any) -> Any:
    """``value`` for the parameter whose default is ``default``: a number where a number is expected."""
    if value is None or not _is_number(default):
        return value
    if isinstance(value, str):
        try:
            value = float(value) if isinstance(default, float) else int(value)
        except ValueError:
            pass
    if not _is_number(value):
        raise FeatcalError(f"Merging method {method!r}: {key} must be a number (default {default!r}); got {value!r}.")
    return value


_REGISTRY: dict[str, MergeMethod] = {}


def merge_method(name: str, *, pretty_name: str, reference_url: str) -> Callable[[MergeFn], MergeFn]:
    """Register ``fn`` under ``name``; its keyword-only arguments are its hyper-parameters."""

    def register(fn: MergeFn) -> MergeFn:
        if name in _REGISTRY:
            raise ValueError(f"merging method {name!r} registered twice")
        signature = inspect.signature(fn)
        defaults = {
            p.name: p.default for p in signature.parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        missing = [k for k, v in defaults.items() if v is inspect.Parameter.empty]
        if missing:
            raise ValueError(f"merging method {name!r}: hyper-parameters {missing} need defaults")
        _REGISTRY[name] = MergeMethod(name, pretty_name, reference_url, fn, defaults)
        return fn

    return register


def get_method(name: str) -> MergeMethod:
    """The method registered as ``name``, or a FeatcalError listing the known ones."""
    from featcal import merging  # noqa: F401  (importing the package registers every method)

    try:
        return _REGISTRY[name]
    except KeyError:
        raise FeatcalError(f"Unknown merging method {name!r}; available: {', '.join(sorted(_REGISTRY))}.") from None


def available_methods() -> list[str]:
    from featcal import merging  # noqa: F401

    return sorted(_REGISTRY)


def is_mergeable(tensor: torch.Tensor) -> bool:
    """Floating-point tensors are merged; integer buffers are copied from the base."""
    return tensor.is_floating_point()
