"""The Space's classifier: the released vision tower, the base CLIP, and every task's class head.

Text heads come from :class:`featcal.families.clip_vision.evaluation.ZeroShotClassifier` (so the Space scores an image
exactly as ``featcal evaluate`` does), all computed once when the model loads (or read from the disk
cache a previous start left, see :mod:`featcal.space.heads`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image

from featcal.devices import resolve_device
from featcal.errors import FeatcalError, ModelInputError, UnknownNameError
from featcal.families import DEFAULT_FAMILY
from featcal.families.clip_vision.entries import image_classes
from featcal.families.clip_vision.evaluation import ZeroShotClassifier, load_base_clip
from featcal.families.clip_vision.folders import load_vision_folder
from featcal.families.clip_vision.images import pixel_values
from featcal.files.reading import read_json
from featcal.hub.downloads import resolve_model_folder
from featcal.hub.refs import is_hub_id, local_path
from featcal.release.export import COMMON_FILES
from featcal.release.manifest import MANIFEST
from featcal.release.published import is_published_local
from featcal.runfolder.layout import CALIBRATED_PREFIX, RELEASE_DIR, RUN_CONFIG
from featcal.space.heads import default_cache_dir, task_heads
from featcal.space.settings import DEFAULT_BASE_MODEL_ID, SpaceSettings
from featcal.suites import SUITE_NAMES, suite_family, suite_names, suite_table, task_table
from featcal.tasks import Task

logger = logging.getLogger(__name__)

ALL_TASKS = "all"


@dataclass(frozen=True)
class ModelSource:
    """Where the Space's vision tower comes from, and the run that made it (if known)."""

    ref: str
    folder: Path
    run_folder: Path | None = None

    def recipe(self) -> dict:
        """The run's ``run_config.json`` (empty when there is none).

        The run folder's own comes first: a release's copy names local inputs by folder name only.
        """
        for where in (self.run_folder, self.folder):
            if where is not None and (where / RUN_CONFIG).is_file():
                return read_json(where / RUN_CONFIG)
        return {}


def resolve_model_source(ref: str) -> ModelSource:
    """The vision-tower folder ``ref`` names: a model folder, a release folder, a run folder or a Hub id.

    A run folder gives its ``release/`` when it has one, else its single ``featcal-*/`` stage. A local
    release (a run's ``release/``, or a folder holding a release's manifest, or a recipe beside model
    files) is checked as ``featcal push`` checks it (:func:`featcal.release.check_release`) before it
    is served.

    Raises:
        ReleaseError: a release folder that is incomplete or differs from what export wrote.
        ModelInputError: a folder that is none of these, a run folder without one calibrated model,
            weights that do not load, or a Hub id that cannot be had.
    """
    path = local_path(ref)
    if path is None or not path.is_dir():
        return ModelSource(ref, resolve_model_folder(ref, what="Space model"))
    if (path / RELEASE_DIR).is_dir():
        return ModelSource(ref, _checked_release(path / RELEASE_DIR), path)
    if (path / MANIFEST).is_file() or (
        (path / RUN_CONFIG).is_file() and any((path / name).is_file() for name in COMMON_FILES if name != RUN_CONFIG)
    ):
        return ModelSource(ref, _checked_release(path), path)
    if (path / "config.json").is_file():
        return ModelSource(ref, path)
    if not (path / RUN_CONFIG).is_file():
        raise ModelInputError(
            ref,
            f"{path} is neither a model folder (config.json, model.safetensors), a release folder "
            f"nor a run folder ({RUN_CONFIG}): set `model_id` to the output of `featcal run`.",
        )
    stages = sorted(p for p in path.glob(f"{CALIBRATED_PREFIX}*") if (p / "config.json").is_file())
    if not stages:
        raise ModelInputError(
            ref,
            f"The run folder {path} has no calibrated model (featcal-*/) and no {RELEASE_DIR}/ yet: "
            "finish the run, or set `model_id` to a model folder.",
        )
    if len(stages) > 1:
        names = ", ".join(p.name for p in stages)
        raise ModelInputError(
            ref,
            f"The run folder {path} holds several calibrated models ({names}): "
            f"set `model_id` to one of them, e.g. {stages[0]}.",
        )
    return ModelSource(ref, stages[0], path)


def _checked_release(folder: Path) -> Path:
    """``folder`` once :func:`featcal.release.check_release` finds it complete and as export wrote it."""
    from featcal.release import check_release

    logger.info("Checking the release %s", folder)
    return check_release(folder).folder


def base_model_ref(settings: SpaceSettings, source: ModelSource) -> str:
    """The base CLIP to use: the setting, else the base the run records, else the default CLIP.

    Raises:
        ModelInputError: when the run records a base that is not usable here (a release names a local
            base by its folder name only; a run folder may name a folder of another machine), so that
            ``base_model_id`` must name it.
    """
    if settings.base_model_id:
        return settings.base_model_id
    recorded = source.recipe().get("base_model_id")
    if not isinstance(recorded, str) or not recorded:
        return DEFAULT_BASE_MODEL_ID
    local = local_path(recorded)
    if (local is not None and local.is_dir()) or is_hub_id(recorded):
        return recorded
    if is_published_local(recorded):
        where = f"a local folder it names only {recorded!r}"
    else:
        where = f"the folder {recorded}, which is not on this machine"
    raise ModelInputError(
        source.ref,
        f"The model {source.ref} was made from a base CLIP in {where}: set `base_model_id` (BASE_MODEL_ID in "
        "a Space) to that base's folder or Hub id.",
    )


def check_image_model(source: ModelSource) -> None:
    """Refuse, before anything is loaded, a model whose run was not a CLIP run: the Space classifies images.

    Raises:
        ModelInputError: for a model whose ``run_config.json`` records another family (a T5's ``seq2seq``).
    """
    family = source.recipe().get("family", DEFAULT_FAMILY)
    if family != DEFAULT_FAMILY:
        raise ModelInputError(
            source.ref,
            f"The model {source.ref} is a {family!r} model: the Space classifies images with CLIP vision towers "
            f"only ({DEFAULT_FAMILY!r} runs); load a {family} release with transformers instead (its model card shows "
            "how).",
        )


def space_tasks(settings: SpaceSettings, recorded_suite: str | None = None) -> list[Task]:
    """The tasks the Space offers: those of its tasks file, else those of the built-in suite.

    Args:
        settings: The Space's settings; their ``suite`` wins over ``recorded_suite``.
        recorded_suite: The suite the model's ``run_config.json`` records, if any (else ``ta8``).

    Raises:
        UnknownNameError: for a suite that is not built in, or not one of the CLIP suites (``glue8`` is FLAN-T5's).
    """
    if settings.tasks_file is None:
        suite = settings.suite or recorded_suite
        if suite in SUITE_NAMES and suite_family(suite) != DEFAULT_FAMILY:
            raise UnknownNameError(
                "CLIP suite",
                suite,
                suite_names(DEFAULT_FAMILY),
                hint=f"The Space classifies images; {suite}'s tasks are not.",
            )
        return list(suite_table(suite).tasks.values())
    return list(task_table(settings.path(settings.tasks_file), replace=True).tasks.values())


class SpaceModel:
    """The vision tower under test beside the base CLIP, with the class heads of every task."""

    def __init__(self, settings: SpaceSettings, *, progress: bool = True) -> None:
        self.settings = settings
        self.device = resolve_device(settings.device)
        self.source = resolve_model_source(settings.model_id)
        check_image_model(self.source)
        self.base_ref = base_model_ref(settings, self.source)
        recorded_suite = self.source.recipe().get("suite")
        self.tasks = {
            task.name: task
            for task in space_tasks(settings, recorded_suite if recorded_suite in suite_names("clip_vision") else None)
        }
        unoffered = [name for name in self.source.recipe().get("tasks") or [] if name not in self.tasks]
        if unoffered:
            logger.warning(
                "The model was made for task(s) %s, which this Space does not offer: give their tasks "
                "file as `tasks_file` (TASKS_FILE in a Space).",
                ", ".join(unoffered),
            )
        base_folder = resolve_model_folder(self.base_ref, what="base CLIP model")
        logger.info("Loading the base CLIP from %s and the vision tower from %s", base_folder, self.source.folder)
        self.clip, tokenizer, self.processor = load_base_clip(base_folder, self.device)
        self.vision = load_vision_folder(self.source.folder).to(self.device)
        self._check_compatible()
        self.classifier = ZeroShotClassifier(self.clip, tokenizer, self.device)
        cache = Path(settings.heads_cache).expanduser() if settings.heads_cache else default_cache_dir()
        self.heads = task_heads(self.classifier, self.tasks.values(), base_folder, cache, progress=progress)

    @property
    def input_side(self) -> int:
        """The side, in pixels, the image processor resizes and crops to (224 for CLIP ViT-B/32)."""
        sides = [
            getattr(sizes, key, None)
            for sizes in (getattr(self.processor, "size", None), getattr(self.processor, "crop_size", None))
            for key in ("shortest_edge", "height", "width")
        ]
        return max((int(side) for side in sides if side), default=0)

    def _check_compatible(self) -> None:
        ours, base = self.vision.config, self.clip.vision_model.config
        mismatched = [
            k
            for k in ("hidden_size", "num_hidden_layers", "image_size", "patch_size")
            if getattr(ours, k) != getattr(base, k)
        ]
        if mismatched:
            raise ModelInputError(
                self.settings.model_id,
                f"The model {self.settings.model_id} does not fit the base {self.base_ref}: they differ in "
                f"{', '.join(mismatched)}. Set `base_model_id` (BASE_MODEL_ID in a Space) to the CLIP it was "
                "merged from.",
            )

    def task_names(self, choice: str) -> list[str]:
        """The tasks a dropdown choice stands for: one task, or all of them for ``"all"``."""
        if choice == ALL_TASKS:
            return list(self.tasks)
        if choice not in self.tasks:
            raise FeatcalError(f"Unknown task {choice!r}: pick one of {', '.join(self.tasks)} or {ALL_TASKS!r}.")
        return [choice]

    @torch.no_grad()
    def probabilities(
        self, image: Image.Image, task_names: list[str], *, base: bool = False
    ) -> dict[str, torch.Tensor]:
        """Per task, the softmax over its classes of the zero-shot logits (of the base tower if ``base``)."""
        vision = self.clip.vision_model if base else self.vision
        embedding = self.classifier.image_embeddings(vision, pixel_values(self.processor, [image]))
        scale = self.clip.logit_scale.exp()
        return {name: (scale * embedding @ self.heads[name].T)[0].softmax(-1).cpu() for name in task_names}

    def top_classes(
        self, image: Image.Image, task_names: list[str], top_k: int, *, base: bool = False
    ) -> dict[str, dict[str, float]]:
        """Per task, its ``top_k`` most probable classes (most probable first) with their probabilities."""
        result = {}
        for name, probs in self.probabilities(image, task_names, base=base).items():
            values, indices = probs.topk(min(top_k, probs.numel()))
            classnames = image_classes(self.tasks[name]).classnames
            result[name] = {classnames[i]: round(float(v), 6) for v, i in zip(values, indices.tolist())}
        return result
