"""lm-evaluation-harness on a model in memory, through its Python API (the optional ``lm-eval`` extra).

``--lm-eval-tasks`` runs the harness's tasks on each evaluated model of a run: the model featcal holds is
wrapped in the harness's ``HFLM`` (``HFLM(pretrained=model, tokenizer=...)``) and passed to
``lm_eval.simple_evaluate``, so no model is written or read again. The task names are checked when the
harness is set up, before any work; a folder of task definitions (``--lm-eval-include``) is read beside
the harness's own, or alone when it defines every task asked for (the harness then indexes no task of
its own, which takes seconds). Results keep each task's metrics (``acc,none``, ``exact_match,strict-match``
...), their standard errors left out.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from featcal.errors import FeatcalError, InvalidParameterError

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `pip install 'featcal[lm-eval]'` (lm-eval and accelerate)"


def _import_harness() -> Any:
    """The ``lm_eval`` package, or a one-line error saying how to install it."""
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM  # noqa: F401  (needs accelerate)
    except ImportError as exc:
        raise FeatcalError(f"--lm-eval-tasks needs lm-evaluation-harness ({exc}): {INSTALL_HINT}.") from None
    return lm_eval


class Harness:
    """lm-evaluation-harness set up for a run's tasks.

    Args:
        tasks: The harness task names the run asks for.
        include: A folder of task definitions (YAML) to read beside the harness's own.
        limit: Examples per task (None: all).
        batch_size: The harness's batch size.

    Raises:
        FeatcalError: when lm-eval is not installed.
        InvalidParameterError: naming a task the harness does not know.
    """

    def __init__(
        self, tasks: Sequence[str], include: str | None = None, *, limit: int | None = None, batch_size: int = 1
    ) -> None:
        _import_harness()
        from lm_eval.tasks import TaskManager

        self.tasks = tuple(tasks)
        self.limit = limit
        self.batch_size = batch_size
        manager = TaskManager(include_path=include, include_defaults=False) if include else None
        if manager is None or any(name not in manager.all_tasks for name in self.tasks):
            manager = TaskManager(include_path=include)
        unknown = [name for name in self.tasks if name not in manager.all_tasks]
        if unknown:
            raise InvalidParameterError(
                "lm_eval_tasks", " ".join(unknown), "tasks lm-evaluation-harness knows (`lm_eval ls tasks`), or "
                "defined in --lm-eval-include",
            )  # fmt: skip
        self.manager = manager

    def run(self, model: Any, tokenizer: Any, tasks: Sequence[str] | None = None) -> dict[str, dict[str, float]]:
        """The harness's results of ``model`` on ``tasks`` (default: all the run's).

        Args:
            model: A ``*ForCausalLM`` in memory, on the device it is evaluated on.
            tokenizer: The base's tokenizer.
            tasks: Some of the run's harness tasks.

        Returns:
            Per task (and group) the harness reports, its metrics by name (``acc,none``), numbers only.

        Raises:
            FeatcalError: when the harness fails (a dataset it cannot download, a missing dependency of a
                task), with its message.
        """
        import lm_eval
        from lm_eval.models.huggingface import HFLM

        names = list(self.tasks if tasks is None else tasks)
        if not names:
            return {}
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=self.batch_size)
        try:
            output = lm_eval.simple_evaluate(
                model=lm, tasks=names, task_manager=self.manager, limit=self.limit, log_samples=False,
                bootstrap_iters=0, confirm_run_unsafe_code=False,
            )  # fmt: skip
        except Exception as exc:  # the harness raises many kinds (datasets, missing packages, task configs)
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FeatcalError(f"lm-evaluation-harness failed on {', '.join(names)}: {first}") from None
        return numeric_results(output["results"] if output else {})


def numeric_results(results: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """The harness's ``results`` with each task's metrics alone: numbers, standard errors left out.

    Args:
        results: ``simple_evaluate(...)["results"]``.

    Returns:
        Per task, its metrics by the harness's names (``metric,filter``).
    """
    return {
        task: {
            key: float(value)
            for key, value in metrics.items()
            if "," in key and "_stderr" not in key and isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        for task, metrics in results.items()
    }
