"""Checkpoints read one tensor at a time and keep no file mapped between reads."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from featcal.checkpoint import Checkpoint
from featcal.errors import ModelInputError


def mapped(path: Path) -> bool:
    """Whether this process has ``path`` memory-mapped (its pages would count in the RSS)."""
    return str(path.resolve()) in Path("/proc/self/maps").read_text()


@pytest.fixture
def weights(tmp_path) -> Path:
    path = tmp_path / "model.safetensors"
    save_file({"vision_model.a": torch.ones(4, 3), "vision_model.b": torch.zeros(2), "text.c": torch.ones(1)}, path)
    return path


def test_keys_shapes_and_reads_without_a_lasting_mapping(weights) -> None:
    assert sorted(Checkpoint(weights)) == ["text.c", "vision_model.a", "vision_model.b"]
    ckpt = Checkpoint(weights, prefix="vision_model.")  # the part under a prefix, keyed without it
    assert sorted(ckpt) == ["a", "b"] and ckpt.shape("a") == (4, 3)
    assert not mapped(weights)
    assert torch.equal(ckpt["a"], torch.ones(4, 3))
    ckpt.check_finite()
    assert not mapped(weights)  # a checkpoint kept for a whole run holds no pages it once read
    with ckpt.reading():
        assert mapped(weights) and ckpt["b"].shape == (2,)
    assert not mapped(weights)


def test_a_non_finite_tensor_is_named(tmp_path) -> None:
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.tensor([1.0, float("nan")])}, path)
    with pytest.raises(ModelInputError, match="tensor 'w' in .*model.safetensors is not finite"):
        Checkpoint(path, name="expert").check_finite()
    assert not mapped(path)
