"""The one option mechanism: what a user-facing value is, how text becomes it, and how a bad one is worded.

An *option* is a dataclass field whose ``metadata["option"]`` is an :class:`Option`: its help, flag,
type (the field's annotation), range and choices. Every value a user gives - a run option on the
command line or in a recipe (:mod:`featcal.spec`), a FeatCal parameter
(:mod:`featcal.calibration.params`), a merging method's hyper-parameter (:mod:`featcal.merging`), a
demo, Space or Hub option - is converted and checked by :func:`convert`, and a value that does not fit
raises :class:`~featcal.errors.InvalidParameterError` worded by :meth:`Option.expected`. The CLI builds
its flags from the same fields (:mod:`featcal.cli.options`).

Values given as text are converted when the conversion is unambiguous (YAML 1.1 reads ``1e-8`` as a
string; a recipe may say ``"false"``; a flag's value is always text). This module imports neither
torch nor transformers, so ``featcal --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from featcal.errors import InvalidParameterError

# The --help sections of a run's options (featcal.spec's, and those a model family declares for its runs).
OUTPUT = "output"
TASKS = "tasks and models"
MERGING = "merging"
EVALUATION = "evaluation"
RUNTIME = "runtime"
STAGES = "stages"
DIAGNOSTICS = "diagnostics"

TRUE_WORDS = frozenset({"true", "yes", "on"})
FALSE_WORDS = frozenset({"false", "no", "off"})
NULL_WORDS = frozenset({"null", "none", "~"})


@dataclass(frozen=True)
class Range:
    """Bounds of a number, e.g. ``Range(gt=0, le=100)``; also written ``Annotated[float, Range(...)]``.

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
            opening, closing = "(" if self.gt is not None else "[", ")" if self.lt is not None else "]"
            return f"in {opening}{_number(low)}, {_number(high)}{closing}"
        if low is not None:
            return f"{'>' if self.gt is not None else '>='} {_number(low)}"
        return f"{'<' if self.lt is not None else '<='} {_number(high)}"


def _number(value: float) -> str:
    """A bound as people write it: ``4294967295`` rather than ``4.29497e+09``, ``0.5``, ``1e-08``."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


@dataclass(frozen=True)
class Option:
    """What a field means to users: its help, flag, allowed values and how the model card shows it.

    Args:
        help: One line for ``--help`` (the default is appended when there is one).
        group: The ``--help`` section the flag is listed under.
        metavar: The placeholder shown in ``--help``.
        range: The allowed numbers (:class:`Range`).
        choices: The allowed values.
        symbol: The symbol used in the paper and the model card (``λ``).
        card: The meaning shown in the model card's recipe table.
        nargs: ``"+"`` for a list given as several words (``--tasks a b``).
        flag: The recipe key and flag name (without dashes) when it differs from the field name.
        aliases: Other flags that set the option, kept working but not listed in ``--help``.
    """

    help: str = ""
    group: str = ""
    metavar: str | None = None
    range: Range | None = None
    choices: tuple[Any, ...] | None = None
    symbol: str = ""
    card: str = ""
    nargs: str | None = None
    flag: str | None = None
    aliases: tuple[str, ...] = ()

    def expected(self, kind: Any) -> str:
        """The allowed values of an option of type ``kind`` in words, e.g. ``"a whole number >= 1"``."""
        if self.choices:
            return "one of " + ", ".join(map(str, self.choices))
        base, _ = base_type(kind)
        words = _CONVERTERS[base][1] if base in _CONVERTERS else str(base)
        return f"{words} {self.range}" if self.range else words


def option(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **meta: Any) -> Any:
    """A dataclass field that is a user-facing option (see :class:`Option` for ``meta``; ``ge``, ``gt``,
    ``le`` and ``lt`` are short for ``range=Range(...)``)."""
    bounds = {key: meta.pop(key) for key in ("gt", "ge", "lt", "le") if key in meta}
    if bounds:
        meta["range"] = Range(**bounds)
    return field(default=default, default_factory=default_factory, metadata={"option": Option(**meta)})


def option_of(f: dataclasses.Field) -> Option | None:
    """The :class:`Option` of a dataclass field, None for internal fields."""
    return f.metadata.get("option")


def flag_name(f: dataclasses.Field) -> str:
    """The field's name as a flag or recipe key, without dashes: ``lambda-ratio``, ``merge-param``."""
    opt = option_of(f)
    return (opt.flag if opt and opt.flag else f.name).replace("_", "-")


# --- conversion of one value ---------------------------------------------------------------------


def base_type(annotation: Any) -> tuple[Any, bool]:
    """``(type, optional)`` of an annotation such as ``int | None`` or ``Annotated[float, Range(gt=0)]``."""
    if typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(annotation))
    if typing.get_origin(annotation) is Literal:
        return type(typing.get_args(annotation)[0]), False
    return annotation, False


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in TRUE_WORDS | FALSE_WORDS:
        return value.strip().lower() in TRUE_WORDS
    raise ValueError


def _as_number(value: Any) -> float | int:
    """A finite int or float; text is read as a number (``"1e-4"``, ``"4e2"``); a bool is no number."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, str):
        text = value.strip()
        try:
            value = int(text)
        except ValueError:
            value = float(text)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    raise ValueError


def _as_int(value: Any) -> int:
    number = _as_number(value)
    if isinstance(number, float) and not number.is_integer():
        raise ValueError
    return int(number)


def _as_float(value: Any) -> float:
    number = float(_as_number(value))  # a huge int (10**400) overflows here: OverflowError, refused below
    if not math.isfinite(number):
        raise ValueError
    return number


def _as_str(value: Any) -> str:
    if isinstance(value, (str, Path)):
        return str(value)
    raise ValueError


def _as_str_list(value: Any) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if isinstance(items, Sequence) and items and all(isinstance(v, str) for v in items):
        return list(items)
    raise ValueError


def _as_params(value: Any) -> dict[str, Any]:
    """Hyper-parameters: a mapping, or ``KEY=VALUE`` words (values read as YAML scalars)."""
    import yaml

    if isinstance(value, Mapping):
        return {str(k).replace("-", "_"): v for k, v in value.items()}
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, Sequence):
        raise ValueError
    params: dict[str, Any] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        if not sep or not key.strip() or not text.strip():
            raise ValueError
        try:
            params[key.strip().replace("-", "_")] = yaml.safe_load(text)
        except yaml.YAMLError:  # "[": no scalar, refused as any value of the wrong form
            raise ValueError(text) from None
    return params


_CONVERTERS: dict[Any, tuple[Callable[[Any], Any], str]] = {
    bool: (_as_bool, "true or false"),
    int: (_as_int, "a whole number"),
    float: (_as_float, "a finite number"),
    str: (_as_str, "a text"),
    list[str]: (_as_str_list, "one or more names"),
    dict[str, Any]: (_as_params, "a mapping of names to values, or KEY=VALUE items"),
}
SUPPORTED_TYPES = tuple(_CONVERTERS)


def convert(value: Any, annotation: Any, opt: Option | None, name: str, *, owner: str | None = None) -> Any:
    """``value`` converted to ``annotation``'s type and checked against ``opt``'s range and choices.

    Args:
        value: The value given (text, a YAML scalar, or already of the type).
        annotation: The type: ``bool``, ``int``, ``float``, ``str``, ``list[str]``, ``dict[str, Any]``,
            ``Literal[...]``, each optionally ``| None`` or ``Annotated[..., Range(...)]``.
        opt: The option's range and choices (None: any value of the type).
        name: The parameter's name, carried by the error.
        owner: Whose parameter it is, for the error (``"merging method 'ties'"``, ``"recipe r.yaml"``).

    Returns:
        The converted value; None for an optional option given null.

    Raises:
        InvalidParameterError: naming ``name`` when the value does not fit.
    """
    kind, optional = base_type(annotation)
    opt = with_annotation_limits(opt or Option(), annotation)
    if value is None or (optional and isinstance(value, str) and value.strip().lower() in NULL_WORDS):
        if optional:
            return None
        raise InvalidParameterError(name, value, opt.expected(kind), owner=owner)
    converter, _ = _CONVERTERS[kind]
    expected = opt.expected(kind) + (" (or null)" if optional else "")
    try:
        converted = converter(value)
    except (ValueError, TypeError, OverflowError):
        raise InvalidParameterError(name, value, expected, owner=owner) from None
    if (opt.choices and converted not in opt.choices) or (opt.range is not None and converted not in opt.range):
        raise InvalidParameterError(name, value, expected, owner=owner)
    return converted


def with_annotation_limits(opt: Option, annotation: Any) -> Option:
    """``opt`` with the range an ``Annotated[..., Range]`` and the choices a ``Literal[...]`` give."""
    if typing.get_origin(annotation) is Annotated:
        annotation, *extras = typing.get_args(annotation)
        bounds = next((extra for extra in extras if isinstance(extra, Range)), None)
        if bounds is not None:
            opt = dataclasses.replace(opt, range=bounds)
    if typing.get_origin(annotation) is Literal:
        opt = dataclasses.replace(opt, choices=typing.get_args(annotation))
    return opt


def convert_field(f: dataclasses.Field, annotation: Any, value: Any, *, owner: str | None = None) -> Any:
    """:func:`convert` for an option field: named by its flag when ``owner`` is given, else by the field."""
    return convert(value, annotation, option_of(f), flag_name(f) if owner else f.name, owner=owner)


def validate(obj: Any) -> None:
    """Convert and check every option field of the (frozen) dataclass ``obj`` in place.

    Raises:
        InvalidParameterError: naming the first field whose value does not fit.
    """
    hints = typing.get_type_hints(type(obj), include_extras=True)
    for f in dataclasses.fields(obj):
        if option_of(f) is not None:
            object.__setattr__(obj, f.name, convert_field(f, hints[f.name], getattr(obj, f.name)))


def option_fields(cls: type) -> list[tuple[dataclasses.Field, Any, type]]:
    """``(field, annotation, owner class)`` of every option of ``cls``, nested option dataclasses flattened."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out: list[tuple[dataclasses.Field, Any, type]] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(option_fields(hints[f.name]))
        elif option_of(f) is not None:
            out.append((f, hints[f.name], cls))
    return out


def field_option(cls: type, name: str, **changes: Any) -> Any:
    """A field for another options class that means what ``cls``'s option ``name`` means, with
    ``changes`` (a default of its own, another help line): one definition of the option, not two.

    Args:
        cls: The options dataclass that defines the option.
        name: The field's name there.
        **changes: ``default`` or ``default_factory`` for the new field, and :class:`Option` fields to replace.

    Returns:
        A dataclass field.
    """
    source = next(f for f in dataclasses.fields(cls) if f.name == name)
    opt = option_of(source)
    if opt is None:
        raise TypeError(f"{cls.__name__}.{name} is not an option")
    default = changes.pop("default", dataclasses.MISSING)
    factory = changes.pop("default_factory", dataclasses.MISSING)
    if default is dataclasses.MISSING and factory is dataclasses.MISSING:
        default, factory = source.default, source.default_factory
    return field(default=default, default_factory=factory, metadata={"option": dataclasses.replace(opt, **changes)})
