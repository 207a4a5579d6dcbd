"""The model card of a language-model run's release: the model card of its released stage folder (its
recipe: merge, FeatCal, calibration data), with the run's measured results and the reference numbers
quoted for its suite, labelled as such.

The template is the ``causal_lm`` family's ``run_card.md.j2``; pass ``template=`` to use your own. Its
variables are the model card's (:func:`featcal.release.model_card.model_context`) and those of
:func:`run_context`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import jinja2
import yaml
from huggingface_hub import ModelCard

from featcal.errors import FeatcalError
from featcal.families import task_schema
from featcal.release.card import _environment, default_model_name
from featcal.release.lm_results import STAGES, harness_results, task_results
from featcal.release.model_card import model_context
from featcal.release.model_folder import ModelFolder
from featcal.runfolder.reader import RunFolder

RUN_CARD_TEMPLATE = ("featcal.families.causal_lm", "run_card.md.j2")


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


def render_run_card(
    run: RunFolder, folder: ModelFolder, *, repo_id: str | None, license: str | None, template: str | Path | None
) -> ModelCard:
    """The model card of a language-model run's release.

    Args:
        run: The run folder.
        folder: Its released stage, read as a model folder.
        repo_id: The Hub repository the card names.
        license: The license in the metadata; None gives ``other`` and a line saying none was given.
        template: A Jinja model card template of your own.

    Returns:
        The card.

    Raises:
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    from featcal.families import get_family

    env, source = _environment(template, get_family(run.record.family))
    package, name = RUN_CARD_TEMPLATE
    if template is None:  # the run's card, not the model folder's
        source = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    shown = template or f"{package}/{name}"
    named = model_context(folder, repo_id=repo_id, license=license, name=default_model_name(run))
    context = {**named, **run_context(run)}
    try:
        text = env.from_string(source).render(**context)
    except jinja2.TemplateError as exc:
        raise FeatcalError(f"Model card template {shown} failed to render: {exc}") from None
    try:
        card = ModelCard(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise FeatcalError(f"Model card template {shown} gives invalid metadata: {exc}") from None
    from featcal.repairs.compare_table import with_comparison

    return with_comparison(card, run.path)  # the repairs compared on the run's merge (featcal run --repair)
