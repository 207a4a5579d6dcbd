"""The model card of a run's release: Hub metadata (``ModelCardData`` with a ``model-index``) and the family's
Jinja template (:func:`~featcal.release.card_template.render_template_card`), with its results plot.

A run whose family releases it as its stage folder (:attr:`~featcal.families.base.ReleaseParts.run_as_model_folder`:
a language model's) has the card variables of that folder (:func:`featcal.release.folder_card.folder_context`);
any other run those of :func:`run_context`. Either way the family's results section
(:meth:`~featcal.families.base.ModelFamily.card_context`) is added to them, and the extra sections of
:data:`CARD_SECTIONS` are appended to the card. Everything in the card comes from the run folder's own files.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from featcal.errors import ReleaseError
from featcal.families import get_family
from featcal.files.atomic import atomic_write_text
from featcal.hub.refs import check_repo_id, is_hub_id, split_revision
from featcal.metrics import CALIBRATION_EXAMPLES_USED, task_score
from featcal.release.card_template import (
    CARD_FILE,
    TAGS,
    card_metadata,
    featcal_rows,
    hub_ids,
    method_info,
    render_template_card,
)
from featcal.release.folder_card import folder_context
from featcal.release.manifest import MANIFEST, read_manifest, update_manifest
from featcal.release.model_folder import read_model_folder
from featcal.release.options import NO_LICENSE
from featcal.release.plot import PLOT_FILE, save_results_plot
from featcal.release.published import local_name, published_config, published_ref
from featcal.release.results import results_rows
from featcal.runfolder.layout import DIAGNOSTICS_PLOT, merged_stage_name
from featcal.runfolder.reader import RunFolder
from featcal.runfolder.record import PROCESSES
from featcal.runfolder.timings import timing_label
from featcal.sweep.report import SWEEP_DIR, SWEEP_PLOT, read_sweep
from featcal.tasks import Task
from featcal.version import __version__

# The model-index metric of a task whose metrics.json entry names its metric (a seq2seq task).
METRIC_TYPES = {"exact_match": "exact_match", "spearman": "spearmanr"}


# Extra sections of a run's card, in order: each takes the run and gives the Markdown appended to its card (a
# heading and its body), or None when it has nothing to say of the run. Append a renderer to add a section.
def _repair_comparison(run: RunFolder) -> str | None:
    """The repairs compared on the run's merge (``featcal run --repair``), imported when a card is rendered."""
    from featcal.repairs.compare_table import comparison_section

    return comparison_section(run)


CARD_SECTIONS: list[Callable[[RunFolder], str | None]] = [_repair_comparison]


def default_model_name(run: RunFolder) -> str:
    """A repository name for the release, e.g. ``clip-vit-base-patch32-ta-featcal``."""
    base = Path(run.base_model.rstrip("/")).name
    suffix = "-featcal" if run.calibrated else ""
    return f"{base}-{merged_stage_name(run.method)}{suffix}"


def _released_score(folder: Path, metrics: Mapping[str, Any], task: str) -> float:
    """The released stage's score on ``task`` (:func:`~featcal.metrics.task_score`).

    Raises:
        ReleaseError: when its metrics hold none for the task.
    """
    score = task_score(metrics.get(task))
    if score is None:
        raise ReleaseError(folder, f"{folder / 'metrics.json'} holds no score of task {task!r}: evaluate it again.")
    return score


def card_data(run: RunFolder, *, model_name: str, license: str) -> ModelCardData:
    """The card's YAML metadata: Hub relations, tags, datasets and one accuracy per task."""
    parts = get_family(run.record.family).release
    method, _ = run.record.merge.described
    released = run.released
    base_models = hub_ids([run.base_model, *(run.experts.get(t.name) for t in run.tasks)])
    datasets = list(dict.fromkeys(t.dataset.path for t in run.tasks if is_hub_id(t.dataset.path)))
    results = [
        EvalResult(
            task_type=parts.task_type,
            task_name=parts.task_name,
            dataset_type=t.dataset.path if is_hub_id(t.dataset.path) else t.name,
            dataset_name=t.name,
            dataset_config=t.dataset.name,
            dataset_split=evaluated_split(t, run.max_eval_samples, run.record.evaluation.details.get("held_out")),
            metric_type=metric,
            metric_name=metric,
            metric_value=_released_score(released.path, released.metrics, t.name),
        )
        for t in run.tasks
        for metric in [METRIC_TYPES.get(released.metrics[t.name].get("metric"), "accuracy")]
    ]
    return card_metadata(
        parts,
        model_name=model_name,
        license=license,
        base_models=base_models,
        tags=[*TAGS, *parts.tags, *([method.replace("_", "-")] if method else [])],
        datasets=datasets,
        eval_results=results,
    )


def evaluated_split(task: Task, max_eval_samples: int | None, held_out: Mapping[str, Any] | None = None) -> str:
    """The split the accuracy was measured on, in ``datasets`` slicing notation when it was a prefix; for a task
    whose evaluated rows were held out of the calibration's (``held_out``: the run's recorded shuffle, naming
    such tasks), the split read and where the rows lie in that shuffle.

    Args:
        task: The task.
        max_eval_samples: The run's limit on the rows evaluated (None: all).
        held_out: The run's ``evaluation.held_out`` setting (seed, the calibration's rows, the tasks), if any.

    Returns:
        E.g. ``validation[:16]``, or ``train (positions 8+ of the seed-42 shuffle)``.
    """
    if held_out and task.name in held_out.get("tasks", ()):
        first = int(held_out["after"])
        last = f"-{first + max_eval_samples - 1}" if max_eval_samples else "+"
        return f"{task.dataset.evaluated_split()} (positions {first}{last} of the seed-{held_out['seed']} shuffle)"
    split = task.dataset.test_split
    return f"{split}[:{max_eval_samples}]" if max_eval_samples else split


def _diagnostics(run: RunFolder, plot: str | None) -> dict[str, Any] | None:
    """The feature-drift summary line (and plot) of the run's ``diagnostics.json``, when it has one of this recipe."""
    from featcal.diagnostics.report import read_report

    report = read_report(run.path, run.recipe_sha256)
    return None if report is None else {"summary": report.summary(), "plot": plot}


def _sweep(run: RunFolder, plot: str | None) -> dict[str, Any] | None:
    """The table (and plot) of the run's ``featcal sweep``, when it has one of this recipe."""
    sweep = read_sweep(run.path, run.recipe_sha256)
    if sweep is None:
        return None
    return {
        "columns": [sweep.label(p) for p in sweep.points],
        "rows": [{"task": task, "values": values} for task, values in sweep.rows()],
        "plot": plot,
    }


def _merge_data(calibration: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """What the card says of the calibration draw a data-using merge (RegMean) read.

    Args:
        calibration: The run's record of that draw (:attr:`MergeRecord.calibration
            <featcal.runfolder.record.MergeRecord.calibration>`), or None for a data-free merge.

    Returns:
        None for a data-free merge, else ``num_calibration_examples``, ``calibration_batch_size``, ``seed``
        and ``calibration_examples_used`` (the examples of each task that had fewer; empty when none did).
    """
    if not calibration:
        return None
    return {
        "num_calibration_examples": calibration.get("num_calibration_examples"),
        "calibration_batch_size": calibration.get("calibration_batch_size"),
        "seed": calibration.get("seed"),
        "calibration_examples_used": dict(calibration.get(CALIBRATION_EXAMPLES_USED) or {}),
    }


def run_context(
    run: RunFolder,
    *,
    repo_id: str | None,
    license: str | None,
    plot: str | None,
    drift_plot: str | None = None,
    sweep_plot: str | None = None,
) -> dict[str, Any]:
    """The template's variables of a run released as its own (not as its stage folder), the family's results
    section included. References to inputs are given as published (see :mod:`featcal.release.published`): Hub ids
    as they are, local folders as ``local:<folder name>``, so that no template, featcal's or a user's, can put a
    local path in the card. Without ``license``, the family's default license (None: ``other``, and
    ``license_given`` is False).

    Args:
        run: The run folder.
        repo_id: The Hub repository the card names, when known.
        license: The license in the metadata.
        plot: The results plot the card shows (None: none).
        drift_plot: The feature-drift plot it shows (None: none).
        sweep_plot: The sweep's plot it shows (None: none).

    Returns:
        The variables by name.
    """
    method, params = run.record.merge.described
    pretty_name, url = method_info(method) if method else ("an existing merge", None)
    rows = results_rows(run)
    model_name = repo_id or default_model_name(run)
    featcal = run.record.featcal.to_json() if run.record.featcal else None
    family = get_family(run.record.family)
    noun = family.noun  # the FeatCal rows speak of the family's examples (CLIP's: images)
    stated = license if license is not None else family.release.default_license
    return {
        "card_data": card_data(run, model_name=model_name, license=stated or NO_LICENSE).to_yaml(),
        "license_given": stated is not None,
        "title": model_name.split("/")[-1],
        "repo_id": repo_id or f"<namespace>/{model_name}",
        "repo_id_known": repo_id is not None,
        "base_model": published_ref(run.base_model),
        "base_commit": run.record.commit_of("models", run.base_model),
        "base_id": split_revision(run.base_model)[0] if is_hub_id(run.base_model) else local_name(run.base_model),
        "base_is_hub": is_hub_id(run.base_model),
        "featcal_version": __version__,
        "recipe_sha256": run.recipe_sha256,
        "local_inputs": published_config(run.raw_config) != dict(run.raw_config),
        "released_stage": run.released.name,
        "seed": run.record.seed,
        "calibrated": run.calibrated is not None,
        "method": {
            "name": method,
            "pretty_name": pretty_name,
            "url": url,
            "params": dict(params),
            "source": published_ref(run.record.merge.merged_from),
            "data": _merge_data(run.record.merge.calibration),
        },
        "featcal": featcal_rows(featcal, noun) if featcal else None,
        "tasks": [
            {
                "name": t.name,
                "dataset": published_ref(t.dataset.path),
                "dataset_commit": run.record.commit_of("datasets", t.name) or t.dataset.revision,
                "config": t.dataset.name,
                "test_split": evaluated_split(t, run.max_eval_samples, run.record.evaluation.details.get("held_out")),
                "expert": published_ref(run.experts.get(t.name)),
                "expert_commit": run.record.commit_of("models", run.experts.get(t.name)),
            }
            for t in run.tasks
        ],
        "rows": rows,
        "has_base": any(r.base is not None for r in rows),
        "has_merged": any(r.merged is not None for r in rows),
        "has_reference": any(r.reference_merged is not None or r.reference_calibrated is not None for r in rows),
        # where the reference numbers come from, when the task table says (else the FeatCal reference run)
        "reference_source": next((t.reference_source for t in run.tasks if t.reference_source), None),
        "plot": plot,
        "diagnostics": _diagnostics(run, drift_plot),
        "sweep": _sweep(run, sweep_plot),
        "timings": [(timing_label(k), float(v)) for k, v in run.timings.items() if isinstance(v, (int, float))],
        "max_eval_samples": run.max_eval_samples,
        "processes": run.raw_config.get(PROCESSES),
        "has_expert": any(r.expert is not None for r in rows),
        **family.card_context(run),
    }


def render_card(
    run: RunFolder,
    *,
    repo_id: str | None = None,
    license: str | None = None,
    template: str | Path | None = None,
    plot: str | None = PLOT_FILE,
    drift_plot: str | None = None,
    sweep_plot: str | None = None,
) -> ModelCard:
    """The model card of ``run``; ``plot`` is the image file the card shows (None for no image).

    ``license`` None gives the family's default (:attr:`~featcal.families.base.ReleaseParts.default_license`).
    When the run folder holds feature-drift diagnostics of this recipe (``featcal diagnose``), the
    card gives their one-line summary, and ``drift_plot`` names the image of them it shows; likewise
    for a sweep (``featcal sweep``): its table, and ``sweep_plot``. A run released as its stage folder has that
    folder's variables and the family's results section, and no image.

    Args:
        run: The run folder.
        repo_id: The Hub repository the card names (its usage snippet and ``model-index``).
        license: The license in the metadata.
        template: A Jinja model card template of your own (None: the family's run card template).
        plot: The results plot the card shows.
        drift_plot: The feature-drift plot the card shows.
        sweep_plot: The sweep's plot the card shows.

    Returns:
        The card.

    Raises:
        InvalidParameterError: for a ``repo_id`` that is not ``namespace/name``.
        ModelInputError: when the stage a run releases as its folder is not a model folder of featcal's.
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    if repo_id is not None:
        check_repo_id(repo_id, namespace=True)
    family = get_family(run.record.family)
    if family.release.run_as_model_folder:
        folder = read_model_folder(run.released.path)

        def context() -> Mapping[str, Any]:
            named = folder_context(folder, repo_id=repo_id, license=license, name=default_model_name(run))
            return {**named, **family.card_context(run)}

    else:

        def context() -> Mapping[str, Any]:
            return run_context(
                run, repo_id=repo_id, license=license, plot=plot, drift_plot=drift_plot, sweep_plot=sweep_plot
            )

    return render_template_card(template, family, context, sections=lambda: [s(run) for s in CARD_SECTIONS])


def check_same_run(out: Path, run: RunFolder) -> None:
    """Refuse to write a run's card into the release of another run.

    Args:
        out: The card's folder.
        run: The run.

    Raises:
        ReleaseError: when ``out`` has a manifest naming another recipe than the run's.
    """
    if (out / MANIFEST).is_file():
        recorded = read_manifest(out).recipe_sha256
        if recorded != run.recipe_sha256:
            raise ReleaseError(
                out,
                f"{out} holds the release of another run (recipe {recorded[:12]}) than {run.path} "
                f"(recipe {run.recipe_sha256[:12]}): write the card into another folder, or export this run there.",
            )


def write_card_files(
    run: RunFolder, out: Path, *, repo_id: str | None, license: str | None, template: str | Path | None
) -> Path:
    """Write ``README.md`` and its images (the results plot when matplotlib is there, and the run's feature-drift
    and sweep plots when the card shows them) into ``out``, created when missing; a run released as its stage
    folder gets the card alone.

    When ``out`` is a release folder (it has a manifest), the manifest must be of the same run, and its
    entries of the card and the plot are updated afterwards.

    Args:
        run: The run folder, read.
        out: The card's folder (a release folder, or one :func:`~featcal.release.card_template.check_card_folder`
            accepted).
        repo_id: The Hub repository the card names.
        license: The license in the card's metadata.
        template: A Jinja model card template of your own.

    Returns:
        The path of ``README.md``.

    Raises:
        ReleaseError: when ``out`` holds the release of another run.
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    check_same_run(out, run)
    if get_family(run.record.family).release.run_as_model_folder:  # no plot: the stage folder's card
        card = render_card(run, repo_id=repo_id, license=license, template=template)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / CARD_FILE, str(card))
        update_manifest(out, {CARD_FILE: True})
        return out / CARD_FILE
    out.mkdir(parents=True, exist_ok=True)
    method, _ = run.record.merge.described
    pretty_name = method_info(method)[0] if method else "merged"
    plot_path, plot_tmp = out / PLOT_FILE, out / f".{PLOT_FILE}.tmp"
    drift_path, drift_tmp = out / DIAGNOSTICS_PLOT, out / f".{DIAGNOSTICS_PLOT}.tmp"
    sweep_path, sweep_tmp = out / SWEEP_PLOT, out / f".{SWEEP_PLOT}.tmp"
    sweep_source = run.path / SWEEP_DIR / SWEEP_PLOT
    has_plot = save_results_plot(results_rows(run), plot_tmp, merged_label=pretty_name)
    try:
        has_drift_plot = (run.path / DIAGNOSTICS_PLOT).is_file()
        if has_drift_plot:
            shutil.copyfile(run.path / DIAGNOSTICS_PLOT, drift_tmp)
        has_sweep_plot = sweep_source.is_file()
        if has_sweep_plot:
            shutil.copyfile(sweep_source, sweep_tmp)
        card = render_card(
            run,
            repo_id=repo_id,
            license=license,
            template=template,
            plot=PLOT_FILE if has_plot else None,
            drift_plot=DIAGNOSTICS_PLOT if has_drift_plot else None,
            sweep_plot=SWEEP_PLOT if has_sweep_plot else None,
        )
        # shipped only when the card shows it (diagnostics of this recipe, a template that uses them)
        has_drift_plot = has_drift_plot and f"({DIAGNOSTICS_PLOT})" in str(card)
        has_sweep_plot = has_sweep_plot and f"({SWEEP_PLOT})" in str(card)  # a sweep of this recipe
    except BaseException:
        for tmp in (plot_tmp, drift_tmp, sweep_tmp):
            tmp.unlink(missing_ok=True)
        raise
    shipped = ((has_plot, plot_tmp, plot_path), (has_drift_plot, drift_tmp, drift_path),
               (has_sweep_plot, sweep_tmp, sweep_path))  # fmt: skip
    for shown, tmp, final in shipped:
        if shown:
            os.replace(tmp, final)
        else:
            tmp.unlink(missing_ok=True)
            final.unlink(missing_ok=True)
    path = out / CARD_FILE
    atomic_write_text(path, str(card))
    update_manifest(
        out, {CARD_FILE: True, PLOT_FILE: has_plot, DIAGNOSTICS_PLOT: has_drift_plot, SWEEP_PLOT: has_sweep_plot}
    )
    return path
