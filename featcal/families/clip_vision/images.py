"""CLIP's task data: a task's images and labels as tensors, calibration pixels and the test loaders."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler

from featcal.data import held_out_indices, load_dataset_split, process_calibration_rows
from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError
from featcal.families.clip_vision.entries import image_classes
from featcal.tasks import Task

logger = logging.getLogger(__name__)

ImageProcessor = Callable[..., dict]
PIXEL_BATCH = 64  # images per call of the image processor


def load_task_split(task: Task, split: str):
    """The ``train`` or ``test`` split of a task's dataset, with its columns checked."""
    spec = task.dataset
    split_name = spec.train_split if split == "train" else spec.test_split
    ds = load_dataset_split(spec.path, split_name, name=spec.name, task=task.name, revision=spec.revision)
    missing = [c for c in (spec.image_column, spec.label_column) if c not in ds.column_names]
    if missing:
        raise DatasetInputError(
            task.name,
            spec.path,
            f"Task {task.name!r}: dataset {spec.path!r} split {split_name!r} has no column(s) {missing}; "
            f"it has {ds.column_names}. Set image_column/label_column in the tasks file.",
        )
    if len(ds) == 0:
        raise DatasetInputError(
            task.name, spec.path, f"Task {task.name!r}: split {split_name!r} of {spec.path!r} is empty."
        )
    return with_decoded_images(ds, spec.image_column)


def with_decoded_images(ds, column: str):
    """``ds`` with its image column decoded as PIL images.

    Parquet written by ``datasets`` records the column as an ``Image`` feature; parquet written by
    pyarrow directly (or other tools) holds the same ``{bytes, path}`` structs without that record.
    """
    import datasets

    feature = ds.features[column]
    if isinstance(feature, dict) and set(feature) == {"bytes", "path"}:
        return ds.cast_column(column, datasets.Image())
    return ds


# What PIL raises for an image it cannot read: garbage bytes, a truncated file, a decompression bomb.
UNREADABLE = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)
PYTHON_OBJECT = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")  # "<_io.BytesIO object at 0x7f...>"


def damaged(task: Task, split: str, row: int, reason: BaseException | str) -> DatasetInputError:
    """The error naming a row of a task's split that holds no readable image."""
    text = reason if isinstance(reason, str) else (str(reason).strip().splitlines() or [type(reason).__name__])[0]
    text = PYTHON_OBJECT.sub("its bytes", text)  # PIL names the file object it read, not the row
    split_name = task.dataset.train_split if split == "train" else task.dataset.test_split
    return DatasetInputError(
        task.name,
        task.dataset.path,
        f"Task {task.name!r}: row {row} of the {split_name} split of {task.dataset.path} is not a readable image "
        f"({text}): fix or remove that row of the dataset.",
    )


def read_image(ds, row: int, column: str) -> Image.Image:
    """Row ``row``'s image, decoded whole (a truncated file fails here, not later in the processor).

    Raises:
        One of :data:`UNREADABLE` when the row holds no readable image.
    """
    image = ds[row][column]
    image.load()
    return image


def check_images(task: Task, ds, split: str, rows: list[int]) -> None:
    """Decode the images of ``rows`` of a split, so that a damaged one is named before any work.

    Raises:
        DatasetInputError: naming the task, the split and the first row whose image does not read.
    """
    column = task.dataset.image_column
    for row in rows:
        try:
            read_image(ds, row, column)
        except UNREADABLE as exc:
            raise damaged(task, split, row, exc) from None


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL image (grayscale, palette, RGBA, CMYK, 16-bit) as 8-bit RGB."""
    if image.mode == "RGB":
        return image
    if image.mode in {"I;16", "I;16B", "I;16L", "I"}:
        arr = torch.from_numpy(np.asarray(image, dtype=np.float32))
        hi = float(arr.max()) or 1.0
        image = Image.fromarray((arr / hi * 255).clamp(0, 255).byte().numpy())
    if image.mode in {"RGBA", "LA", "P", "PA"}:
        rgba = image.convert("RGBA")
        canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(canvas, rgba).convert("RGB")
    return image.convert("RGB")


def pixel_values(processor: ImageProcessor, images: list[Image.Image]) -> torch.Tensor:
    """Pixel tensors [N, C, H, W] for a list of PIL images."""
    return processor(images=[to_rgb(im) for im in images], return_tensors="pt")["pixel_values"]


def calibration_pixels(
    task: Task, processor: ImageProcessor, n: int, seed: int, batch_size: int = 64, *, world: World = SINGLE
) -> torch.Tensor:
    """The calibration images of a task, from its train split only, as pixel tensors.

    Args:
        task: The task.
        processor: The base's image processor.
        n: Images to use (all of the split when it has fewer).
        seed: The seed of the shuffle that picks them.
        batch_size: Images per call of the processor.
        world: Under torchrun, this process's contiguous part of the images (:meth:`World.part`).

    Returns:
        ``[n, 3, H, W]`` pixels, or this process's part of them.

    Raises:
        DatasetInputError: the split cannot be loaded, or has fewer images than there are processes.
    """
    ds = load_task_split(task, "train")
    if n > len(ds) and world.is_main:
        logger.warning(
            "Task %s: asked for %d calibration images, the train split has %d; using all.", task.name, n, len(ds)
        )
    rows = process_calibration_rows(task, len(ds), n, seed, world, "image(s)")
    column = task.dataset.image_column
    chunks = []
    for start in range(0, len(rows), batch_size):
        batch = []
        for row in rows[start : start + batch_size]:
            try:
                batch.append(read_image(ds, row, column))
            except UNREADABLE as exc:
                raise damaged(task, "train", row, exc) from None
        chunks.append(pixel_values(processor, batch))
    return torch.cat(chunks)


@dataclass(frozen=True)
class Damaged:
    """A row whose image does not read, in place of its image: what a data-loading worker hands back
    (an exception raised there would reach the run as a traceback)."""

    row: int
    reason: str


class LabelledImages(Dataset):
    """(image, label) pairs from a Hub-format dataset split; :class:`PixelBatch` makes the pixels."""

    def __init__(self, dataset, image_column: str, label_column: str) -> None:
        self.dataset = dataset
        self.image_column = image_column
        self.label_column = label_column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Image.Image | Damaged, int]:
        try:
            row = self.dataset[index]  # decodes the image's header: garbage bytes fail here
            row[self.image_column].load()  # and its pixels: a truncated file fails here
        except UNREADABLE as exc:
            return Damaged(index, (str(exc).strip().splitlines() or [type(exc).__name__])[0]), -1
        return row[self.image_column], int(row[self.label_column])


class PixelBatch:
    """The collate function: one call of the image processor on the whole batch, and the labels; a batch
    holding a row whose image does not read is that row's :class:`Damaged` instead of its pixels.

    Runs in the data-loading workers when there are any; picklable for them.
    """

    def __init__(self, processor: ImageProcessor) -> None:
        self.processor = processor

    def __call__(self, rows: list[tuple[Image.Image | Damaged, int]]) -> tuple[torch.Tensor | Damaged, torch.Tensor]:
        images, labels = zip(*rows)
        bad = next((image for image in images if isinstance(image, Damaged)), None)
        if bad is not None:
            return bad, torch.tensor(labels, dtype=torch.int64)
        return pixel_values(self.processor, list(images)), torch.tensor(labels, dtype=torch.int64)


# Worker processes cost about a second to start and pay off only on larger test sets.
MIN_IMAGES_FOR_WORKERS = 1024


class _TaskBatches(Sampler[list[int]]):
    """Batches of one task's rows of a :class:`ConcatDataset`, in order; the task is switchable.

    Under torchrun, batch ``i`` of a task is rank ``i mod world size``'s: each process sees the very
    batches one process would, so per-batch results do not depend on the number of processes.
    """

    def __init__(self, offsets: Sequence[int], sizes: Sequence[int], batch_size: int, world: World = SINGLE) -> None:
        self.offsets, self.sizes, self.batch_size, self.world = list(offsets), list(sizes), batch_size, world
        self.task = 0

    def _all(self, task: int) -> Iterator[tuple[int, list[int]]]:
        start, size = self.offsets[task], self.sizes[task]
        for index, first in enumerate(range(0, size, self.batch_size)):
            yield index, list(range(start + first, start + min(first + self.batch_size, size)))

    def __iter__(self) -> Iterator[list[int]]:
        return (rows for index, rows in self._all(self.task) if self.world.owns(index))

    def __len__(self) -> int:
        return sum(1 for index, _ in self._all(self.task) if self.world.owns(index))

    def rows(self, task: int) -> int:
        """How many of ``task``'s images this process sees."""
        return sum(len(rows) for index, rows in self._all(task) if self.world.owns(index))


class TestImages:
    """Every task's test images (the first ``max_samples`` of each) behind one data loader.

    Its worker processes start once and serve every evaluation of a run (zero-shot, experts, merged,
    calibrated), instead of once per task and stage; below :data:`MIN_IMAGES_FOR_WORKERS` images in
    all, the main process loads them itself. With ``pin_memory`` (a CUDA device) batches arrive in
    page-locked memory for non-blocking copies.

    Args:
        tasks: The tasks; each one's test split is loaded and checked once.
        processor: The image processor, applied to a batch at a time in the loader.
        batch_size: Images per batch (a batch never mixes tasks).
        num_workers: Data-loading worker processes for large test sets.
        max_samples: Only the first N test images of each task.
        held_out: The run's ``held_out`` setting (:func:`featcal.data.held_out_setting`): a task it names, whose
            calibration reads its test split, is evaluated on the images after the calibration's in the same
            shuffle instead.
        pin_memory: Page-locked batches.
        world: Under torchrun, this process's batches only (every ``world.size``-th batch of a task).
    """

    def __init__(
        self,
        tasks: Sequence[Task],
        processor: ImageProcessor,
        *,
        batch_size: int,
        num_workers: int = 0,
        max_samples: int | None = None,
        held_out: Mapping[str, Any] | None = None,
        pin_memory: bool = False,
        world: World = SINGLE,
    ) -> None:
        parts = []
        for task in tasks:
            ds = load_task_split(task, "test")
            if held_out is not None and task.name in held_out["tasks"]:
                ds = ds.select(held_out_indices(len(ds), int(held_out["after"]), int(held_out["seed"]))[:max_samples])
            elif max_samples is not None:
                ds = ds.select(range(min(max_samples, len(ds))))
            parts.append(LabelledImages(ds, task.dataset.image_column, task.dataset.label_column))
        self.index = {task.name: i for i, task in enumerate(tasks)}
        sizes = [len(part) for part in parts]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.sizes = dict(zip(self.index, sizes))
        self._batches = _TaskBatches(offsets, sizes, batch_size, world)
        workers = num_workers if sum(sizes) >= MIN_IMAGES_FOR_WORKERS else 0
        self.loader = DataLoader(
            ConcatDataset(parts),
            batch_sampler=self._batches,
            num_workers=workers,
            collate_fn=PixelBatch(processor),
            pin_memory=pin_memory,
            persistent_workers=workers > 0,
        )

    @property
    def batch_size(self) -> int:
        """Test images per batch."""
        return self._batches.batch_size

    def local_size(self, task: Task) -> int:
        """How many of ``task``'s test images this process evaluates (all of them for one process)."""
        return self._batches.rows(self.index[task.name])

    def batches(self, task: Task) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``(pixels, labels)`` batches of ``task``'s test images (this process's), in order.

        Raises:
            DatasetInputError: naming the task, the split and the row, at the first image that does not read.
        """
        self._batches.task = self.index[task.name]
        for pixels, labels in self.loader:
            if isinstance(pixels, Damaged):
                raise damaged(task, "test", pixels.row, pixels.reason)
            yield pixels, labels


def check_labels(task: Task, dataset, split: str) -> None:
    """Raise naming the task, split and label when a label lies outside ``[0, number of class names)``."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = dataset.data.column(task.dataset.label_column)
    if not (pa.types.is_integer(column.type) or pa.types.is_boolean(column.type)):  # PatchCamelyon's are bool
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the {split} split of {task.dataset.path} has labels of type {column.type} in "
            f"column {task.dataset.label_column!r}; class indices must be integers (or booleans): fix "
            "'label_column' in the tasks file or the dataset.",
        )
    bounds = pc.min_max(column).as_py()
    low, high = int(bounds["min"]), int(bounds["max"])
    count = len(image_classes(task).classnames)
    if low < 0 or high >= count:
        bad = low if low < 0 else high
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: the {split} split of {task.dataset.path} has label {bad}, but the task has "
            f"{count} class names (labels 0 to {count - 1}); fix 'classnames' in "
            "the tasks file or the dataset.",
        )


def test_pixels(task: Task, processor: ImageProcessor, n: int) -> torch.Tensor:
    """The first ``n`` images of a task's test split (all of them when it has fewer), as pixel tensors.

    Raises:
        DatasetInputError: naming the task, the split and the row of an image that does not read.
    """
    ds = load_task_split(task, "test")
    rows = list(range(min(n, len(ds))))
    check_images(task, ds, "test", rows)
    column = task.dataset.image_column
    chunks = [
        pixel_values(processor, ds.select(rows[s : s + PIXEL_BATCH])[column]) for s in range(0, len(rows), PIXEL_BATCH)
    ]
    return torch.cat(chunks)
