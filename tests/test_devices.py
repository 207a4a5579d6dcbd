"""The device path: every stage runs wherever ``--device`` says, with the same results as the CPU's.

Tests taking ``device`` run on the CPU and, where torch sees a GPU, on CUDA too
(``tests/conftest.py``); `scripts/gpu_check.sh` runs the CUDA ones. Faults of the device path that
are not CUDA-specific are tested on the CPU here.
"""

import ast
import json
import shutil
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from featcal.cli import main
from featcal.devices import resolve_device
from featcal.errors import InvalidParameterError
from featcal.families.clip_vision.evaluation import (
    IMAGE_PROCESSOR,
    ZeroShotClassifier,
    load_base_clip,
    load_image_processor,
)
from featcal.merging import available_methods, get_method
from featcal.merging.registry import MethodRegistry, merge_method
from featcal.precision import fixed_precision
from featcal.tasks import load_task_file
from tests.support.builders import FIXTURE
from tests.support.merge_data import fixture_merge
from tests.support.runs import fast_run

FAST = [*fast_run(max_eval_samples=4), "--eval-experts", "--no-export"]
MERGING = Path(__file__).parents[1] / "featcal" / "merging"
FACTORIES = {"zeros", "ones", "empty", "full", "tensor", "arange", "eye", "rand", "randn", "linspace"}


def run(world, out: Path, *extra: str) -> int:
    return main(["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, *extra])


@pytest.fixture(scope="module")
def cpu_run(world, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cpu") / "run"
    assert run(world, out, "--device", "cpu") == 0
    return out


def test_a_run_on_each_device_matches_the_cpu_run(world, tmp_path, cpu_run, device) -> None:
    out = tmp_path / "run"
    assert run(world, out, "--device", device) == 0  # merge, evaluations (experts too), FeatCal
    for stage in ("ta", "featcal-ta"):
        ours, cpu = (
            load_file(str(out / stage / "model.safetensors")),
            load_file(str(cpu_run / stage / "model.safetensors")),
        )
        for key in cpu:
            torch.testing.assert_close(ours[key], cpu[key], rtol=1e-4, atol=1e-5)
    for stage in ("experts", "ta", "featcal-ta"):
        ours, cpu = (json.loads((o / stage / "metrics.json").read_text()) for o in (out, cpu_run))
        assert {t: ours[t]["accuracy"] for t in world["tasks"]} == {t: cpu[t]["accuracy"] for t in world["tasks"]}


@pytest.mark.parametrize("method", available_methods())
def test_every_merging_method_computes_on_the_device(method: str, device) -> None:
    from featcal.families.clip_vision.folders import vision_checkpoint

    base = vision_checkpoint(FIXTURE / "base")
    experts = [vision_checkpoint(FIXTURE / "experts" / f"t{i}") for i in range(3)]
    params = {"iterations": 5} if method == "wudi" else {}
    if get_method(method).uses_data:
        base, experts, params["data"] = fixture_merge()
    on_cpu = get_method(method)(base, experts, **params)
    on_device = get_method(method)(base, experts, device=device, **params)
    assert all(value.device.type == "cpu" for value in on_device.values())
    for key, value in on_cpu.items():
        torch.testing.assert_close(on_device[key], value, rtol=1e-4, atol=1e-6)


def test_no_merging_method_allocates_a_tensor_without_a_device() -> None:
    """A factory call without ``device=`` lands on the CPU while the inputs are on a GPU."""
    offenders = []
    for path in sorted(MERGING.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                offenders.append(f"{path.name}:{node.lineno} torch.{node.func.attr}")
    assert offenders == []


def test_a_whole_model_method_without_a_device_refuses_a_gpu() -> None:
    registry = MethodRegistry()

    @merge_method(
        "first", pretty_name="First", reference_url="https://example.org", whole_model=True, registry=registry
    )
    def first(base, experts):
        return dict(experts[0])

    base = {"w": torch.zeros(2)}
    assert registry.get("first")(base, [{"w": torch.ones(2)}], device="cpu")["w"].sum() == 2
    with pytest.raises(InvalidParameterError, match="computes on the CPU only"):
        registry.get("first")(base, [{"w": torch.ones(2)}], device="cuda")


def test_evaluating_a_model_moves_it_to_the_classifiers_device(device) -> None:
    """`--eval-experts` built each expert on the CPU and sent only the pixels to the device."""
    clip, tokenizer, processor = load_base_clip(FIXTURE / "base")
    task = next(iter(load_task_file(FIXTURE / "tasks.json").tasks.values()))
    classifier = ZeroShotClassifier(clip, tokenizer, device)
    model = clip.vision_model
    with mock.patch.object(model, "to", wraps=model.to) as moved:
        classifier.evaluate_task(model, task, processor, batch_size=4, max_samples=4, progress=False)
    moved.assert_any_call(torch.device(device))


def test_a_cuda_index_beyond_the_gpus_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(InvalidParameterError, match=r"cuda:0 to cuda:1, since torch sees 2 GPU"):
        resolve_device("cuda:2")


def test_the_precision_is_fixed_during_a_run_and_restored_after() -> None:
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = (matmul.fp32_precision, conv.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
    torch.set_float32_matmul_precision("high")  # a user's global setting: TF32 everywhere
    try:
        with fixed_precision("float32"):
            assert (matmul.fp32_precision, conv.fp32_precision) == ("ieee", "ieee")
            assert torch.backends.mkldnn.matmul.fp32_precision == "ieee"
        with fixed_precision("tf32"):
            assert (matmul.fp32_precision, conv.fp32_precision) == ("tf32", "tf32")
        assert matmul.fp32_precision == "tf32"  # the user's setting is back
    finally:
        torch.set_float32_matmul_precision("highest")
        matmul.fp32_precision, conv.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision = before


def test_precision_and_image_processor_are_recorded(world, tmp_path, capsys, device) -> None:
    out = tmp_path / "run"
    assert run(world, out, "--device", device, "--skip-featcal", "--precision", "tf32") == 0
    config = json.loads((out / "run_config.json").read_text())
    assert config["precision"] == "tf32" and config["evaluation"]["image_processor"] == IMAGE_PROCESSOR
    assert main(["run", "--tasks-file", str(world["tasks_file"]), "--precision", "fp16"]) == 2
    assert "--precision 'fp16' is invalid: it must be one of float32, tf32, bf16" in capsys.readouterr().err


def test_bf16_forwards_redo_the_calibration_and_nothing_before_it(world, tmp_path, cpu_run, device) -> None:
    """The same run folder with --precision bf16: the merge and its evaluation are kept, the calibration
    (whose forwards change) is redone, and its weights stay close to the float32 ones."""
    out = tmp_path / "run"
    shutil.copytree(cpu_run, out)
    before = json.loads((out / "stages.json").read_text())
    assert run(world, out, "--device", device, "--precision", "bf16") == 0
    after = json.loads((out / "stages.json").read_text())
    assert after["merge"] == before["merge"] and after["evaluate:ta"] == before["evaluate:ta"]
    assert after["calibrate"]["identity"] != before["calibrate"]["identity"]
    assert json.loads((out / "run_config.json").read_text())["precision"] == "bf16"
    merged = load_file(str(out / "ta" / "model.safetensors"))
    ours, reference = (load_file(str(o / "featcal-ta" / "model.safetensors")) for o in (out, cpu_run))
    changed = [k for k in reference if k.startswith("encoder.layers.")]
    gaps = [float((ours[k] - reference[k]).norm() / (reference[k] - merged[k]).norm()) for k in changed]
    assert 0 < max(gaps) < 0.1, max(gaps)  # bf16 rounding moves the update by a few percent at most


def test_the_pil_image_processor_is_used_with_or_without_torchvision() -> None:
    assert type(load_image_processor(FIXTURE / "base")).__name__ == IMAGE_PROCESSOR


def test_a_float16_base_is_loaded_in_float32(world, tmp_path, device) -> None:
    root = tmp_path / "w"
    shutil.copytree(world["root"], root)
    weights = root / "base" / "model.safetensors"
    save_file({k: v.half() for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    config = json.loads((root / "base" / "config.json").read_text())
    (root / "base" / "config.json").write_text(json.dumps({**config, "dtype": "float16", "torch_dtype": "float16"}))
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(root / "tasks.json"), "--output-dir", str(out), *FAST, "--device", device]
    assert main(argv) == 0
    assert load_file(str(out / "featcal-ta" / "model.safetensors"))["pre_layrnorm.weight"].dtype == torch.float32


def test_test_images_start_their_workers_once_per_run(monkeypatch) -> None:
    import featcal.families.clip_vision.images as images_module

    processor = load_image_processor(FIXTURE / "base")
    tasks = list(load_task_file(FIXTURE / "tasks.json").tasks.values())
    small = images_module.TestImages(tasks, processor, batch_size=4, num_workers=2)
    assert small.loader.num_workers == 0  # 30 images: workers would cost more than they save
    monkeypatch.setattr(images_module, "MIN_IMAGES_FOR_WORKERS", 0)
    images = images_module.TestImages(tasks, processor, batch_size=4, num_workers=1)
    seen, workers = {}, []
    for task in [*tasks, tasks[0]]:
        batches = list(images.batches(task))
        assert all(len(labels) <= 4 for _, labels in batches)
        seen.setdefault(task.name, []).append(torch.cat([labels for _, labels in batches]))
        workers.append([w.pid for w in images.loader._iterator._workers])
    assert all(pids == workers[0] for pids in workers)  # the same worker process served every pass
    first, again = seen[tasks[0].name]
    assert torch.equal(first, again) and len(first) == small.sizes[tasks[0].name]


def test_timings_record_the_peak_memory(cpu_run) -> None:
    memory = json.loads((cpu_run / "timings.json").read_text())["peak_memory"]
    assert 0.1 < memory["host_rss_gib"] < 64 and "cuda_max_allocated_gib" not in memory
