"""The registry of merging methods: a decorator turns a typed function into a named method.

Most methods are **per-tensor kernels**: ``kernel(base, task_vectors, *, <hyper-parameters>)``
returns one merged float32 tensor, and the streaming driver (:mod:`featcal.merging.driver`) runs it
over the model one tensor at a time. A method that needs the whole model at once (TIES's top-k over
each whole task vector) registers with ``whole_model=True`` and maps state dicts to a state dict:
``fn(base, experts, *, <hyper-parameters>) -> dict[str, Tensor]``. A method that computes its merge from
calibration data (RegMean) registers with ``uses_data=True`` and takes, beside them, the family's view of
the model and each task's examples (:class:`~featcal.merging.data.MergeData`):
``fn(base, experts, data, device, world, *, <hyper-parameters>) -> dict[str, Tensor]``.

Hyper-parameters are the function's keyword-only arguments. Their annotations give the type
(``float``, ``int``, ``bool``, ``str`` or ``Literal[...]`` choices), optionally bounded by a
:class:`Range` (``Annotated[float, Range(gt=0, le=100)]``); their defaults are the method's
defaults. A hyper-parameter added to a method after runs recorded it is marked :data:`RECORDED_WHEN_SET`
(``Annotated[bool, RECORDED_WHEN_SET]``): it is left out of the resolved parameters while at its
default, so the records, and the identities, of those runs stay what they were. The registry
validates and converts the values given before the method runs, so methods check none themselves.
Values are converted, checked and worded by :mod:`featcal.options`, as every other option of featcal is.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Generic, Literal, Protocol, TypeVar

import torch

from featcal.distributed import SINGLE, World
from featcal.errors import InvalidParameterError, UnknownNameError
from featcal.merging.common import FloatingAs, StateDict
from featcal.merging.driver import KERNEL_INPUTS, merge_tensorwise
from featcal.options import Option, Range, convert, with_annotation_limits

if TYPE_CHECKING:
    from featcal.merging.data import MergeData

F = TypeVar("F", bound=Callable[..., Any])


class _Named(Protocol):
    name: str


N = TypeVar("N", bound=_Named)
DATA_INPUTS = ("base", "experts", "data", "device", "world")  # a data-using method's positional parameters

__all__ = ["RECORDED_WHEN_SET", "Range"]  # methods write their bounds as Annotated[float, Range(...)]

RECORDED_WHEN_SET = "recorded when set"  # an Annotated[...] mark: see the module docstring

_KINDS = (bool, int, float, str)


@dataclass(frozen=True)
class HyperParameter:
    """A hyper-parameter of a merging method, read from a keyword-only argument of its function.

    Args:
        name: The argument's name.
        type: ``float``, ``int``, ``bool`` or ``str``.
        default: The argument's default, converted to ``type``.
        option: Its choices (from a ``Literal[...]`` annotation) and range (from a :class:`Range` in an
            ``Annotated[...]`` annotation).
        recorded_when_set: Left out of the resolved parameters while at its default (an ``Annotated[...]``
            annotation marked :data:`RECORDED_WHEN_SET`).
    """

    name: str
    type: type
    default: Any
    option: Option = Option()
    recorded_when_set: bool = False

    @property
    def choices(self) -> tuple[Any, ...] | None:
        """The allowed values, when the annotation lists them."""
        return self.option.choices

    @property
    def range(self) -> Range | None:
        """The allowed numbers, when the annotation bounds them."""
        return self.option.range

    @property
    def expected(self) -> str:
        """What a value must be, as error messages say it, e.g. ``"a finite number in (0, 100]"``."""
        return self.option.expected(self.type)

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
        return convert(value, self.type, self.option, self.name, owner=owner)


@dataclass(frozen=True)
class MergekitForm:
    """How mergekit writes the same merge: its method name and each model's parameters.

    Args:
        name: mergekit's method name (``task_arithmetic``, ``linear``).
        model_parameters: Each model's ``parameters`` from the method's resolved hyper-parameters; None
            when mergekit has no equivalent of the merge with these hyper-parameters.
        needs_base: Whether mergekit's method takes the base model.
    """

    name: str
    model_parameters: Callable[[dict[str, Any]], dict[str, Any] | None]
    needs_base: bool = True


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
        mergekit: How mergekit writes the same merge, when it has an equivalent.
        uses_data: The method computes its merge from each task's calibration examples (a whole-model
            method called with a :class:`~featcal.merging.data.MergeData`).
        check: Checks the resolved hyper-parameters together (what a type and range cannot say: that a
            text is a regular expression), raising :class:`InvalidParameterError`, which
            :meth:`resolved_params` names after the method; None when nothing to check.
    """

    name: str
    pretty_name: str
    reference_url: str
    description: str
    fn: Callable[..., Any]
    params: tuple[HyperParameter, ...]
    inputs: tuple[str, ...] | None
    mergekit: MergekitForm | None = None
    uses_data: bool = False
    check: Callable[[dict[str, Any]], None] | None = None

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
            All hyper-parameters by name, in the function's order (for recipes and model cards), but those
            recorded only when set that are at their defaults.

        Raises:
            UnknownNameError: If a name is not a hyper-parameter of this method (``.names`` lists them).
            InvalidParameterError: If a value has the wrong type or is out of range (``.name``, ``.value``).
        """
        return resolve_params(self.params, params, owner=f"merging method {self.name!r}", check=self.check)

    def __call__(
        self,
        base: StateDict,
        experts: Sequence[StateDict],
        *,
        device: torch.device | str | None = None,
        world: World = SINGLE,
        data: MergeData | None = None,
        dtype: torch.dtype | None = None,
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
                a whole-model method (TIES) is computed whole by every process; a data-using method
                sums its statistics over them, each process streaming its part of the examples.
            data: For a data-using method (:attr:`uses_data`), the model's structure and each task's
                calibration examples, one task per expert; ignored by the others.
            dtype: The floating-point dtype of the merged tensors (None: the base's, tensor by tensor).
                The arithmetic is float32 either way; only the result's rounding differs.
            **params: Hyper-parameters; those not given take their defaults.

        Returns:
            A new state dict with the base's keys, shapes and dtypes (``dtype`` for floating-point
            tensors when given); integer buffers are copies of the base's.

        Raises:
            UnknownNameError: If a parameter name is not a hyper-parameter of this method.
            InvalidParameterError: If a value is invalid, if ``experts`` is empty, or if a data-using
                method is given no ``data`` or data for another number of tasks.
        """
        resolved = self.resolved_params(**params)
        experts = list(experts)
        owner = f"merging method {self.name!r}"
        if not experts:
            raise InvalidParameterError("experts", experts, "at least one expert state dict", owner=owner)
        device = None if device is None else torch.device(device)
        if dtype is not None:
            base = FloatingAs(base, dtype)
        if self.uses_data:
            if data is None or len(data.tasks) != len(experts):
                raise InvalidParameterError(
                    "data", None if data is None else list(data.tasks),
                    f"the calibration data of each of the {len(experts)} experts' tasks (a MergeData): this "
                    "method computes its merge from them", owner=owner,
                )  # fmt: skip
            return self.fn(base, experts, data, device or torch.device("cpu"), world, **resolved)
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


def resolve_params(
    declared: Sequence[HyperParameter],
    given: Mapping[str, Any],
    *,
    owner: str,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every hyper-parameter's value: the defaults of ``declared`` overridden by ``given``, validated and
    converted (a merging method's, a repair's).

    Args:
        declared: The hyper-parameters, in the function's order.
        given: Values by name; ``None`` stands for the default.
        owner: Whose parameters they are, for errors (``"merging method 'ties'"``).
        check: Checks the resolved values together, raising :class:`InvalidParameterError`.

    Returns:
        All hyper-parameters by name, in ``declared``'s order, but those recorded only when set that are
        at their defaults.

    Raises:
        UnknownNameError: If a name is not among ``declared`` (``.names`` lists them).
        InvalidParameterError: If a value has the wrong type or is out of range, named after ``owner``.
    """
    known = [p.name for p in declared]
    unknown = [key for key in given if key not in known]
    if unknown:
        raise UnknownNameError(f"parameter of {owner}", unknown, known)
    resolved = {
        p.name: p.default if given.get(p.name) is None else p.check(given[p.name], owner=owner) for p in declared
    }
    if check is not None:
        try:
            check(resolved)
        except InvalidParameterError as error:  # named after the owner, as a bad value above is
            raise InvalidParameterError(error.name, error.value, error.expected, owner=owner) from None
    return {p.name: resolved[p.name] for p in declared if not (p.recorded_when_set and resolved[p.name] == p.default)}


class NamedRegistry(Generic[N]):
    """Registered items by their ``name`` (merging methods, repairs), looked up with one error wording.

    Args:
        kind: What the items are, for errors (``"merging method"``).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, N] = {}

    def add(self, item: N) -> None:
        """Register ``item``; a ValueError if its name is taken."""
        if item.name in self._items:
            raise ValueError(f"{self.kind} {item.name!r} registered twice")
        self._items[item.name] = item

    def get(self, name: str) -> N:
        """The item registered as ``name``; an UnknownNameError listing the known ones if none is."""
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(self.kind, name, self.names()) from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._items)


class MethodRegistry(NamedRegistry[MergeMethod]):
    """Merging methods by name. The package's methods are in :data:`METHODS`; a test may use its own."""

    def __init__(self) -> None:
        super().__init__("merging method")


METHODS = MethodRegistry()


def merge_method(
    name: str,
    *,
    pretty_name: str,
    reference_url: str,
    description: str | None = None,
    whole_model: bool = False,
    uses_data: bool = False,
    registry: MethodRegistry | None = None,
    mergekit: MergekitForm | None = None,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> Callable[[F], F]:
    """Register the decorated function as the merging method ``name``.

    A per-tensor kernel takes, by name, positional tensors among ``base`` (θ0), ``task_vectors``
    (τ, stacked (T, ...)) and ``experts`` (θ_t, stacked), all float32, and returns the merged
    float32 tensor; it must name ``task_vectors`` or ``experts``. A whole-model function takes
    ``(base, experts)`` state dicts and returns the merged state dict without modifying them. In both
    the keyword-only arguments are the hyper-parameters, each annotated ``float``, ``int``, ``bool``,
    ``str`` or ``Literal[...]``, optionally ``Annotated[..., Range(...)]``, with a default. A data-using
    function takes ``(base, experts, data, device, world)``: the state dicts, a
    :class:`~featcal.merging.data.MergeData`, where to compute and the processes.

    Args:
        name: The registry name, as recipes and :func:`get_method` give it.
        pretty_name: The name for people, shown in model cards.
        reference_url: The paper.
        description: One line for ``featcal methods``; default the first line of the docstring.
        whole_model: The function maps state dicts to a state dict instead of being a kernel.
        uses_data: The function computes the merge from each task's calibration examples (it takes a
            :class:`~featcal.merging.data.MergeData`); commands then read the tasks' data for it.
        registry: Where to register; default :data:`METHODS`, which :func:`get_method` reads.
        mergekit: How mergekit writes the same merge, when it has an equivalent (recorded beside a merge
            as ``mergekit_config.yml``).
        check: Checks the resolved hyper-parameters together, raising :class:`InvalidParameterError`.

    Returns:
        A decorator that registers the function and returns it unchanged.

    Raises:
        TypeError: If the function's signature is not a kernel's (or a whole-model function's), or a
            hyper-parameter lacks a default or has an unsupported annotation.
        ValueError: If ``name`` is taken or a default is outside its own type or range.
    """

    def register(fn: F) -> F:
        inputs, params = _read_signature(fn, name, whole_model=whole_model, uses_data=uses_data)
        doc = inspect.getdoc(fn) or ""
        summary = description if description is not None else (doc.splitlines() or [""])[0]
        method = MergeMethod(name, pretty_name, reference_url, summary, fn, params, inputs, mergekit, uses_data, check)
        (METHODS if registry is None else registry).add(method)
        return fn

    return register


def _read_signature(
    fn: Callable[..., Any], name: str, *, whole_model: bool, uses_data: bool = False
) -> tuple[tuple[str, ...] | None, tuple[HyperParameter, ...]]:
    """The kernel inputs (``None`` for a whole-model or data-using function) and hyper-parameters of ``fn``."""
    where = f"merging method {name!r}"
    hints = typing.get_type_hints(fn, include_extras=True)
    positional: list[str] = []
    params: list[HyperParameter] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
        elif p.kind is inspect.Parameter.KEYWORD_ONLY:
            params.append(hyper_parameter(p, hints.get(p.name), where))
        else:
            raise TypeError(f"{where}: *{p.name} is not allowed; hyper-parameters are keyword-only arguments")
    if uses_data:
        if positional != list(DATA_INPUTS):
            raise TypeError(f"{where}: a data-using method takes ({', '.join(DATA_INPUTS)}); got {positional}")
        return None, tuple(params)
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


def hyper_parameter(p: inspect.Parameter, annotation: Any, where: str) -> HyperParameter:
    """The hyper-parameter that keyword-only argument ``p`` (annotated ``annotation``) declares.

    Args:
        p: The argument.
        annotation: Its annotation, extras included.
        where: Whose argument it is, for errors (``"merging method 'ties'"``).

    Returns:
        The hyper-parameter, its default converted to its type.

    Raises:
        TypeError: If it lacks a default or an annotation, or its annotation is not supported.
        ValueError: If its default is outside its own type or range.
    """
    if p.default is inspect.Parameter.empty or annotation is None:
        raise TypeError(f"{where}: hyper-parameter {p.name} needs a type annotation and a default")
    kind = typing.get_args(annotation)[0] if typing.get_origin(annotation) is Annotated else annotation
    choices = typing.get_args(kind) if typing.get_origin(kind) is Literal else None
    if choices is not None:
        kind = type(choices[0])
        if any(type(choice) is not kind for choice in choices):
            raise TypeError(f"{where}: the choices of {p.name} must all have one type; got {choices}")
    opt = with_annotation_limits(Option(), annotation)
    marks = typing.get_args(annotation)[1:] if typing.get_origin(annotation) is Annotated else ()
    if kind not in _KINDS or (opt.range is not None and kind not in (int, float)):
        raise TypeError(
            f"{where}: hyper-parameter {p.name} is annotated {annotation!r}; use float, int, bool, str or "
            "Literal[...], with Annotated[..., Range(...)] for bounds on a number"
        )
    param = HyperParameter(p.name, kind, None, opt, RECORDED_WHEN_SET in marks)
    try:
        default = param.check(p.default, owner=where)
    except InvalidParameterError as error:
        raise ValueError(error.message) from None
    return dataclasses.replace(param, default=default)
