"""The offline mini8 benchmark: procedural tasks, tokenizer, zoo building and caching, and the demo.

The test marked ``slow`` builds the reduced zoo (``ZooConfig.tiny()``) and runs the real pipeline on
it: Task Arithmetic must lose accuracy against the experts and FeatCal must win much of it back.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from featcal.demo import ZOO_VERSION, ZooConfig, build_zoo, default_cache_dir, zoo_path
from featcal.demo import zoo as zoo_module
from featcal.demo.images import MINI8_TASKS
from featcal.demo.looks import DUOTONES, in_task_look
from featcal.demo.styles import PRETRAIN_STYLES, restyle
from featcal.demo.tokenizer import build_tokenizer
from featcal.demo.vocabulary import pretraining_classnames
from featcal.errors import FeatcalError

# A zoo small enough to build in seconds: it checks formats, not accuracies.
MICRO = ZooConfig(
    name="micro",
    train_per_task=24,
    test_per_task=16,
    vision_hidden=32,
    vision_layers=2,
    text_hidden=32,
    projection_dim=32,
    pretrain_steps=2,
    pretrain_batch_size=16,
    expert_steps=2,
    expert_batch_size=8,
)


# ---------------------------------------------------------------- tasks and tokenizer


def test_eight_tasks_with_distinct_label_spaces_and_templates():
    assert len(MINI8_TASKS) == 8
    assert len({t.name for t in MINI8_TASKS}) == 8
    classnames = [set(t.classnames) for t in MINI8_TASKS]
    for i, a in enumerate(classnames):
        for b in classnames[i + 1 :]:
            assert not a & b
    for task in MINI8_TASKS:
        assert len(set(task.classnames)) == len(task.classnames) >= 6
        assert all(template.count("{}") == 1 for template in task.templates)


@pytest.mark.parametrize("task", MINI8_TASKS, ids=lambda t: t.name)
def test_renderers_are_deterministic_and_vary(task):
    def draw(seed: int, label: int) -> np.ndarray:
        return np.asarray(task.sample(np.random.default_rng(seed), label, 32))

    image = task.sample(np.random.default_rng(0), 0, 32)
    assert image.mode == "RGB" and image.size == (32, 32)
    assert np.array_equal(draw(1, 0), draw(1, 0))
    assert not np.array_equal(draw(1, 0), draw(2, 0))  # nuisances vary with the seed
    for label in range(len(task.classnames)):
        assert draw(3, label).std() > 5  # something is drawn


@pytest.mark.parametrize("style", sorted(PRETRAIN_STYLES))
def test_pretraining_styles_keep_the_image_and_change_its_look(style):
    images = [task.sample(np.random.default_rng(5), 1, 32) for task in MINI8_TASKS]
    styled = restyle(images, style)
    assert [(s.mode, s.size) for s in styled] == [("RGB", (32, 32))] * len(images)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(styled, restyle(images, style)))
    changed = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(images, styled)]
    assert all(changed) if style != "native" else not any(changed)


@pytest.mark.parametrize("task", MINI8_TASKS, ids=lambda t: t.name)
def test_distinct_task_looks_draw_each_form_task_in_its_own_palette(task):
    image = task.sample(np.random.default_rng(7), 2, 32)
    assert in_task_look(image, task.name, "shared") is image
    looked = in_task_look(image, task.name, "distinct")
    if task.name not in DUOTONES:  # colors and scenes: the colour is the label
        assert looked is image
        return
    dark, light = (np.array(c, np.float64) for c in DUOTONES[task.name])
    pixels = np.asarray(looked, np.float64).reshape(-1, 3)
    along = np.clip((pixels - dark) @ (light - dark) / ((light - dark) @ (light - dark)), 0, 1)
    off_palette = np.linalg.norm(pixels - (dark + along[:, None] * (light - dark)), axis=1)
    assert off_palette.max() < 1.5  # every pixel lies on the segment from the dark end to the light one
    brightness = np.asarray(image.convert("L"), np.float64).ravel()
    assert np.corrcoef(brightness, along)[0, 1] > 0.99  # the picture survives as brightness along it


def test_task_palettes_differ_from_task_to_task():
    assert set(DUOTONES) == {t.name for t in MINI8_TASKS} - {"colors", "scenes"}  # every form task has one
    ends = [np.array(dark + light, np.float64) for dark, light in DUOTONES.values()]
    assert min(np.linalg.norm(a - b) for i, a in enumerate(ends) for b in ends[i + 1 :]) > 60


def test_tokenizer_round_trips_and_separates_class_names(tmp_path):
    from transformers import AutoTokenizer

    corpus = [tpl.format(c) for t in MINI8_TASKS for tpl in t.templates for c in t.classnames]
    tokenizer = build_tokenizer(corpus)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded(corpus)["input_ids"] == tokenizer(corpus)["input_ids"]
    ids = tokenizer(["an arrow pointing upper right.", "an arrow pointing upper left."])["input_ids"]
    assert ids[0] != ids[1] and len(ids[0]) == len(ids[1]) == 8  # bos, 5 words, ".", eos: one token each
    assert tokenizer("a zebra!")["input_ids"][-1] == tokenizer.eos_token_id  # unseen words still tokenize


# ---------------------------------------------------------------- config and cache


def test_cache_keys():
    assert ZooConfig.mini8().cache_key() == f"mini8-v{ZOO_VERSION}-seed0"
    assert ZooConfig.mini8(seed=3).cache_key() == f"mini8-v{ZOO_VERSION}-seed3"
    assert ZooConfig.tiny().cache_key() == f"tiny8-v{ZOO_VERSION}-seed0"
    custom = replace(ZooConfig.mini8(), expert_steps=7).cache_key()
    assert (
        custom.startswith(f"mini8-v{ZOO_VERSION}-seed0-")
        and custom != replace(ZooConfig.mini8(), expert_steps=8).cache_key()
    )


@pytest.mark.parametrize(
    "bad",
    [
        dict(tasks=("digits", "nope")),
        dict(tasks=("digits",)),
        dict(patch_size=5),
        dict(expert_steps=0),
        dict(pretrain_style="sepia"),
        dict(pretrain_vocabulary="klingon"),
        dict(task_looks="plaid"),
    ],
)
def test_config_rejects_bad_fields(bad):
    with pytest.raises(FeatcalError):
        ZooConfig(**bad)


def test_assignments_make_a_variant_and_reject_bad_items():
    variant = ZooConfig.mini8().with_assignments(
        ["vision_hidden=128", "pretrain_vocabulary=held-out", "expert_lr=1e-4", "tasks=digits,colors"]
    )
    assert (variant.vision_hidden, variant.pretrain_vocabulary, variant.expert_lr) == (128, "held-out", 1e-4)
    assert variant.tasks == ("digits", "colors") and variant.cache_key() != ZooConfig.mini8().cache_key()
    for bad, message in (
        ("vision_hidden", "expected NAME=VALUE"),
        ("nope=1", "expected NAME=VALUE"),
        ("vision_hidden=wide", "'wide' is not a int"),
        ("pretrain_vocabulary=klingon", "pretrain_vocabulary must be one of"),
        ("task_looks=plaid", "task_looks must be one of"),
    ):
        with pytest.raises(FeatcalError, match=message):
            ZooConfig.mini8().with_assignments([bad])


def test_held_out_vocabulary_names_every_class_with_words_the_benchmark_never_uses():
    benchmark_words = {w for task in MINI8_TASKS for name in task.classnames for w in name.lower().split()}
    held_out = [pretraining_classnames(t.name, t.classnames, "held-out") for t in MINI8_TASKS]
    words = [w for names in held_out for name in names for w in name.split()]
    assert not benchmark_words & set(words) and len(words) == len(set(words))
    assert [len(n) for n in held_out] == [len(t.classnames) for t in MINI8_TASKS]
    assert pretraining_classnames("digits", MINI8_TASKS[0].classnames, "benchmark") == MINI8_TASKS[0].classnames


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("FEATCAL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "featcal"
    monkeypatch.setenv("FEATCAL_CACHE", str(tmp_path / "mine"))
    assert default_cache_dir() == tmp_path / "mine"
    assert zoo_path(ZooConfig.mini8()) == tmp_path / "mine" / "benchmark" / f"mini8-v{ZOO_VERSION}-seed0"


def test_failed_build_leaves_nothing(monkeypatch, tmp_path):
    def broken(folder: Path, config: ZooConfig, *, progress: bool) -> None:
        (folder / "base").mkdir()
        raise RuntimeError("killed")

    monkeypatch.setattr(zoo_module, "_build_into", broken)
    with pytest.raises(RuntimeError):
        build_zoo(MICRO, cache_dir=tmp_path, progress=False)
    assert list((tmp_path / "benchmark").iterdir()) == []


# ---------------------------------------------------------------- a micro zoo, read by featcal's own loaders


@pytest.fixture(scope="module")
def micro_zoo(tmp_path_factory) -> Path:
    return build_zoo(MICRO, cache_dir=tmp_path_factory.mktemp("cache"), progress=False)


def test_zoo_layout_loads_with_featcal_loaders(micro_zoo):
    from transformers import CLIPModel, CLIPVisionModel

    from featcal.checkpoint import check_compatible
    from featcal.families.clip_vision.entries import image_classes
    from featcal.families.clip_vision.evaluation import load_base_clip
    from featcal.families.clip_vision.folders import vision_checkpoint
    from featcal.families.clip_vision.images import load_task_split
    from featcal.tasks import load_task_file

    table = load_task_file(micro_zoo / "tasks.json")
    assert table.base_model == str(micro_zoo / "base")
    assert list(table.tasks) == [t.name for t in MINI8_TASKS]
    for task in table.tasks.values():
        assert Path(task.expert) == micro_zoo / "experts" / task.name
        test = load_task_split(task, "test")
        assert len(test) == MICRO.test_per_task and len(load_task_split(task, "train")) == MICRO.train_per_task
        assert test.features["label"].names == list(image_classes(task).classnames)
        assert test[0]["image"].size == (32, 32)
    base = vision_checkpoint(micro_zoo / "base")
    check_compatible(base, {t: vision_checkpoint(micro_zoo / "experts" / t) for t in table.tasks})
    assert isinstance(CLIPVisionModel.from_pretrained(micro_zoo / "experts" / "digits"), CLIPVisionModel)
    clip, tokenizer, processor = load_base_clip(micro_zoo / "base")
    assert isinstance(clip, CLIPModel)
    assert processor(images=[test[0]["image"]], return_tensors="pt")["pixel_values"].shape == (1, 3, 32, 32)
    assert tokenizer('a photo of the number: "7".')["input_ids"][-1] == clip.config.text_config.eos_token_id
    info = json.loads((micro_zoo / "zoo.json").read_text())
    assert info["version"] == ZOO_VERSION and info["seed"] == 0 and info["config"] == MICRO.to_dict()
    assert set(info["tasks"]) == set(table.tasks)
    assert all(0 <= r["expert_accuracy"] <= 1 for r in info["tasks"].values())


def test_experts_keep_the_frozen_parts_of_the_base(micro_zoo):
    from safetensors.torch import load_file

    base = {
        k.removeprefix("vision_model."): v
        for k, v in load_file(micro_zoo / "base" / "model.safetensors").items()
        if k.startswith("vision_model.")
    }
    expert = {
        k.removeprefix("vision_model."): v
        for k, v in load_file(micro_zoo / "experts" / "digits" / "model.safetensors").items()
    }
    frozen = [k for k in expert if k.startswith(MICRO.expert_frozen)]
    assert any(k.startswith("embeddings.") for k in frozen) and any(k.startswith("post_layernorm.") for k in frozen)
    assert all(torch.equal(expert[k], base[k]) for k in frozen)
    trained = [k for k in expert if k.startswith("encoder.") and k.endswith("weight")]
    assert any(not torch.equal(expert[k], base[k]) for k in trained)


def test_base_is_pretrained_on_the_train_images_in_the_pretraining_style(monkeypatch, tmp_path):
    import datasets

    assert ZooConfig.mini8().pretrain_style == "negative" and MICRO.pretrain_style == "negative"
    seen = {}
    real = zoo_module.pretrain_clip

    def spy(clip, tokenizer, data, **kwargs):
        seen.update(data)
        return real(clip, tokenizer, data, **kwargs)

    monkeypatch.setattr(zoo_module, "pretrain_clip", spy)
    folder = build_zoo(MICRO, cache_dir=tmp_path, progress=False)
    train = datasets.load_dataset(
        "parquet", data_files=str(folder / "data" / "digits" / "data" / "train-00000-of-00001.parquet")
    )["train"]
    images = [row["image"].convert("RGB") for row in train]
    processor = zoo_module._image_processor(MICRO)
    styled = processor(images=restyle(images, "negative"), return_tensors="pt")["pixel_values"]
    native = processor(images=images, return_tensors="pt")["pixel_values"]
    assert torch.allclose(seen["digits"].train_pixels, styled)
    assert not torch.allclose(seen["digits"].train_pixels, native)  # the experts' look is never seen
    assert seen["digits"].train_labels.tolist() == train["label"]


def test_held_out_vocabulary_pretrains_on_other_names_and_tokenizes_both(monkeypatch, tmp_path):
    seen = {}
    real = zoo_module.pretrain_clip

    def spy(clip, tokenizer, data, **kwargs):
        seen.update(data, tokenizer=tokenizer)
        return real(clip, tokenizer, data, **kwargs)

    monkeypatch.setattr(zoo_module, "pretrain_clip", spy)
    config = replace(MICRO, tasks=("digits", "colors"), pretrain_vocabulary="held-out")
    folder = build_zoo(config, cache_dir=tmp_path, progress=False)
    table = json.loads((folder / "tasks.json").read_text())["tasks"]
    tokenizer = seen["tokenizer"]
    for task in MINI8_TASKS[:1] + MINI8_TASKS[3:4]:
        assert tuple(seen[task.name].classnames) == pretraining_classnames(task.name, task.classnames, "held-out")
        assert table[task.name]["classnames"] == list(task.classnames)  # the benchmark keeps its own names
        for name in (*task.classnames, *seen[task.name].classnames):
            (piece, _), *_ = tokenizer.backend_tokenizer.pre_tokenizer.pre_tokenize_str(name.split()[-1])
            assert piece + "</w>" in tokenizer.get_vocab()  # the whole word is a token of the vocabulary


def test_distinct_task_looks_reach_every_split_of_the_zoo(tmp_path):
    import datasets

    assert ZooConfig.mini8().task_looks == "distinct" and ZooConfig.tiny().task_looks == "shared"
    config = replace(MICRO, tasks=("digits", "colors"), task_looks="distinct")
    folder = build_zoo(config, cache_dir=tmp_path, progress=False)
    for split in ("train", "test"):
        for task, grey in (("digits", True), ("colors", False)):
            path = folder / "data" / task / "data" / f"{split}-00000-of-00001.parquet"
            images = [
                np.asarray(row["image"].convert("RGB"), np.int16)
                for row in datasets.load_dataset("parquet", data_files=str(path))["train"]
            ]
            spread = max(int(np.abs(np.diff(image, axis=-1)).max()) for image in images)
            assert (spread <= 1) == grey  # digits in black-to-white, colors in their own hues


def test_cached_zoo_is_reused_and_force_rebuilds_identically(micro_zoo, monkeypatch):
    from safetensors.torch import load_file

    cache = micro_zoo.parent.parent
    before = load_file(micro_zoo / "experts" / "shapes" / "model.safetensors")
    calls = []
    real = zoo_module._build_into
    monkeypatch.setattr(zoo_module, "_build_into", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert build_zoo(MICRO, cache_dir=cache, progress=False) == micro_zoo
    assert calls == []
    assert build_zoo(MICRO, cache_dir=cache, force=True, progress=False) == micro_zoo
    assert calls == [1]
    after = load_file(micro_zoo / "experts" / "shapes" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert sorted(p.name for p in micro_zoo.parent.iterdir()) == [micro_zoo.name]  # no partial or old copies


# ---------------------------------------------------------------- the reduced benchmark, end to end


# Measured on the tiny zoo (seed 0): see benchmarks/mini8.md. The floors leave room for thread-count
# and platform noise but fail if merging stops hurting or FeatCal stops helping.
TINY_MIN_TA_LOSS = 8.0
TINY_MIN_FEATCAL_GAIN = 3.0


@pytest.fixture(scope="module")
def tiny_zoo(tmp_path_factory) -> Path:
    return build_zoo(ZooConfig.tiny(), cache_dir=tmp_path_factory.mktemp("tiny-cache"), progress=False)


@pytest.mark.slow
def test_demo_command_prints_the_table(tiny_zoo, tmp_path, capsys, device):
    from featcal.cli import build_parser
    from featcal.cli.demo import cmd_demo

    args = build_parser().parse_args(
        ["-q", "demo", "--tiny", "--zoo-cache-dir", str(tiny_zoo.parent.parent), "--device", device]
        + ["--output-dir", str(tmp_path / "demo")]
    )
    assert cmd_demo(args) == 0
    out = capsys.readouterr().out
    header = out.splitlines()[1]
    for column in ("zero-shot", "expert", "TA", "TA+FeatCal"):
        assert column in header
    assert all(t.name in out for t in MINI8_TASKS) and "average" in out
    assert (tmp_path / "demo" / "release" / "model.safetensors").is_file()

    def average(stage: str) -> float:
        return 100 * json.loads((tmp_path / "demo" / stage / "metrics.json").read_text())["average"]["accuracy"]

    experts, merged, calibrated = average("experts"), average("ta"), average("featcal-ta")
    assert experts - merged >= TINY_MIN_TA_LOSS, (experts, merged)
    assert calibrated - merged >= TINY_MIN_FEATCAL_GAIN, (merged, calibrated)


def test_the_zoo_trains_on_one_thread_whatever_the_caller_s_and_one_of_another_count_is_rebuilt(micro_zoo, monkeypatch):
    from safetensors.torch import load_file

    from featcal.threads import torch_threads

    cache, marker = micro_zoo.parent.parent, micro_zoo / "zoo.json"
    info = json.loads(marker.read_text())
    assert info["torch_threads"] == 1 and info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    before = load_file(micro_zoo / "experts" / "colors" / "model.safetensors")
    seen = []
    real = zoo_module._build_into

    def counting(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(zoo_module, "_build_into", counting)
    marker.write_text(json.dumps({**info, "torch_threads": 2}))  # as a two-thread build of before recorded it
    with torch_threads(2):
        assert build_zoo(MICRO, cache_dir=cache, progress=False) == micro_zoo
        assert torch.get_num_threads() == 2  # the caller's count, restored
    assert seen == [1]  # not reused: rebuilt, on one thread
    assert json.loads(marker.read_text())["torch_threads"] == 1
    after = load_file(micro_zoo / "experts" / "colors" / "model.safetensors")
    assert all(torch.equal(before[k], after[k]) for k in before)
