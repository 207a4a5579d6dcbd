"""``featcal code-eval``'s options: the problems and completions files, pass@k's k, the wall time of each
program, the opt-in to running code, and the report file."""

from __future__ import annotations

from dataclasses import dataclass

from featcal.options import option, validate

GROUP = "code evaluation"


@dataclass(frozen=True)
class CodeEvalOptions:
    """What ``featcal code-eval`` scores, and how.

    Raises:
        InvalidParameterError: naming the option whose value does not fit.
    """

    problems: str | None = option(
        None, help="JSONL file of problems in the HumanEval+ format (task_id, prompt, test, entry_point)",
        group=GROUP, metavar="FILE",
    )  # fmt: skip
    completions: str | None = option(
        None, help="JSONL file of samples, one a line: task_id, completion (the text after the prompt)",
        group=GROUP, metavar="FILE",
    )  # fmt: skip
    k: int = option(1, help="the k of pass@k (each problem needs at least k samples)", group=GROUP, metavar="K", ge=1)
    timeout: float = option(
        10.0, help="wall-time seconds each program may run", group=GROUP, metavar="SECONDS", gt=0, le=3600
    )
    allow_code_execution: bool = option(
        False, help="run the model-generated programs, in the sandbox docs/code-eval.md describes; nothing runs "
        "without it", group=GROUP,
    )  # fmt: skip
    output: str | None = option(
        None, help="JSON file to write pass@k and every program's outcome to", group=GROUP, metavar="FILE"
    )

    def __post_init__(self) -> None:
        validate(self)
