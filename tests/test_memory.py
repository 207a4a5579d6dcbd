"""Peak memory per stage (featcal.memory) and the lean run: what a run keeps in memory between stages."""

import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import time

import pytest
import torch

from featcal.allocator import glibc, keep_freed_memory_for_reuse
from featcal.devices import default_eval_batch_size
from featcal.errors import FeatcalError
from featcal.families.clip_vision.evaluation import ZeroShotClassifier, load_base_clip
from featcal.memory import MemoryMeter, host_peak_bytes
from featcal.spec import RunSpec
from featcal.tasks import load_task_file
from tests.support.builders import FIXTURE
from tests.support.runs import fast_run

MIB = 2**20


def _touch(nbytes: int) -> torch.Tensor:
    """A tensor whose pages are all resident."""
    return torch.ones(nbytes // 4, dtype=torch.float32)


def test_each_stage_records_its_own_peak_and_the_process_peak_is_kept():
    meter = MemoryMeter(torch.device("cpu"))
    with meter.stage("big"):
        big = _touch(400 * MIB)
        del big
    with meter.stage("small"):
        small = _touch(8 * MIB)
        del small
    report = meter.report()
    stages = report["stages"]
    assert set(stages) == {"start-up", "big", "small"}
    assert stages["big"]["host_rss_gib"] * 2**30 > 400 * MIB
    assert stages["big"]["host_rss_gib"] - stages["small"]["host_rss_gib"] > 300 / 1024
    assert report["host_rss_gib"] == pytest.approx(max(s["host_rss_gib"] for s in stages.values()), abs=0.01)
    assert report["host_rss_gib"] * 2**30 == pytest.approx(host_peak_bytes(), abs=MIB)  # never reset


def test_a_stage_below_the_record_is_sampled():
    meter = MemoryMeter(torch.device("cpu"), interval=0.001)
    with meter.stage("record"):
        _touch(300 * MIB)  # the process's record, so later stages stay below it
    with meter.stage("below"):
        kept = _touch(100 * MIB)
        time.sleep(0.05)  # several samples see it resident
        del kept
    below = meter.report()["stages"]["below"]["host_rss_gib"] * 2**30
    assert below > 100 * MIB and below < host_peak_bytes()


def test_the_peak_is_the_process_s_own_when_a_large_process_started_it():
    """A parent holding 768 MiB starts a process that needs about 0.2 GiB: its peak is its own, while its
    ``ru_maxrss`` holds the parent's high-water mark, kept across exec after vfork."""
    held = b"\x01" * (768 * MIB)  # touched pages of this process
    code = (
        "import json, resource; from featcal.memory import host_peak_bytes; "
        "print(json.dumps([host_peak_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    own, maxrss = json.loads(out)
    assert len(held) == 768 * MIB
    assert maxrss >= 768 * MIB  # what the peak would be read as from ru_maxrss
    assert 50 * MIB < own < 512 * MIB


def test_the_peak_is_ru_maxrss_where_there_is_no_proc(monkeypatch, tmp_path):
    import featcal.memory

    monkeypatch.setattr(featcal.memory, "_STATUS", tmp_path / "no-status")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert maxrss <= featcal.memory.host_peak_bytes() <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def test_a_run_records_per_stage_peaks_and_its_threads(world, tmp_path, device):
    from featcal.cli import main

    threads = torch.get_num_threads()
    out = tmp_path / "run"
    args = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out)]
    args += fast_run()
    args += ["--max-eval-samples", "4", "--eval-zero-shot", "--eval-experts", "--device", device]
    assert main(args) == 0
    timings = json.loads((out / "timings.json").read_text())
    memory = timings["peak_memory"]
    expected = {"start-up", "eval_zero-shot", "eval_experts", "merge", "eval_ta", "calibrate", "eval_featcal-ta"}
    assert expected | {"export"} == set(memory["stages"])
    peaks = [stage["host_rss_gib"] for stage in memory["stages"].values()]
    assert all(0.05 < peak <= memory["host_rss_gib"] for peak in peaks)
    # the allocator's peaks on CUDA, per stage and for the run; none on the CPU
    on_gpu = ["cuda_max_allocated_gib" in stage for stage in (memory, *memory["stages"].values())]
    assert on_gpu == [device == "cuda"] * len(on_gpu)
    assert timings["settings"]["torch_threads"] == 1  # the fixture's tower is small
    assert {"merge_s", "calibrate_s", "eval_experts_s", "eval_zero-shot_s"} <= set(timings)

    again = tmp_path / "again"
    assert main([*args[:5], str(again), *args[6:], "--threads", "2", "--no-export"]) == 0
    assert json.loads((again / "timings.json").read_text())["settings"]["torch_threads"] == 2
    assert torch.get_num_threads() == threads  # each run restored the process's count


def test_keep_heads_only_releases_the_base_towers_and_keeps_the_heads(device):
    table = load_task_file(FIXTURE / "tasks.json")
    tasks = list(table.tasks.values())
    clip, tokenizer, _ = load_base_clip(FIXTURE / "base")
    reference = ZeroShotClassifier(clip.to(device), tokenizer, device=device)
    heads = {t.name: reference.head(t).clone() for t in tasks}
    clip, tokenizer, _ = load_base_clip(FIXTURE / "base")
    classifier = ZeroShotClassifier(clip.to(device), tokenizer, device=device)
    classifier.keep_heads_only(tasks[:2])
    assert clip.text_model is None and clip.vision_model is None and clip.text_projection is None
    for task in tasks[:2]:
        assert torch.equal(classifier.head(task), heads[task.name])
    with pytest.raises(FeatcalError, match="text tower was already released"):
        classifier.head(tasks[2])


def _mapped(path) -> bool:
    real = os.path.realpath(path)
    return any(line.rstrip().endswith(real) for line in open("/proc/self/maps", encoding="utf-8"))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's maps from /proc")
def test_keep_heads_only_closes_the_map_of_the_base_s_weights_file(tmp_path):
    base = tmp_path / "base"
    shutil.copytree(FIXTURE / "base", base)
    table = load_task_file(FIXTURE / "tasks.json")
    clip, tokenizer, _ = load_base_clip(base)
    classifier = ZeroShotClassifier(clip, tokenizer)
    assert _mapped(base / "model.safetensors")  # transformers reads the weights through a map of the file
    scale, projection = clip.logit_scale.clone(), clip.visual_projection.weight.clone()
    classifier.keep_heads_only(list(table.tasks.values()))
    del clip
    gc.collect()
    assert not _mapped(base / "model.safetensors")  # no kept tensor holds the map (and the pages it read)
    assert torch.equal(classifier.clip.logit_scale, scale)
    assert torch.equal(classifier.clip.visual_projection.weight, projection)


def test_threads_default_to_one_for_small_towers_and_restore():
    from featcal.threads import SMALL_MODEL_HIDDEN_SIZE, choose_threads, torch_threads

    before = torch.get_num_threads()
    assert choose_threads(None, SMALL_MODEL_HIDDEN_SIZE - 1) == 1
    assert choose_threads(None, 768) == before
    assert choose_threads(3, 32) == 3
    with torch_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before


def test_the_calibration_runs_without_the_test_images_read_in_process(world, tmp_path, monkeypatch, device):
    import weakref

    import featcal.pipeline as pipeline
    from featcal.cli import main

    loaded: list[weakref.ref] = []
    alive_during_calibration: list[bool] = []
    test_images, calibrate = ZeroShotClassifier.test_images, pipeline.calibrate

    def tracked_test_images(self, *args, **kwargs):
        images = test_images(self, *args, **kwargs)
        loaded.append(weakref.ref(images))
        return images

    def checked_calibrate(*args, **kwargs):
        alive_during_calibration.extend(ref() is not None for ref in loaded)
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(ZeroShotClassifier, "test_images", tracked_test_images)
    monkeypatch.setattr(pipeline, "calibrate", checked_calibrate)
    args = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(tmp_path / "run")]
    args += fast_run()
    args += ["--max-eval-samples", "4", "--device", device, "--no-export"]
    assert main(args) == 0
    assert alive_during_calibration == [False]  # the merged model's evaluation loaded them; released
    assert len(loaded) == 2  # opened again for the calibrated model's evaluation
    tasks = json.loads(world["tasks_file"].read_text())["tasks"]
    metrics = json.loads((tmp_path / "run" / "featcal-ta" / "metrics.json").read_text())
    assert [metrics[task]["num_samples"] for task in tasks] == [4] * len(tasks)


def _fixture_state_and_config():
    from transformers import CLIPVisionModel

    expert = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t0"))
    return {k: v.clone() for k, v in expert.state_dict().items()}, expert.config


def test_saving_a_model_writes_what_a_materialised_model_writes(tmp_path):
    """The same files, byte for byte, as loading the state into a real model and saving that."""
    from transformers import CLIPVisionModel

    from featcal.families.clip_vision.folders import save_vision_model

    state, config = _fixture_state_and_config()
    save_vision_model(state, config, tmp_path / "lean")
    model = CLIPVisionModel(config)
    model.load_state_dict(state, strict=True)
    model.save_pretrained(tmp_path / "materialised")
    for name in ("model.safetensors", "config.json"):
        assert (tmp_path / "lean" / name).read_bytes() == (tmp_path / "materialised" / name).read_bytes(), name


def test_saving_a_model_makes_no_second_copy_of_its_weights(tmp_path, monkeypatch):
    """The model that writes the folder holds no weights of its own (meta device)."""
    from transformers import CLIPVisionModel

    from featcal.families.clip_vision.folders import save_vision_model

    devices = []
    original = CLIPVisionModel.save_pretrained

    def spy(self, *args, **kwargs):
        devices.extend({p.device.type for p in self.parameters()})
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CLIPVisionModel, "save_pretrained", spy)
    state, config = _fixture_state_and_config()
    save_vision_model(state, config, tmp_path / "lean")
    assert devices == ["meta"]


def test_saving_a_state_of_another_model_is_refused_and_writes_nothing(tmp_path):
    from featcal.families.clip_vision.folders import save_vision_model

    state, config = _fixture_state_and_config()
    del state["encoder.layers.0.mlp.fc1.weight"]
    state["encoder.layers.0.mlp.fc1.bias"] = torch.zeros(3)
    with pytest.raises(ValueError, match="missing.*fc1.weight.*other shapes.*fc1.bias"):
        save_vision_model(state, config, tmp_path / "bad")
    assert list(tmp_path.iterdir()) == []


_ALLOCATION_SCRIPT = """
import ctypes, sys, torch
from featcal.allocator import glibc, keep_freed_memory_for_reuse
applied = keep_freed_memory_for_reuse() if sys.argv[1] == "tuned" else False
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
glibc().mallinfo2.restype = MallInfo2
MIB = 2**20
activation = torch.empty(6 * MIB).fill_(1.0)  # 24 MiB, a batch activation's size
mapped = glibc().mallinfo2().hblkhd // MIB  # bytes in blocks mapped on their own
del activation
print(applied, mapped, glibc().mallinfo2().fordblks // MIB)  # free bytes the heap keeps
"""


@pytest.mark.skipif(glibc() is None, reason="glibc's allocator settings apply to glibc only")
def test_freed_activation_memory_is_kept_for_the_next_batch():
    """With glibc's defaults a fresh process maps a 24 MiB block on its own and unmaps it when freed
    (the next batch faults its pages in again); tuned, it comes from the heap, which keeps it."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.pop("FEATCAL_ALLOCATOR", None)
    result = {}
    for mode in ("default", "tuned"):
        out = subprocess.run(
            [sys.executable, "-c", _ALLOCATION_SCRIPT, mode], capture_output=True, text=True, check=True, env=env
        ).stdout.split()
        assert out[0] == str(mode == "tuned")
        result[mode] = (int(out[1]), int(out[2]))  # (MiB mapped on their own while alive, MiB kept free after)
    assert result["default"][0] >= 24 and result["default"][1] < 24
    assert result["tuned"][0] < 24 and result["tuned"][1] >= 24


def test_the_user_s_own_allocator_settings_win(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert keep_freed_memory_for_reuse() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert keep_freed_memory_for_reuse() is False
    monkeypatch.delenv("GLIBC_TUNABLES")
    monkeypatch.setenv("FEATCAL_ALLOCATOR", "glibc")
    assert keep_freed_memory_for_reuse() is False


def test_evaluation_batches_default_to_the_device_s_size_and_a_given_size_wins(device):
    table = load_task_file(FIXTURE / "tasks.json")
    task = next(iter(table.tasks.values()))
    clip, tokenizer, processor = load_base_clip(FIXTURE / "base")
    classifier = ZeroShotClassifier(clip.to(device), tokenizer, device=device)
    expected = 16 if torch.device(device).type == "cpu" else 256
    assert default_eval_batch_size(device) == expected
    assert (default_eval_batch_size("cpu"), default_eval_batch_size("cuda")) == (16, 256)
    assert classifier.test_images([task], processor).batch_size == expected
    given = classifier.test_images([task], processor, batch_size=3)
    assert given.batch_size == 3 and next(given.batches(task))[0].shape[0] == 3
    assert RunSpec().eval_batch_size is None and RunSpec(eval_batch_size=5).eval_batch_size == 5


def test_releasing_free_memory_hands_back_what_pyarrow_s_pool_kept():
    """pyarrow's default pool keeps freed blocks; release_free_memory gives them back to the system."""
    import numpy as np
    import pyarrow as pa

    from featcal.memory import host_rss_bytes, release_free_memory

    parts = [pa.array(np.random.default_rng(i).random(2_000_000)) for i in range(20)]  # numpy's memory
    pooled = pa.concat_arrays(parts)  # 320 MB from the pool
    assert pa.default_memory_pool().bytes_allocated() >= 300e6
    del parts, pooled
    kept = host_rss_bytes()
    release_free_memory()
    assert host_rss_bytes() < kept - 150e6
