"""Model faults: each refused up front with one line naming the file (and tensor), exit 2, nothing written."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from featcal.cli import main
from tests.support.runs import CPU, fast_run

FAST = fast_run()
# The faults are refused before any model runs, so on the CPU alone.


@pytest.fixture
def world_copy(world, tmp_path):
    root = tmp_path / "w"
    shutil.copytree(world["root"], root)
    return root


def run(capsys, argv):
    code = main(["-q", *argv])
    err = capsys.readouterr().err.strip()
    return code, err


def poison(path, key_suffix: str, value=float("nan")) -> str:
    state = load_file(str(path))
    key = next(k for k in state if k.endswith(key_suffix))
    state[key].view(-1)[0] = value
    save_file(state, str(path), metadata={"format": "pt"})
    return key


def test_evaluate_refuses_a_model_with_nan_weights(world_copy, capsys) -> None:
    model = world_copy / "experts" / "task0"
    poison(model / "model.safetensors", "encoder.layers.1.mlp.fc2.weight")
    argv = ["evaluate", "--model", str(model), "--tasks-file", str(world_copy / "tasks.json"), *CPU]
    code, err = run(capsys, argv)
    assert code == 2 and len(err.splitlines()) == 1
    assert "encoder.layers.1.mlp.fc2.weight" in err and "model.safetensors" in err and "not finite" in err
    assert not (model / "metrics.json").exists()


def test_a_nan_base_is_refused_before_anything_is_written(world_copy, tmp_path, capsys) -> None:
    poison(world_copy / "base" / "model.safetensors", "vision_model.pre_layrnorm.bias", float("inf"))
    out = tmp_path / "out"
    argv = ["run", "--tasks-file", str(world_copy / "tasks.json"), "--output-dir", str(out), *FAST, *CPU]
    code, err = run(capsys, argv)
    assert code == 2 and "base model" in err and "pre_layrnorm.bias" in err and "not finite" in err
    assert not out.exists()


def test_a_vision_only_base_is_not_a_clip_model(world_copy, tmp_path, capsys) -> None:
    vision_only = world_copy / "experts" / "task1"  # a CLIPVisionModel folder
    out = tmp_path / "out"
    argv = ["run", "--tasks-file", str(world_copy / "tasks.json"), "--base-model-id", str(vision_only)]
    code, err = run(capsys, [*argv, "--output-dir", str(out), *FAST, *CPU])
    assert code == 2 and "'clip_vision_model' model, not a CLIPModel with a text tower" in err
    assert not out.exists()


def test_a_base_without_its_text_weights_is_refused(world_copy, tmp_path, capsys) -> None:
    weights = world_copy / "base" / "model.safetensors"
    state = {k: v for k, v in load_file(str(weights)).items() if not k.startswith("text_model.encoder.layers.1.")}
    save_file(state, str(weights), metadata={"format": "pt"})
    out = tmp_path / "out"
    argv = ["run", "--tasks-file", str(world_copy / "tasks.json"), "--output-dir", str(out), *FAST, *CPU]
    code, err = run(capsys, argv)
    assert code == 2 and "is not a complete CLIPModel" in err and "text_model.encoder.layers.1" in err
    assert not out.exists()


def test_a_merged_input_of_another_architecture_is_refused(world_copy, tmp_path, capsys) -> None:
    from transformers import CLIPVisionConfig, CLIPVisionModel

    config = CLIPVisionConfig(hidden_size=16, intermediate_size=20, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=8)  # fmt: skip
    other = tmp_path / "other"
    CLIPVisionModel(config).save_pretrained(other)
    out = tmp_path / "out"
    argv = ["run", "--tasks-file", str(world_copy / "tasks.json"), "--skip-ta", "--ta-model-path", str(other)]
    code, err = run(capsys, [*argv, "--output-dir", str(out), *FAST, *CPU])
    assert code == 2 and str(other) in err and "does not match the base model's vision tower" in err
    assert not out.exists()
    argv = ["evaluate", "--model", str(other), "--tasks-file", str(world_copy / "tasks.json"), *CPU]
    code, err = run(capsys, argv)
    assert code == 2 and "does not match the base model's vision tower" in err
    assert not (other / "metrics.json").exists()


def test_metrics_are_strict_json(world, tmp_path, device) -> None:
    from featcal.files.atomic import atomic_write_json

    with pytest.raises(ValueError):
        atomic_write_json(tmp_path / "m.json", {"t": {"accuracy": float("nan")}})
    assert not (tmp_path / "m.json").exists() and not list(tmp_path.iterdir())
    out = tmp_path / "out"
    assert main(["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out),
                 "--skip-featcal", *FAST, "--device", device]) == 0  # fmt: skip

    def refuse(constant: str) -> None:
        pytest.fail(f"a JSON file holds {constant}")

    for path in out.rglob("*.json"):
        json.loads(path.read_text(), parse_constant=refuse)
    assert torch.isfinite(torch.tensor(json.loads((out / "ta" / "metrics.json").read_text())["average"]["loss"]))
