"""What a language model's evaluation depends on besides its test rows: the held-out rows' shuffle, the
length of a greedy answer, and the lm-evaluation-harness tasks.

A text task's dataset may have one split (MergeBench's ``_val`` sets have ``train`` alone), so its
evaluation rows are held out of the calibration split: the rows after the calibration's in the same
shuffle (:func:`featcal.data.held_out_indices`), never read by a calibration of the run's number of
examples or fewer. These settings are recorded in ``run_config.json`` (``evaluation``) and are part of
every evaluation's identity. This module imports neither torch nor transformers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import InvalidParameterError
from featcal.families.causal_lm.options import LMEvaluationOptions

if TYPE_CHECKING:
    from featcal.spec import RunSpec

# ``--lm-eval-tasks mergebench``: MergeBench's lm-evaluation-harness tasks (the suite's resource lists them).
MERGEBENCH_ALIAS = "mergebench"


@dataclass(frozen=True)
class LMEvaluationSettings:
    """How a run evaluates language models.

    Attributes:
        seed: The seed of the shuffle of each task's split (the calibration's).
        held_out_after: The held-out rows are those after this many in the shuffle: the calibration's
            number of examples.
        max_new_tokens: The length of a greedy response whose answer is compared (exact match).
        lm_eval_tasks: lm-evaluation-harness tasks run on the zero-shot base, the merged and the calibrated
            models (none: the harness is not run).
        lm_eval_by_task: Those each task's expert is run on (its benchmark's, as the suite maps them).
        lm_eval_include: A folder of task definitions the harness reads beside its own.
        protocol: MergeBench's five-domain evaluation, when asked for (``--eval-protocol mergebench``): its
            ``benchmark_data`` folder (None: the Hub's datasets), ``allow_code_execution`` and, for MergeBench's
            judged safety, ``safety`` (``wildguard``) and ``judge``
            (:mod:`featcal.families.causal_lm.mergebench_eval`); None: the held-out evaluation alone.
    """

    seed: int
    held_out_after: int
    max_new_tokens: int
    lm_eval_tasks: tuple[str, ...] = ()
    lm_eval_by_task: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    lm_eval_include: str | None = None
    protocol: Mapping[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        """The settings as ``run_config.json`` records them (the harness's only when it runs)."""
        data: dict[str, Any] = {
            "held_out": {"seed": self.seed, "after": self.held_out_after},
            "max_new_tokens": self.max_new_tokens,
        }
        if self.lm_eval_tasks:
            data["lm_eval"] = {
                "tasks": list(self.lm_eval_tasks),
                "by_task": {task: list(names) for task, names in self.lm_eval_by_task.items()},
                "include": self.lm_eval_include,
            }
        if self.protocol is not None:
            data["protocol"] = dict(self.protocol)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LMEvaluationSettings:
        """The settings :meth:`to_json` wrote."""
        held_out = data["held_out"]
        harness = data.get("lm_eval") or {}
        return cls(
            seed=int(held_out["seed"]),
            held_out_after=int(held_out["after"]),
            max_new_tokens=int(data["max_new_tokens"]),
            lm_eval_tasks=tuple(harness.get("tasks", ())),
            lm_eval_by_task={task: tuple(names) for task, names in (harness.get("by_task") or {}).items()},
            lm_eval_include=harness.get("include"),
            protocol=data.get("protocol"),
        )


def harness_tasks(requested: Sequence[str], suite_map: Mapping[str, Sequence[str]]) -> tuple[str, ...]:
    """The harness tasks asked for, ``mergebench`` replaced by MergeBench's list, each once, in order.

    Args:
        requested: ``--lm-eval-tasks`` as given.
        suite_map: MergeBench's harness tasks by task (:func:`featcal.suites.suite_lm_eval`).

    Returns:
        The task names.
    """
    names: list[str] = []
    for name in requested:
        if name == MERGEBENCH_ALIAS:
            names.extend(task for tasks in suite_map.values() for task in tasks)
        else:
            names.append(name)
    return tuple(dict.fromkeys(names))


def evaluation_settings(spec: RunSpec) -> LMEvaluationSettings:
    """A run spec's language-model evaluation settings.

    Args:
        spec: The run's options.

    Returns:
        The settings: the held-out rows follow the ``num_calibration_examples`` calibration rows of the
        ``seed`` shuffle (also when the run does not calibrate, so every run on the same data holds the same
        rows out); the harness's tasks with MergeBench's mapping of tasks to them.

    Raises:
        InvalidParameterError: for an ``lm_eval_include`` that is not a folder.
        DatasetInputError: for a ``benchmark_data`` folder that lacks a file MergeBench's protocol reads.
    """
    from featcal.families.causal_lm.mergebench_eval.settings import protocol_settings
    from featcal.suites import suite_lm_eval

    options = spec.options(LMEvaluationOptions)
    suite_map, _ = suite_lm_eval(MERGEBENCH_ALIAS)
    tasks = harness_tasks(options.lm_eval_tasks or (), suite_map)
    include = None
    if options.lm_eval_include is not None:
        folder = Path(options.lm_eval_include).expanduser()
        if not folder.is_dir():
            raise InvalidParameterError("lm_eval_include", options.lm_eval_include, "a folder of task definitions")
        include = str(folder.resolve())
    by_task = {task: tuple(n for n in names if n in tasks) for task, names in suite_map.items()}
    return LMEvaluationSettings(
        seed=spec.seed,
        held_out_after=spec.featcal.num_calibration_examples,
        max_new_tokens=options.eval_max_new_tokens,
        lm_eval_tasks=tasks,
        lm_eval_by_task={task: names for task, names in by_task.items() if names} if tasks else {},
        lm_eval_include=include,
        protocol=protocol_settings(spec),
    )
