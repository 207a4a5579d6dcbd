"""The results section of a language-model run's card: what :func:`run_context` adds to the variables of its
released stage folder's card (:func:`featcal.release.folder_card.folder_context`): the run's measured results and
the reference numbers quoted for its suite, labelled as such. The family's run card template,
``run_card.md.j2``, shows them.
"""

from __future__ import annotations

from typing import Any

from featcal.families.causal_lm.run_results import STAGES, harness_results, task_results
from featcal.families.registry import task_schema
from featcal.runfolder.reader import RunFolder


def _measure(measure: Any) -> dict[str, Any] | None:
    return None if measure is None else {**{s: measure.values.get(s) for s in STAGES}, "closed": measure.closed}


SOLVE_PARAMS = ("lambda_ratio", "anchor_blend_rho", "teacher_interp_alpha", "covariance_eps")


def _featcal_source(run: RunFolder, suite: str | None) -> str | None:
    """What a language suite says of a run's FeatCal parameters when its solve's (λ, ρ, α, ε) are the defaults."""
    from featcal.calibration.params import FeatCalParams
    from featcal.suites import featcal_settings_source

    if suite is None or run.record.featcal is None:
        return None
    params, defaults = run.record.featcal.params.to_dict(), FeatCalParams().to_dict()
    if any(params[name] != defaults[name] for name in SOLVE_PARAMS):
        return None
    return featcal_settings_source(suite)


def run_context(run: RunFolder) -> dict[str, Any]:
    """The run's part of the card's variables: its results, harness results, what was not run, the held-out
    rows and the suite's reference numbers.

    Args:
        run: The run folder.

    Returns:
        ``results`` (per task and the average: ``loss`` and ``exact_match`` by stage with ``closed``, the share
        of the expert − merged gap closed; ``held_out``), ``stages`` (the stages measured), ``harness`` (rows of
        task, metric and values by stage), ``harness_tasks``, ``not_run`` (a language suite's benchmarks featcal
        does not run), ``evaluation`` (the recorded settings), ``reference`` (the suite's published averages on
        the run's backbone, with their source; None when there are none), ``featcal_source`` (where a language
        suite's FeatCal parameters come from when they are featcal's defaults; else None), ``run_id`` and
        ``released_stage``.
    """
    from featcal.suites import merged_reference, reference_source, suite_family, suite_lm_eval

    results = task_results(run)
    rows = [
        {"task": r.task, "loss": _measure(r.loss), "exact_match": _measure(r.exact_match), "held_out": r.held_out}
        for r in results
    ]
    stages = [s for s in STAGES if any(r.loss.values.get(s) is not None for r in results)]
    details = dict(run.record.evaluation.details)
    suite, backbone = run.record.suite, run.record.backbone
    text_suite = suite is not None and task_schema(suite_family(suite)) != "image"
    reference = None
    if text_suite and backbone is not None:
        averages = merged_reference(suite, backbone)
        method = run.record.merge.method
        merged, calibrated = (
            averages.get(method, {}).get("average"),
            averages.get(f"{method}_featcal", {}).get("average"),
        )
        if merged is not None or calibrated is not None:
            reference = {"merged": merged, "calibrated": calibrated, "source": reference_source(suite, backbone)}
    not_run = suite_lm_eval(suite)[1] if text_suite else {}
    return {
        "results": rows,
        "stages": stages,
        "harness": [{**row, "measure": _measure(row["measure"])} for row in harness_results(run)],
        "harness_tasks": list((details.get("lm_eval") or {}).get("tasks", [])),
        "not_run": [{"task": task, "what": what} for task, what in not_run.items()],
        "evaluation": details,
        "max_eval_samples": run.max_eval_samples,
        "reference": reference,
        "featcal_source": _featcal_source(run, suite) if text_suite else None,
        "run_id": run.recipe_sha256,
        "released_stage": run.released.name,
        "suite": suite if text_suite else None,
        "backbone": backbone if text_suite else None,
    }
