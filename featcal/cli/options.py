"""Command-line flags derived from :mod:`featcal.spec`: one flag per run option, with its help.

Flags default to ``argparse.SUPPRESS``, so the parsed namespace holds exactly the options the user
typed (abbreviated or not); :func:`given_values` hands them to :func:`featcal.spec.build_spec`, which
layers them over a recipe and converts and checks every value.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Collection, Mapping
from typing import Any

from featcal.calibration.params import GROUP as FEATCAL
from featcal.options import flag_name as _flag_name
from featcal.options import option_fields, option_of
from featcal.spec import DIAGNOSTICS, EVALUATION, MERGING, RUNTIME, STAGES, TASKS, RunSpec

GROUP_TITLES = {
    "output": "output",
    TASKS: "tasks and models",
    MERGING: "merging",
    FEATCAL: "FeatCal (defaults: the published reference run)",
    EVALUATION: "evaluation",
    RUNTIME: "runtime",
    STAGES: "stages",
    DIAGNOSTICS: "feature-drift diagnostics (featcal diagnose, --diagnose)",
}
RUN_GROUPS = tuple(GROUP_TITLES)


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return "" if value in ({}, []) else f" (default {value} here)"
    if f.default is None or f.default is False:
        return ""
    return f" (default {f.default})"


def flag(field_name: str) -> str:
    """The flag of the run option ``field_name`` (``lambda_ratio`` → ``--lambda-ratio``)."""
    for f, _, _ in option_fields(RunSpec):
        if f.name == field_name:
            return f"--{_flag_name(f)}"
    raise KeyError(field_name)


def add_spec_options(
    parser: argparse.ArgumentParser,
    *,
    groups: Collection[str] = RUN_GROUPS,
    exclude: Collection[str] = (),
    renamed: Mapping[str, str] | None = None,
) -> None:
    """Add the flags of every run option in ``groups`` (but not ``exclude``) to ``parser``.

    Args:
        parser: The subcommand's parser.
        groups: Which option groups of :class:`~featcal.spec.RunSpec` to offer.
        exclude: Field names to leave out.
        renamed: Field name → flag, for a subcommand that spells an option differently (``--method``).
    """
    sections: dict[str, argparse._ArgumentGroup] = {}
    for f, annotation, _ in option_fields(RunSpec):
        opt = option_of(f)
        assert opt is not None
        if opt.group not in groups or f.name in exclude:
            continue
        if opt.group not in sections:
            sections[opt.group] = parser.add_argument_group(GROUP_TITLES[opt.group])
        names = [(renamed or {}).get(f.name, f"--{_flag_name(f)}")]
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": opt.help + _default_text(f)}
        if annotation is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = opt.metavar
            if f.name == "merge_params":
                kwargs["action"] = "append"
            elif opt.nargs:
                kwargs["nargs"] = opt.nargs
        sections[opt.group].add_argument(*names, **kwargs)


def given_values(args: argparse.Namespace) -> dict[str, Any]:
    """The run options the user typed, by field name (flags not typed are absent)."""
    names = {f.name for f, _, _ in option_fields(RunSpec)}
    return {name: value for name, value in vars(args).items() if name in names}
