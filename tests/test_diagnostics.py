"""Feature drift (`featcal diagnose`, `featcal run --diagnose`) on the tiny published-code fixture."""

from __future__ import annotations

import gc
import json
import math
import shutil

import pytest
import torch
from transformers import CLIPImageProcessor, CLIPVisionModel

from featcal.cli import main
from featcal.diagnostics.drift import POOLED, measure_drift
from featcal.diagnostics.report import CALIBRATED, MERGED, DriftReport, read_report
from featcal.errors import FeatcalError, RunFolderError
from featcal.families.clip_vision.adapter import CLIPVisionAdapter
from featcal.families.clip_vision.folders import vision_checkpoint
from featcal.families.clip_vision.images import calibration_pixels
from featcal.release import check_release
from featcal.runfolder.layout import DIAGNOSTICS, DIAGNOSTICS_PLOT, RUN_CONFIG
from featcal.runfolder.reader import read_run
from featcal.tasks import load_task_file
from tests.support.builders import FIXTURE
from tests.support.release_runs import make_run
from tests.support.runs import CPU, fast_run

TASKS = ("t0", "t1", "t2")
RUN = [
    "--tasks-file", str(FIXTURE / "tasks.json"), "--base-model-id", str(FIXTURE / "base"),
    *fast_run(calibration=8), "--eval-batch-size", "4",
]  # fmt: skip


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, device):
    """`featcal run --diagnose` on the fixture, measured on the run's calibration images, exported."""
    out = tmp_path_factory.mktemp("diagnose") / "run"
    argv = ["-q", "run", *RUN, "--device", device, "--diagnose", "--diagnose-split", "calibration"]
    assert main([*argv, "--output-dir", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def experts():
    return {t: vision_checkpoint(FIXTURE / "experts" / t) for t in TASKS}


def expert_model(task: str) -> CLIPVisionModel:
    return CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / task)).eval()


def calibration_images(task: str, n: int = 8) -> torch.Tensor:
    table = load_task_file(FIXTURE / "tasks.json")
    processor = CLIPImageProcessor.from_pretrained(str(FIXTURE / "base"))
    return calibration_pixels(table.tasks[task], processor, n, 42)


# --- the measurement -------------------------------------------------------------------------------


def test_an_expert_against_itself_drifts_exactly_zero(experts, device):
    drift = measure_drift(
        {"self": expert_model("t1")}, {"t1": experts["t1"]}, calibration_images, device=device, progress=False
    )
    assert drift.points == ("layer 0", "layer 1", POOLED)
    if device == "cpu":
        assert drift.drift["self"]["t1"] == (0.0, 0.0, 0.0)
    else:  # a GPU's library may pick other kernels for the two streams
        assert drift.drift["self"]["t1"] == pytest.approx((0.0, 0.0, 0.0), abs=1e-6)
    assert drift.num_images == {"t1": 8}


def test_drift_of_a_merge_is_positive_and_equals_the_definition(run_dir, experts, device):
    """Against the whole-model forward on the CPU: every layer's hidden states, and the pooled output."""
    merged = CLIPVisionModel.from_pretrained(str(run_dir / "ta")).eval()
    drift = measure_drift({MERGED: merged}, experts, calibration_images, batch_size=3, device=device, progress=False)
    for task in TASKS:
        pixels = calibration_images(task)
        with torch.no_grad():
            m = merged(pixel_values=pixels, output_hidden_states=True)
            e = expert_model(task)(pixel_values=pixels, output_hidden_states=True)
        expected = [float((a - b).norm() / b.norm()) for a, b in zip(m.hidden_states[1:], e.hidden_states[1:])]
        expected.append(float((m.pooler_output - e.pooler_output).norm() / e.pooler_output.norm()))
        assert drift.drift[MERGED][task] == pytest.approx(expected, rel=1e-5 if device == "cpu" else 1e-3)
        assert all(v > 0 for v in drift.drift[MERGED][task])


def test_the_models_are_left_where_and_as_they_were(run_dir, experts, device):
    merged = CLIPVisionModel.from_pretrained(str(run_dir / "ta")).eval()
    before = {k: v.clone() for k, v in merged.state_dict().items()}
    measure_drift({MERGED: merged}, {"t0": experts["t0"]}, calibration_images, device=device, progress=False)
    assert all(torch.equal(before[k], v) for k, v in merged.state_dict().items())


class CountingAdapter(CLIPVisionAdapter):
    """Counts, at the first batch of every layer, the live tensors shaped like a whole stream (all images)."""

    def __init__(self, num_images: int) -> None:
        super().__init__()
        self.num_images = num_images
        self.most = 0

    def run_layer(self, layer, hidden, context=None):
        if hidden.storage_offset() == 0:  # the first batch of a layer: count then
            self.count()
        return super().run_layer(layer, hidden, context)

    def count(self) -> None:
        streams = [
            t for t in gc.get_objects() if type(t) is torch.Tensor and t.dim() == 3 and t.shape[0] == self.num_images
        ]
        self.most = max(self.most, len({t.untyped_storage().data_ptr() for t in streams}))


def test_memory_holds_one_layer_of_features_per_stream(run_dir, experts, device):
    """Two models and one expert: three streams at any time, whatever the number of layers and tasks."""
    models = {
        MERGED: CLIPVisionModel.from_pretrained(str(run_dir / "ta")).eval(),
        CALIBRATED: CLIPVisionModel.from_pretrained(str(run_dir / "featcal-ta")).eval(),
    }
    adapter = CountingAdapter(num_images=8)
    measure_drift(models, experts, calibration_images, adapter=adapter, batch_size=3, device=device, progress=False)
    assert adapter.most == 3


def test_batch_size_does_not_change_the_drift(run_dir, experts, device):
    merged = CLIPVisionModel.from_pretrained(str(run_dir / "ta")).eval()
    small = measure_drift({MERGED: merged}, experts, calibration_images, batch_size=1, device=device, progress=False)
    large = measure_drift({MERGED: merged}, experts, calibration_images, batch_size=64, device=device, progress=False)
    for task in TASKS:
        assert small.drift[MERGED][task] == pytest.approx(
            large.drift[MERGED][task], rel=1e-5 if device == "cpu" else 1e-3
        )


def test_a_task_without_images_is_an_error(experts):
    with pytest.raises(FeatcalError, match="no images"):
        measure_drift({"x": expert_model("t0")}, {"t0": experts["t0"]}, lambda t: torch.empty(0, 3, 32, 32))


# --- featcal run --diagnose ------------------------------------------------------------------------


def test_featcal_lowers_the_summed_drift_on_the_calibration_images(run_dir):
    report = json.loads((run_dir / DIAGNOSTICS).read_text())
    assert report["split"] == "calibration" and report["images_per_task"] == dict.fromkeys(TASKS, 8)
    merged, calibrated = report["models"][MERGED], report["models"][CALIBRATED]
    assert (merged["stage"], calibrated["stage"]) == ("ta", "featcal-ta")
    assert calibrated["summed_layer_drift"] < merged["summed_layer_drift"]
    assert merged["summed_layer_drift"] == pytest.approx(math.fsum(v for t in TASKS for v in merged["drift"][t][:-1]))
    assert report["run_id"] == json.loads((run_dir / RUN_CONFIG).read_text())["run_id"]


def test_the_report_reads_back(run_dir):
    data = json.loads((run_dir / DIAGNOSTICS).read_text())
    report = DriftReport.from_json(data, where=run_dir / DIAGNOSTICS)
    assert report.to_json() == data
    assert read_report(run_dir, data["run_id"]).summary() == data["summary"]
    assert read_report(run_dir, "another-recipe") is None


def test_the_plot_is_a_png(run_dir):
    assert (run_dir / DIAGNOSTICS_PLOT).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_card_shows_the_summary_and_the_release_ships_the_plot(run_dir):
    summary = json.loads((run_dir / DIAGNOSTICS).read_text())["summary"]
    release = run_dir / "release"
    card = (release / "README.md").read_text()
    assert summary in card and f"({DIAGNOSTICS_PLOT})" in card
    assert (release / DIAGNOSTICS_PLOT).read_bytes() == (run_dir / DIAGNOSTICS_PLOT).read_bytes()
    assert DIAGNOSTICS_PLOT in {f.path_in_repo for f in check_release(release).files}


def test_a_second_run_skips_the_stage(run_dir, caplog, device):
    before = (run_dir / DIAGNOSTICS).stat().st_mtime_ns
    argv = ["run", *RUN, "--device", device, "--diagnose", "--diagnose-split", "calibration"]
    with caplog.at_level("INFO", logger="featcal"):
        assert main([*argv, "--output-dir", str(run_dir)]) == 0
    assert "Feature drift: diagnostics.json is up to date" in caplog.text
    assert (run_dir / DIAGNOSTICS).stat().st_mtime_ns == before
    assert "diagnose" in json.loads((run_dir / "stages.json").read_text())


def test_other_diagnostics_options_redo_the_stage_and_the_card(run_dir, tmp_path, device):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    argv = ["-q", "run", *RUN, "--device", device, "--diagnose", "--diagnose-images", "4", "--output-dir", str(run)]
    assert main(argv) == 0
    report = json.loads((run / DIAGNOSTICS).read_text())
    assert report["split"] == "test" and report["images_per_task"] == dict.fromkeys(TASKS, 4)
    assert report["summary"] in (run / "release" / "README.md").read_text()
    assert main(["-q", "run", *RUN, "--device", device, "--force", "--skip-featcal", "--output-dir", str(run)]) == 0
    assert not (run / DIAGNOSTICS).exists() and not (run / DIAGNOSTICS_PLOT).exists()
    assert DIAGNOSTICS_PLOT not in {p.name for p in (run / "release").iterdir()}


# --- featcal diagnose RUN --------------------------------------------------------------------------


def test_diagnose_command_measures_a_run_folder(run_dir, tmp_path, capsys, device):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    (run / DIAGNOSTICS).unlink()
    assert main(["-q", "diagnose", str(run), "--split", "test", "--num-images", "5", "--device", device]) == 0
    out = capsys.readouterr().out
    report = json.loads((run / DIAGNOSTICS).read_text())
    assert report["split"] == "test" and report["images_per_task"] == dict.fromkeys(TASKS, 5)
    assert report["summary"] in out and "layer 1" in out
    assert set(report["models"]) == {MERGED, CALIBRATED}
    assert read_run(run).calibrated is not None  # the run folder is still a valid run


def test_diagnose_a_merged_only_run(tmp_path, capsys, device):
    out = tmp_path / "run"
    assert main(["-q", "run", *RUN, "--device", device, "--skip-featcal", "--no-export", "--output-dir", str(out)]) == 0
    assert main(["-q", "diagnose", str(out), "--num-images", "4", "--device", device]) == 0
    report = json.loads((out / DIAGNOSTICS).read_text())
    assert set(report["models"]) == {MERGED}
    assert "Feature drift of Task Arithmetic from the experts" in report["summary"]
    code = main(["-q", "diagnose", str(out), "--split", "calibration", *CPU])
    assert code == 2
    assert "--split 'calibration' is invalid" in capsys.readouterr().err


def error_of(capsys, argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("featcal: error: ") and err.count("\n") == 1
    return err


def test_a_folder_without_models_is_refused_and_left_untouched(run_dir, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(run_dir / RUN_CONFIG, run / RUN_CONFIG)
    err = error_of(capsys, ["-q", "diagnose", str(run), *CPU])
    assert "has neither ta/ nor featcal-ta/" in err
    assert sorted(p.name for p in run.iterdir()) == [RUN_CONFIG]


def test_a_run_without_its_merged_stage_is_refused_naming_it_and_left_untouched(tmp_path, capsys):
    """With ta/ removed, the drift before FeatCal cannot be measured: refused, not the calibrated model alone."""
    run = make_run(tmp_path)[0]  # ta/ and featcal-ta/ of the tiny fixture, its tasks and base
    shutil.rmtree(run / "ta")
    capsys.readouterr()  # the building's own output
    before = {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    err = error_of(capsys, ["-q", "diagnose", str(run), "--num-images", "4", *CPU])
    assert f"Run folder {run} holds no merged model (ta/ with config.json)" in err
    assert not (run / DIAGNOSTICS).exists() and not (run / DIAGNOSTICS_PLOT).exists()
    assert {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before


def test_bad_inputs_exit_2(tmp_path, capsys):
    assert "does not exist" in error_of(capsys, ["diagnose", str(tmp_path / "missing")])
    assert "--num-images '0' is invalid" in error_of(capsys, ["diagnose", str(tmp_path), "--num-images", "0"])
    assert "--split 'train' is invalid" in error_of(capsys, ["diagnose", str(tmp_path), "--split", "train"])
    flags = ["--skip-featcal", "--diagnose", "--diagnose-split", "calibration", "--output-dir", str(tmp_path / "o")]
    err = error_of(capsys, ["run", *RUN, *CPU, *flags])
    assert "--diagnose-split 'calibration' is invalid" in err
    assert not (tmp_path / "o").exists()


def test_a_damaged_report_is_an_error(run_dir, tmp_path):
    (tmp_path / DIAGNOSTICS).write_text(json.dumps({"format": "something else"}))
    with pytest.raises(RunFolderError, match="not a featcal diagnostics report"):
        read_report(tmp_path, "x")


def test_a_run_from_a_given_merged_model_measures_that_model_not_its_calibration(run_dir, tmp_path, device):
    # FeatCal calibrates the merged model in place; the stage must read the merged weights back.
    out = tmp_path / "skip-ta"
    args = ["-q", "run", *RUN, "--device", device, "--diagnose", "--diagnose-split", "calibration"]
    args += ["--output-dir", str(out)]
    assert main([*args, "--skip-ta", "--ta-model-path", str(run_dir / "ta"), "--no-export"]) == 0
    ours, theirs = (json.loads((folder / DIAGNOSTICS).read_text())["models"] for folder in (out, run_dir))
    for name in (MERGED, CALIBRATED):
        assert ours[name]["summed_layer_drift"] == pytest.approx(theirs[name]["summed_layer_drift"], rel=1e-6)
