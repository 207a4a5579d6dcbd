"""Turn a finished run into a release folder: exactly the files that `featcal push` uploads."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from pathlib import Path

from featcal.errors import FeatcalError
from featcal.hub import check_repo_id, is_hub_id, local_path, resolve_model_folder
from featcal.io import atomic_folder, atomic_write_json
from featcal.outputs import check_output_folder
from featcal.release.card import write_card_files
from featcal.release.manifest import MANIFEST, manifest_of, tensors_sha256, write_manifest
from featcal.release.options import DEFAULT_LICENSE
from featcal.release.plot import PLOT_FILE
from featcal.release.published import published_config
from featcal.runfolder import DIAGNOSTICS_PLOT, METRICS, RELEASE_DIR, RUN_CONFIG, RunFolder, read_run, recipe_sha256
from featcal.sweep.report import SWEEP_PLOT
from featcal.version import __version__

logger = logging.getLogger(__name__)

WEIGHTS = "model.safetensors"
REQUIRED_FILES = ("config.json", WEIGHTS, "preprocessor_config.json", "README.md", METRICS, RUN_CONFIG, MANIFEST)
RELEASE_FILES = frozenset({*REQUIRED_FILES, PLOT_FILE, DIAGNOSTICS_PLOT, SWEEP_PLOT})
RELEASE_NAMES = re.compile("|".join(map(re.escape, sorted(RELEASE_FILES))))


def load_vision_model(folder: Path, what: str):
    """A `CLIPVisionModel` from ``folder``, refusing missing or unexpected weights."""
    from transformers import CLIPVisionModel

    try:
        model, info = CLIPVisionModel.from_pretrained(str(folder), dtype="auto", output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise FeatcalError(f"{what}: {folder} does not load as a transformers CLIPVisionModel ({exc}).") from None
    problems = [f"{kind} {sorted(map(str, keys))[:3]}" for kind, keys in info.items() if keys]
    if problems:
        raise FeatcalError(f"{what}: the weights in {folder} do not match a CLIPVisionModel: {'; '.join(problems)}.")
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


def _write_weights(run: RunFolder, out: Path, published: dict) -> str:
    """Write the released model; returns its ``tensors_sha256`` (also stamped in its metadata)."""
    model = load_vision_model(run.released.path, f"Stage {run.released.name!r}")
    model.save_pretrained(str(out))
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


def _write_processor(run: RunFolder, out: Path) -> None:
    from featcal.evaluation import load_image_processor

    local = local_path(run.base_model)
    if not is_hub_id(run.base_model) and (local is None or not local.exists()):
        raise FeatcalError(
            f"The base model folder {run.base_model!r} named in {run.path / RUN_CONFIG} does not exist here "
            "(a relative path is relative to where `featcal run` ran): export from there, or fix the path."
        )
    folder = resolve_model_folder(run.base_model, what="base model")
    try:
        processor = load_image_processor(folder)
    except (OSError, ValueError) as exc:
        raise FeatcalError(f"The base model {run.base_model} has no usable image processor config ({exc}).") from None
    processor.save_pretrained(str(out))


def export_release(
    run_dir: str | Path,
    out_dir: str | Path | None = None,
    *,
    repo_id: str | None = None,
    license: str = DEFAULT_LICENSE,
    template: str | Path | None = None,
) -> Path:
    """Write the release folder of a run (default ``<run>/release``) and return its path.

    The folder holds the released model (calibrated when present, else merged) as a
    ``CLIPVisionModel``, the base model's image processor config, the model card (``README.md``) and
    its plot, the evaluation report (``metrics.json``), the recipe (``run_config.json``, with local
    inputs named ``local:<folder name>``, see :mod:`featcal.release.published`) and the manifest
    (``release_manifest.json``: the SHA-256 of every other file). The weights' safetensors metadata
    carries featcal's version, the recipe hash, ``tensors_sha256`` (a hash of the tensor data, see
    :mod:`featcal.release.manifest`) and ``published_config_sha256`` (the recipe hash of the published
    ``run_config.json``). It is written in a temporary folder beside it and renamed into place, so it is
    never seen half-written; exporting the same run again gives the same bytes.

    Args:
        run_dir: The run folder written by ``featcal run``.
        out_dir: Where to write the release (default ``<run>/release``); an existing release there is
            replaced, a folder holding other files is refused.
        repo_id: The Hub repository the card names (its usage snippet and ``model-index``).
        license: The license in the card's metadata.
        template: A Jinja model card template of your own.

    Returns:
        The release folder.

    Raises:
        RunFolderError: when the run folder is incomplete, damaged or edited after the run.
        ModelInputError: when the released weights or the base's image processor do not load.
        OutputPathError: when ``out_dir`` is a file or holds files that are not part of a release.
    """
    run = read_run(run_dir)
    if repo_id is not None:
        check_repo_id(repo_id, namespace=True)
    out = Path(out_dir).expanduser() if out_dir is not None else run.path / RELEASE_DIR
    check_output_folder(out, kind="release", allowed=RELEASE_NAMES)
    with atomic_folder(out) as tmp:
        published = published_config(run.config)
        tensors = _write_weights(run, tmp, published)
        _write_processor(run, tmp)
        atomic_write_json(tmp / RUN_CONFIG, published)
        atomic_write_json(tmp / METRICS, {**run.released.metrics, "run_id": run.recipe_sha256})
        write_card_files(run, tmp, repo_id=repo_id, license=license, template=template)
        names = [p.name for p in tmp.iterdir() if not p.name.startswith(".")]
        write_manifest(tmp, manifest_of(tmp, names, recipe=run.recipe_sha256, tensors=tensors))
    logger.info("Exported %s (stage %s, recipe %s) to %s", run.path, run.released.name, run.recipe_sha256[:12], out)
    return out
