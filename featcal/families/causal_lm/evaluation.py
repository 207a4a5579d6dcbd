"""A language model's evaluation, built in and offline: held-out response loss and exact match per task.

Each task is evaluated on rows of its calibration split held out of the calibration: the rows after the
calibration's in the same shuffle (:class:`~featcal.families.causal_lm.settings.LMEvaluationSettings`),
the first ``max_eval_samples`` of them when that is set. For each row the text is rendered as the
calibration renders it (prompt, then response) and cut at the task's ``max_length`` tokens, and:

- **loss**: the mean negative log-likelihood (nats per token) of the response's tokens given the
  text before them, over all the task's held-out response tokens (a token belongs to the response
  when it starts at or after the response's first character, as for ``weigh: response``); a task
  whose texts are one part (``text``) is scored on every token after the first;
- **exact match**, for a task whose responses have one answer (``answer`` in its text format): the model
  answers the prompt greedily (at most ``max_new_tokens`` tokens, until its end-of-text token), the answer
  is found in its response and in the reference response by the task's rule, and the two are compared
  after normalisation (:mod:`featcal.families.causal_lm.answers`); rows whose reference holds no answer
  are not counted.

Under torchrun each process evaluates its share of every task's rows and the sums (negative
log-likelihood, tokens, matches, answers counted) are added over the processes. With ``lm_eval`` tasks in
the settings, lm-evaluation-harness runs on each model too (:mod:`featcal.families.causal_lm.harness`),
in rank 0 alone; with MergeBench's protocol in them (``--eval-protocol mergebench``), its five domains run
on the base, merged and calibrated models and each expert's own domain on the expert, in rank 0 alone
(:mod:`featcal.families.causal_lm.mergebench_eval`), their results under ``mergebench``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from featcal.data import held_out_indices, held_out_record
from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError, ModelInputError
from featcal.families.causal_lm.adapter import ATTENTION_MASK, INPUT_IDS
from featcal.families.causal_lm.answers import extract_answer, normalize_answer
from featcal.families.causal_lm.folders import load_config, load_lm_folder, meta_model
from featcal.families.causal_lm.generation import greedy_responses
from featcal.families.causal_lm.mergebench_eval.protocol import DOMAIN_NAMES, MERGEBENCH
from featcal.families.causal_lm.settings import LMEvaluationSettings
from featcal.families.causal_lm.texts import base_tokenizer, encode_texts, load_text_split, render_text
from featcal.metrics import EXACT_MATCH, LM_EVAL, MetricsReport, TaskMetrics, count_parameters
from featcal.progress import Progress
from featcal.tasks import Task
from featcal.threads import SMALL_MODEL_HIDDEN_SIZE

logger = logging.getLogger(__name__)

LOGIT_ROWS = 1024  # positions whose logits are computed at once: bounds memory at LOGIT_ROWS × vocabulary


# Texts per batch on the CPU for a model narrower than SMALL_MODEL_HIDDEN_SIZE (the demo's): on lm5, `featcal run
# --skip-featcal` (imports, the merge, its evaluation on 5 tasks × 512 held-out rows, greedy answers of at most 16
# tokens) took 21.6 s of CPU in batches of 4, 11.2 s in 16 and 8.6 s in 100, with the same exact match
# (docs/offline-benchmark.md).
SMALL_MODEL_TEXT_BATCH = 100


def default_text_batch_size(device: torch.device, hidden_size: int | None = None) -> int:
    """Texts per batch when none is asked for: 16 on an accelerator; on the CPU 4, or
    :data:`SMALL_MODEL_TEXT_BATCH` for a model narrower than :data:`~featcal.threads.SMALL_MODEL_HIDDEN_SIZE`
    (whose forwards are too small to keep a core busy in batches of 4).

    Args:
        device: Where the evaluation runs.
        hidden_size: The model's width, when known.

    Returns:
        The batch size.
    """
    if device.type != "cpu":
        return 16
    small = hidden_size is not None and hidden_size < SMALL_MODEL_HIDDEN_SIZE
    return SMALL_MODEL_TEXT_BATCH if small else 4


@dataclass(frozen=True)
class HeldOutRows:
    """One task's held-out rows: where they lie in the shuffle, and this process's share as texts.

    Attributes:
        texts: This process's rows as ``(prompt, response)``.
        total: The rows evaluated over all processes.
        record: Where they come from, as each task's result records it.
    """

    texts: tuple[tuple[str, str], ...]
    total: int
    record: Mapping[str, Any]


@dataclass(frozen=True)
class HeldOutTexts:
    """The run's held-out rows of every task, read once and shared by its evaluations."""

    tasks: Mapping[str, HeldOutRows]
    batch_size: int


def held_out_rows(
    task: Task, settings: LMEvaluationSettings, max_samples: int | None, world: World = SINGLE
) -> HeldOutRows:
    """A task's held-out rows (the first ``max_samples`` of them when set), this process's share as texts.

    Args:
        task: A text task.
        settings: The run's evaluation settings (the shuffle's seed, the calibration rows to skip).
        max_samples: Evaluate the first this many held-out rows (None: all).
        world: Under torchrun, the processes that share the rows.

    Returns:
        The rows: this process's texts, the number over all processes, and where they lie.

    Raises:
        DatasetInputError: when the split has no row after the calibration's, or fewer than the processes.
    """
    rows = load_text_split(task)
    indices = held_out_indices(len(rows), settings.held_out_after, settings.seed)
    if max_samples is not None:
        indices = indices[:max_samples]
    if len(indices) < world.size:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: its {task.dataset.train_split} split has {len(rows)} rows, leaving "
            f"{len(indices)} after the {settings.held_out_after} calibration rows to evaluate on (at least "
            f"{max(world.size, 1)} needed): lower num_calibration_examples.",
        )
    share = indices[world.part(len(indices))]
    record = held_out_record(task.dataset.calibration_split(), settings.seed, settings.held_out_after, len(indices))
    return HeldOutRows(tuple(render_text(task, rows[int(i)]) for i in share), len(indices), record)


def _logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The LM head's logits of some positions' final hidden states (Gemma-2's soft-capping included)."""
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def response_nll(
    model: nn.Module, tokenizer: Any, texts: Sequence[tuple[str, str]], task: Task, batch_size: int
) -> tuple[float, int]:
    """The summed negative log-likelihood of the responses' tokens, and their number.

    Args:
        model: A ``*ForCausalLM`` in eval mode on its device.
        tokenizer: The base's tokenizer (right padding).
        texts: ``(prompt, response)`` pairs.
        task: Their task (its ``max_length`` cuts the texts).
        batch_size: Texts per forward.

    Returns:
        The sum in nats and the number of response tokens.
    """
    assert task.text is not None
    # a text of one part (``text``) is scored whole: every token after the first
    fmt = dataclasses.replace(task.text, weigh="all" if task.text.text is not None else "response")
    device = next(model.parameters()).device
    total, tokens = 0.0, 0
    for start in range(0, len(texts), batch_size):
        batch = encode_texts(tokenizer, texts[start : start + batch_size], fmt).batch
        ids = batch.inputs[INPUT_IDS].to(device)
        mask = batch.context[ATTENTION_MASK].to(device)
        assert batch.token_weights is not None
        scored = batch.token_weights[:, 1:].to(device) > 0  # token t is predicted at position t - 1
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, :-1][scored]
        targets = ids[:, 1:][scored]
        for row in range(0, targets.numel(), LOGIT_ROWS):
            logits = _logits(model, hidden[row : row + LOGIT_ROWS])
            total += float(F.cross_entropy(logits, targets[row : row + LOGIT_ROWS], reduction="sum"))
        tokens += int(targets.numel())
    return total, tokens


def exact_matches(rule: str, responses: Sequence[str], references: Sequence[str]) -> tuple[int, int]:
    """How many responses give the reference's answer, and how many references hold one.

    Args:
        rule: The task's ``answer`` rule.
        responses: The model's responses.
        references: The reference responses, in the same order.

    Returns:
        ``(matches, counted)``.
    """
    matches = counted = 0
    for response, reference in zip(responses, references):
        expected = extract_answer(rule, reference)
        if expected is None:
            continue
        counted += 1
        found = extract_answer(rule, response)
        matches += found is not None and normalize_answer(found) == normalize_answer(expected)
    return matches, counted


class HeldOutEvaluator:
    """The causal-LM family's :class:`~featcal.families.base.Evaluator` (see the module docstring).

    Args:
        base_folder: The base model's folder (its tokenizer, and the zero-shot model).
        device: Where the evaluation runs.
        world: Under torchrun, the processes that share each task's rows.
        settings: The run's :class:`LMEvaluationSettings` as recorded (``to_json``).

    Raises:
        ModelInputError: when the base has no fast tokenizer.
        FeatcalError: when harness tasks are asked for and lm-eval is not installed, or does not know one.
    """

    def __init__(
        self, base_folder: str | Path, device: torch.device | str, *, world: World = SINGLE,
        settings: Mapping[str, Any],
    ) -> None:  # fmt: skip
        self.base_folder = Path(base_folder)
        self.device = torch.device(device)
        self.world = world
        self.settings = LMEvaluationSettings.from_json(settings)
        self.tokenizer = base_tokenizer(self.base_folder)
        self.hidden_size = getattr(load_config(self.base_folder), "hidden_size", None)
        self.harness = None
        if self.settings.lm_eval_tasks:
            from featcal.families.causal_lm.harness import Harness

            self.harness = Harness(self.settings.lm_eval_tasks, self.settings.lm_eval_include)
        self.protocol = None
        if self.settings.protocol is not None:
            from featcal.families.causal_lm.mergebench_eval.runner import MergeBenchEvaluation, ProtocolSettings

            record = self.settings.protocol
            judged = {key: record[key] for key in ("safety", "judge") if key in record}
            # each evaluated model is float32 (base_model, and the merged ones) and stays on the device while judged
            parameters = sum(p.numel() for p in meta_model(load_config(self.base_folder)).parameters())
            self.protocol = MergeBenchEvaluation(
                ProtocolSettings(record["benchmark_data"], record["allow_code_execution"], **judged), str(self.device),
                evaluated_bytes=torch.finfo(torch.float32).bits // 8 * parameters,
            )  # fmt: skip

    def base_model(self) -> nn.Module:
        """The base model, loaded from its folder (float32)."""
        return load_lm_folder(self.base_folder)

    def prepare(self, tasks: Sequence[Task]) -> None:
        """Nothing to keep of the base: every evaluation reads the texts and the tokenizer alone."""

    def test_data(
        self, tasks: Sequence[Task], *, batch_size: int | None, num_workers: int, max_samples: int | None
    ) -> HeldOutTexts:
        """Every task's held-out rows (the first ``max_samples`` when set), this process's share.

        Args:
            tasks: The run's tasks.
            batch_size: Texts per forward (None: :func:`default_text_batch_size`); also the harness's.
            num_workers: Unused: the texts are read once, in this process.
            max_samples: Rows per task (None: all held-out rows); also the harness's ``limit``.

        Returns:
            The rows of every task and the batch size.

        Raises:
            DatasetInputError: for a task with too few rows after its calibration rows.
        """
        if self.harness is not None:
            self.harness.limit = max_samples
            self.harness.batch_size = batch_size or default_text_batch_size(self.device, self.hidden_size)
        if self.protocol is not None:
            self.protocol.configure(max_samples, batch_size or default_text_batch_size(self.device, self.hidden_size))
        rows = {task.name: held_out_rows(task, self.settings, max_samples, self.world) for task in tasks}
        return HeldOutTexts(rows, batch_size or default_text_batch_size(self.device, self.hidden_size))

    def evaluate(self, model: nn.Module, tasks: Sequence[Task], *, data: HeldOutTexts, progress: bool) -> MetricsReport:
        """Held-out loss (and exact match) of ``model`` on each task, their average, the model's size, and the
        harness's results when it runs.

        Args:
            model: A ``*ForCausalLM``; moved to the evaluation's device.
            tasks: The tasks.
            data: :meth:`test_data`'s rows.
            progress: Show a progress bar.

        Returns:
            The report (the harness's results under ``lm_eval``, on rank 0).

        Raises:
            ModelInputError: when a task's loss is not finite.
            FeatcalError: when the harness fails.
        """
        model = model.to(self.device).eval()
        results = {}
        for task in Progress(tasks, desc="Evaluating tasks", unit="tasks", enabled=progress):
            results[task.name] = self._measure(model, task, data)
            logger.info("%s: held-out loss %.4f", task.name, results[task.name].loss)
        report = MetricsReport.from_results(results, model_info=count_parameters(model))
        if self.harness is not None and self.world.is_main:
            report = report.with_extra({LM_EVAL: self.harness.run(model, self.tokenizer)})
        if self.protocol is not None and self.world.is_main:
            report = report.with_extra({MERGEBENCH: self.protocol.run(model, self.tokenizer)})
        return report

    def evaluate_task(self, model: nn.Module, task: Task, *, data: HeldOutTexts, progress: bool) -> TaskMetrics:
        """Held-out loss (and exact match) of ``model`` (an expert) on its task, and the harness's results on
        the harness tasks of the task's benchmark.

        Args:
            model: The task's expert; moved to the evaluation's device.
            task: Its task.
            data: :meth:`test_data`'s rows.
            progress: Unused (one task).

        Returns:
            The task's result.

        Raises:
            ModelInputError: when the loss is not finite.
            FeatcalError: when the harness fails.
        """
        model = model.to(self.device).eval()
        result = self._measure(model, task, data)
        names = self.settings.lm_eval_by_task.get(task.name, ())
        if self.harness is not None and names and self.world.is_main:
            harness = {LM_EVAL: self.harness.run(model, self.tokenizer, names)}
            result = dataclasses.replace(result, extra={**result.extra, **harness})
        if self.protocol is not None and task.name in DOMAIN_NAMES and self.world.is_main:
            own = {MERGEBENCH: self.protocol.run(model, self.tokenizer, (task.name,))}
            result = dataclasses.replace(result, extra={**result.extra, **own})
        return result

    def _measure(self, model: nn.Module, task: Task, data: HeldOutTexts) -> TaskMetrics:
        """One task's sums on this process, added over the processes, as the task's result.

        Raises:
            ModelInputError: when the model's loss is not finite.
        """
        rows = data.tasks[task.name]
        nll, tokens = response_nll(model, self.tokenizer, rows.texts, task, data.batch_size)
        sums = torch.tensor([nll], dtype=torch.float64, device=self.device)
        counts = torch.tensor([tokens, 0, 0], dtype=torch.int64, device=self.device)
        rule = task.text.answer if task.text is not None else None
        if rule is not None:
            assert task.text is not None
            responses = greedy_responses(
                model, self.tokenizer, [prompt for prompt, _ in rows.texts], max_length=task.text.max_length,
                max_new_tokens=self.settings.max_new_tokens, batch_size=data.batch_size,
            )  # fmt: skip
            counts[1], counts[2] = exact_matches(rule, responses, [response for _, response in rows.texts])
        self.world.all_reduce_sum_([sums, counts], what=f"evaluation of {task.name}")
        nll, (tokens, matches, counted) = float(sums[0]), (int(c) for c in counts)
        if not math.isfinite(nll) or tokens == 0:
            what = "not finite (NaN or infinity)" if tokens else "measured on no response token"
            raise ModelInputError(
                None,
                f"Task {task.name!r}: the held-out loss is {what}; check the model's weights, and that the "
                "responses survive max_length.",
            )
        extra: dict[str, Any] = {"tokens": tokens, "held_out": dict(rows.record)}
        if rule is not None:
            extra |= {EXACT_MATCH: matches / counted if counted else None, "answers": counted}
        return TaskMetrics(None, nll / tokens, rows.total, extra)
