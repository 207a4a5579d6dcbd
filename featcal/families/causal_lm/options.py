"""The causal-LM family's run options: how its evaluation answers and which lm-evaluation-harness tasks run.

They are flags of ``featcal run`` (and of the commands that evaluate) and recipe keys like every run option,
listed with the evaluation's; the run spec carries them opaquely (:meth:`featcal.spec.RunSpec.options`) and
:mod:`featcal.families.causal_lm.settings` reads them. This module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass

from featcal.errors import InvalidParameterError
from featcal.options import EVALUATION, option, validate


@dataclass(frozen=True)
class LMEvaluationOptions:
    """A run's options of language-model evaluation.

    Raises:
        InvalidParameterError: when a value has the wrong type or lies outside its range.
    """

    eval_max_new_tokens: int = option(
        512, help="language tasks with one answer: tokens a greedy response may have (its answer is compared "
        "with the reference's: exact match)", group=EVALUATION, metavar="T", ge=1,
    )  # fmt: skip
    lm_eval_tasks: list[str] | None = option(
        None, help="language models: also run these lm-evaluation-harness tasks on every evaluated model "
        "(`mergebench`: MergeBench's; needs the lm-eval extra)", group=EVALUATION, metavar="TASK", nargs="+",
    )  # fmt: skip
    lm_eval_include: str | None = option(
        None, help="folder of lm-evaluation-harness task definitions (YAML) beside the harness's own",
        group=EVALUATION, metavar="DIR",
    )  # fmt: skip

    def __post_init__(self) -> None:
        validate(self)

    def check(self) -> None:
        """Refuse options that do not fit together (checked with the run's own, in :class:`~featcal.spec.RunSpec`).

        Raises:
            InvalidParameterError: for ``lm_eval_include`` without ``lm_eval_tasks``.
        """
        if self.lm_eval_include is not None and not self.lm_eval_tasks:
            raise InvalidParameterError(
                "lm_eval_include", self.lm_eval_include, "given with lm_eval_tasks, the tasks to run from it"
            )
