"""Command-line flags derived from option dataclasses (:mod:`featcal.options`): one flag per option.

Flags default to ``argparse.SUPPRESS``, so the parsed namespace holds exactly the options the user
typed (abbreviated or not); :func:`given_values` hands them to the dataclass (or to
:func:`featcal.spec.build_spec`, which layers them over a recipe), which converts and checks every
value. Every subcommand is finished with :func:`command`, which records its flags by parameter name
so that an error about a parameter is worded with the flag that set it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

from featcal.calibration.params import GROUP as FEATCAL
from featcal.options import base_type, flag_name, option_fields, option_of
from featcal.spec import DIAGNOSTICS, EVALUATION, MERGING, OUTPUT, RUNTIME, STAGES, TASKS, RunSpec

GROUP_TITLES = {
    OUTPUT: "output",
    TASKS: "tasks and models",
    MERGING: "merging",
    FEATCAL: "FeatCal (defaults: the published reference run)",
    EVALUATION: "evaluation",
    RUNTIME: "runtime",
    STAGES: "stages",
    DIAGNOSTICS: "feature-drift diagnostics (featcal diagnose, --diagnose)",
}
RUN_GROUPS = tuple(GROUP_TITLES)
FLAGS = "flags"  # the namespace attribute that maps each parameter to the flag that sets it


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
        return "" if value in ({}, []) else f" (default {value} here)"
    if f.default is None or f.default is False:
        return ""
    return f" (default {f.default})"


def add_options(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    groups: Collection[str] | None = None,
    exclude: Collection[str] = (),
    only: Collection[str] | None = None,
    renamed: Mapping[str, str] | None = None,
    helps: Mapping[str, str] | None = None,
    required: Collection[str] = (),
    section: str | None = None,
) -> None:
    """Add a flag for each option of the dataclass ``cls`` to ``parser``, in ``--help`` sections by group.

    Args:
        parser: The subcommand's parser.
        cls: The options dataclass (:class:`~featcal.spec.RunSpec`, a command's own options).
        groups: Which option groups to offer (None: all).
        exclude: Field names to leave out.
        only: Field names to offer (None: all that ``groups`` and ``exclude`` leave).
        renamed: Field name → flag, for a subcommand that spells an option differently (``--method``).
        helps: Field name → help line, for a subcommand that says more or less than the option's own.
        required: Field names whose flag must be given.
        section: The ``--help`` section every flag offered here is listed under, instead of its group's.
    """
    sections: dict[str, argparse._ArgumentGroup] = {}
    for f, annotation, _ in option_fields(cls):
        opt = option_of(f)
        assert opt is not None
        wanted = (groups is None or opt.group in groups) and f.name not in exclude and (only is None or f.name in only)
        if not wanted:
            continue
        title = section or GROUP_TITLES.get(opt.group, opt.group)
        if title not in sections:
            sections[title] = parser.add_argument_group(title) if title else parser
        names = [(renamed or {}).get(f.name, f"--{flag_name(f)}")]
        help_text = (helps or {}).get(f.name, opt.help) + ("" if f.name in required else _default_text(f))
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_text}
        if f.name in required:
            kwargs["required"] = True
        if base_type(annotation)[0] is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["metavar"] = opt.metavar
            if base_type(annotation)[0] == dict[str, Any]:
                kwargs["action"] = "append"
            elif opt.nargs:
                kwargs["nargs"] = opt.nargs
        sections[title].add_argument(*names, **kwargs)
        for alias in opt.aliases:  # older spellings: accepted, not listed
            sections[title].add_argument(f"--{alias}", **{**kwargs, "help": argparse.SUPPRESS, "required": False})


def add_spec_options(parser: argparse.ArgumentParser, **kwargs: Any) -> None:
    """:func:`add_options` for the run's options (:class:`~featcal.spec.RunSpec`); ``groups`` defaults to
    every run group."""
    add_options(parser, RunSpec, **{"groups": RUN_GROUPS, **kwargs})


def given_values(args: argparse.Namespace, cls: type = RunSpec) -> dict[str, Any]:
    """The options of ``cls`` the user typed, by field name (flags not typed are absent)."""
    names = {f.name for f, _, _ in option_fields(cls)}
    return {name: value for name, value in vars(args).items() if name in names}


def command(parser: argparse.ArgumentParser, func: Callable[[argparse.Namespace], int]) -> None:
    """Finish a subcommand's parser: its handler, and each parameter's flag (the first long one) for the
    wording of errors (:func:`featcal.cli.errors.word_error`)."""
    flags = {}
    for action in parser._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if long and action.help != argparse.SUPPRESS:
            flags.setdefault(action.dest, long[0])
    parser.set_defaults(func=func, **{FLAGS: flags})


def flag(field_name: str) -> str:
    """The flag of the run option ``field_name`` (``lambda_ratio`` → ``--lambda-ratio``).

    Raises:
        KeyError: for a name that is no run option.
    """
    for f, _, _ in option_fields(RunSpec):
        if f.name == field_name:
            return f"--{flag_name(f)}"
    raise KeyError(field_name)
