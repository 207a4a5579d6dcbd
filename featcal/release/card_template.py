"""The one model card renderer: a family's Jinja template (or the user's) rendered with the variables of a run's or
a model folder's card, featcal's filters, and the words both kinds of card share.

The template is the family's (:attr:`~featcal.families.base.ReleaseParts.card_template` for a run,
:attr:`~featcal.families.base.ReleaseParts.folder_card_template` for a model folder); pass ``template=`` to use
your own. This module also decides which folders may receive a card (:func:`check_card_folder`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from featcal.calibration.params import FeatCalParams
from featcal.errors import FeatcalError, OutputPathError
from featcal.files.reading import read_text_input
from featcal.hub.refs import is_hub_id, split_revision
from featcal.options import option_fields, option_of
from featcal.release.manifest import MANIFEST
from featcal.release.plot import PLOT_FILE
from featcal.release.published import LOCAL_MARK, is_published_local, local_name
from featcal.release.results import ResultRow
from featcal.runfolder.layout import DIAGNOSTICS_PLOT
from featcal.sweep.report import SWEEP_PLOT
from featcal.tasks import DATA_FILE_SUFFIXES

if TYPE_CHECKING:
    from featcal.families.base import ModelFamily, ReleaseParts

CARD_FILE = "README.md"
# A card context's key (a family's ``card_context``): EvalResults the card's model-index adds to the tasks'.
MODEL_INDEX_RESULTS = "model_index_results"
TAGS = ["merge", "featcal", "model-merging"]  # the family's follow, then the merging method's
# The recipe table's symbol and meaning of each FeatCal hyper-parameter, from the run spec.
FEATCAL_PARAMS = {f.name: (option_of(f).symbol, option_of(f).card) for f, _, _ in option_fields(FeatCalParams)}
# What run_config.json's FeatCal section records beside the parameters, when it applies.
FEATCAL_RECORDS = {
    "calibration_examples_used": ("", "train images of the tasks that had fewer than n; all of them were used"),
}
# The files a card folder may hold besides a release's: the card and the images it shows.
CARD_FILES = frozenset({CARD_FILE, PLOT_FILE, DIAGNOSTICS_PLOT, SWEEP_PLOT})


def method_info(method: str) -> tuple[str, str | None]:
    """Pretty name and reference URL of a merging method from its registry (the bare name if not registered).

    Args:
        method: The merging method's name.

    Returns:
        Its name for people and its reference URL (None when unknown).
    """
    from featcal.merging import get_method

    try:
        registered = get_method(method)
    except FeatcalError:
        return method, None
    return registered.pretty_name, registered.reference_url


def hub_ids(refs: Iterable[str | None]) -> list[str]:
    """The Hub ids among ``refs``, revisions stripped, each once, in order.

    Args:
        refs: Model references (Hub ids, local paths, None).

    Returns:
        The Hub repositories.
    """
    return list(dict.fromkeys(split_revision(r)[0] for r in refs if r and is_hub_id(r)))


def card_metadata(
    parts: ReleaseParts,
    *,
    model_name: str,
    license: str,
    base_models: list[str],
    tags: list[str],
    datasets: list[str],
    eval_results: list[EvalResult] | None = None,
) -> ModelCardData:
    """A card's YAML metadata, for a run's card and a model folder's alike.

    Args:
        parts: The family's release parts (its ``pipeline_tag``).
        model_name: The repository the card names.
        license: The license (``other`` when none was given).
        base_models: The Hub models it was merged from (none: no base model relation).
        tags: The card's tags.
        datasets: The Hub datasets it names.
        eval_results: Its ``model-index`` results, if measured.

    Returns:
        The metadata.
    """
    return ModelCardData(
        model_name=model_name,
        library_name="transformers",
        license=license,
        pipeline_tag=parts.pipeline_tag,
        base_model=base_models or None,
        base_model_relation="merge" if base_models else None,
        tags=tags,
        datasets=datasets or None,
        eval_results=eval_results,
    )


def featcal_rows(values: Mapping[str, Any], noun: str) -> list[dict[str, Any]]:
    """The card's FeatCal table: each recorded value with its symbol and meaning, spoken of the family's examples.

    Args:
        values: The FeatCal parameters (and what a run records beside them), by name.
        noun: What one example of the family is called (``image``, ``text``).

    Returns:
        One row a value: ``name``, ``symbol``, ``value`` and ``meaning``.
    """
    words = FEATCAL_PARAMS | FEATCAL_RECORDS
    return [
        {
            "name": k,
            "symbol": words.get(k, ("", ""))[0],
            "value": v,
            "meaning": words.get(k, ("", ""))[1].replace("images", f"{noun}s"),
        }
        for k, v in values.items()
    ]


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


def _environment(template: str | Path | None, card_template: tuple[str, str]) -> tuple[jinja2.Environment, str]:
    if template is None:
        package, name = card_template
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


def render_template_card(
    template: str | Path | None,
    family: ModelFamily,
    context: Callable[[], Mapping[str, Any]],
    *,
    folder: bool = False,
    sections: Callable[[], Iterable[str | None]] = tuple,
) -> ModelCard:
    """A model card rendered from ``template`` (None: the family's run or folder card template) with the values
    ``context`` gives, followed by the extra sections ``sections`` gives.

    Args:
        template: A Jinja model card template of your own, or None for the family's.
        family: The model family whose template the card uses.
        context: Gives the template's values; called inside the rendering's error handling. Its
            :data:`MODEL_INDEX_RESULTS` entry, if any, is added to the card's ``model-index`` instead.
        folder: Whether the card is a model folder's (the family's
            :attr:`~featcal.families.base.ReleaseParts.folder_card_template`), else a run's
            (:attr:`~featcal.families.base.ReleaseParts.card_template`).
        sections: Gives the Markdown of extra sections appended to the rendered text (None: no section).

    Returns:
        The card.

    Raises:
        FeatcalError: when the template is missing, fails to render or gives invalid metadata.
    """
    card_template = (folder and family.release.folder_card_template) or family.release.card_template
    env, source = _environment(template, card_template)
    shown = template or "/".join(card_template)
    try:
        values = dict(context())
        extra = list(values.pop(MODEL_INDEX_RESULTS, None) or ())
        text = env.from_string(source).render(**values)
    except jinja2.TemplateError as exc:
        raise FeatcalError(f"Model card template {shown} failed to render: {exc}") from None
    text += "".join(section for section in sections() if section is not None)
    try:
        card = ModelCard(text)
        if extra:
            card.data.eval_results = [*(card.data.eval_results or []), *extra]
            card.data.model_name = card.data.model_name or values.get("title")
        return card
    except (ValueError, yaml.YAMLError) as exc:
        raise FeatcalError(f"Model card template {shown} gives invalid metadata: {exc}") from None


def check_card_folder(out: Path) -> None:
    """Refuse a card folder that holds someone else's files: a folder may receive the card when it is new
    or empty, a featcal release (its manifest then names the run), or holds only an earlier featcal card.

    Args:
        out: The folder the card is to be written into.

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
