"""The registry of merging methods: a decorator turns a typed function into a named method.

Most methods are **per-tensor kernels**: ``kernel(base, task_vectors, *, <hyper-parameters>)``
returns one merged float32 tensor, and the streaming driver (:mod:`featcal.merging.driver`) runs it
over the model one tensor at a time. A method that needs the whole model at once (TIES's top-k over
each whole task vector) registers with ``whole_model=True`` and maps state dicts to a state dict:
``fn(base, experts, *, <hyper-parameters>) -> dict[str, Tensor]``.

Hyper-parameters are the function's keyword-only arguments. Their annotations give the type
(``float``, ``int``, ``bool``, ``str`` or ``Literal[...]`` choices), optionally bounded by a
:class:`Range` (``Annotated[float, Range(gt=0, le=100)]``); their defaults are the method's
defaults. The registry validates and converts the values given before the method runs, so methods
check none themselves.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeVar

import torch

from featcal.distributed import SINGLE, World
from featcal.errors import InvalidParameterError, UnknownNameError
from featcal.merging.common import StateDict
from featcal.merging.driver import KERNEL_INPUTS, merge_tensorwise

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True)
class Range:
    """Bounds of a numeric hyper-parameter, written ``Annotated[float, Range(gt=0, le=100)]``.

    Args:
        gt: The value must be greater than this.
        ge: The value must be at least this.
        lt: The value must be less than this.
        le: The value must be at most this.

    Raises:
        TypeError: If no bound is given, or both bounds of one side.
    """

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def __post_init__(self) -> None:
        lower = [bound for bound in (self.gt, self.ge) if bound is not None]
        upper = [bound for bound in (self.lt, self.le) if bound is not None]
        if not lower + upper or len(lower) > 1 or len(upper) > 1:
            raise TypeError(f"{self!r}: give one or two bounds, at most one of gt, ge and one of lt, le")

    def __contains__(self, value: float) -> bool:
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )

    def __str__(self) -> str:
        """``in (0, 100]`` when bounded on both sides, ``> 0`` or ``>= 0`` (etc.) when on one."""
        low = self.gt if self.gt is not None else self.ge
        high = self.lt if self.lt is not None else self.le
        if low is not None and high is not None:
            return f"in {'(' if self.gt is not None else '['}{low:g}, {high:g}{')' if self.lt is not None else ']'}"
        if low is not None:
            return f"{'>' if self.gt is not None else '>='} {low:g}"
        return f"{'<' if self.lt is not None else '<='} {high:g}"


_NOUNS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}


@dataclass(frozen=True)
class HyperParameter:
    """A hyper-parameter of a merging method, read from a keyword-only argument of its function.

    Args:
        name: The argument's name.
        type: ``float``, ``int``, ``bool`` or ``str``.
        default: The argument's default, converted to ``type``.
        choices: The allowed values, from a ``Literal[...]`` annotation.
        range: The bounds, from a :class:`Range` in an ``Annotated[...]`` annotation.
    """

    name: str
    type: type
    default: Any
    choices: tuple[Any, ...] | None = None
    range: Range | None = None

    @property
    def expected(self) -> str:
        """What a value must be, as error messages say it, e.g. ``"a finite number in (0, 100]"``."""
        if self.choices is not None:
            return "one of " + ", ".join(map(repr, self.choices))
        return _NOUNS[self.type] + (f" {self.range}" if self.range else "")

    def __str__(self) -> str:
        """The parameter as ``featcal methods`` lists it, e.g. ``top_k: float in (0, 100] = 20.0``."""
        kind = " | ".join(map(repr, self.choices)) if self.choices is not None else self.type.__name__
        bounds = f" {self.range}" if self.range else ""
        return f"{self.name}: {kind}{bounds} = {self.default!r}"

    def check(self, value: Any, *, owner: str) -> Any:
        """``value`` converted to this parameter's type (``"1e-4"`` to ``1e-4``), once it is valid.

        Args:
            value: The value given.
            owner: Whose parameter this is, for the error (``"merging method 'ties'"``).

        Returns:
            The value as ``self.type``: a float for a float (never NaN or infinite), an int for an int.

        Raises:
            InvalidParameterError: If the value has the wrong type (a bool is not a number), is not
                among the choices, or is out of range.
        """
        converted = _converted(value, self.type)
        if (
            converted is _INVALID
            or (self.choices is not None and converted not in self.choices)
            or (self.range is not None and converted not in self.range)
        ):
            raise InvalidParameterError(self.name, value, self.expected, owner=owner)
        return converted


_INVALID = object()


def _converted(value: Any, kind: type) -> Any:
    """``value`` as ``kind``, numbers written as text read as numbers; ``_INVALID`` if it is none."""
    if kind is bool or kind is str:
        return value if isinstance(value, kind) else _INVALID
    if isinstance(value, bool):
        return _INVALID
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)  # "1e-4", or an integer written "4e2"
            except ValueError:
                return _INVALID
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return _INVALID
    if kind is float:
        return float(value)
    if isinstance(value, numbers.Integral) or float(value).is_integer():
        return int(value)
    return _INVALID


@dataclass(frozen=True)
class MergeMethod:
    """A registered merging method: its function, its hyper-parameters, and what the card shows.

    Args:
        name: The registry name (``"ties"``), as recipes and the Python API give it.
        pretty_name: The name for people (``"TIES-Merging"``).
        reference_url: The paper.
        description: One line saying what the method computes.
        fn: The per-tensor kernel or, for a whole-model method, the state-dict function.
        params: The hyper-parameters, in the function's order.
        inputs: The kernel's positional parameters (among
            :data:`~featcal.merging.driver.KERNEL_INPUTS`); ``None`` for a whole-model method.
    """

    name: str
    pretty_name: str
    reference_url: str
    description: str
    fn: Callable[..., Any]
    params: tuple[HyperParameter, ...]
    inputs: tuple[str, ...] | None

    @property
    def whole_model(self) -> bool:
        """Whether the method needs the whole model at once instead of one tensor at a time."""
        return self.inputs is None

    @property
    def defaults(self) -> dict[str, Any]:
        """Each hyper-parameter's default, by name."""
        return {p.name: p.default for p in self.params}

    def resolved_params(self, **params: Any) -> dict[str, Any]:
        """Every hyper-parameter's value: the defaults overridden by ``params``, validated and converted.

        Args:
            **params: Hyper-parameter values by name; ``None`` stands for the default.

        Returns:
            All hyper-parameters by name, in the function's order (for recipes and model cards).

        Raises:
            UnknownNameError: If a name is not a hyper-parameter of this method (``.names`` lists them).
            InvalidParameterError: If a value has the wrong type or is out of range (``.name``, ``.value``).
        """
        owner = f"merging method {self.name!r}"
        known = [p.name for p in self.params]
        unknown = [key for key in params if key not in known]
        if unknown:
            raise UnknownNameError(f"parameter of {owner}", unknown, known)
        return {
            p.name: p.default if params.get(p.name) is None else p.check(params[p.name], owner=owner)
            for p in self.params
        }

    def __call__(
        self,
        base: StateDict,
        experts: Sequence[StateDict],
        *,
        device: torch.device | str | None = None,
        world: World = SINGLE,
        **params: Any,
    ) -> dict[str, torch.Tensor]:
        """Merge ``experts`` into ``base``.

        Args:
            base: The base model's state dict (a dict of tensors or a lazily-read
                :class:`~featcal.checkpoint.Checkpoint`); not modified.
            experts: One state dict per task, with the base's keys; not modified.
            device: Where to compute (default: the CPU); tensors are read there one at a time and
                the merged state dict is returned on the CPU.
            world: Under torchrun, the processes: a per-tensor method shares the tensors among them;
                a whole-model method (TIES) is computed whole by every process.
            **params: Hyper-parameters; those not given take their defaults.

        Returns:
            A new state dict with the base's keys, shapes and dtypes; integer buffers are copies of
            the base's.

        Raises:
            UnknownNameError: If a parameter name is not a hyper-parameter of this method.
            InvalidParameterError: If a value is invalid, or if ``experts`` is empty.
        """
        resolved = self.resolved_params(**params)
        experts = list(experts)
        if not experts:
            raise InvalidParameterError(
                "experts", experts, "at least one expert state dict", owner=f"merging method {self.name!r}"
            )
        device = None if device is None else torch.device(device)
        if self.inputs is None:
            if "device" in inspect.signature(self.fn).parameters:
                return self.fn(base, experts, device, **resolved)
            if device is not None and device.type != "cpu":
                raise InvalidParameterError(
                    "device",
                    str(device),
                    "cpu: this method computes on the CPU only",
                    owner=f"merging method {self.name!r}",
                )
            return self.fn(base, experts, **resolved)
        return merge_tensorwise(
            self.fn, self.inputs, base, experts, resolved, desc=self.pretty_name, device=device, world=world
        )


class MethodRegistry:
    """Merging methods by name. The package's methods are in :data:`METHODS`; a test may use its own."""

    def __init__(self) -> None:
        self._methods: dict[str, MergeMethod] = {}

    def add(self, method: MergeMethod) -> None:
        """Register ``method``; a ValueError if its name is taken."""
        if method.name in self._methods:
            raise ValueError(f"merging method {method.name!r} registered twice")
        self._methods[method.name] = method

    def get(self, name: str) -> MergeMethod:
        """The method registered as ``name``; an UnknownNameError listing the known ones if none is."""
        try:
            return self._methods[name]
        except KeyError:
            raise UnknownNameError("merging method", name, self.names()) from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._methods)


METHODS = MethodRegistry()


def merge_method(
    name: str,
    *,
    pretty_name: str,
    reference_url: str,
    description: str | None = None,
    whole_model: bool = False,
    registry: MethodRegistry | None = None,
) -> Callable[[F], F]:
    """Register the decorated function as the merging method ``name``.

    A per-tensor kernel takes, by name, positional tensors among ``base`` (θ0), ``task_vectors``
    (τ, stacked (T, ...)) and ``experts`` (θ_t, stacked), all float32, and returns the merged
    float32 tensor; it must name ``task_vectors`` or ``experts``. A whole-model function takes
    ``(base, experts)`` state dicts and returns the merged state dict without modifying them. In both
    the keyword-only arguments are the hyper-parameters, each annotated ``float``, ``int``, ``bool``,
    ``str`` or ``Literal[...]``, optionally ``Annotated[..., Range(...)]``, with a default.

    Args:
        name: The registry name, as recipes and :func:`get_method` give it.
        pretty_name: The name for people, shown in model cards.
        reference_url: The paper.
        description: One line for ``featcal methods``; default the first line of the docstring.
        whole_model: The function maps state dicts to a state dict instead of being a kernel.
        registry: Where to register; default :data:`METHODS`, which :func:`get_method` reads.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        TypeError: If the function's signature is not a kernel's (or a whole-model function's), or a
            hyper-parameter lacks a default or has an unsupported annotation.
        ValueError: If ``name`` is taken or a default is outside its own type or range.
    """

    def register(fn: F) -> F:
        inputs, params = _read_signature(fn, name, whole_model=whole_model)
        doc = inspect.getdoc(fn) or ""
        summary = description if description is not None else (doc.splitlines() or [""])[0]
        method = MergeMethod(name, pretty_name, reference_url, summary, fn, params, inputs)
        (METHODS if registry is None else registry).add(method)
        return fn

    return register


def _read_signature(
    fn: Callable[..., Any], name: str, *, whole_model: bool
) -> tuple[tuple[str, ...] | None, tuple[HyperParameter, ...]]:
    """The kernel inputs (``None`` for a whole-model function) and hyper-parameters of ``fn``."""
    where = f"merging method {name!r}"
    hints = typing.get_type_hints(fn, include_extras=True)
    positional: list[str] = []
    params: list[HyperParameter] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            params.append(_hyper_parameter(p, hints.get(p.name), where))
        else:
            raise TypeError(f"{where}: *{p.name} is not allowed; hyper-parameters are keyword-only arguments")
    if whole_model:
        if positional not in (["base", "experts"], ["base", "experts", "device"]):
            raise TypeError(f"{where}: a whole-model method takes (base, experts[, device]); got {positional}")
        return None, tuple(params)
    if not set(positional) <= set(KERNEL_INPUTS) or not {"task_vectors", "experts"} & set(positional):
        raise TypeError(
            f"{where}: a kernel's positional parameters are named among {', '.join(KERNEL_INPUTS)}, "
            f"with task_vectors or experts; got {positional}"
        )
    return tuple(positional), tuple(params)


def _hyper_parameter(p: inspect.Parameter, annotation: Any, where: str) -> HyperParameter:
    """The hyper-parameter that keyword-only argument ``p`` (annotated ``annotation``) declares."""
    if p.default is inspect.Parameter.empty or annotation is None:
        raise TypeError(f"{where}: hyper-parameter {p.name} needs a type annotation and a default")
    kind, bounds, choices = annotation, None, None
    if typing.get_origin(kind) is Annotated:
        kind, *extras = typing.get_args(kind)
        bounds = next((extra for extra in extras if isinstance(extra, Range)), None)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        kind = type(choices[0])
        if any(type(choice) is not kind for choice in choices):
            raise TypeError(f"{where}: the choices of {p.name} must all have one type; got {choices}")
    if kind not in _NOUNS or (bounds is not None and kind not in (int, float)):
        raise TypeError(
            f"{where}: hyper-parameter {p.name} is annotated {annotation!r}; use float, int, bool, str or "
            "Literal[...], with Annotated[..., Range(...)] for bounds on a number"
        )
    param = HyperParameter(p.name, kind, None, choices, bounds)
    try:
        default = param.check(p.default, owner=where)
    except InvalidParameterError as error:
        raise ValueError(error.message) from None
    return dataclasses.replace(param, default=default)


def get_method(name: str) -> MergeMethod:
    """The merging method registered as ``name``.

    Args:
        name: A registry name such as ``"task_arithmetic"`` or ``"ties"``.

    Returns:
        The method, callable as ``method(base, experts, **hyper_parameters)``.

    Raises:
        UnknownNameError: If no method has that name (``.known`` lists those that do).
    """
    from featcal import merging  # noqa: F401  (importing the package registers every method)

    return METHODS.get(name)


def available_methods() -> list[str]:
    """The names of the registered merging methods, sorted.

    Returns:
        The names :func:`get_method` accepts.
    """
    from featcal import merging  # noqa: F401

    return METHODS.names()
