"""Tiny stand-ins for the Hub repositories a `featcal run` reads, to serve from the Hub double.

The world is built for one built-in suite on one backbone (:func:`featcal.suites.suite_table`; by
default the eight TA8 tasks on CLIP ViT-B/32, what a run with no input flag reads):

- the backbone's base, e.g. ``openai/clip-vit-base-patch32``: a tiny CLIPModel with its tokenizer
  and image processor (:func:`tests.support.builders.save_base`), plus the other weight formats the
  real repository also holds (``pytorch_model.bin``, ``tf_model.h5``, ``flax_model.msgpack``) as
  placeholder bytes that are no weights at all: featcal must never fetch them.
- the backbone's experts, e.g. ``tanganke/clip-vit-base-patch32_<task>``: a tiny CLIPVisionModel per task.
- The suite's datasets under the ids and configurations the task table names, in the Hub's parquet
  layout, each with the configurations, splits, column names, label type and class count the table
  and :data:`DATASETS` give, and a README whose YAML declares them, as ``push_to_hub`` writes it.
  The train and test splits the table names hold :data:`ROWS` rows, others :data:`EXTRA_ROWS`,
  their labels spread over all the classes.

The split lists are those of the real dataset cards as this file's author knows them, or the splits
FusionBench's dataset configs name; they were not checked against the live Hub (the tests never
reach it). ``clip-benchmark/wds_fer2013`` is a WebDataset (tar shards) on the Hub; its stand-in is
parquet with the same columns (``jpg``, ``cls``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml
from PIL import Image

from tests.support.builders import save_base, save_expert
from tests.support.hub_double import git_blob_sha1

REPO_ROOT = Path(__file__).parents[2]
TA8 = REPO_ROOT / "featcal" / "resources" / "ta8_tasks.json"
# The sizes of the rehearsal's runs: a handful of images, CPU, no data-loading workers.
SMALL = ["--device", "cpu", "--num-calibration-examples", "8", "--max-eval-samples", "8", "--eval-num-workers", "0"]
ROWS = 8  # in each task's train and test split; other splits (corruptions, extra, validation) get EXTRA_ROWS
EXTRA_ROWS = 2
CORRUPTIONS = ["contrast", "gaussian_noise", "impulse_noise", "jpeg_compression", "motion_blur", "pixelate", "spatter"]
DIGITS = [str(d) for d in range(10)]


@dataclass(frozen=True)
class Config:
    """One configuration of a dataset repository: its folder of parquet files and its splits."""

    name: str
    folder: str
    splits: tuple[str, ...]
    full_numbers: bool = False  # SVHN's other configuration: a `digits` column of boxes and labels
    bool_labels: bool = False  # PatchCamelyon: the label column holds booleans, not class indices


def _default(*extra: str) -> tuple[Config, ...]:
    return (Config("default", "data", ("train", "test", *extra)),)


# Dataset id -> its configurations, as on the Hub.
DATASETS: dict[str, tuple[Config, ...]] = {
    "tanganke/sun397": _default(),
    "tanganke/stanford_cars": _default(*CORRUPTIONS),
    "tanganke/resisc45": _default(*CORRUPTIONS),
    "tanganke/eurosat": _default(*CORRUPTIONS),
    "ufldl-stanford/svhn": (
        Config("cropped_digits", "cropped_digits", ("train", "test", "extra")),
        Config("full_numbers", "full_numbers", ("train", "test", "extra"), full_numbers=True),
    ),
    "tanganke/gtsrb": _default(*CORRUPTIONS),
    "ylecun/mnist": (Config("mnist", "mnist", ("train", "test")),),
    "tanganke/dtd": _default(),
    # the twelve more tasks of the 14- and 20-task suites (featcal/resources/tall_tasks.json)
    "dpdl-benchmark/oxford_flowers102": _default("validation"),
    "1aurent/PatchCamelyon": (Config("default", "data", ("train", "validation", "test"), bool_labels=True),),
    "clip-benchmark/wds_fer2013": _default(),
    "timm/oxford-iiit-pet": _default(),
    "tanganke/stl10": _default(),
    "tanganke/cifar100": _default(),
    "tanganke/cifar10": _default(),
    "ethz/food101": (Config("default", "data", ("train", "validation")),),
    "zalando-datasets/fashion_mnist": _default(),
    "tanganke/emnist_letters": _default(),
    "tanganke/kmnist": _default(),
    "nateraw/rendered-sst2": _default("validation"),
}

PLACEHOLDER_WEIGHTS = {
    "pytorch_model.bin": b"placeholder: not a pickle, never to be fetched\n",
    "tf_model.h5": b"placeholder: not an HDF5 file\n",
    "flax_model.msgpack": b"placeholder: not msgpack\n",
}


def ta8_table() -> dict:
    return json.loads(TA8.read_text())


@dataclass(frozen=True)
class World:
    """The stand-ins on disk: each repository's folder, by repository type and id."""

    root: Path
    models: dict[str, Path]
    datasets: dict[str, Path]

    def publish(self, double, *, skip: tuple[str, ...] = ()) -> None:
        """Put every stand-in in ``double`` (a :class:`~tests.support.hub_double.HubDouble`), one commit each."""
        for repo_id, folder in self.models.items():
            if repo_id not in skip:
                double.publish_folder(repo_id, folder, summary="Upload model")
        for repo_id, folder in self.datasets.items():
            if repo_id not in skip:
                double.publish_folder(repo_id, folder, repo_type="dataset", summary="Upload dataset")


def build_world(root: Path, seed: int = 0, *, suite: str | None = None, backbone: str | None = None) -> World:
    """Write the base, experts and datasets of ``suite`` on ``backbone`` (default TA8 on B/32) under ``root``."""
    from featcal.families.clip_vision.entries import image_classes
    from featcal.suites import suite_table

    table = suite_table(suite, backbone)
    models: dict[str, Path] = {}
    base_folder = root / "models" / table.base_model
    base = save_base(base_folder, seed, max_positions=77)
    for name, data in PLACEHOLDER_WEIGHTS.items():
        (base_folder / name).write_bytes(data)
    (base_folder / "README.md").write_text("---\nlicense: mit\ntags:\n- vision\n---\n\n# Tiny stand-in CLIP\n")
    models[table.base_model] = base_folder
    datasets: dict[str, Path] = {}
    for i, task in enumerate(table.tasks.values()):
        expert = root / "models" / task.expert
        save_expert(base, expert, seed=seed + 100 + i)
        (expert / "README.md").write_text(f"---\nbase_model: {table.base_model}\n---\n\n# Tiny expert: {task.name}\n")
        models[task.expert] = expert
        spec = task.dataset
        if spec.path not in datasets:
            datasets[spec.path] = root / "datasets" / spec.path
            write_dataset(
                datasets[spec.path],
                DATASETS[spec.path],
                list(image_classes(task).classnames),
                seed=seed + 200 + i,
                columns=(spec.image_column, spec.label_column),
                full_splits=(spec.train_split, spec.test_split),
            )
    return World(root, models, datasets)


def _features(config: Config, classnames: list[str], columns: tuple[str, str]):
    from datasets import ClassLabel, Features, Sequence, Value
    from datasets import Image as ImageFeature

    image, label = columns
    if config.full_numbers:
        digit = {"bbox": Sequence(Value("int32"), length=4), "label": ClassLabel(names=DIGITS)}
        return Features({image: ImageFeature(), "digits": Sequence(digit)})
    return Features(
        {image: ImageFeature(), label: Value("bool") if config.bool_labels else ClassLabel(names=classnames)}
    )


def _image(label: int, rng: np.random.Generator) -> Image.Image:
    tint = np.array([(label * 97) % 256, (label * 57) % 256, (label * 31) % 256])
    return Image.fromarray(np.clip(rng.normal(tint, 60, size=(32, 32, 3)), 0, 255).astype(np.uint8))


def write_dataset(
    folder: Path,
    configs: tuple[Config, ...],
    classnames: list[str],
    *,
    seed: int,
    columns: tuple[str, str] = ("image", "label"),
    full_splits: tuple[str, ...] = ("train", "test"),
) -> None:
    """A dataset repository: ``{config folder}/{split}-00000-of-00001.parquet`` and a README declaring them.

    ``columns`` names the image and label columns; the ``full_splits`` hold :data:`ROWS` rows each.
    """
    from datasets import Dataset

    rng = np.random.default_rng(seed)
    infos, card_configs = [], []
    for config in configs:
        names = DIGITS if config.name in ("cropped_digits", "mnist") else classnames
        features = _features(config, names, columns)
        splits = []
        for split in config.splits:
            count = ROWS if split in full_splits else EXTRA_ROWS
            labels = [(i * len(names)) // count for i in range(count)]  # spread over all the classes
            images = [_image(label, rng) for label in labels]
            if config.full_numbers:
                rows = {"digits": [{"bbox": [[1, 2, 8, 16]], "label": [label]} for label in labels]}
            else:
                rows = {columns[1]: [bool(label) for label in labels] if config.bool_labels else labels}
            path = folder / config.folder / f"{split}-00000-of-00001.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            Dataset.from_dict({columns[0]: images, **rows}, features=features).to_parquet(str(path))
            splits.append({"name": split, "num_bytes": path.stat().st_size, "num_examples": count})
        infos.append({"config_name": config.name, "features": features._to_yaml_list(), "splits": splits})
        card_configs.append(
            {
                "config_name": config.name,
                "data_files": [{"split": s, "path": f"{config.folder}/{s}-*"} for s in config.splits],
            }
        )
    if len(infos) == 1 and configs[0].name != "default":
        card_configs[0]["default"] = True
    header = {"dataset_info": infos[0] if len(infos) == 1 else infos, "configs": card_configs}
    readme = f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n# Tiny stand-in of {folder.name}\n"
    (folder / "README.md").write_text(readme)


# -- running featcal as a user would, against the double ------------------------------------------


def user_env(endpoint: str, home: Path, *, offline: bool = False, token: str | None = None) -> dict[str, str]:
    """The environment of a user whose Hub is ``endpoint``: ``HF_HOME`` (and caches) under ``home``, no token
    unless ``token``, Xet off (the double speaks LFS only), ``HF_HUB_OFFLINE=1`` when ``offline``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "GRADIO_", "FEATCAL_"))}
    env.pop("PYTHONPATH", None)
    env |= {
        "HF_ENDPOINT": endpoint,
        "HF_HOME": str(home / "hf"),
        "HF_HUB_DISABLE_XET": "1",
        "XDG_CACHE_HOME": str(home / "xdg"),
        "FEATCAL_CACHE": str(home / "featcal"),
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "GRADIO_ANALYTICS_ENABLED": "False",
    }
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token:
        env["HF_TOKEN"] = token
    return env


def featcal_cli(args: list[str], env: dict[str, str], *, cwd: Path | None = None, timeout: float = 300):
    """``python -m featcal ARGS`` in a fresh process; the completed process (stdout, stderr as text)."""
    return subprocess.run(
        [sys.executable, "-m", "featcal", *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def error_line(result) -> str:
    """The one ``featcal: error:`` line a failed command printed last (exit status 2, no traceback)."""
    lines = result.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("featcal: error:")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr[-3000:]
    return errors[0]


def tensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def same_tensors(a: Path, b: Path) -> bool:
    first, second = tensors(a), tensors(b)
    return first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)


def cache_problems(home: Path) -> list[str]:
    """What in the caches under ``home`` a rerun could trust wrongly: a partial file (``*.incomplete``),
    a Hub cache blob whose content is not the one its name (sha256 or git oid) says, a snapshot link
    to a missing blob, and a dataset still being prepared."""
    problems = [str(p) for p in home.rglob("*.incomplete")]
    for blob in (home / "hf" / "hub").glob("*/blobs/*"):
        data = blob.read_bytes()
        digest = hashlib.sha256(data).hexdigest() if len(blob.name) == 64 else git_blob_sha1(data)
        if digest != blob.name:
            problems.append(f"{blob}: content does not match its name")
    for link in (home / "hf" / "hub").glob("*/snapshots/*/**/*"):
        if link.is_symlink() and not link.exists():
            problems.append(f"{link}: dangling")
    return problems
