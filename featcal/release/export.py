"""The one exporter: turn a run's released stage, or a model folder, into a release folder: exactly the files that
`featcal push` uploads (:func:`export_release`)."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.errors import FeatcalError, RunFolderError
from featcal.families import get_family
from featcal.files.atomic import atomic_folder, atomic_write_json
from featcal.files.model_files import MODEL_CONFIG, WEIGHTS
from featcal.hub.downloads import resolve_model_folder
from featcal.hub.refs import check_repo_id, is_hub_id, local_path
from featcal.metrics import RUN_ID, WEIGHTS_SHA256, weights_sha256
from featcal.outputs import check_output_folder
from featcal.release.card_template import CARD_FILE
from featcal.release.folder_card import render_folder_card
from featcal.release.folder_release import local_inputs, release_names, write_folder_release
from featcal.release.manifest import MANIFEST, manifest_of, tensors_sha256, write_manifest
from featcal.release.model_folder import default_release_folder, is_model_input, read_model_folder
from featcal.release.plot import PLOT_FILE
from featcal.release.published import published_config
from featcal.release.run_card import render_card, write_card_files
from featcal.runfolder.layout import DIAGNOSTICS_PLOT, METRICS, RELEASE_DIR, RUN_CONFIG, calibrated_stage_name
from featcal.runfolder.lock import RunLock
from featcal.runfolder.reader import RunFolder, read_run
from featcal.runfolder.record import recipe_sha256
from featcal.sweep.report import SWEEP_PLOT
from featcal.version import __version__

if TYPE_CHECKING:
    from featcal.families.base import ModelFamily

logger = logging.getLogger(__name__)

# What a run's own release holds, whatever its family; a family adds its preprocessor's files.
COMMON_FILES = (MODEL_CONFIG, WEIGHTS, CARD_FILE, METRICS, RUN_CONFIG, MANIFEST)
OPTIONAL_FILES = (PLOT_FILE, DIAGNOSTICS_PLOT, SWEEP_PLOT)


def required_files(family: ModelFamily) -> tuple[str, ...]:
    """The files a release of ``family``'s model must hold."""
    return (*COMMON_FILES, *family.release.files)


def run_release_names(family: ModelFamily) -> re.Pattern[str]:
    """The names a run's own release of ``family``'s model may hold (what ``export`` may replace)."""
    names = {*required_files(family), *OPTIONAL_FILES, *family.release.optional_files}
    return re.compile("|".join(map(re.escape, sorted(names))))


def load_released_model(family: ModelFamily, folder: Path, what: str):
    """The family's release class (``CLIPVisionModel``) loaded from ``folder``, refusing missing or
    unexpected weights.

    Raises:
        FeatcalError: naming ``what`` and the folder when it does not load as that class, or its weights
            do not match it.
    """
    import transformers

    model_class = family.release.model_class
    try:
        with (family.release.quiet_loading or nullcontext)():  # a T5 release's LM head, which transformers warns of
            model, info = getattr(transformers, model_class).from_pretrained(
                str(folder), dtype="auto", output_loading_info=True
            )
    except (OSError, ValueError, RuntimeError) as exc:
        raise FeatcalError(f"{what}: {folder} does not load as a transformers {model_class} ({exc}).") from None
    problems = [f"{kind} {sorted(map(str, keys))[:3]}" for kind, keys in info.items() if keys]
    if problems:
        raise FeatcalError(f"{what}: the weights in {folder} do not match a {model_class}: {'; '.join(problems)}.")
    return model.eval()


def stamp_safetensors(path: Path, metadata: dict[str, str]) -> None:
    """Rewrite a safetensors file with ``metadata`` added to its header (same tensors).

    safetensors writes metadata keys in hash order; they are sorted here so that exporting the same
    run twice gives the same bytes (and pushing it again is a no-op).
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        tensors = {key: f.get_tensor(key) for key in f.keys()}
        merged = {**(f.metadata() or {}), **metadata}
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(tensors, str(tmp), metadata=merged)
    with tmp.open("r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
        canonical = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(canonical) <= size:  # same keys and values: same length, padded with spaces like safetensors
            f.seek(8)
            f.write(canonical.ljust(size))
    os.replace(tmp, path)


def _write_weights(run: RunFolder, family: ModelFamily, out: Path, published: dict) -> str:
    """Write the released model; returns its ``tensors_sha256`` (also stamped in its metadata)."""
    model = load_released_model(family, run.released.path, f"Stage {run.released.name!r}")
    model.save_pretrained(str(out))
    if family.release.edit_config is not None:
        config = family.release.edit_config(json.loads((out / MODEL_CONFIG).read_text(encoding="utf-8")))
        (out / MODEL_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    tensors = tensors_sha256(out / WEIGHTS)
    stamp_safetensors(
        out / WEIGHTS,
        {
            "format": "pt",
            "featcal_version": __version__,
            "recipe_sha256": run.recipe_sha256,
            "tensors_sha256": tensors,
            "published_config_sha256": recipe_sha256(published),
        },
    )
    return tensors


def _write_preprocessor(run: RunFolder, family: ModelFamily, out: Path) -> None:
    """Write the base's preprocessor (CLIP's image processor) beside the released weights."""
    local = local_path(run.base_model)
    if not is_hub_id(run.base_model) and (local is None or not local.exists()):
        raise FeatcalError(
            f"The base model folder {run.base_model!r} named in {run.path / RUN_CONFIG} does not exist here "
            "(a relative path is relative to where `featcal run` ran): export from there, or fix the path."
        )
    folder = resolve_model_folder(run.base_model, what="base model")
    family.preprocessor(folder).save_pretrained(str(out))


def _release_metrics(run: RunFolder, family: ModelFamily) -> dict[str, Any]:
    """The release's ``metrics.json``: the released stage's results, what the family adds from the whole run
    (:attr:`~featcal.families.base.ReleaseParts.run_metrics`), and the recipe as ``run_id``."""
    added = family.release.run_metrics(run) if family.release.run_metrics is not None else {}
    return {**run.released.metrics, **added, RUN_ID: run.recipe_sha256}


def released_source(run: RunFolder) -> dict[str, Any]:
    """Which stage of ``run`` a release copies, and the SHA-256 of its weight files, checked: the stage is
    the one the run's record says it released, and its report measured these very weights.

    Raises:
        RunFolderError: when the run calibrated but its calibrated stage is gone (releasing the merge
            under the calibrated recipe would be a wrong release), or the stage's ``metrics.json``
            measured other weights than its folder holds (or does not say which).
    """
    stage = run.released
    if run.record.featcal is not None and run.calibrated is None:
        expected = calibrated_stage_name(run.method)
        raise RunFolderError(
            run.path / expected,
            f"Run folder {run.path} calibrated, but {expected}/ is missing: run `featcal run` on it again to redo "
            "the calibration, rather than release the merge under the calibrated recipe.",
        )
    weights = weights_sha256(stage.path)
    if stage.metrics.get(WEIGHTS_SHA256) != weights:
        raise RunFolderError(
            stage.path / METRICS,
            f"{stage.path / METRICS} is not the evaluation of the weights in {stage.path} (it records "
            f"{'other weights' if stage.metrics.get(WEIGHTS_SHA256) else 'no weights'}): run `featcal run` on "
            f"{run.path} again to evaluate them.",
        )
    return {"stage": stage.name, WEIGHTS_SHA256: weights}


def export_release(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    repo_id: str | None = None,
    license: str | None = None,
    template: str | Path | None = None,
) -> Path:
    """Write the release folder of a run's released stage, or of a model folder, and return its path.

    What is released, whatever the family:

    - a model folder written by ``featcal merge`` or ``featcal calibrate`` (a folder with ``featcal_recipe.json``
      or ``config.json`` and no ``run_config.json``; a family whose folders are released on their own, see
      :func:`~featcal.release.model_folder.read_model_folder`): the folder's files and a card of its recipe
      (:func:`~featcal.release.folder_release.write_folder_release`; default ``<folder>-release`` beside it);
    - a run whose family releases it as its released stage's folder
      (:attr:`~featcal.families.base.ReleaseParts.run_as_model_folder`: a language model's): that folder's
      release, with the stage's ``metrics.json`` and a card of the run's results (license ``other`` unless given);
    - any other run: the released model (calibrated when present, else merged) saved as its family's class (a
      ``CLIPVisionModel``), the base model's preprocessor (CLIP's image processor config), the model card
      (``README.md``) and its plot, the evaluation report (``metrics.json``), the recipe (``run_config.json``,
      with local inputs named ``local:<folder name>``, see :mod:`featcal.release.published`) and the manifest
      (``release_manifest.json``: the SHA-256 of every other file). The weights' safetensors metadata carries
      featcal's version, the recipe hash, ``tensors_sha256`` (a hash of the tensor data, see
      :mod:`featcal.release.manifest`) and ``published_config_sha256`` (the recipe hash of the published
      ``run_config.json``).

    A run's release (default ``<run>/release``) is written while no other process writes the run, from the stage
    the run's record says it released, checked against its report (:func:`released_source`). Every release is
    written in a temporary folder beside it and renamed into place, so it is never seen half-written; exporting
    the same input again gives the same bytes.

    Args:
        run_dir: The run folder written by ``featcal run``, or a model folder (see above).
        out_dir: Where to write the release; an existing release there is replaced, a folder holding other files
            is refused.
        repo_id: The Hub repository the card names (its usage snippet and ``model-index``).
        license: The license in the card's metadata (default: the family's, see
            :attr:`~featcal.families.base.ReleaseParts.default_license`; where it has none ``other``, and the
            card says none was given).
        template: A Jinja model card template of your own.

    Returns:
        The release folder.

    Raises:
        RunFolderError: when the run folder is incomplete, damaged or edited after the run, its released
            stage's results do not belong to its weights, or the calibrated stage of a calibrated run is gone.
        RunLockedError: when another process is writing the run folder.
        ModelInputError: when the released weights or the base's preprocessor do not load, or a model
            folder is not one of featcal's that is released on its own (a CLIP stage folder is released from its run).
        NoSpaceError: when a model folder's release does not fit on its file system.
        OutputPathError: when ``out_dir`` is a file, holds files that are not part of a release, or is or holds
            an input.
        InvalidParameterError: for a ``repo_id`` that is not ``namespace/name``.
        FeatcalError: when the card's template fails to render.
    """
    if repo_id is not None:
        check_repo_id(repo_id, namespace=True)
    if is_model_input(run_dir):  # a model folder of featcal merge / calibrate: no run around it
        folder = read_model_folder(run_dir)
        return write_folder_release(
            folder,
            Path(out_dir).expanduser() if out_dir is not None else default_release_folder(folder.path),
            card=lambda: render_folder_card(folder, repo_id=repo_id, license=license, template=template),
            recipe_sha256=folder.recipe_sha256,
            allowed=release_names(folder.family),
            inputs=local_inputs(folder),
            release_only=True,
        )
    run_path = Path(run_dir).expanduser()
    out = Path(out_dir).expanduser() if out_dir is not None else run_path / RELEASE_DIR
    inside = run_path.resolve() in out.resolve().parents
    # The run is read, and its release written, while no other process writes the run.
    with RunLock(run_path, shared=not inside):
        run = read_run(run_path)
        family = get_family(run.record.family)
        source = released_source(run)
        if family.release.run_as_model_folder:  # its stage's folder, with the run's results
            folder = read_model_folder(run.released.path)
            return write_folder_release(
                folder,
                out,
                card=lambda: render_card(run, repo_id=repo_id, license=license, template=template),
                recipe_sha256=run.recipe_sha256,
                allowed=release_names(folder.family, with_metrics=True),
                inputs=[folder.path],
                metrics=_release_metrics(run, family),
                source=source,
            )
        check_output_folder(out, kind="release", allowed=run_release_names(family))
        with atomic_folder(out) as tmp:
            published = published_config(run.raw_config)
            tensors = _write_weights(run, family, tmp, published)
            _write_preprocessor(run, family, tmp)
            atomic_write_json(tmp / RUN_CONFIG, published)
            atomic_write_json(tmp / METRICS, _release_metrics(run, family))
            write_card_files(run, tmp, repo_id=repo_id, license=license, template=template)
            names = [p.name for p in tmp.iterdir() if not p.name.startswith(".")]
            write_manifest(tmp, manifest_of(tmp, names, recipe=run.recipe_sha256, tensors=tensors, source=source))
    logger.info("Exported %s (stage %s, recipe %s) to %s", run.path, run.released.name, run.recipe_sha256[:12], out)
    return out
