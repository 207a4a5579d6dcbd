"""FeatCal's hyper-parameters, defined beside the algorithm that reads them.

The run spec (:mod:`featcal.spec`) nests them, the CLI offers each as a flag, ``run_config.json`` and
the model card record them: all from this one definition. This module imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from featcal.options import option, option_of, validate

GROUP = "FeatCal"  # the --help section of these options


@dataclass(frozen=True)
class FeatCalParams:
    """FeatCal hyper-parameters; the defaults are the published reference run's.

    Raises:
        InvalidParameterError: when a value has the wrong type or lies outside its range.
    """

    num_calibration_examples: int = option(
        256, help="calibration examples (images or texts) per task, from the train split", group=GROUP, metavar="N",
        ge=1, symbol="n", card="training images per task used for calibration",
    )  # fmt: skip
    calibration_batch_size: int = option(
        16, help="examples per forward batch while collecting statistics", group=GROUP, metavar="B", ge=1,
        card="images per forward batch while collecting statistics",
    )  # fmt: skip
    lambda_ratio: float = option(
        0.05, help="ridge towards the anchor", group=GROUP, metavar="λ", ge=0,
        symbol="λ", card="strength of the pull towards the anchor weights",
    )  # fmt: skip
    anchor_blend_rho: float = option(
        2.2, help="anchor ρ·merged + (1−ρ)·base", group=GROUP, metavar="ρ",
        symbol="ρ", card="anchor = ρ·merged + (1−ρ)·base",
    )  # fmt: skip
    teacher_interp_alpha: float = option(
        0.25, help="teacher input α·expert + (1−α)·student", group=GROUP, metavar="α",
        symbol="α", card="teacher input = α·expert + (1−α)·merged features",
    )  # fmt: skip
    covariance_eps: float = option(
        1e-8, help="ridge added to the covariance solves", group=GROUP, metavar="ε", ge=0,
        symbol="ε", card="ridge added to the covariance solves",
    )  # fmt: skip

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, float | int]:
        """The values by name, as ``run_config.json`` records them."""
        return dataclasses.asdict(self)


def symbol(name: str) -> str:
    """The paper's symbol of a FeatCal parameter (``λ`` for ``lambda_ratio``), or its name where it has none.

    Raises:
        KeyError: for a name that is not a FeatCal parameter.
    """
    fields = {f.name: f for f in dataclasses.fields(FeatCalParams)}
    return option_of(fields[name]).symbol or name
