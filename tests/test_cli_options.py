"""Every command's flags come from option dataclasses, and list the options they always did.

``tests/golden/cli_options.json`` records, per command, the options ``--help`` listed before the flags
were derived from the option dataclasses; the changes made on purpose since are listed below with
their reason, so a flag lost or renamed by accident fails here.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from featcal.cli import build_parser, main

RECORDED = json.loads((Path(__file__).parent / "golden" / "cli_options.json").read_text())
# Changes on purpose: command -> (options added, options no longer listed).
CHANGES = {
    # the demo's zoo cache under its own name; --cache-dir, which means the Hub cache elsewhere, is kept hidden;
    # the benchmark it builds, mini8 or lm5 (docs/offline-benchmark.md)
    "demo": ({"--zoo-cache-dir", "--zoo"}, {"--cache-dir"}),
    # a language-model merge's calibration texts per expert (docs/causal-lm.md), among the task options, and
    # the dtype its weights are written in (the base's, or float32: docs/causal-lm.md)
    **{command: ({"--data", "--output-dtype"}, set()) for command in ("merge", "calibrate")},
    # a language model's evaluation: generation length of exact match, lm-evaluation-harness tasks (docs/causal-lm.md)
    "run": ({"--data", "--output-dtype", "--eval-max-new-tokens", "--lm-eval-tasks", "--lm-eval-include"}, set()),
    # the Space's model listed under one spelling; --model-id is kept as a hidden alias
    "space": (set(), {"--model-id"}),
}
# Commands added on purpose: command -> its options.
ADDED = {
    # the causal-LM architectures of the installed transformers, supported or refused (docs/causal-lm.md)
    "architectures": ["--recorded"],
    # running generated code, opt-in (docs/code-eval.md)
    "code-eval": ["--allow-code-execution", "--completions", "--k", "--output", "--problems", "--timeout"],
}
# the calibration draw a data-using merging method (RegMean) reads, beside --data
CHANGES["merge"] = (
    CHANGES["merge"][0]
    | {"--num-calibration-examples", "--calibration-batch-size", "--allow-fewer-calibration-examples", "--seed"},
    CHANGES["merge"][1],
)
# where the calibration's feature streams wait between their uses: device or host memory (docs/causal-lm.md)
for command in ("run", "calibrate"):
    CHANGES[command] = (CHANGES[command][0] | {"--stream-storage"}, CHANGES[command][1])
# the repair a calibrate applies, FeatCal by default or SVC, and the hyper-parameters of SVC (docs/repairs.md)
CHANGES["calibrate"] = (CHANGES["calibrate"][0] | {"--method", "--repair-param"}, CHANGES["calibrate"][1])
# Representation Surgery's output is evaluated by calibrate itself: its modules are no model (docs/repairs.md)
CHANGES["calibrate"] = (CHANGES["calibrate"][0] | {"--evaluate"}, CHANGES["calibrate"][1])
# MergeBench's five domains on a mergebench run, the benchmarks' local copies and the opt-in to running the
# coding domain's generated programs (docs/causal-lm.md)
CHANGES["run"] = (
    CHANGES["run"][0] | {"--eval-protocol", "--benchmark-data", "--allow-code-execution"},
    CHANGES["run"][1],
)
# several repairs side by side on a run's merge, and the table of them (docs/repairs.md)
CHANGES["run"] = (CHANGES["run"][0] | {"--repair"}, CHANGES["run"][1])
ADDED["compare"] = ["RUN"]


def listed_options(parser: argparse.ArgumentParser) -> list[str]:
    """The options and positionals ``parser``'s ``--help`` lists (``-h`` aside)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
            continue
        out += [s for s in action.option_strings if s not in ("-h", "--help")]
        if not action.option_strings:
            out.append(action.dest.upper() if action.metavar is None else str(action.metavar))
    return sorted(out)


def commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """Every (sub)command's name and parser."""
    yield " ".join(prefix) or "featcal", parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*prefix, name))


def test_every_command_lists_the_options_it_did() -> None:
    current = {name: listed_options(parser) for name, parser in commands(build_parser())}
    assert current.keys() == RECORDED.keys() | ADDED.keys()
    assert {name: current[name] for name in ADDED} == ADDED
    for name, options in RECORDED.items():
        added, removed = CHANGES.get(name, (set(), set()))
        assert set(current[name]) == (set(options) | added) - removed, name


def test_hidden_aliases_still_set_their_option() -> None:
    parser = build_parser()
    assert parser.parse_args(["space", "--model-id", "a/b"]).model_id == "a/b"
    assert parser.parse_args(["demo", "--cache-dir", "/tmp/zoo"]).zoo_cache_dir == "/tmp/zoo"


def test_every_command_records_its_flags_for_its_errors() -> None:
    for name, parser in commands(build_parser()):
        if name == "featcal" or any(isinstance(a, argparse._SubParsersAction) for a in parser._actions):
            continue
        flags = parser.get_default("flags")
        assert flags and parser.get_default("func"), name
        assert all(flag.startswith("--") for flag in flags.values()), name


def test_the_demo_s_old_cache_flag_still_sets_the_zoo_cache(tmp_path, capsys) -> None:
    """``--cache-dir`` is a hidden alias of ``--zoo-cache-dir`` (checked before any zoo is built)."""
    parser = build_parser()
    for flag in ("--cache-dir", "--zoo-cache-dir"):
        assert parser.parse_args(["demo", flag, str(tmp_path)]).zoo_cache_dir == str(tmp_path)
    assert "--cache-dir" not in parser._subparsers._group_actions[0].choices["demo"].format_help()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["demo", "--zoo-seed", "-1"], "--zoo-seed '-1' is invalid: it must be a whole number >= 0"),
        (["diagnose", "run", "--split", "val"], "--split 'val' is invalid: it must be one of test, calibration"),
        (["tasks", "--suite", "ta9"], "--suite 'ta9' is invalid: it must be one of ta8, ta14, ta20"),
        (["sweep", "run", "--together", "0"], "--together '0' is invalid: it must be a whole number >= 1"),
    ],
)
def test_a_bad_value_is_worded_with_the_command_s_own_flag(capsys, argv, said) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("featcal: error: ") and said in err and len(err.splitlines()) == 1
