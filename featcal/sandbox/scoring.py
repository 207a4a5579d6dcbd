"""Score generated completions of coding problems (HumanEval+ format) in the sandbox: outcomes and pass@k.

A problem is a function to complete: its ``prompt`` (signature and docstring), its ``test`` (code that
defines ``check(candidate)``) and its ``entry_point`` (the function's name). A sample is the model's
completion of the prompt; the program run is, as bigcode-evaluation-harness builds it for
``humanevalplus``, the prompt and the completion, then the test, then ``check(entry_point)``. A
problem whose test asserts by itself (MBPP+ style) has no entry point, and nothing is appended.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from featcal.errors import InvalidParameterError
from featcal.progress import Progress
from featcal.sandbox.passk import mean_pass_at_k
from featcal.sandbox.runner import Limits, Outcome, require_opt_in, run_program, shared_folders


@dataclass(frozen=True)
class Problem:
    """One coding problem.

    Args:
        task_id: Its name, e.g. ``"HumanEval/0"``.
        prompt: The code the model completes.
        test: The test code run after the completion.
        entry_point: The function ``check`` is called with; None when the test asserts by itself.
    """

    task_id: str
    prompt: str
    test: str
    entry_point: str | None = None

    def program(self, completion: str) -> str:
        """The program that tests one completion.

        Args:
            completion: The model's text after the prompt.

        Returns:
            Prompt, completion, test and the call of ``check``.
        """
        check = f"check({self.entry_point})\n" if self.entry_point else ""
        return f"{self.prompt}{completion}\n\n{self.test}\n\n{check}"


@dataclass(frozen=True)
class CodeScore:
    """What scoring found.

    Args:
        pass_at_k: ``{"pass@1": 0.5, ...}``, each the mean over problems.
        outcomes: Each problem's outcomes, one per sample, in the samples' order.
    """

    pass_at_k: dict[str, float]
    outcomes: dict[str, list[Outcome]]

    def counts(self) -> dict[str, tuple[int, int]]:
        """``(samples, passed)`` of each problem."""
        return {task: (len(runs), sum(run.passed for run in runs)) for task, runs in self.outcomes.items()}


def score_completions(
    problems: Sequence[Problem],
    completions: Mapping[str, Sequence[str]],
    ks: Sequence[int] = (1,),
    limits: Limits | None = None,
    *,
    allow_code_execution: bool = False,
    progress: bool = True,
    shared: Sequence[str | os.PathLike[str]] = (),
) -> CodeScore:
    """Run every completion of every problem in the sandbox and compute pass@k.

    Args:
        problems: The problems.
        completions: Each problem's samples by ``task_id``; every problem needs at least ``max(ks)``.
        ks: The k of each pass@k reported (MergeBench: pass@1 of 10 samples).
        limits: What each program may use (default :class:`~featcal.sandbox.runner.Limits`).
        allow_code_execution: Must be True: running generated code is opt-in.
        progress: Show a progress bar over the programs run.
        shared: Folders each program sees read-only (:func:`~featcal.sandbox.runner.run_program`'s ``shared``).

    Returns:
        The :class:`CodeScore`.

    Raises:
        CodeExecutionNotAllowedError: without the opt-in; nothing ran.
        InvalidParameterError: for no problems, repeated task ids, completions of no given problem, a
            problem with fewer than ``max(ks)`` completions, a k < 1, or a shared folder that does not exist or
            shares its name with another; checked before anything runs.
        SandboxUnavailableError: when the sandbox cannot be set up here.
    """
    require_opt_in(allow_code_execution)
    if not problems:
        raise InvalidParameterError("problems", [], "at least one problem")
    if not ks or any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in ks):
        raise InvalidParameterError("ks", list(ks), "one or more whole numbers >= 1")
    ids = [problem.task_id for problem in problems]
    if len(set(ids)) != len(ids):
        raise InvalidParameterError("problems", sorted({i for i in ids if ids.count(i) > 1}), "unique task_ids")
    unknown = sorted(set(completions) - set(ids))
    if unknown:
        raise InvalidParameterError("completions", unknown, "completions of the problems given only (unknown task_ids)")
    for problem in problems:
        samples = completions.get(problem.task_id, ())
        if len(samples) < max(ks):
            raise InvalidParameterError(
                f"completions[{problem.task_id!r}]",
                len(samples),
                f"at least max(ks)={max(ks)} samples (it has {len(samples)})",
            )
    shared_folders(shared)
    outcomes: dict[str, list[Outcome]] = {task: [] for task in ids}
    total = sum(len(completions[task]) for task in ids)
    with Progress(desc="Running generated code", total=total, unit="programs", enabled=progress) as bar:
        for problem in problems:
            for completion in completions[problem.task_id]:
                program = problem.program(completion)
                outcomes[problem.task_id].append(run_program(program, limits, allow_code_execution=True, shared=shared))
                bar.update(1)
    counts = [(len(runs), sum(run.passed for run in runs)) for runs in outcomes.values()]
    return CodeScore({f"pass@{k}": mean_pass_at_k(counts, k) for k in ks}, outcomes)
