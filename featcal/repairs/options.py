"""The options that choose a repair on ``featcal calibrate``: ``--method`` and ``--repair-param``.

This module imports neither torch nor the repairs, so ``featcal --help`` stays fast; the name is
checked against the registry (:func:`featcal.repairs.catalog.get_repair`) when the command runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from featcal.options import option, validate

DEFAULT_REPAIR = "featcal"
SURGERY_NAME = "surgery"
PROBSURGERY_NAME = "probsurgery"
MODULE_REPAIRS = (SURGERY_NAME, PROBSURGERY_NAME)  # the repairs whose output is per-task modules (``--evaluate``)


@dataclass(frozen=True)
class RepairChoice:
    """Which repair ``featcal calibrate`` applies, and the hyper-parameters of one other than FeatCal.

    Raises:
        InvalidParameterError: when a value has the wrong type.
    """

    method: str = option(
        DEFAULT_REPAIR, help="the repair: featcal, lot, surgery or probsurgery (read the same calibration draw), "
        "or svc (data-free); `featcal methods` lists them", metavar="NAME",
    )  # fmt: skip
    repair_params: dict[str, Any] = option(
        default_factory=dict, help="a hyper-parameter of a repair other than FeatCal (svc: alpha=0.1), repeatable",
        metavar="KEY=VALUE", flag="repair_param",
    )  # fmt: skip
    evaluate: bool = option(
        False, help="surgery, probsurgery: evaluate accuracy per task on the test splits, with the modules and without"
    )

    def __post_init__(self) -> None:
        validate(self)


@dataclass(frozen=True)
class RepairComparison:
    """Which repairs ``featcal run --repair`` compares side by side on the run's merge (none: the run as before).

    Raises:
        InvalidParameterError: when a value has the wrong type.
    """

    repair: list[str] | None = option(
        None, help="compare these repairs on the run's merge, each on the same calibration draw, with its "
        "accuracy per task, wall time and peak RSS (featcal, lot, surgery, probsurgery, svc; each with its "
        "defaults, or with hyper-parameters as NAME:KEY=VALUE[,KEY=VALUE...], e.g. svc:alpha=0.3, the same "
        "repair once per setting; `featcal compare RUN` prints the table; docs/repairs.md)", metavar="NAME",
        nargs="+",
    )  # fmt: skip

    def __post_init__(self) -> None:
        validate(self)
