"""Task datasets and their images as tensors: loading, calibration subsets and evaluation loaders.

A task's dataset is a Hub dataset id or a local folder in the Hub's parquet layout; which one it is,
and whether the Hub may be asked, is decided by :mod:`featcal.hub`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler

from featcal.distributed import SINGLE, World
from featcal.errors import DatasetInputError
from featcal.hub import (
    OFFLINE_HINT,
    download_failure,
    gated_repo_message,
    hub_reachable,
    is_hub_id,
    is_offline,
    local_path,
    retry_transient,
)
from featcal.tasks import Task

logger = logging.getLogger(__name__)

ImageProcessor = Callable[..., dict]


def load_dataset_split(path: str, split: str, *, name: str | None = None, task: str = "?"):
    """One split of a dataset, from a local parquet repo folder or a Hub id.

    A Hub dataset is asked for only when the Hub answers, or from the cache when ``HF_HUB_OFFLINE``
    is set; passing refusals of the Hub (429, 5xx) are retried (:func:`~featcal.hub.retry_transient`).

    Args:
        path: A local dataset folder or a Hub dataset id.
        split: The split to load (``"train"``, ``"test"``).
        name: The dataset's configuration, if it has several.
        task: The task the dataset is for (carried by the errors).

    Returns:
        The split, a ``datasets.Dataset``.

    Raises:
        DatasetInputError: The folder does not exist, ``path`` is no Hub id, the Hub cannot be reached,
            the dataset is missing, gated or private, the split is missing, the download was refused or
            cut off, or the dataset cannot be loaded.
    """
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    local = local_path(path)
    if local is not None and not local.exists():
        raise DatasetInputError(task, path, f"Task {task!r}: the dataset folder {path} does not exist.")
    if local is None and not is_hub_id(path):
        raise DatasetInputError(
            task,
            path,
            f"Task {task!r}: the dataset {path!r} is neither an existing folder nor a Hub id ('namespace/name').",
        )
    if local is None and not is_offline() and not hub_reachable():
        # With HF_HUB_OFFLINE set, datasets can still serve a cached copy.
        raise DatasetInputError(
            task, path, f"Task {task!r}: cannot load dataset {path!r}: the Hub cannot be reached. {OFFLINE_HINT}"
        )

    def load():
        return datasets.load_dataset(str(local) if local is not None else path, name, split=split)

    try:
        return load() if local is not None or is_offline() else retry_transient(load, what=f"dataset {path}")
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise DatasetInputError(
                task, path, f"Task {task!r}: dataset {path!r} has no split {split!r} ({exc})."
            ) from None
        raise DatasetInputError(task, path, f"Task {task!r}: cannot load dataset {path!r}: {exc}") from None
    except DatasetNotFoundError as exc:
        if "gated" in str(exc):
            message = gated_repo_message("dataset", path, repo_type="dataset")
        else:
            message = (
                f"The dataset {path!r} is not on the Hub, or not visible to you: check its id in the tasks file, "
                "or log in with `hf auth login` for a private or gated one."
            )
        raise DatasetInputError(task, path, f"Task {task!r}: {message}") from None
    except Exception as exc:
        if local is not None:  # nothing of the Hub's to blame or retry: the folder is not a parquet dataset
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DatasetInputError(
                task,
                path,
                f"Task {task!r}: the dataset folder {path} does not load ({reason}): featcal reads a folder in "
                "the Hub's parquet layout (data/<split>-00000-of-00001.parquet, as `Dataset.to_parquet` writes) "
                "and never runs a dataset script.",
            ) from None
        if isinstance(exc, (FileNotFoundError, ConnectionError)):
            raise DatasetInputError(
                task, path, f"Task {task!r}: cannot load dataset {path!r}: {exc}. {OFFLINE_HINT}"
            ) from None
        message = download_failure(exc, "dataset", path, repo_type="dataset")
        if message is None:
            raise
        raise DatasetInputError(task, path, f"Task {task!r}: {message}") from None


def load_task_split(task: Task, split: str):
    """The ``train`` or ``test`` split of a task's dataset, with its columns checked."""
    spec = task.dataset
    split_name = spec.train_split if split == "train" else spec.test_split
    ds = load_dataset_split(spec.path, split_name, name=spec.name, task=task.name)
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


def calibration_indices(num_rows: int, n: int, seed: int) -> list[int]:
    """The first ``n`` rows of the split after one shuffle with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_rows, generator=generator)[:n].tolist()


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
    rows = calibration_indices(len(ds), n, seed)
    if len(rows) < world.size:
        raise DatasetInputError(
            task.name,
            task.dataset.path,
            f"Task {task.name!r}: its {len(rows)} calibration image(s) cannot be split over {world.size} processes; "
            f"start at most {len(rows)} processes.",
        )
    rows = rows[world.part(len(rows))]
    column = task.dataset.image_column
    chunks = []
    for start in range(0, len(rows), batch_size):
        batch = ds.select(rows[start : start + batch_size])[column]
        chunks.append(pixel_values(processor, batch))
    return torch.cat(chunks)


class LabelledImages(Dataset):
    """(image, label) pairs from a Hub-format dataset split; :class:`PixelBatch` makes the pixels."""

    def __init__(self, dataset, image_column: str, label_column: str) -> None:
        self.dataset = dataset
        self.image_column = image_column
        self.label_column = label_column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Image.Image, int]:
        row = self.dataset[index]
        return row[self.image_column], int(row[self.label_column])


class PixelBatch:
    """The collate function: one call of the image processor on the whole batch, and the labels.

    Runs in the data-loading workers when there are any; picklable for them.
    """

    def __init__(self, processor: ImageProcessor) -> None:
        self.processor = processor

    def __call__(self, rows: list[tuple[Image.Image, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = zip(*rows)
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
        pin_memory: bool = False,
        world: World = SINGLE,
    ) -> None:
        parts = []
        for task in tasks:
            ds = load_task_split(task, "test")
            if max_samples is not None:
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
        """``(pixels, labels)`` batches of ``task``'s test images (this process's), in order."""
        self._batches.task = self.index[task.name]
        return iter(self.loader)
