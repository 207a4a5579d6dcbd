"""The causal-LM family's run options: how its evaluation answers and which lm-evaluation-harness tasks run.

They are flags of ``featcal run`` (and of the commands that evaluate) and recipe keys like every run option,
listed with the evaluation's; the run spec carries them opaquely (:meth:`featcal.spec.RunSpec.options`) and
:mod:`featcal.families.causal_lm.settings` reads them. This module imports neither torch nor transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from featcal.errors import InvalidParameterError
from featcal.options import EVALUATION, option, validate

if TYPE_CHECKING:
    from featcal.spec import RunSpec


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
    eval_protocol: str = option(
        "held-out", help="language models: held-out (featcal's held-out rows of each task) or mergebench (also "
        "MergeBench's five domains through lm-evaluation-harness and, for coding, featcal's sandbox; a run of the "
        "mergebench suite; docs/causal-lm.md)", group=EVALUATION, choices=("held-out", "mergebench"),
    )  # fmt: skip
    benchmark_data: str | None = option(
        None, help="mergebench protocol: folder of local copies of the benchmarks' data "
        "(<dataset id>/<configuration or default>/<split>.jsonl) read instead of the Hub", group=EVALUATION,
        metavar="DIR",
    )  # fmt: skip
    allow_code_execution: bool = option(
        False, help="mergebench protocol: run the coding domain's model-generated programs in featcal's sandbox "
        "(docs/code-eval.md); the protocol is refused without it", group=EVALUATION,
    )  # fmt: skip
    mergebench_safety: str | None = option(
        None, help="mergebench protocol's safety domain: wildguard (the default; MergeBench's, the paper's: "
        "wildguardtest, harmbench, xstest, do_anything_now answered by the model and judged by WildGuard, a 7B "
        "model needing about 20 GB of GPU memory; refused on a CPU) or fusionbench (FusionBench's lm-eval variant: "
        "truthfulqa_mc2, toxigen, winogender; not comparable with the paper's; docs/causal-lm.md)", group=EVALUATION,
        choices=("wildguard", "fusionbench"),
    )  # fmt: skip
    safety_judge: str | None = option(
        None, help="mergebench protocol's judged safety (--mergebench-safety wildguard): the judge, a Hub id or a "
        "folder of WildGuard's weights (default: allenai/wildguard)", group=EVALUATION, metavar="ID_OR_DIR",
    )  # fmt: skip

    @property
    def safety(self) -> str:
        """The protocol's safety variant: ``mergebench_safety`` as given, else MergeBench's judged one."""
        return self.mergebench_safety or "wildguard"

    @property
    def judge(self) -> str:
        """The judged safety's judge: ``safety_judge`` as given, else WildGuard's Hub id."""
        return self.safety_judge or "allenai/wildguard"

    def __post_init__(self) -> None:
        validate(self)

    def check(self, run: RunSpec) -> None:
        """Refuse options that do not fit together (checked with the run's own, in :class:`~featcal.spec.RunSpec`).

        Args:
            run: The run whose options these are (its suite decides whether MergeBench's protocol applies).

        Raises:
            InvalidParameterError: for ``lm_eval_include`` without ``lm_eval_tasks``; for MergeBench's protocol on
                a run of another suite or without ``allow_code_execution``; for the protocol's options without it;
                for ``safety_judge`` without ``mergebench_safety wildguard``.
        """
        if self.lm_eval_include is not None and not self.lm_eval_tasks:
            raise InvalidParameterError(
                "lm_eval_include", self.lm_eval_include, "given with lm_eval_tasks, the tasks to run from it"
            )
        if self.eval_protocol == "mergebench":
            if run.suite != "mergebench":
                raise InvalidParameterError(
                    "eval_protocol", self.eval_protocol, "set on a run of the mergebench suite (suite mergebench), "
                    "whose five domains it evaluates, or held-out",
                )  # fmt: skip
            if self.allow_code_execution is not True:
                raise InvalidParameterError(
                    "allow_code_execution", self.allow_code_execution, "given with eval_protocol mergebench: its "
                    "coding domain runs model-generated programs, in featcal's sandbox (docs/code-eval.md)",
                )  # fmt: skip
            if self.safety_judge is not None and self.safety != "wildguard":
                raise InvalidParameterError(
                    "safety_judge", self.safety_judge, "given with mergebench_safety wildguard, whose judge it is"
                )
        else:
            for name in ("benchmark_data", "allow_code_execution"):
                if getattr(self, name):
                    raise InvalidParameterError(name, getattr(self, name), "given with eval_protocol mergebench")
            for name in ("mergebench_safety", "safety_judge"):
                if getattr(self, name) is not None:
                    raise InvalidParameterError(name, getattr(self, name), "given with eval_protocol mergebench")
