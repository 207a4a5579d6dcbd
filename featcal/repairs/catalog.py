"""featcal's repairs, registered: FeatCal (the default), LOT Merging, Representation Surgery, ProbSurgery and
SVC; look them up here.

FeatCal is registered with the parameters of :class:`~featcal.calibration.params.FeatCalParams`, its
computation staying :func:`featcal.stages.calibrate`'s; LOT, Surgery, ProbSurgery and SVC
register themselves (:mod:`featcal.repairs.lot`, :mod:`featcal.repairs.surgery`,
:mod:`featcal.repairs.probsurgery`, :mod:`featcal.repairs.svc`).
"""

from __future__ import annotations

from featcal.calibration.params import FeatCalParams
from featcal.merging.registry import HyperParameter
from featcal.options import base_type, option_fields, option_of, with_annotation_limits
from featcal.repairs import lot, probsurgery, surgery, svc  # noqa: F401 - they register themselves
from featcal.repairs.registry import REPAIRS, Repair


def featcal_params() -> tuple[HyperParameter, ...]:
    """FeatCal's parameters as hyper-parameters: each field of :class:`FeatCalParams`, its type, range and default."""
    return tuple(
        HyperParameter(f.name, base_type(annotation)[0], f.default, with_annotation_limits(option_of(f), annotation))
        for f, annotation, _ in option_fields(FeatCalParams)
    )


FEATCAL = Repair(
    "featcal", "FeatCal", "https://arxiv.org/abs/2605.13030",
    "Re-solves each layer in closed form so that the merged model's features match each expert's on its "
    "calibration examples",
    featcal_params(), uses_data=True, releasable=True,
)  # fmt: skip
REPAIRS.add(FEATCAL)


def get_repair(name: str) -> Repair:
    """The repair registered as ``name``.

    Args:
        name: A registry name such as ``"featcal"`` or ``"svc"``.

    Returns:
        The repair.

    Raises:
        UnknownNameError: If no repair has that name (``.known`` lists those that do).
    """
    return REPAIRS.get(name)


def available_repairs() -> list[str]:
    """The names of the registered repairs, sorted.

    Returns:
        The names :func:`get_repair` accepts.
    """
    return REPAIRS.names()
