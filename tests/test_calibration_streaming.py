"""FeatCal from folder to folder, one encoder layer in memory at a time, and the writer behind it."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import CLIPImageProcessor, CLIPVisionModel

from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.calibration.streaming import CheckpointLayers, featcal_calibrate_folder
from featcal.errors import FeatcalError
from featcal.families.clip_vision import FAMILY
from featcal.families.clip_vision.adapter import CLIPVisionAdapter
from featcal.families.clip_vision.folders import save_vision_model, streamed_vision_model, vision_checkpoint
from featcal.families.clip_vision.images import calibration_pixels
from featcal.files.safetensors_writer import SafetensorsWriter
from featcal.merging import get_method
from featcal.tasks import load_task_file
from tests.support.builders import FIXTURE

PARAMS = FeatCalParams(num_calibration_examples=12, calibration_batch_size=4)


@pytest.fixture(scope="module")
def merged_folder(tmp_path_factory):
    """The fixture's Task Arithmetic merge saved as a folder, with its experts and calibration images."""
    table = load_task_file(FIXTURE / "tasks.json")
    base = vision_checkpoint(FIXTURE / "base")
    experts = {t: vision_checkpoint(FIXTURE / "experts" / t) for t in table.tasks}
    state = get_method("task_arithmetic")(base, list(experts.values()), scaling_factor=0.3)
    config = CLIPVisionModel.from_pretrained(str(FIXTURE / "base")).config
    folder = save_vision_model(state, config, tmp_path_factory.mktemp("merged") / "ta")
    processor = CLIPImageProcessor.from_pretrained(str(FIXTURE / "base"))
    pixels = {t: calibration_pixels(table.tasks[t], processor, 12, 42) for t in table.tasks}
    return folder, config, base, experts, pixels


def _calibrate_folder(merged_folder, output, **kwargs):
    folder, config, base, experts, pixels = merged_folder
    featcal_calibrate_folder(
        FAMILY, folder, output, base, experts, pixels.__getitem__, PARAMS, config=config, progress=False, **kwargs
    )


def test_the_streamed_calibration_writes_the_in_memory_calibration_s_folder(merged_folder, tmp_path, device):
    """Every tensor bit for bit, and the same config, as calibrating the loaded model and saving it."""
    folder, config, base, experts, pixels = merged_folder
    model = CLIPVisionModel.from_pretrained(str(folder))
    calibrated = featcal_calibrate(model, base, experts, pixels.__getitem__, PARAMS, device=device, progress=False)
    save_vision_model(calibrated.state_dict(), config, tmp_path / "in-memory")
    _calibrate_folder(merged_folder, tmp_path / "streamed", device=device)
    expected = load_file(str(tmp_path / "in-memory" / "model.safetensors"))
    streamed = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    assert streamed.keys() == expected.keys()
    assert [key for key in expected if not torch.equal(streamed[key], expected[key])] == []
    assert json.loads((tmp_path / "streamed" / "config.json").read_text()) == json.loads(
        (tmp_path / "in-memory" / "config.json").read_text()
    )
    with safe_open(str(tmp_path / "streamed" / "model.safetensors"), "pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    CLIPVisionModel.from_pretrained(str(tmp_path / "streamed"))  # transformers reads it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in-memory", "streamed"]  # no temporary left


def test_one_encoder_layer_at_a_time_is_in_memory(merged_folder, tmp_path, monkeypatch):
    """When a layer is loaded every other layer is on the meta device, and a stored layer goes back there."""
    seen = []
    load, store = CheckpointLayers.load, CheckpointLayers.store

    def watched_load(self, index, layer):
        siblings = [m for m in layer_list[0] if m is not layer]
        seen.append((index, sum(p.device.type != "meta" for m in siblings for p in m.parameters())))
        load(self, index, layer)

    def watched_store(self, index, layer):
        store(self, index, layer)
        seen.append((index, "stored", all(p.device.type == "meta" for p in layer.parameters())))

    layer_list = []
    from featcal.calibration import driver

    calibrate = driver.FeatCalibrator.calibrate

    def remember_layers(self, merged, *args, **kwargs):
        layer_list.append(self.adapter.layers(merged))
        return calibrate(self, merged, *args, **kwargs)

    monkeypatch.setattr(CheckpointLayers, "load", watched_load)
    monkeypatch.setattr(CheckpointLayers, "store", watched_store)
    monkeypatch.setattr(driver.FeatCalibrator, "calibrate", remember_layers)
    _calibrate_folder(merged_folder, tmp_path / "out")
    layers = len(layer_list[0])
    assert [entry for entry in seen if len(entry) == 2] == [(i, 0) for i in range(layers)]
    assert [entry for entry in seen if len(entry) == 3] == [(i, "stored", True) for i in range(layers)]


def test_a_failed_streamed_calibration_leaves_no_folder(merged_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("FEATCAL_FAIL_AT", "calibrate:layer1")
    with pytest.raises(FeatcalError, match="calibrate:layer1"):
        _calibrate_folder(merged_folder, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_a_process_that_does_not_write_calibrates_all_the_same(merged_folder, tmp_path):
    """``output`` None (the other processes of a torchrun): the calibration runs and nothing is written."""
    _calibrate_folder(merged_folder, None)
    _calibrate_folder(merged_folder, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_streamed_folder_with_a_tensor_missing_is_not_written(tmp_path):
    config = CLIPVisionModel.from_pretrained(str(FIXTURE / "base")).config
    state = CLIPVisionModel.from_pretrained(str(FIXTURE / "base")).state_dict()
    with pytest.raises(ValueError, match="never written"):
        with streamed_vision_model(config, tmp_path / "out") as writer:
            for key in list(state)[1:]:
                writer.write(key, state[key])
    assert list(tmp_path.iterdir()) == []


def test_the_writer_places_tensors_written_in_any_order_and_checks_them(tmp_path):
    tensors = {
        "b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a": torch.tensor([1.5], dtype=torch.bfloat16),
        "c": torch.arange(5, dtype=torch.int64),
    }
    layout = {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}
    writer = SafetensorsWriter(tmp_path / "x.safetensors", layout, {"format": "pt"})
    with pytest.raises(ValueError, match="shape"):
        writer.write("b", torch.zeros(3, 2))
    writer.write("c", tensors["c"])
    writer.write("b", tensors["b"].T.contiguous().T)  # a non-contiguous view is written as its values
    with pytest.raises(KeyError):
        writer.write("c", tensors["c"])
    with pytest.raises(ValueError, match="never written"):
        writer.close()
    writer = SafetensorsWriter(tmp_path / "x.safetensors", layout, {"format": "pt"})
    for name in ("c", "a", "b"):
        writer.write(name, tensors[name])
    writer.close()
    loaded = load_file(str(tmp_path / "x.safetensors"))
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], tensors[k]) for k in tensors)


def test_a_layer_with_tensors_outside_its_state_dict_is_refused():
    """A non-persistent buffer would be left as uninitialised memory by a checkpoint read: refused."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(2, 2)
            self.register_buffer("scale", torch.ones(2), persistent=False)

    with torch.device("meta"):
        layer = Layer()
    store = CheckpointLayers(None, None, torch.device("cpu"), None)
    with pytest.raises(FeatcalError, match="not in their state dict"):
        store._materialise(layer)


def test_the_writer_writes_save_file_s_bytes_for_one_dtype(tmp_path):
    """Tensors of one dtype, written in any order: the very bytes safetensors' own save_file writes."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        name: torch.randn(*shape, generator=generator)
        for name, shape in {"b.w": (3, 4), "a.b": (5,), "c": (2, 2, 2)}.items()
    }
    save_file(tensors, str(tmp_path / "reference.safetensors"), metadata={"format": "pt"})
    writer = SafetensorsWriter(
        tmp_path / "ours.safetensors", {k: (v.dtype, tuple(v.shape)) for k, v in tensors.items()}, {"format": "pt"}
    )
    for name in ("c", "a.b", "b.w"):
        writer.write(name, tensors[name])
    writer.close()
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_a_layer_of_mixed_dtypes_is_loaded_tensor_by_tensor(tmp_path):
    """Parameters of several dtypes cannot share one block: each gets its own memory, and its values."""

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.full = torch.nn.Linear(3, 2)
            self.half = torch.nn.Linear(2, 2).to(torch.float16)

    values = {f"encoder.layers.0.{k}": v for k, v in Layer().state_dict().items()}
    save_file(values, str(tmp_path / "model.safetensors"))
    with torch.device("meta"):
        layer = Layer()
    checkpoint = vision_checkpoint(tmp_path / "model.safetensors")
    store = CheckpointLayers(checkpoint, None, torch.device("cpu"), CLIPVisionAdapter())
    store.load(0, layer)
    loaded = {f"encoder.layers.0.{k}": v for k, v in layer.state_dict().items()}
    assert all(torch.equal(loaded[k], values[k]) and loaded[k].dtype == values[k].dtype for k in values)
    store.store(0, layer)
    assert all(p.device.type == "meta" for p in layer.parameters())
