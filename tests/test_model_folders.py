"""Model folders written tensor by tensor (or whole through ``save_pretrained``) are the folders transformers'
``save_pretrained`` writes: one file or shards and their index, a tied tensor once, in a chosen dtype;
they load back in transformers and in featcal's Checkpoint, and appear whole or not at all."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from featcal.checkpoint import Checkpoint
from featcal.files.model_folders import (
    WEIGHTS,
    WEIGHTS_INDEX,
    save_model_state,
    saved_layout,
    streamed_model_folder,
)
from featcal.files.safetensors_writer import ShardedSafetensorsWriter

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # the tied pair, and the key save_pretrained keeps
# The tied Llama's stored tensors are 74880 bytes in float32: the embedding (12800) alone exceeds the first
# limit (a shard of its own), and both limits give at least three shards.
LIMITS = (10_000, 20_000)


def llama_config(tied: bool):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=tied,
    )  # fmt: skip


def meta_llama(tied: bool):
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(llama_config(tied))


def random_state(model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values for every key of ``model``'s state dict, a tied alias the very tensor it is tied to."""
    generator = torch.Generator().manual_seed(seed)
    state = {key: torch.randn(value.shape, generator=generator) for key, value in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state[HEAD] = state[EMBED]
    return state


def save_pretrained_folder(folder: Path, tied: bool, state: dict[str, torch.Tensor], **kwargs) -> Path:
    """What transformers' own save_pretrained writes for a materialised Llama holding ``state``."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(llama_config(tied))
    model.load_state_dict(state)
    model.save_pretrained(folder, **kwargs)
    return folder


def stream(model, folder: Path, state: dict[str, torch.Tensor], **kwargs) -> Path:
    with streamed_model_folder(model, folder, **kwargs) as writer:
        for key in reversed(list(state)):  # in any order
            writer.write(key, state[key])
    return folder


def weight_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("*.safetensors"))


def load_checked(folder: Path, **kwargs):
    """The folder loaded by ``AutoModelForCausalLM``, which must find every key and no other."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True, **kwargs)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_sharded_streamed_folder_is_the_one_save_pretrained_writes(tmp_path, tied, limit):
    meta = meta_llama(tied)
    state = random_state(meta)
    ours = stream(meta, tmp_path / "ours", state, max_shard_bytes=limit)
    theirs = save_pretrained_folder(tmp_path / "theirs", tied, state, max_shard_size=limit)

    index = json.loads((ours / WEIGHTS_INDEX).read_text())
    assert (ours / WEIGHTS_INDEX).read_text() == (theirs / WEIGHTS_INDEX).read_text()  # names, map, sizes
    assert weight_files(ours) == weight_files(theirs) == sorted(set(index["weight_map"].values()))
    assert len(weight_files(ours)) >= 3 and not (ours / WEIGHTS).exists()
    for name in weight_files(ours):  # one dtype: the very bytes of safetensors' save_file
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name
    assert (ours / "config.json").read_text() == (theirs / "config.json").read_text()

    # The properties that matter, whatever the assignment: every stored key in one shard, the tied
    # alias in none, each shard within the limit unless it is one tensor larger than it.
    stored = [key for key in state if not (tied and key == HEAD)]
    assert sorted(index["weight_map"]) == sorted(stored)
    sizes = {}
    for name in weight_files(ours):
        with safe_open(str(ours / name), framework="pt") as handle:
            keys = list(handle.keys())
            sizes[name] = sum(state[k].nbytes for k in keys)  # float32 as stored
            assert all(index["weight_map"][k] == name for k in keys)
            assert sizes[name] <= limit or len(keys) == 1
    assert index["metadata"]["total_size"] == sum(sizes.values()) == sum(state[k].nbytes for k in stored)
    assert index["metadata"]["total_parameters"] == meta.num_parameters()

    model = load_checked(ours)
    loaded = model.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied

    checkpoint = Checkpoint(ours)  # featcal's reader, bit for bit
    assert sorted(checkpoint) == sorted(stored)
    with checkpoint.reading():
        assert all(checkpoint[k].dtype == state[k].dtype and torch.equal(checkpoint[k], state[k]) for k in stored)


def test_a_limit_the_weights_fit_in_gives_one_file(tmp_path):
    meta = meta_llama(tied=False)
    folder = stream(meta, tmp_path / "m", random_state(meta), max_shard_bytes=10**9)
    assert weight_files(folder) == [WEIGHTS] and not (folder / WEIGHTS_INDEX).exists()


def test_bf16_storage_rounds_what_was_written_and_says_so(tmp_path):
    meta = meta_llama(tied=True)
    state = random_state(meta)
    config_dtype = meta.config.dtype
    folder = stream(meta, tmp_path / "ours", state, max_shard_bytes=5_000, dtype=torch.bfloat16)
    assert meta.config.dtype == config_dtype  # the caller's configuration is not changed
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    checkpoint = Checkpoint(folder)
    with checkpoint.reading():
        for key in checkpoint:
            assert checkpoint[key].dtype == torch.bfloat16
            assert torch.equal(checkpoint[key], state[key].to(torch.bfloat16))
    index = json.loads((folder / WEIGHTS_INDEX).read_text())
    assert index["metadata"]["total_size"] == sum(state[k].numel() * 2 for k in checkpoint)
    assert len(weight_files(folder)) >= 3
    model = load_checked(folder)  # transformers 5 loads in the folder's dtype
    assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.model.embed_tokens.weight, state[EMBED].to(torch.bfloat16))

    # save_model_state (through save_pretrained) writes the same folder.
    whole = save_model_state(
        meta_llama(tied=True), state, tmp_path / "whole", max_shard_bytes=5_000, dtype=torch.bfloat16
    )
    assert (whole / WEIGHTS_INDEX).read_text() == (folder / WEIGHTS_INDEX).read_text()
    assert weight_files(whole) == weight_files(folder)
    assert all((whole / name).read_bytes() == (folder / name).read_bytes() for name in weight_files(folder))
    assert (whole / "config.json").read_text() == (folder / "config.json").read_text()


def test_a_dtype_leaves_integer_buffers_as_they_are(tmp_path):
    """A ResNet's batch norms count their batches in int64 buffers: they stay int64 in a bf16 folder."""
    from transformers import AutoModel, ResNetConfig, ResNetModel

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_channels=3)
    with torch.device("meta"):
        meta = ResNetModel(config)
    layout = saved_layout(meta, torch.bfloat16).tensors
    integers = [key for key, (dtype, _) in layout.items() if not dtype.is_floating_point]
    assert integers and all(layout[key][0] == torch.int64 for key in integers)
    assert all(dtype == torch.bfloat16 for dtype, _ in (layout[k] for k in layout if k not in integers))
    state = {
        key: torch.full(value.shape, 3) if key in integers else torch.rand(value.shape)
        for key, value in meta.state_dict().items()
    }
    folder = stream(meta, tmp_path / "m", state, dtype=torch.bfloat16)
    with safe_open(str(folder / WEIGHTS), framework="pt") as handle:
        assert {k: handle.get_tensor(k).dtype for k in integers} == dict.fromkeys(integers, torch.int64)
        assert torch.equal(handle.get_tensor(integers[0]), state[integers[0]])
    model = AutoModel.from_pretrained(str(folder))
    assert model.dtype == torch.bfloat16


def test_a_tied_alias_is_stored_once_and_may_be_written_when_equal(tmp_path):
    meta = meta_llama(tied=True)
    assert HEAD in meta.state_dict()  # the state dict lists both keys ...
    saved = saved_layout(meta)
    assert saved.aliases == {HEAD: EMBED} and HEAD not in saved.tensors  # ... save_pretrained keeps the embedding's
    state = random_state(meta)
    for order, name in (([HEAD, EMBED], "alias-first"), ([EMBED, HEAD], "alias-last"), ([EMBED], "no-alias")):
        with streamed_model_folder(meta, tmp_path / name) as writer:
            for key in state:
                if key not in (EMBED, HEAD):
                    writer.write(key, state[key])
            for key in order:
                writer.write(key, state[key].clone())  # equal values, another tensor
        with safe_open(str(tmp_path / name / WEIGHTS), framework="pt") as handle:
            assert HEAD not in handle.keys() and torch.equal(handle.get_tensor(EMBED), state[EMBED])
        model = load_checked(tmp_path / name)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert torch.equal(model.lm_head.weight, state[EMBED])


@pytest.mark.parametrize("alias_first", [True, False])
def test_a_tied_alias_written_with_other_values_is_refused(tmp_path, alias_first):
    meta = meta_llama(tied=True)
    state = random_state(meta)
    keys = [key for key in state if key != HEAD]
    with pytest.raises(ValueError, match="tied weights"):
        with streamed_model_folder(meta, tmp_path / "m", max_shard_bytes=20_000) as writer:
            for key in [HEAD, *keys] if alias_first else [*keys, HEAD]:
                writer.write(key, state[EMBED] + 1 if key == HEAD else state[key])
    assert list(tmp_path.iterdir()) == []


def test_save_model_state_stores_a_tied_tensor_once(tmp_path):
    meta = meta_llama(tied=True)
    state = random_state(meta)
    theirs = save_pretrained_folder(tmp_path / "theirs", True, state)
    with_alias = save_model_state(meta_llama(tied=True), {**state, HEAD: state[EMBED].clone()}, tmp_path / "a")
    without = save_model_state(meta_llama(tied=True), {k: v for k, v in state.items() if k != HEAD}, tmp_path / "b")
    for folder in (with_alias, without):
        assert (folder / WEIGHTS).read_bytes() == (theirs / WEIGHTS).read_bytes()
        model = load_checked(folder)
        assert model.lm_head.weight is model.model.embed_tokens.weight
    with pytest.raises(ValueError, match="tied weights"):
        save_model_state(meta_llama(tied=True), {**state, HEAD: state[EMBED] + 1}, tmp_path / "c")
    with pytest.raises(ValueError, match=r"missing \['lm_head.weight'\]"):  # untied: both are needed
        save_model_state(meta_llama(tied=False), {k: v for k, v in state.items() if k != HEAD}, tmp_path / "d")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


@pytest.mark.parametrize("limit", [None, 20_000])
def test_save_model_state_shards_as_save_pretrained(tmp_path, limit):
    meta = meta_llama(tied=False)
    state = random_state(meta)
    ours = save_model_state(meta, dict(reversed(list(state.items()))), tmp_path / "ours", max_shard_bytes=limit)
    theirs = save_pretrained_folder(tmp_path / "theirs", False, state, **({"max_shard_size": limit} if limit else {}))
    assert weight_files(ours) == weight_files(theirs)  # the state's order does not change the shards
    assert all((ours / name).read_bytes() == (theirs / name).read_bytes() for name in weight_files(ours))
    if limit:
        assert (ours / WEIGHTS_INDEX).read_text() == (theirs / WEIGHTS_INDEX).read_text()


@pytest.mark.parametrize("limit", [None, 20_000])
def test_a_block_that_raises_or_misses_a_tensor_leaves_nothing(tmp_path, limit):
    meta = meta_llama(tied=False)
    state = random_state(meta)
    target = tmp_path / "m"
    with pytest.raises(RuntimeError, match="boom"):
        with streamed_model_folder(meta, target, max_shard_bytes=limit) as writer:
            writer.write(EMBED, state[EMBED])
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"1 tensor\(s\) never written, e.g. \['model.norm.weight'\]"):
        with streamed_model_folder(meta, target, max_shard_bytes=limit) as writer:
            for key in state:
                if key != "model.norm.weight":
                    writer.write(key, state[key])
    assert list(tmp_path.iterdir()) == []
    target.mkdir()  # a folder already there stays as it was
    (target / "keep").write_text("x")
    with pytest.raises(ValueError, match="never written"):
        with streamed_model_folder(meta, target, max_shard_bytes=limit):
            pass
    assert [p.name for p in tmp_path.iterdir()] == ["m"] and [p.name for p in target.iterdir()] == ["keep"]


def test_the_options_are_checked(tmp_path):
    meta = meta_llama(tied=False)
    for kwargs in ({"max_shard_bytes": 0}, {"max_shard_bytes": "5GB"}, {"dtype": torch.int8}, {"dtype": "bfloat16"}):
        with pytest.raises(ValueError):
            with streamed_model_folder(meta, tmp_path / "m", **kwargs):
                pass
        with pytest.raises(ValueError):
            save_model_state(meta, random_state(meta), tmp_path / "m", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_the_sharded_writer_routes_each_tensor_to_its_file(tmp_path):
    files = {
        "one.safetensors": {"a": (torch.float32, (2,)), "b": (torch.int64, (3,))},
        "two.safetensors": {"c": (torch.bfloat16, (2, 2))},
    }
    writer = ShardedSafetensorsWriter(tmp_path, files, {"format": "pt"}, aliases={"c2": "c"}, ignored={"x"})
    writer.write("c", torch.ones(2, 2))
    writer.write("x", torch.zeros(7))  # ignored
    with pytest.raises(KeyError):
        writer.write("nope", torch.zeros(1))
    with pytest.raises(KeyError):
        writer.write("c", torch.ones(2, 2))
    with pytest.raises(ValueError, match="shape"):
        writer.write("a", torch.ones(3))
    assert writer.pending() == ["a", "b"]
    writer.write("b", torch.arange(3))
    writer.write("a", torch.ones(2))
    with pytest.raises(ValueError, match="tied weights"):
        writer.write("c2", torch.ones(4))
    writer.write("c2", torch.ones(2, 2) + 1e-4)  # the same bytes in bf16: accepted
    writer.close()
    with safe_open(str(tmp_path / "two.safetensors"), framework="pt") as handle:
        assert list(handle.keys()) == ["c"] and handle.get_tensor("c").dtype == torch.bfloat16
    with safe_open(str(tmp_path / "one.safetensors"), framework="pt") as handle:
        assert torch.equal(handle.get_tensor("b"), torch.arange(3))
    with pytest.raises(ValueError, match="two files"):
        ShardedSafetensorsWriter(tmp_path / "n", {"p": files["two.safetensors"], "q": files["two.safetensors"]})
    with pytest.raises(ValueError, match="no file holds"):
        ShardedSafetensorsWriter(tmp_path / "n", {"p": files["two.safetensors"]}, aliases={"d": "zz"})


# model.safetensors of the tiny CLIPVisionModel below, as the one-file writer at 1062744 (before sharding) wrote it.
CLIP_WEIGHTS_SHA256 = "2e4ae60b458e33f1860241a17b71a9aeb4711bc9e0254ba51bda0be3d1b9f15a"


def test_the_one_file_path_writes_the_bytes_it_wrote_before_sharding(tmp_path):
    from featcal.families.clip_vision.folders import meta_vision_model
    from tests.support.builders import tiny_clip_config

    model = meta_vision_model(tiny_clip_config().vision_config)
    values = {
        key: (torch.linspace(-1, 1, value.numel(), dtype=torch.float64) * (i + 1)).reshape(value.shape).to(value.dtype)
        for i, (key, value) in enumerate(model.state_dict().items())
    }
    folder = stream(model, tmp_path / "ours", values)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", WEIGHTS]
    assert hashlib.sha256((folder / WEIGHTS).read_bytes()).hexdigest() == CLIP_WEIGHTS_SHA256
    whole = save_model_state(meta_vision_model(tiny_clip_config().vision_config), values, tmp_path / "whole")
    assert (whole / WEIGHTS).read_bytes() == (folder / WEIGHTS).read_bytes()
    assert (whole / "config.json").read_text() == (folder / "config.json").read_text()
