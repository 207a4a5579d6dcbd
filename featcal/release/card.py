"""The model card: Hub metadata (``ModelCardData`` with a ``model-index``) and a Jinja-rendered body.

The template is the model family's (CLIP's ships as ``featcal/families/clip_vision/model_card.md.j2``);
pass ``template=`` to use your own. Everything in the card comes from the run folder's own files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from featcal.calibration.params import FeatCalParams
from featcal.errors import FeatcalError, OutputPathError, ReleaseError
from featcal.families import get_family
from featcal.files.atomic import atomic_write_text
from featcal.files.reading import read_text_input
from featcal.hub.refs import check_repo_id, is_hub_id, split_revision
from featcal.metrics import CALIBRATION_EXAMPLES_USED, task_score
from featcal.options import option_fields, option_of
from featcal.release.manifest import MANIFEST, read_manifest, update_manifest
from featcal.release.options import NO_LICENSE
from featcal.release.plot import PLOT_FILE, save_results_plot
from featcal.release.published import LOCAL_MARK, is_published_local, local_name, published_config, published_ref
from featcal.release.results import ResultRow, results_rows
from featcal.runfolder.layout import DIAGNOSTICS_PLOT, RELEASE_DIR, merged_stage_name
from featcal.runfolder.lock import RunLock
from featcal.runfolder.reader import RunFolder, read_run
from featcal.runfolder.record import PROCESSES
from featcal.runfolder.timings import timing_label
from featcal.sweep.report import SWEEP_DIR, SWEEP_PLOT, read_sweep
from featcal.tasks import DATA_FILE_SUFFIXES, Task

if TYPE_CHECKING:
    from featcal.families.base import ModelFamily
from featcal.version import __version__

logger = logging.getLogger(__name__)

CARD_FILE = "README.md"
TAGS = ["merge", "featcal", "model-merging"]  # the family's follow, then the merging method's
# The recipe table's symbol and meaning of each FeatCal hyper-parameter, from the run spec.
FEATCAL_PARAMS = {f.name: (option_of(f).symbol, option_of(f).card) for f, _, _ in option_fields(FeatCalParams)}
# The model-index metric of a task whose metrics.json entry names its metric (a seq2seq task).
METRIC_TYPES = {"exact_match": "exact_match", "spearman": "spearmanr"}
# What run_config.json's FeatCal section records beside the parameters, when it applies.
FEATCAL_RECORDS = {
    "calibration_examples_used": ("", "train images of the tasks that had fewer than n; all of them were used"),
}


def default_model_name(run: RunFolder) -> str:
    """A repository name for the release, e.g. ``clip-vit-base-patch32-ta-featcal``."""
    base = Path(run.base_model.rstrip("/")).name
    suffix = "-featcal" if run.calibrated else ""
    return f"{base}-{merged_stage_name(run.method)}{suffix}"


def _method_info(method: str) -> tuple[str, str | None]:
    """Pretty name and reference URL from the merging registry (the bare name if not registered)."""
    from featcal.merging import get_method

    try:
        registered = get_method(method)
    except FeatcalError:
        return method, None
    return registered.pretty_name, registered.reference_url


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
    refs = [run.base_model, *(run.experts.get(t.name) for t in run.tasks)]
    base_models = list(dict.fromkeys(split_revision(r)[0] for r in refs if is_hub_id(r)))
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
    return ModelCardData(
        model_name=model_name,
        library_name="transformers",
        license=license,
        pipeline_tag=parts.pipeline_tag,
        base_model=base_models or None,
        base_model_relation="merge" if base_models else None,
        tags=[*TAGS, *parts.tags, *([method.replace("_", "-")] if method else [])],
        datasets=datasets or None,
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


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def _reference(row: ResultRow) -> str:
    values = [v for v in (row.reference_merged, row.reference_calibrated) if v is not None]
    return " → ".join(_pct(v) for v in values) or "–"


def _link(ref: str | None, kind: str, commit: str | None = None) -> str:
    """A Hub id as a link to its page, or to the files of the ``commit`` it was read at (named beside it);
    a local folder or data file (a path or ``local:<name>``) by its name only."""
    if not ref:
        return "–"
    if is_hub_id(ref):
        repo_id, revision = split_revision(ref)
        url = f"https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{repo_id}"
        at = commit or revision
        if at is None:
            return f"[{repo_id}]({url})"
        return f"[{repo_id}]({url}/tree/{at}) at `{at[:12]}`"
    name = ref[len(LOCAL_MARK) :] if is_published_local(ref) else local_name(ref)
    return f"`{name}` (local {'file' if Path(name).suffix.lower() in DATA_FILE_SUFFIXES else 'folder'})"


def _environment(
    template: str | Path | None, family: ModelFamily, card_template: tuple[str, str] | None = None
) -> tuple[jinja2.Environment, str]:
    if template is None:
        package, name = card_template or family.release.card_template
        source = resources.files(package).joinpath(name).read_text(encoding="utf-8")
    else:
        source = read_text_input(Path(template).expanduser(), "Model card template")
    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False)
    env.filters.update(
        pct=_pct,
        reference=_reference,
        model_link=lambda ref, commit=None: _link(ref, "model", commit),
        dataset_link=lambda ref, commit=None: _link(ref, "dataset", commit),
        tojson=lambda value: json.dumps(value, ensure_ascii=False),
    )
    return env, source


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


def _context(
    run: RunFolder,
    *,
    repo_id: str | None,
    license: str | None,
    plot: str | None,
    drift_plot: str | None = None,
    sweep_plot: str | None = None,
) -> dict[str, Any]:
    """The template's variables. References to inputs are given as published (see
    :mod:`featcal.release.published`): Hub ids as they are, local folders as ``local:<folder name>``,
    so that no template, featcal's or a user's, can put a local path in the card. Without ``license``, the
    family's default license (None: ``other``, and ``license_given`` is False)."""
    method, params = run.record.merge.described
    pretty_name, url = _method_info(method) if method else ("an existing merge", None)
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
        "featcal": [
            {
                "name": k,
                "symbol": (FEATCAL_PARAMS | FEATCAL_RECORDS).get(k, ("", ""))[0],
                "value": v,
                "meaning": (FEATCAL_PARAMS | FEATCAL_RECORDS).get(k, ("", ""))[1].replace("images", f"{noun}s"),
            }
            for k, v in featcal.items()
        ]
        if featcal
        else None,
        "tasks": [
            {
                "name": t.name,
                "dataset": published_ref(t.dataset.path),
                "dataset_commit": run.record.commit_of("datasets", t.name) or t.dataset.revision,
                "config": t.dataset.name,
                "test_split": evaluated_split(t, run.max_eval_samples, run.record.evaluation.details.get("held_out")),
                "classes": len(t.classnames),
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
    for a sweep (``featcal sweep``): its table, and ``sweep_plot``.
    """
    from featcal.repairs.compare_table import with_comparison

    if repo_id is not None:
        check_repo_id(repo_id, namespace=True)
    card = render_template_card(
        template,
        get_family(run.record.family),
        lambda: _context(
            run, repo_id=repo_id, license=license, plot=plot, drift_plot=drift_plot, sweep_plot=sweep_plot
        ),
    )
    return with_comparison(card, run.path)  # the repairs compared on the run's merge (featcal run --repair)


def render_template_card(
    template: str | Path | None,
    family: ModelFamily,
    context: Callable[[], Mapping[str, Any]],
    card_template: tuple[str, str] | None = None,
) -> ModelCard:
    """A model card rendered from ``template`` (None: ``card_template``, else ``family``'s run card) with the
    values ``context`` gives.

    Args:
        template: A Jinja model card template of your own, or None for the family's.
        family: The model family whose template and filters the card uses.
        context: Gives the template's values; called inside the rendering's error handling.
        card_template: The package and file name of the family's template to use when ``template`` is None
            (a model folder's card: :attr:`~featcal.families.base.ReleaseParts.folder_card_template`); None: the
            family's ``card_template``.

    Returns:
        The card.

    Raises:
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    env, source = _environment(template, family, card_template)
    shown = template or "/".join(card_template or family.release.card_template)
    try:
        text = env.from_string(source).render(**context())
    except jinja2.TemplateError as exc:
        raise FeatcalError(f"Model card template {shown} failed to render: {exc}") from None
    try:
        return ModelCard(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise FeatcalError(f"Model card template {shown} gives invalid metadata: {exc}") from None


def write_card(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    repo_id: str | None = None,
    license: str | None = None,
    template: str | Path | None = None,
) -> Path:
    """Write ``README.md`` and the results plot for the run into ``out_dir`` (default ``<run>/release``).

    A language-model folder's card is written by :func:`featcal.release.model_card.write_model_card`
    (``featcal card DIR`` chooses between the two).

    Only the card and its image change; the weights and the rest of the folder are left as they are.
    In a release folder, the entries of the two files in ``release_manifest.json`` are updated, so the
    release still passes :func:`~featcal.release.check.check_release` (an edit by hand does not).

    Args:
        run_dir: The run folder written by ``featcal run``.
        out_dir: Where to write the card (default ``<run>/release``); created when missing.
        repo_id: The Hub repository the card names (its usage snippet and ``model-index``).
        license: The license in the card's metadata (default: the family's: ``mit`` for CLIP; ``other`` for T5,
            and the card says none was given).
        template: A Jinja model card template of your own.

    Returns:
        The path of ``README.md``.

    Raises:
        RunFolderError: when the run folder is incomplete, damaged or edited after the run.
        ReleaseError: when ``out_dir`` holds the release of another run, or an unreadable manifest.
        OutputPathError: when ``out_dir`` holds files that are not a featcal card's or release's.
        RunLockedError: when another process is writing the run folder.
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    run_path = Path(run_dir).expanduser()
    out = Path(out_dir).expanduser() if out_dir is not None else run_path / RELEASE_DIR
    inside = run_path.resolve() in out.resolve().parents
    with RunLock(run_path, shared=not inside):  # no other process writes the run meanwhile
        run = read_run(run_path)
        check_card_folder(out)
        out.mkdir(parents=True, exist_ok=True)
        card = write_card_files(run, out, repo_id=repo_id, license=license, template=template)
    logger.info("Wrote the model card %s", card)
    return card


CARD_FILES = frozenset({CARD_FILE, PLOT_FILE, DIAGNOSTICS_PLOT, SWEEP_PLOT})


def check_card_folder(out: Path) -> None:
    """Refuse a card folder that holds someone else's files: a folder may receive the card when it is new
    or empty, a featcal release (its manifest then names the run), or holds only an earlier featcal card.

    Raises:
        OutputPathError: naming the folder and what it holds.
    """
    if out.exists() and not out.is_dir():
        raise OutputPathError(out, f"The card folder {out} exists and is a file: choose another path.")
    if not out.is_dir() or (out / MANIFEST).is_file():
        return
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
    foreign = [name for name in visible if name not in CARD_FILES]
    if foreign or (CARD_FILE in visible and not _is_featcal_card(out / CARD_FILE)):
        shown = ", ".join((foreign or [CARD_FILE])[:5])
        raise OutputPathError(
            out,
            f"{out} holds files that are not a featcal model card's ({shown}): write the card into a new or "
            "empty folder, or a release folder.",
        )


def _is_featcal_card(path: Path) -> bool:
    """Whether ``path`` is a model card featcal wrote (its metadata tags name featcal)."""
    try:
        card = ModelCard.load(path)
    except (OSError, ValueError, yaml.YAMLError):
        return False
    return "featcal" in (card.data.tags or [])


def write_card_files(
    run: RunFolder, out: Path, *, repo_id: str | None, license: str | None, template: str | Path | None
) -> Path:
    """Write the plot (when matplotlib is there) and ``README.md`` into the existing folder ``out``.

    When ``out`` is a release folder (it has a manifest), the manifest must be of the same run, and its
    entries of the card and the plot are updated afterwards.
    """
    if (out / MANIFEST).is_file():
        recorded = read_manifest(out).recipe_sha256
        if recorded != run.recipe_sha256:
            raise ReleaseError(
                out,
                f"{out} holds the release of another run (recipe {recorded[:12]}) than {run.path} "
                f"(recipe {run.recipe_sha256[:12]}): write the card into another folder, or export this run there.",
            )
    method, _ = run.record.merge.described
    pretty_name = _method_info(method)[0] if method else "merged"
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
