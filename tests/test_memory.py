"""Peak memory per stage (featcal.memory) and the lean run: what a run keeps in memory between stages."""

import json
import time

import pytest
import torch

from featcal.errors import FeatcalError
from featcal.evaluation import ZeroShotClassifier, load_base_clip
from featcal.memory import MemoryMeter, host_peak_bytes
from featcal.tasks import load_task_file
from tests.support.builders import FIXTURE

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


def test_a_run_records_per_stage_peaks_and_its_threads(world, tmp_path, device):
    from featcal.cli import main

    threads = torch.get_num_threads()
    out = tmp_path / "run"
    args = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out)]
    args += ["--num-calibration-examples", "4", "--calibration-batch-size", "4", "--eval-num-workers", "0"]
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


def test_keep_heads_only_releases_the_base_towers_and_keeps_the_heads():
    table = load_task_file(FIXTURE / "tasks.json")
    tasks = list(table.tasks.values())
    clip, tokenizer, _ = load_base_clip(FIXTURE / "base")
    reference = ZeroShotClassifier(clip, tokenizer)
    heads = {t.name: reference.head(t).clone() for t in tasks}
    clip, tokenizer, _ = load_base_clip(FIXTURE / "base")
    classifier = ZeroShotClassifier(clip, tokenizer)
    classifier.keep_heads_only(tasks[:2])
    assert clip.text_model is None and clip.vision_model is None
    for task in tasks[:2]:
        assert torch.equal(classifier.head(task), heads[task.name])
    with pytest.raises(FeatcalError, match="text tower was already released"):
        classifier.head(tasks[2])


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
    args += ["--num-calibration-examples", "4", "--calibration-batch-size", "4", "--eval-num-workers", "0"]
    args += ["--max-eval-samples", "4", "--device", device, "--no-export"]
    assert main(args) == 0
    assert alive_during_calibration == [False]  # the merged model's evaluation loaded them; released
    assert len(loaded) == 2  # opened again for the calibrated model's evaluation
    tasks = json.loads(world["tasks_file"].read_text())["tasks"]
    metrics = json.loads((tmp_path / "run" / "featcal-ta" / "metrics.json").read_text())
    assert [metrics[task]["num_samples"] for task in tasks] == [4] * len(tasks)
