"""MergeBench's coding domain: programs sampled as bigcode-evaluation-harness samples them, run in featcal's
sandbox, scored by pass@1.

bigcode-evaluation-harness (``humanevalplus``, ``mbppplus``, as MergeBench's evaluate.sh runs them) prompts
with HumanEval+'s ``prompt`` stripped, or for MBPP+ with a docstring of the task and its first test
(``'\"\"\"\\n{prompt}\\n{test_list[0]}\\n\"\"\"\\n'``); draws 10 samples per problem at temperature 0.2, top-p
0.95 and no top-k, each at most 512 tokens long with its prompt; cuts each sample at the first of the
task's stop words (a sample stops being extended at its first, as bigcode's stopping criterion stops a
batch once each of its samples has one: the text kept is the same); and runs the prompt, the sample and the
task's tests (HumanEval+'s ``check`` called on the entry point). The programs run here in featcal's sandbox
(:mod:`featcal.sandbox`), never in this process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from featcal.errors import SandboxUnavailableError
from featcal.families.causal_lm.mergebench_eval.protocol import (
    CODE_MAX_LENGTH,
    CODE_SAMPLES,
    CODE_SEED,
    CODE_TEMPERATURE,
    CODE_TOP_P,
    CodeTask,
)
from featcal.sandbox.packages import check_extensions, package_folders
from featcal.sandbox.runner import SITE, Limits, require_opt_in, run_program
from featcal.sandbox.scoring import Problem, score_completions

# A folder holding the numpy the programs import (its ``numpy`` and, from a wheel, ``numpy.libs``), instead of
# the one this process imports: e.g. one built for the sandbox's Python when this process runs another version.
SANDBOX_SITE = "FEATCAL_SANDBOX_SITE"
# The lines run before each program: numpy's folders, shown read-only at SITE, on its module path; OpenBLAS on one
# thread (its buffers stay within the program's memory limit).
PRELUDE = f'import os, sys\nos.environ.setdefault("OPENBLAS_NUM_THREADS", "1")\nsys.path.append({SITE!r})\n'


def numpy_folders() -> list[str]:
    """The folders of the numpy the programs import: the one in :data:`SANDBOX_SITE`'s folder when set, else the
    one this process imports (wherever it lies: the sandbox shows these folders alone, read-only).

    Returns:
        numpy's package folder and the folders its wheel installed beside it (``numpy.libs``).

    Raises:
        SandboxUnavailableError: when there is no numpy there, or the sandbox's Python cannot load its
            compiled extensions (built for another Python version).
    """
    site = os.environ.get(SANDBOX_SITE)
    try:
        folders = package_folders("numpy", [site] if site else None)
        check_extensions(folders[0])
    except SandboxUnavailableError as exc:
        named = f"{SANDBOX_SITE}={site}" if site else f"{SANDBOX_SITE} unset: this Python's numpy"
        raise SandboxUnavailableError(
            f"{exc.message.rstrip('.')} ({named}; MergeBench's coding tests import numpy; docs/code-eval.md)."
        ) from exc
    return folders


def numpy_check(limits: Limits, folders: Sequence[str]) -> None:
    """Check, with one program in the sandbox, that numpy imports and computes there with :data:`PRELUDE`.

    HumanEval+'s and MBPP+'s tests begin with ``import numpy as np``; the sandbox's Python sees the standard
    library alone (``-I -S``) and the folders shared with it.

    Args:
        limits: The programs' limits.
        folders: numpy's folders (:func:`numpy_folders`).

    Raises:
        SandboxUnavailableError: when numpy does not import in the sandbox (a library its extensions load lies
            in a folder the sandbox hides), with the sandbox's reason: every program would fail.
    """
    check = "import numpy\nassert int(numpy.arange(4).sum()) == 6\n"
    outcome = run_program(PRELUDE + check, limits, allow_code_execution=True, shared=folders)
    if not outcome.passed:
        raise SandboxUnavailableError(
            f"MergeBench's coding tests import numpy, which does not import in featcal's sandbox from "
            f"{', '.join(folders)} ({outcome.reason}): name a folder holding a numpy that imports there "
            f"in {SANDBOX_SITE} (docs/code-eval.md)."
        )


def sandbox_numpy(limits: Limits | None = None) -> list[str]:
    """numpy's folders for the programs, once checked (:func:`numpy_folders`, then :func:`numpy_check`).

    Args:
        limits: The checking program's limits (default :class:`~featcal.sandbox.runner.Limits`).

    Returns:
        The folders to share with each program.

    Raises:
        SandboxUnavailableError: as :func:`numpy_folders` and :func:`numpy_check`, or when the sandbox cannot be
            set up here.
    """
    folders = numpy_folders()
    numpy_check(limits or Limits(), folders)
    return folders


def problem(task: CodeTask, row: Mapping[str, Any]) -> Problem:
    """One benchmark row as the problem bigcode-evaluation-harness builds of it.

    Args:
        task: ``humanevalplus`` or ``mbppplus``.
        row: The dataset's row (HumanEval+: task_id, prompt, test, entry_point; MBPP+: task_id, prompt,
            test_list, test).

    Returns:
        The problem: its prompt, and the test code run after a sample.
    """
    if task.name == "mbppplus":
        prompt = f'"""\n{row["prompt"]}\n{row["test_list"][0]}\n"""\n'
        return Problem(f"{task.name}/{row['task_id']}", prompt, "\n" + row["test"])
    return Problem(str(row["task_id"]), str(row["prompt"]).strip(), str(row["test"]), str(row["entry_point"]))


def read_rows(path: Path, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` rows (all: None) of a JSON-lines copy of a benchmark's split."""
    rows = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line.strip():
                rows.append(json.loads(line))
            if limit is not None and len(rows) == limit:
                break
    return rows


def hub_rows(task: CodeTask, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` rows of a benchmark's split, read with ``datasets`` from the Hub (or its cache)."""
    from datasets import load_dataset

    data = load_dataset(task.dataset, split=task.split)
    count = len(data) if limit is None else min(limit, len(data))
    return [dict(data[i]) for i in range(count)]


def stop_at_stop_word(text: str, stop: Sequence[str]) -> str:
    """``text`` up to the first stop word it holds (bigcode's ``_stop_at_stop_token``)."""
    cut = min((i for i in (text.find(word) for word in stop) if i != -1), default=len(text))
    return text[:cut]


class _StopWords:
    """A stopping criterion: a sample is done once its text after the prompt holds a stop word."""

    def __init__(self, start: int, stop: Sequence[str], tokenizer: Any) -> None:
        self.start, self.stop, self.tokenizer = start, tuple(stop), tokenizer

    def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
        import torch

        texts = self.tokenizer.batch_decode(input_ids[:, self.start :], skip_special_tokens=True)
        return torch.tensor([any(w in t for w in self.stop) for t in texts], device=input_ids.device)


def sample_completions(model: Any, tokenizer: Any, prompts: Sequence[str], stop: Sequence[str]) -> list[list[str]]:
    """:data:`CODE_SAMPLES` sampled completions of each prompt, cut at the stop words.

    Args:
        model: A ``*ForCausalLM`` in eval mode.
        tokenizer: The base's tokenizer.
        prompts: The problems' prompts.
        stop: The task's stop words.

    Returns:
        Per prompt, its samples (the text after the prompt).
    """
    import torch
    from transformers import GenerationConfig, StoppingCriteriaList

    device = next(model.parameters()).device
    config = GenerationConfig(
        do_sample=True, temperature=CODE_TEMPERATURE, top_p=CODE_TOP_P, top_k=0, max_length=CODE_MAX_LENGTH,
        num_return_sequences=CODE_SAMPLES, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(CODE_SEED)
    out = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"].to(device)
        with torch.no_grad():
            criteria = StoppingCriteriaList([_StopWords(ids.shape[1], stop, tokenizer)])
            generated = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config, stopping_criteria=criteria
            )
        texts = tokenizer.batch_decode(generated[:, ids.shape[1] :], skip_special_tokens=True)
        out.append([stop_at_stop_word(text, stop) for text in texts])
    return out


def run_code_task(
    model: Any, tokenizer: Any, task: CodeTask, rows: Sequence[Mapping[str, Any]], *, allow_code_execution: bool
) -> dict[str, float]:
    """pass@1 of ``model`` on a coding benchmark's rows, its programs run in the sandbox.

    Args:
        model: A ``*ForCausalLM`` in eval mode.
        tokenizer: The base's tokenizer.
        task: The benchmark.
        rows: Its rows.
        allow_code_execution: The user's opt-in to running generated code.

    Returns:
        ``{"pass@1": ..., "problems": ..., "samples": ...}``.

    Raises:
        CodeExecutionNotAllowedError: without the opt-in; nothing ran.
        SandboxUnavailableError: when the sandbox cannot import numpy, which the benchmarks' tests import
            (:func:`sandbox_numpy`); checked before any sample is drawn.
    """
    require_opt_in(allow_code_execution)
    limits = Limits(wall_s=task.timeout_s, cpu_s=max(1, int(task.timeout_s)))
    folders = sandbox_numpy(limits)
    problems = [problem(task, row) for row in rows]
    samples = sample_completions(model, tokenizer, [p.prompt for p in problems], task.stop)
    completions = {p.task_id: s for p, s in zip(problems, samples)}
    programs = [replace(p, prompt=PRELUDE + p.prompt) for p in problems]  # the model saw the prompt alone
    score = score_completions(
        programs, completions, ks=(1,), limits=limits, allow_code_execution=allow_code_execution, progress=False,
        shared=folders,
    )  # fmt: skip
    return {"pass@1": score.pass_at_k["pass@1"], "problems": float(len(problems)), "samples": float(CODE_SAMPLES)}
