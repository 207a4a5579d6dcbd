"""Build tiny CLIP bases, experts and Hub-format datasets on disk, offline, for the tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny-clip-3task"


def _bytes_to_unicode() -> dict[int, str]:
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes, extra = printable[:], 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, codes)))


def byte_level_tokenizer(model_max_length: int | None = None):
    """A CLIPTokenizer over single bytes (no merges): 512 byte tokens plus BOS 512 and EOS 513."""
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": i + 256 for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = 512
    vocab["<|endoftext|>"] = 513
    extra = {} if model_max_length is None else {"model_max_length": model_max_length}
    return CLIPTokenizer(vocab=vocab, merges=[], **extra)


def tiny_clip_config(max_positions: int = 64):
    from transformers import CLIPConfig

    return CLIPConfig(
        text_config=dict(
            vocab_size=514,
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=max_positions,
            bos_token_id=512,
            eos_token_id=513,
            pad_token_id=513,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=32,
    )


def save_base(folder: Path, seed: int = 0, *, max_positions: int | None = None):
    """A random tiny CLIPModel with tokenizer and image processor, as a Hub-format folder.

    ``max_positions`` sets the text tower's positions and the tokenizer's ``model_max_length`` (77 in
    the real CLIP, long enough for the TA8 prompts); by default 64 and no limit.
    """
    from transformers import CLIPImageProcessor, CLIPModel

    torch.manual_seed(seed)
    model = CLIPModel(tiny_clip_config(max_positions or 64)).eval()
    model.save_pretrained(folder)
    byte_level_tokenizer(max_positions).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return model


def save_expert(base_model, folder: Path, seed: int, scale: float = 0.05):
    """The base's vision tower plus a random task vector, as a CLIPVisionModel folder."""
    from transformers import CLIPVisionModel

    generator = torch.Generator().manual_seed(seed)
    expert = CLIPVisionModel(base_model.config.vision_config)
    state = {
        k: v + scale * v.std().nan_to_num(0.02).clamp_min(0.02) * torch.randn(v.shape, generator=generator)
        if v.is_floating_point()
        else v
        for k, v in base_model.vision_model.state_dict().items()
    }
    expert.load_state_dict(state)
    expert.save_pretrained(folder)
    return expert


def save_dataset(
    folder: Path,
    classes: list[str],
    *,
    train: int,
    test: int,
    seed: int,
    image_column: str = "image",
    label_column: str = "label",
) -> None:
    """A parquet dataset repo (data/{split}-00000-of-00001.parquet) of random class-tinted images."""
    from datasets import ClassLabel, Dataset, Features
    from datasets import Image as ImageFeature

    rng = np.random.default_rng(seed)
    features = Features({image_column: ImageFeature(), label_column: ClassLabel(names=classes)})
    (folder / "data").mkdir(parents=True, exist_ok=True)
    for split, count in (("train", train), ("test", test)):
        labels = [i % len(classes) for i in range(count)]
        images = []
        for label in labels:
            tint = np.array([(label * 97) % 256, (label * 57) % 256, (label * 31) % 256])
            pixels = np.clip(rng.normal(tint, 60, size=(32, 32, 3)), 0, 255).astype(np.uint8)
            images.append(Image.fromarray(pixels))
        Dataset.from_dict({image_column: images, label_column: labels}, features=features).to_parquet(
            str(folder / "data" / f"{split}-00000-of-00001.parquet")
        )


def build_world(
    root: Path,
    *,
    tasks: int = 2,
    classes: int = 3,
    train: int = 12,
    test: int = 6,
    seed: int = 0,
    expert_scale: float = 0.05,
) -> dict:
    """A base, one expert and one dataset per task, and a tasks file naming them by relative path."""
    base = save_base(root / "base", seed)
    table = {}
    for i in range(tasks):
        name = f"task{i}"
        names = [f"kind{i}x{c}" for c in range(classes)]
        save_expert(base, root / "experts" / name, seed=seed + 100 + i, scale=expert_scale)
        save_dataset(root / "data" / name, names, train=train, test=test, seed=seed + 200 + i)
        table[name] = {
            "dataset": {"path": f"data/{name}"},
            "expert": f"experts/{name}",
            "classnames": names,
            "templates": ["a photo of a {}.", "a picture of {}."],
        }
    tasks_file = root / "tasks.json"
    tasks_file.write_text(json.dumps({"base_model": "base", "tasks": table}, indent=1))
    return {"root": root, "tasks_file": tasks_file, "base": root / "base", "tasks": list(table)}
