"""CLIP's evaluation: zero-shot class heads from the base CLIP's text tower, accuracy per task and average."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from featcal.devices import default_eval_batch_size
from featcal.distributed import SINGLE, World
from featcal.errors import FeatcalError, ModelInputError
from featcal.families.clip_vision.entries import image_classes
from featcal.families.clip_vision.folders import check_clip_model_folder
from featcal.families.clip_vision.images import TestImages
from featcal.metrics import MetricsReport, TaskMetrics, count_parameters
from featcal.progress import Progress
from featcal.tasks import Task

logger = logging.getLogger(__name__)


def load_base_clip(folder: str | Path, device: torch.device | str = "cpu"):
    """The base `CLIPModel` (text tower, projections, logit scale), its tokenizer and image processor.

    Raises:
        ModelInputError: when the folder is not a complete CLIPModel: another model type, or weights
            that transformers would leave missing (randomly initialised) or ignore.
    """
    from transformers import CLIPModel

    check_clip_model_folder(folder)
    try:
        model, info = CLIPModel.from_pretrained(str(folder), dtype=torch.float32, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelInputError(str(folder), f"The base model {folder} does not load as a CLIPModel ({exc}).") from None
    problems = [f"{kind} {sorted(map(str, keys))[:3]}" for kind, keys in info.items() if keys]
    if problems:
        raise ModelInputError(
            str(folder),
            f"The base model {folder} is not a complete CLIPModel: {'; '.join(problems)}. Give the full CLIP "
            "(vision and text towers) the experts were fine-tuned from.",
        )
    model = model.to(device).eval()
    return model, _load_tokenizer(folder), base_image_processor(folder)


# A CLIP tokenizer's files: the fast one's tokenizer.json, or the slow one's vocabulary and merges.
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))


def _load_tokenizer(folder: str | Path):
    """The base's tokenizer; refused when its files are missing (transformers would build an empty
    vocabulary that turns every prompt into the same tokens) or do not load."""
    from transformers import AutoTokenizer

    if not any(all((Path(folder) / name).is_file() for name in names) for names in TOKENIZER_FILES):
        raise ModelInputError(
            str(folder),
            f"The base model {folder} has no tokenizer (tokenizer.json, or vocab.json and merges.txt): give the "
            "full CLIP folder, saved with its tokenizer (`tokenizer.save_pretrained`).",
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as exc:
        raise ModelInputError(str(folder), f"The base model {folder}'s tokenizer does not load ({exc}).") from None


def base_image_processor(folder: str | Path):
    """The base's image processor, or a one-line error naming the folder."""
    try:
        return load_image_processor(folder)
    except (OSError, ValueError, TypeError) as exc:
        raise ModelInputError(
            str(folder), f"The base model {folder}'s image processor does not load ({exc})."
        ) from None


# transformers picks a torchvision backend for CLIPImageProcessor when torchvision imports, whose
# pixels differ slightly from the PIL backend's: featcal always uses the PIL one, so pixels,
# statistics and accuracies do not depend on whether torchvision is installed.
IMAGE_PROCESSOR = "CLIPImageProcessorPil"


def load_image_processor(folder: str | Path):
    """The model's CLIP image processor, always with the PIL backend (:data:`IMAGE_PROCESSOR`)."""
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil.from_pretrained(str(folder))


class ZeroShotClassifier:
    """Zero-shot heads of one base CLIP model, applied to any vision tower of the same family.

    Under torchrun (``world``), each process evaluates its share of every task's test batches and the
    counts are summed over the processes; every process computes the class heads itself.
    """

    def __init__(
        self,
        clip_model: nn.Module,
        tokenizer,
        device: torch.device | str = "cpu",
        text_batch_size: int = 256,
        *,
        world: World = SINGLE,
    ) -> None:
        self.clip = clip_model
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.text_batch_size = text_batch_size
        self.world = world
        self._heads: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def text_embeddings(self, texts: Sequence[str]) -> torch.Tensor:
        """L2-normalised projected text embeddings; a prompt longer than the text tower's positions is cut
        to them (a tokenizer saved without ``model_max_length`` would not cut it)."""
        out = []
        positions = self.clip.config.text_config.max_position_embeddings
        for start in range(0, len(texts), self.text_batch_size):
            batch = self.tokenizer(
                list(texts[start : start + self.text_batch_size]),
                padding=True,
                truncation=True,
                max_length=positions,
                return_tensors="pt",
            ).to(self.device)
            pooled = self.clip.text_model(
                input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
            ).pooler_output
            out.append(F.normalize(self.clip.text_projection(pooled), dim=-1))
        return torch.cat(out)

    def head(self, task: Task) -> torch.Tensor:
        """[classes, dim]: per class, the normalised mean of its normalised template embeddings.

        Raises:
            FeatcalError: for a task whose head was not computed before :meth:`keep_heads_only`.
        """
        if task.name not in self._heads:
            if self.tokenizer is None:
                raise FeatcalError(f"Task {task.name!r} has no class head: the text tower was already released.")
            classes = image_classes(task)
            texts = [p for c in classes.classnames for p in classes.prompts(c)]
            emb = self.text_embeddings(texts).view(len(classes.classnames), len(classes.templates), -1)
            self._heads[task.name] = F.normalize(emb.mean(1), dim=-1)
        return self._heads[task.name]

    def keep_heads_only(self, tasks: Sequence[Task]) -> None:
        """Compute the heads of ``tasks``, then drop the base's text and vision towers and the tokenizer.

        What stays (the heads, the visual projection and the logit scale, in memory of their own)
        evaluates any vision tower on these tasks; a run calls this once its heads are known, so the
        towers do not stay in memory through calibration. The base vision tower is dropped from this
        classifier's CLIP model: evaluate it (zero-shot) first.
        """
        for task in tasks:
            self.head(task)
        self.clip.text_model = None
        self.clip.text_projection = None
        self.clip.vision_model = None
        self.tokenizer = None
        _own_storage(self.clip)

    @torch.no_grad()
    def image_embeddings(self, vision_model: nn.Module, pixel_values: torch.Tensor) -> torch.Tensor:
        pooled = vision_model(pixel_values=pixel_values.to(self.device, non_blocking=True)).pooler_output
        return F.normalize(self.clip.visual_projection(pooled), dim=-1)

    @torch.no_grad()
    def logits(
        self,
        vision_model: nn.Module,
        pixel_values: torch.Tensor,
        task: Task,
        features: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Scaled cosine logits against ``task``'s head; ``features`` maps the normalised image embeddings
        first (a Representation Surgery module), its result used as it is."""
        embedded = self.image_embeddings(vision_model, pixel_values)
        if features is not None:
            embedded = features(embedded)
        return self.clip.logit_scale.exp() * embedded @ self.head(task).T

    @torch.no_grad()
    def evaluate_task(
        self,
        vision_model: nn.Module,
        task: Task,
        processor=None,
        *,
        batch_size: int | None = None,
        num_workers: int = 0,
        max_samples: int | None = None,
        progress: bool = True,
        images: TestImages | None = None,
        features: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> TaskMetrics:
        """Accuracy, mean cross-entropy and image count of ``vision_model`` on ``task``'s test split.

        Args:
            vision_model: A CLIP vision tower of the base's family; moved to this classifier's device.
            task: The task.
            processor: The base's image processor (not needed with ``images``).
            batch_size: Test images per batch (not needed with ``images``; default
                :func:`default_eval_batch_size` of this classifier's device).
            num_workers: Data-loading worker processes (not needed with ``images``).
            max_samples: Only the first N test images (not needed with ``images``).
            progress: Show a progress bar.
            images: The run's test images, whose loader is shared by every evaluation of the run.
            features: Maps the image embeddings before the head (see :meth:`logits`).

        Returns:
            The task's result.

        Raises:
            ModelInputError: when the model's outputs are not finite.
        """
        vision_model = vision_model.to(self.device).eval()
        if images is None:
            images = self.test_images([task], processor, batch_size=batch_size, num_workers=num_workers,
                                      max_samples=max_samples)  # fmt: skip
        # Sums stay on the device: one host round-trip per task, not per batch.
        loss_total = torch.zeros((), dtype=torch.float64, device=self.device)
        correct_total = torch.zeros((), dtype=torch.int64, device=self.device)
        seen = 0
        total = images.local_size(task)
        with Progress(desc=f"Evaluating {task.name}", total=total, unit="images", leave=False, enabled=progress) as bar:
            for pixels, labels in images.batches(task):
                labels = labels.to(self.device, non_blocking=True)
                logits = self.logits(vision_model, pixels, task, features)
                loss_total += F.cross_entropy(logits, labels, reduction="sum").double()
                correct_total += (logits.argmax(-1) == labels).sum()
                seen += labels.numel()
                bar.update(labels.numel())
        seen_total = torch.tensor(seen, dtype=torch.int64, device=self.device)
        self.world.all_reduce_sum_([loss_total, correct_total, seen_total], what=f"evaluation of {task.name}")
        loss_sum, correct, seen = float(loss_total), int(correct_total), int(seen_total)
        if not math.isfinite(loss_sum):
            raise ModelInputError(
                None,
                f"Task {task.name!r}: the model's outputs are not finite (NaN or infinity) on its test images; "
                "check the model's weights.",
            )
        return TaskMetrics(accuracy=correct / seen, loss=loss_sum / seen, num_samples=seen)

    def test_images(
        self,
        tasks: Sequence[Task],
        processor,
        *,
        batch_size: int | None = None,
        num_workers: int = 0,
        max_samples: int | None = None,
        held_out: Mapping[str, Any] | None = None,
    ) -> TestImages:
        """The tasks' test images behind one loader, pinned when this classifier is on CUDA (``held_out``: see
        :class:`TestImages`)."""
        return TestImages(
            tasks,
            processor,
            batch_size=batch_size or default_eval_batch_size(self.device),
            num_workers=num_workers,
            max_samples=max_samples,
            held_out=held_out,
            pin_memory=self.device.type == "cuda",
            world=self.world,
        )

    def evaluate(
        self,
        vision_model: nn.Module,
        tasks: Sequence[Task],
        processor=None,
        *,
        batch_size: int | None = None,
        num_workers: int = 0,
        max_samples: int | None = None,
        progress: bool = True,
        images: TestImages | None = None,
    ) -> MetricsReport:
        """Accuracy and loss of ``vision_model`` on each task, their average and the model's size.

        Args:
            vision_model: A CLIP vision tower of the base's family.
            tasks: The tasks, each evaluated on its test split.
            processor: The base's image processor (not needed with ``images``).
            batch_size: Test images per batch (not needed with ``images``; default
                :func:`default_eval_batch_size` of this classifier's device).
            num_workers: Data-loading worker processes (not needed with ``images``).
            max_samples: Evaluate only the first N test images of each task (not needed with ``images``).
            progress: Show progress bars.
            images: The run's test images (:meth:`test_images`), shared by its evaluations.

        Returns:
            The report the reference run writes as metrics.json.
        """
        vision_model = vision_model.to(self.device).eval()
        if images is None:
            images = self.test_images(tasks, processor, batch_size=batch_size, num_workers=num_workers,
                                      max_samples=max_samples)  # fmt: skip
        results: dict[str, TaskMetrics] = {}
        for task in Progress(tasks, desc="Evaluating tasks", unit="tasks", enabled=progress):
            results[task.name] = self.evaluate_task(vision_model, task, progress=progress, images=images)
            logger.info("%s: accuracy %.4f", task.name, results[task.name].accuracy)
        return MetricsReport.from_results(results, model_info=count_parameters(vision_model))


def _own_storage(module: nn.Module) -> None:
    """Give every CPU parameter and buffer of ``module`` storage of its own.

    transformers maps the base's safetensors file into memory and its CPU tensors are views of that
    map; while a single one of them lives (the visual projection, kept for evaluation) the whole map
    stays open, and every page the text and vision towers read stays in the process's resident memory
    (0.18 GiB after the class heads of a ViT-B/32 base). Copies let the map close with the towers.
    Tensors on an accelerator were copied off the map when the model moved there.
    """
    with torch.no_grad():
        for sub in module.modules():
            for param in sub.parameters(recurse=False):
                if param.device.type == "cpu":
                    param.data = param.data.clone()
            for name, buffer in list(sub.named_buffers(recurse=False)):
                if buffer.device.type == "cpu":
                    setattr(sub, name, buffer.clone())


class ZeroShotEvaluator:
    """CLIP's :class:`~featcal.families.base.Evaluator`: zero-shot accuracy with the base's text tower.

    Args:
        base_folder: The base ``CLIPModel`` folder (text tower, projections, tokenizer, image processor).
        device: Where the evaluation runs.
        world: Under torchrun, the processes that share each task's test images.
        held_out: The run's ``held_out`` evaluation setting (:func:`featcal.data.held_out_setting`), if any.

    Raises:
        ModelInputError: when the base is not a complete CLIPModel with a tokenizer and image processor.
    """

    def __init__(
        self,
        base_folder: str | Path,
        device: torch.device | str,
        *,
        world: World = SINGLE,
        held_out: Mapping[str, Any] | None = None,
    ) -> None:
        clip, tokenizer, self.processor = load_base_clip(base_folder, device)
        self.classifier = ZeroShotClassifier(clip, tokenizer, device, world=world)
        self.held_out = held_out  # the run's shuffle holding test images out of the calibration's, if any

    def base_model(self) -> nn.Module:
        """The base's own vision tower (evaluate it before :meth:`prepare`, which drops it)."""
        return self.classifier.clip.vision_model

    def prepare(self, tasks: Sequence[Task]) -> None:
        """Compute the class heads of ``tasks``, then drop the base's towers and tokenizer."""
        self.classifier.keep_heads_only(tasks)

    def test_data(
        self, tasks: Sequence[Task], *, batch_size: int | None, num_workers: int, max_samples: int | None
    ) -> TestImages:
        """The tasks' test images behind one loader (see :meth:`ZeroShotClassifier.test_images`)."""
        return self.classifier.test_images(
            tasks,
            self.processor,
            batch_size=batch_size,
            num_workers=num_workers,
            max_samples=max_samples,
            held_out=self.held_out,
        )

    def evaluate(self, model: nn.Module, tasks: Sequence[Task], *, data: TestImages, progress: bool) -> MetricsReport:
        """Zero-shot accuracy and loss of ``model`` on each task (see :meth:`ZeroShotClassifier.evaluate`)."""
        return self.classifier.evaluate(model, tasks, progress=progress, images=data)

    def evaluate_task(self, model: nn.Module, task: Task, *, data: TestImages, progress: bool) -> TaskMetrics:
        """Zero-shot accuracy and loss of ``model`` on one task."""
        return self.classifier.evaluate_task(model, task, progress=progress, images=data)
