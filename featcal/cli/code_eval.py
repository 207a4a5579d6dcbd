"""`featcal code-eval`: run the completions of coding problems in the sandbox and print pass@k."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from featcal.cli.common import path_line, show_progress
from featcal.cli.options import add_options, command, given_values
from featcal.errors import OutputPathError
from featcal.sandbox.options import CodeEvalOptions

REPORT_KIND = "featcal code-eval"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "code-eval",
        help="score model-written programs (HumanEval+ format) in a sandbox: pass@k (opt-in)",
        description="Run each completion of each problem, the prompt's function completed and then the "
        "problem's test, in featcal's Linux sandbox (no network, no access to your files or environment, "
        "limits on time, memory, processes and file size: docs/code-eval.md), and print pass@k. Nothing runs "
        "without --allow-code-execution.",
    )
    add_options(parser, CodeEvalOptions, required=("problems", "completions"))
    command(parser, cmd_code_eval)


def _check_output(output: str, inputs: list[str]) -> Path:
    """The report file, refused when it is an input or an existing file that is not such a report."""
    from featcal.outputs import check_output_file

    path = check_output_file(output, kind="report file")
    if any(path == Path(item).resolve() for item in inputs):
        raise OutputPathError(output, f"The report file {output} is an input of the command: write it elsewhere.")
    if path.exists():
        try:
            kind = json.loads(path.read_text(encoding="utf-8")).get("kind")
        except (ValueError, AttributeError):
            kind = None
        if kind != REPORT_KIND:
            raise OutputPathError(
                output, f"{output} exists and is not a featcal code-eval report: name a new file, or remove it first."
            )
    return path


def cmd_code_eval(args: argparse.Namespace) -> int:
    from featcal.files.atomic import atomic_write_json
    from featcal.sandbox.files import check_completions, read_completions, read_problems
    from featcal.sandbox.runner import Limits, require_opt_in
    from featcal.sandbox.scoring import score_completions

    options = CodeEvalOptions(**given_values(args, CodeEvalOptions))
    require_opt_in(options.allow_code_execution)
    inputs = [options.problems, options.completions]
    output = _check_output(options.output, inputs) if options.output else None
    problems = read_problems(options.problems)
    completions = read_completions(options.completions)
    check_completions(problems, completions, options.k, options.problems, options.completions)
    limits = Limits(wall_s=options.timeout)
    score = score_completions(
        problems, completions, (options.k,), limits, allow_code_execution=True, progress=show_progress(args)
    )
    statuses = Counter(outcome.status for runs in score.outcomes.values() for outcome in runs)
    if output is not None:
        atomic_write_json(
            output,
            {
                "kind": REPORT_KIND,
                **score.pass_at_k,
                "problems": {
                    task: [{"status": run.status, "reason": run.reason} for run in runs]
                    for task, runs in score.outcomes.items()
                },
            },
        )
    counted = ", ".join(f"{statuses[status]} {status}" for status in ("passed", "failed", "timeout", "killed"))
    print(f"{len(problems)} problems, {sum(statuses.values())} programs: {counted}")
    for name, value in score.pass_at_k.items():
        print(f"{name}: {value:.4f}")
    if output is not None:
        print(path_line("Report", output))
    return 0
