"""MergeBench's five-domain evaluation of one model: lm-evaluation-harness for what it covers, featcal's
sandbox for the coding domain's programs.

The harness runs through its Python API on the model featcal holds (``HFLM(pretrained=model)``) with each
task's own settings (few-shot count, generation, filters), no chat template, as MergeBench's evaluate.sh
runs it. With a folder of local copies the harness reads them (:mod:`.local_data`); without one it
downloads each dataset from the Hub as lm-eval does. The coding domain's samples are drawn here and run
in the sandbox (:mod:`.coding`), only when the user opted in.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from featcal.errors import CodeExecutionNotAllowedError
from featcal.families.causal_lm.mergebench_eval.coding import hub_rows, read_rows, run_code_task, sandbox_numpy
from featcal.families.causal_lm.mergebench_eval.judged_safety import (
    BENCHMARKS,
    FUSIONBENCH,
    JUDGED,
    JUDGED_VARIANT,
    MAX_NEW_TOKENS,
    check_sources,
    judge_card,
    run_judged_safety,
    safety_score,
    stop_ids,
)
from featcal.families.causal_lm.mergebench_eval.local_data import (
    check_local_copies,
    code_source,
    harness_source,
    write_definitions,
)
from featcal.families.causal_lm.mergebench_eval.nltk_data import check_punkt_tab
from featcal.families.causal_lm.mergebench_eval.protocol import (
    CODING,
    DOMAIN_NAMES,
    PROTOCOL,
    SAFETY,
    SAFETY_VARIANT,
    domain,
    harness_task_names,
)
from featcal.families.causal_lm.mergebench_eval.scores import domain_scores, raw_average
from featcal.families.causal_lm.mergebench_eval.wildguard import JUDGE_ID, check_judge

CODE_OPT_IN = (
    "MergeBench's coding domain runs model-generated programs: give allow_code_execution to run them in "
    "featcal's sandbox (docs/code-eval.md)."
)


@dataclass(frozen=True)
class ProtocolSettings:
    """How a run evaluates by MergeBench's protocol.

    Attributes:
        data: The folder of local copies of the benchmarks (None: the Hub's datasets).
        allow_code_execution: The user's opt-in to running the coding domain's programs.
        limit: Examples per harness task and problems per coding benchmark (None: all).
        batch_size: The harness's batch size.
        safety: ``wildguard`` (MergeBench's judged protocol, the run's default) or ``fusionbench`` (FusionBench's
            lm-eval variant: what a run record naming no ``safety`` ran, hence the default here).
        judge: The judged protocol's WildGuard: a Hub id or a folder.
    """

    data: str | None
    allow_code_execution: bool
    limit: int | None = None
    batch_size: int = 1
    safety: str = FUSIONBENCH
    judge: str = JUDGE_ID


def _harness_domain_tasks(name: str, safety: str) -> tuple[Any, ...]:
    """A domain's harness tasks: none for the safety domain judged by WildGuard."""
    return () if name == SAFETY and safety == JUDGED else domain(name).harness


def judge_device() -> str:
    """Where the judge runs when no device is given.

    Returns:
        ``cuda`` (the first GPU) when there is one, else ``cpu``.
    """
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_protocol(
    data: str | None,
    allow_code_execution: bool,
    safety: str = FUSIONBENCH,
    judge: str = JUDGE_ID,
    device: str | None = None,
    evaluated_bytes: int = 0,
) -> None:
    """Refuse, before any work, what the protocol cannot run with.

    Args:
        data: The folder of local copies, or None.
        allow_code_execution: The opt-in to running generated code.
        safety: ``fusionbench`` or ``wildguard`` (:class:`ProtocolSettings`).
        judge: WildGuard's Hub id or folder (``wildguard`` alone).
        device: Where the evaluated model, and so the judge, runs (None: :func:`judge_device`).
        evaluated_bytes: The evaluated model's weights on ``device``, which stay there while the judge runs
            (0: not known yet; the judge alone is checked).

    Raises:
        CodeExecutionNotAllowedError: without the opt-in (the coding domain runs programs).
        DatasetInputError: for a folder lacking a file some task reads.
        FeatcalError: when lm-eval is not installed, or nltk's ``punkt_tab`` data, which ifeval's checks read,
            is not (:func:`.nltk_data.check_punkt_tab`).
        SandboxUnavailableError: when the coding domain's programs could not import numpy in the sandbox, or
            the sandbox cannot be set up here (:func:`.coding.sandbox_numpy`: one program run in it).
        ModelInputError: for a judge that cannot be loaded (:func:`.wildguard.check_judge`).
    """
    if allow_code_execution is not True:
        raise CodeExecutionNotAllowedError(CODE_OPT_IN)
    check_punkt_tab()
    if data is not None:
        sources = [harness_source(t) for name in DOMAIN_NAMES for t in _harness_domain_tasks(name, safety)]
        sources += [code_source(t) for t in domain(CODING).code]
        check_local_copies(Path(data), sources)
    sandbox_numpy()
    if safety == JUDGED:
        check_sources(None if data is None else Path(data))
        check_judge(judge, device or judge_device(), evaluated_bytes)


def safety_answers(model: Any, tokenizer: Any, prompts: Sequence[str], batch_size: int) -> list[str]:
    """The evaluated model's greedy answers to the judged safety's chat-formatted prompts: none cut, at most
    :data:`~.judged_safety.MAX_NEW_TOKENS` new tokens, each ending at the end of its turn
    (:func:`~.judged_safety.stop_ids`).

    Args:
        model: A ``*ForCausalLM`` in eval mode, on its device.
        tokenizer: The base's tokenizer.
        prompts: The prompts in :data:`~.judged_safety.CHAT_FORMAT`.
        batch_size: Prompts per batch.

    Returns:
        The answers, decoded without special tokens.
    """
    from featcal.families.causal_lm.generation import greedy_responses

    stops = stop_ids(getattr(model.generation_config, "eos_token_id", None), tokenizer)
    return greedy_responses(model, tokenizer, prompts, max_length=1 << 30, max_new_tokens=MAX_NEW_TOKENS,
                            batch_size=batch_size, stop_ids=stops)  # fmt: skip  # max_length: no prompt is cut


class MergeBenchEvaluation:
    """MergeBench's protocol set up for a run (checked by :func:`check_protocol` first).

    Args:
        settings: The run's :class:`ProtocolSettings`.
        device: Where the evaluated models run (None: :func:`judge_device`).
        evaluated_bytes: The weights of each evaluated model on ``device`` (the judge is loaded beside them).

    Raises:
        as :func:`check_protocol`.
    """

    def __init__(self, settings: ProtocolSettings, device: str | None = None, evaluated_bytes: int = 0) -> None:
        check_protocol(
            settings.data, settings.allow_code_execution, settings.safety, settings.judge, device, evaluated_bytes
        )
        self.settings = settings
        self._harness_set_up: Any = None
        self._definitions: tempfile.TemporaryDirectory[str] | None = None

    def configure(self, limit: int | None, batch_size: int) -> None:
        """Set the examples per task (None: all) and the harness's batch size of the run's evaluations."""
        self.settings = replace(self.settings, limit=limit, batch_size=batch_size)

    def run(self, model: Any, tokenizer: Any, domains: Sequence[str] = DOMAIN_NAMES) -> dict[str, Any]:
        """The protocol's results of ``model`` on ``domains``.

        Args:
            model: A ``*ForCausalLM`` in eval mode, on its device.
            tokenizer: The base's tokenizer.
            domains: Some of :data:`~.protocol.DOMAIN_NAMES` (an expert: its own).

        Returns:
            ``{"protocol", "tasks": {task: {metric: value}}, "domains": {domain: score}, "average", "safety"}``:
            ``average`` the plain mean of the domains' scores when all five are measured, else None.

        Raises:
            FeatcalError: when the harness fails (a dataset it cannot read).
        """
        judged = self.settings.safety == JUDGED and SAFETY in domains
        tasks = [t for name in domains for t in _harness_domain_tasks(name, self.settings.safety)]
        results: dict[str, dict[str, float]] = {}
        if tasks:
            results.update(self._harness(model, tokenizer, tasks))
        for name in domains:
            for code in domain(name).code:
                rows = self._code_rows(code)
                results[code.name] = run_code_task(
                    model, tokenizer, code, rows, allow_code_execution=self.settings.allow_code_execution
                )
        if judged:
            results.update(self._judged_safety(model, tokenizer))
        scores = domain_scores(results, domains)
        report: dict[str, Any] = {"protocol": PROTOCOL, "tasks": results}
        if judged:
            scores[SAFETY] = safety_score(results)
            report["judge"] = judge_card(self.settings.judge)
        report |= {"domains": scores, "average": raw_average(scores)}
        report["safety"] = JUDGED_VARIANT if self.settings.safety == JUDGED else SAFETY_VARIANT
        return report

    def _judged_safety(self, model: Any, tokenizer: Any) -> dict[str, dict[str, Any]]:
        """MergeBench's judged safety of ``model``: its answers, then WildGuard's verdicts (loaded for them alone)."""
        from featcal.families.causal_lm.mergebench_eval.judged_safety import read_rows as safety_rows
        from featcal.families.causal_lm.mergebench_eval.wildguard import WildGuard

        data = None if self.settings.data is None else Path(self.settings.data)
        rows = {b.name: safety_rows(b, data, self.settings.limit) for b in BENCHMARKS}

        def respond(prompts: Any) -> list[str]:
            return safety_answers(model, tokenizer, prompts, self.settings.batch_size)

        holder: dict[str, Any] = {}

        def judge(pairs: Any) -> list[str]:  # loaded once every answer is generated
            holder["judge"] = WildGuard(self.settings.judge, next(model.parameters()).device)
            return holder["judge"](pairs)

        try:
            return run_judged_safety(respond, judge, rows)
        finally:
            if "judge" in holder:
                holder["judge"].close()

    def _harness(self, model: Any, tokenizer: Any, tasks: Sequence[Any]) -> dict[str, dict[str, float]]:
        """The harness's results of ``tasks``; the harness (and the local definitions) are set up once."""
        from featcal.families.causal_lm.harness import Harness

        if self._harness_set_up is None:  # the definitions are kept while this object lives: read at each run
            self._definitions = tempfile.TemporaryDirectory(prefix="featcal-mergebench-tasks-")
            every = [t for name in DOMAIN_NAMES for t in domain(name).harness]
            data = None if self.settings.data is None else Path(self.settings.data)
            write_definitions(every, Path(self._definitions.name), data)
            self._harness_set_up = Harness(harness_task_names(), self._definitions.name)
        harness = self._harness_set_up
        harness.limit, harness.batch_size = self.settings.limit, self.settings.batch_size
        return harness.run(model, tokenizer, [t.name for t in tasks])

    def _code_rows(self, code: Any) -> list[dict[str, Any]]:
        if self.settings.data is None:
            return hub_rows(code, self.settings.limit)
        return read_rows(code_source(code).files(Path(self.settings.data))[code.split], self.settings.limit)
