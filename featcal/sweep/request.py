"""What a sweep asks for: the calibration sizes, at most one swept FeatCal parameter and how many
settings are calibrated together, checked before any work, and the FeatCal settings they make."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from featcal.calibration.params import FeatCalParams
from featcal.errors import InvalidParameterError, UnknownNameError
from featcal.options import Option, Range, convert, convert_field, option, validate

DEFAULT_SIZES = (8, 16, 32, 64, 128, 256)
# The parameters a sweep may vary besides n: those that change the solves or the teacher. The batch
# size only changes the arithmetic's order, and n has its own option.
SWEEPABLE = ("lambda_ratio", "anchor_blend_rho", "teacher_interp_alpha", "covariance_eps")
SIZES_EXPECTED = "whole numbers >= 1 separated by commas, e.g. 8,16,32"

_FIELDS = {f.name: f for f in dataclasses.fields(FeatCalParams)}
_HINTS = typing.get_type_hints(FeatCalParams)


@dataclass(frozen=True)
class SweptParameter:
    """One FeatCal parameter and the values it takes in a sweep."""

    name: str
    values: tuple[float, ...]


def parse_sizes(text: str) -> tuple[int, ...]:
    """Calibration sizes from ``"8,16,32"``: each a whole number >= 1; sorted, repeats dropped.

    Raises:
        InvalidParameterError: naming ``num_calibration_examples`` and the text given.
    """
    items = [item.strip() for item in str(text).split(",")]
    if not items or any(not item for item in items):
        raise InvalidParameterError("num_calibration_examples", text, SIZES_EXPECTED)
    field = _FIELDS["num_calibration_examples"]
    try:
        sizes = {convert_field(field, int, item) for item in items}
    except InvalidParameterError:
        raise InvalidParameterError("num_calibration_examples", text, SIZES_EXPECTED) from None
    return tuple(sorted(sizes))


def parse_parameter(text: str) -> SweptParameter:
    """``"lambda_ratio=0.01,0.05,0.1"`` (dashes allowed in the name): a parameter of
    :data:`SWEEPABLE` and its values, each checked as that option checks it; repeats dropped, order kept.

    Raises:
        UnknownNameError: for a name that is not a sweepable FeatCal parameter.
        InvalidParameterError: for a missing ``=``, an empty list or a value out of the option's range.
    """
    name, sep, values = str(text).partition("=")
    name = name.strip().replace("-", "_")
    if not sep or not name:
        raise InvalidParameterError(
            "param", text, "NAME=VALUE,VALUE,… with NAME one of " + ", ".join(SWEEPABLE), owner="sweep"
        )
    if name not in SWEEPABLE:
        hint = "The calibration sizes have their own option, `num_calibration_examples`." if name in _FIELDS else ""
        raise UnknownNameError("FeatCal parameter to sweep", name, SWEEPABLE, hint=hint)
    items = [item.strip() for item in values.split(",")]
    if any(not item for item in items):
        raise InvalidParameterError(name, values, "numbers separated by commas", owner="sweep")
    converted: list[float] = []
    for item in items:
        try:
            value = convert_field(_FIELDS[name], _HINTS[name], item)
        except InvalidParameterError as exc:
            raise InvalidParameterError(name, item, exc.expected, owner="sweep") from None
        if value not in converted:
            converted.append(value)
    return SweptParameter(name, tuple(converted))


@dataclass(frozen=True)
class SweepFlags:
    """``featcal sweep``'s own flags as typed: the texts :meth:`SweepRequest.parse` reads."""

    sizes: str | None = option(
        None, help="calibration examples per task, comma-separated (default "
        f"{','.join(map(str, DEFAULT_SIZES))}; with --param, the run's n)", group="sweep", metavar="N,N,…",
        flag="num_calibration_examples",
    )  # fmt: skip
    param: str | None = option(
        None, help=f"also sweep one FeatCal parameter: {', '.join(SWEEPABLE)} (e.g. lambda_ratio=0.01,0.05,0.1)",
        group="sweep", metavar="NAME=V,V,…",
    )  # fmt: skip
    together: str | None = option(
        None, help="calibrate at most K settings at once (each holds a model copy, its feature streams and its "
        "layer statistics in memory; default: all)", group="sweep", metavar="K",
    )  # fmt: skip

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class SweepRequest:
    """A sweep's own options (``featcal sweep``'s flags); the run's other options come from its run spec.

    Attributes:
        sizes: Calibration examples per task (None: 8 … 256, or with ``parameter`` the run's n).
        parameter: The FeatCal parameter to sweep and its values, or None.
        together: At most this many settings are calibrated (and held in memory) at once; None: all.

    Raises:
        InvalidParameterError: for ``together`` below 1.
    """

    sizes: tuple[int, ...] | None = None
    parameter: SweptParameter | None = None
    together: int | None = None

    def __post_init__(self) -> None:
        if self.together is not None and (isinstance(self.together, bool) or self.together < 1):
            raise InvalidParameterError("together", self.together, "a whole number >= 1")

    @classmethod
    def parse(cls, sizes: str | None, parameter: str | None, together: str | int | None) -> SweepRequest:
        """The request from its flags' texts (``"8,16"``, ``"lambda_ratio=0.01,0.1"``, ``"2"``).

        Raises:
            InvalidParameterError, UnknownNameError: naming the flag's parameter and what it must be.
        """
        count = None
        if together is not None:
            count = convert(together, int, Option(range=Range(ge=1)), "together")
        return cls(
            parse_sizes(sizes) if sizes is not None else None,
            parse_parameter(parameter) if parameter is not None else None,
            count,
        )


def sweep_settings(
    base: FeatCalParams, sizes: tuple[int, ...], parameter: SweptParameter | None
) -> list[FeatCalParams]:
    """Every setting of the sweep: each size, with each value of the swept parameter (n varies fastest)."""
    values: tuple[dict[str, float], ...] = (
        ({},) if parameter is None else tuple({parameter.name: v} for v in parameter.values)
    )
    return [dataclasses.replace(base, num_calibration_examples=n, **change) for change in values for n in sizes]
