"""Every command's flags come from option dataclasses, and list the options they always did.

``tests/golden/cli_options.json`` records, per command, the options ``--help`` listed before the flags
were derived from the option dataclasses; the changes made on purpose since are listed below with
their reason, so a flag lost or renamed by accident fails here.

``tests/golden/cli_option_details.json`` records every option of every command in full, as the code at
its ``recorded_at`` commit defines it: flags, hidden aliases, metavar, nargs, action, whether required,
its ``--help`` section and text (which holds the default), and the values ``merge --method`` and
``calibrate --method`` accept with each one's hyper-parameters. A change is a failure that names the
command, the option and the field, unless ``DETAIL_CHANGES`` lists it with its reason. Recorded with
``python -c "from tests.test_cli_options import record_details; record_details('COMMIT')"``, this file
beside that commit's ``featcal`` (the record of 2baee13 was made so, before the issue 41 redesign).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from featcal.cli import build_parser, main

RECORDED = json.loads((Path(__file__).parent / "golden" / "cli_options.json").read_text())
DETAILS = Path(__file__).parent / "golden" / "cli_option_details.json"
# Changes on purpose to a recorded detail: (command, option, field) -> reason; a listed change that does not
# occur fails too. ``option`` is the option's first flag (a positional's name), or a value of a --method;
# ``field`` one of the record's keys, "option" (added or removed) or "command" (added or removed), e.g.
# ("run", "--eval-max-new-tokens", "section"): "issue 41: the causal-LM family's own options".
DETAIL_CHANGES: dict[tuple[str, str, str], str] = {
    ("compare", "*", "command"): "issue 42: the table of the repairs a run compared (docs/repairs.md)",
    ("run", "--repair", "option"): "issue 42: repairs side by side on the run's merge, each entry NAME or "
    "NAME:KEY=VALUE[,KEY=VALUE...] with its hyper-parameters (docs/repairs.md)",
    ("run", "--eval-protocol", "option"): "issue 43: MergeBench's five domains (docs/causal-lm.md)",
    ("run", "--benchmark-data", "option"): "issue 43: local copies of MergeBench's benchmarks (docs/causal-lm.md)",
    ("run", "--allow-code-execution", "option"): "issue 43: the opt-in to running generated code (docs/code-eval.md)",
    ("calibrate --method", "lot", "hyper-parameters"): "issue 42: LOT solves the norms too; norms=false: linears only",
    ("run", "--mergebench-safety", "option"): "issue 43: MergeBench's safety domain, its judged protocol by default "
    "(wildguard: the paper's) or FusionBench's lm-eval variant by name (fusionbench; docs/causal-lm.md)",
    ("run", "--safety-judge", "option"): "issue 43: the judged safety's WildGuard (docs/causal-lm.md)",
}
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
# the protocol's safety domain, MergeBench's judged one by default, and its judge (docs/causal-lm.md)
CHANGES["run"] = (CHANGES["run"][0] | {"--mergebench-safety", "--safety-judge"}, CHANGES["run"][1])
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


def option_details(parser: argparse.ArgumentParser) -> dict[str, dict[str, object]]:
    """Every option of ``parser`` (hidden aliases and positionals included, ``-h`` aside) by its first flag or
    name: how it is parsed and how ``--help`` shows it."""
    sections = {id(a): group.title for group in parser._action_groups for a in group._group_actions}
    details = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction | argparse._HelpAction):
            continue
        hidden = action.help == argparse.SUPPRESS
        key = action.option_strings[0] if action.option_strings else action.dest
        details[key] = {
            "flags": list(action.option_strings),
            "dest": action.dest,
            "action": type(action).__name__,
            "metavar": action.metavar,
            "nargs": action.nargs,
            "const": repr(action.const),
            "default": repr(action.default),
            "type": getattr(action.type, "__name__", repr(action.type)),
            "choices": None if action.choices is None else list(action.choices),
            "required": action.required,
            "hidden": hidden,
            "section": sections.get(id(action)),
            "help": None if hidden else action.help,
        }
    return details


def method_values() -> dict[str, dict[str, list[str]]]:
    """The names ``merge --method`` and ``calibrate --method`` accept, each with its hyper-parameters as
    ``featcal methods`` lists them (name, type, range, default)."""
    from featcal.merging import available_methods, get_method
    from featcal.repairs.catalog import available_repairs, get_repair

    return {
        "merge --method": {name: list(map(str, get_method(name).params)) for name in available_methods()},
        "calibrate --method": {name: list(map(str, get_repair(name).params)) for name in available_repairs()},
    }


def current_details() -> dict[str, dict[str, dict[str, object]]]:
    """What ``cli_option_details.json`` records, from the code as it is: commands, then --method values."""
    options = {name: option_details(parser) for name, parser in commands(build_parser())}
    values = {
        where: {name: {"hyper-parameters": params} for name, params in v.items()}
        for where, v in method_values().items()
    }
    return {**options, **values}


def record_details(commit: str) -> None:
    """Write ``cli_option_details.json`` from the code as it is (run on ``commit``, which it names)."""
    DETAILS.write_text(json.dumps({"recorded_at": commit, "commands": current_details()}, indent=1) + "\n")


def detail_changes(recorded: dict, current: dict) -> dict[tuple[str, str, str], str]:
    """Every (command, option, field) whose value differs between two records, with the two values."""
    changes = {}
    for command in sorted(recorded.keys() | current.keys()):
        if command not in current or command not in recorded:
            changes[(command, "*", "command")] = "removed" if command not in current else "added"
            continue
        before, after = recorded[command], current[command]
        for option in sorted(before.keys() | after.keys()):
            if option not in after or option not in before:
                changes[(command, option, "option")] = "removed" if option not in after else "added"
                continue
            for key in sorted(before[option].keys() | after[option].keys()):
                if before[option].get(key) != after[option].get(key):
                    changes[(command, option, key)] = f"{before[option].get(key)!r} -> {after[option].get(key)!r}"
    return changes


def test_every_option_of_every_command_is_as_recorded_or_its_change_is_listed() -> None:
    recorded = json.loads(DETAILS.read_text())["commands"]
    changes = detail_changes(recorded, current_details())
    unlisted = [f"{c} {o} {k}: {what}" for (c, o, k), what in changes.items() if (c, o, k) not in DETAIL_CHANGES]
    stale = [key for key in DETAIL_CHANGES if key not in changes]
    assert unlisted == [], "options changed without a reason in DETAIL_CHANGES:\n" + "\n".join(unlisted)
    assert stale == [], f"DETAIL_CHANGES lists changes that do not occur: {stale}"


def test_the_details_record_every_command_and_both_method_registries() -> None:
    recorded = json.loads(DETAILS.read_text())["commands"]
    listed = {name for name, _ in commands(build_parser())}
    assert listed <= recorded.keys() | {c for c, _, k in DETAIL_CHANGES if k == "command"}
    for name in ("architectures", "code-eval", "methods", "calibrate", "merge", "featcal"):
        assert recorded[name], name
    assert {"featcal", "svc"} <= recorded["calibrate --method"].keys()
    assert {"task_arithmetic", "ties"} <= recorded["merge --method"].keys()


def test_a_changed_option_is_named_with_its_command_and_field() -> None:
    recorded = {"calibrate": {"--method": {"help": "the repair", "metavar": "NAME"}, "--gone": {"help": "x"}}}
    current = {
        "calibrate": {"--method": {"help": "the repair (default featcal)", "metavar": "NAME"}, "--new": {}},
        "fresh": {},
    }
    assert detail_changes(recorded, current) == {
        ("calibrate", "--gone", "option"): "removed",
        ("calibrate", "--method", "help"): "'the repair' -> 'the repair (default featcal)'",
        ("calibrate", "--new", "option"): "added",
        ("fresh", "*", "command"): "added",
    }


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
