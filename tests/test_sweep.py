"""`featcal sweep`: the joint calibration of several settings against separate runs, and the command."""

import dataclasses

import pytest
import torch
from transformers import CLIPImageProcessor, CLIPVisionModel

from featcal.calibration import FeatCalParams, featcal_calibrate
from featcal.calibration.sweep import featcal_calibrate_many, setting_groups
from featcal.errors import FeatcalError
from featcal.families.clip_vision.folders import vision_checkpoint
from featcal.families.clip_vision.images import calibration_pixels
from featcal.merging import get_method
from featcal.tasks import load_task_file
from tests.support.builders import FIXTURE
from tests.support.image_watch import ImagesAtSolves
from tests.support.rounding import FLOAT32_UPDATE_TOLERANCE

# Settings are compared with separate runs tensor by tensor, relative to the calibration's update
# (‖sweep − separate‖ / ‖separate − merged‖). A setting whose n is a multiple of the batch size sees
# the very same batches as its separate run; one with a partial last batch reads expert rows computed
# in a full batch, and whether a row's float32 result depends on the batch around it is the kernel's
# choice: with MKL's default kernels on an AMD EPYC it does not (every setting equal to its separate run
# to the bit), with MKL's COMPATIBLE branch it does, and n = 3 lands 2.7e-5 from its separate run (3.3e-5
# with ATen without SIMD and oneDNN at SSE4.1 besides; `python benchmarks/comparison_spread.py`). Such
# last-bit differences are the calibration's float32 rounding, so the bound is the golden run's
# (tests/support/rounding.py: 2.5e-4), far below what a real change of setting moves (α, ρ or λ by
# 0.05: above 0.1 on this measure, the fixture README).
TOLERANCE = FLOAT32_UPDATE_TOLERANCE


@pytest.fixture(scope="module")
def fixture_run():
    table = load_task_file(FIXTURE / "tasks.json")
    base = vision_checkpoint(FIXTURE / "base")
    experts = {t: vision_checkpoint(FIXTURE / "experts" / t) for t in table.tasks}
    merged_state = get_method("task_arithmetic")(base, list(experts.values()), scaling_factor=0.3)
    merged = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t0"))
    merged.load_state_dict(merged_state)
    processor = CLIPImageProcessor.from_pretrained(str(FIXTURE / "base"))
    pixels = {t: calibration_pixels(table.tasks[t], processor, 12, 42) for t in table.tasks}
    return base, experts, merged.eval(), pixels, table, processor


def cpu_state(model) -> dict:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def separate_run(fixture_run, params, device, forward_dtype=None):
    base, experts, merged, _, table, processor = fixture_run
    n = params.num_calibration_examples
    pixels = {t: calibration_pixels(table.tasks[t], processor, n, 42) for t in table.tasks}
    model = featcal_calibrate(
        merged, base, experts, pixels.__getitem__, params, device=device, progress=False, forward_dtype=forward_dtype
    )
    return cpu_state(model)


def swept(fixture_run, settings, device, together=None, forward_dtype=None):
    base, experts, merged, pixels, _, _ = fixture_run
    runs = featcal_calibrate_many(
        merged, base, experts, pixels.__getitem__, settings, together=together, device=device, progress=False,
        forward_dtype=forward_dtype,
    )  # fmt: skip
    return {i: cpu_state(model) for i, model in runs}


def worst_difference(state, expected, merged_state):
    """The largest ‖state − expected‖ / ‖expected − merged‖ over the calibrated tensors."""
    worst = 0.0
    for key, value in expected.items():
        if key.startswith("encoder.layers."):
            change = (expected[key] - merged_state[key]).norm()
            assert change > 0, key  # the calibration moved it: the comparison means something
            worst = max(worst, float((state[key] - value).norm() / change))
        else:
            assert torch.equal(state[key], value), key
    return worst


def test_nested_sizes_give_the_weights_of_separate_runs(fixture_run, device):
    merged_state = cpu_state(fixture_run[2])
    sizes = [3, 4, 8, 12]  # batch 4: a partial batch, one batch, two, three
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in sizes]
    results = swept(fixture_run, settings, device)
    assert sorted(results) == [0, 1, 2, 3]
    for i, params in enumerate(settings):
        expected = separate_run(fixture_run, params, device)
        assert worst_difference(results[i], expected, merged_state) <= TOLERANCE, params
    # the settings differ from one another by far more than the tolerance
    assert worst_difference(results[0], results[3], merged_state) > 1e-2


def test_multiples_of_the_batch_are_bit_identical_on_cpu(fixture_run):
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in (4, 12)]
    results = swept(fixture_run, settings, "cpu")
    for i, params in enumerate(settings):
        expected = separate_run(fixture_run, params, "cpu")
        for key, value in expected.items():
            assert torch.equal(results[i][key], value), (params.num_calibration_examples, key)


def test_bf16_forwards_give_the_weights_of_separate_bf16_runs(fixture_run, device):
    """The sweep's own forward loop autocasts as the driver does: each setting equals its bf16 run,
    and differs from its float32 one by far more than the tolerance."""
    merged_state = cpu_state(fixture_run[2])
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in (4, 12)]
    results = swept(fixture_run, settings, device, forward_dtype=torch.bfloat16)
    for i, params in enumerate(settings):
        expected = separate_run(fixture_run, params, device, forward_dtype=torch.bfloat16)
        assert worst_difference(results[i], expected, merged_state) <= TOLERANCE, params
    assert worst_difference(results[1], separate_run(fixture_run, settings[1], device), merged_state) > 1e-3


@pytest.mark.parametrize(
    "name,values",
    [("lambda_ratio", [0.01, 0.05, 0.2]), ("anchor_blend_rho", [1.0, 2.2]), ("teacher_interp_alpha", [0.0, 0.5])],
)
def test_parameter_values_give_the_weights_of_separate_runs(fixture_run, name, values, device):
    merged_state = cpu_state(fixture_run[2])
    common = FeatCalParams(num_calibration_examples=8, calibration_batch_size=4)
    settings = [dataclasses.replace(common, **{name: v}) for v in values]
    results = swept(fixture_run, settings, device)
    for i, params in enumerate(settings):
        expected = separate_run(fixture_run, params, device)
        assert worst_difference(results[i], expected, merged_state) <= TOLERANCE, params


def test_groups_give_the_same_weights_as_all_together(fixture_run, device):
    """Bit for bit on the CPU; on CUDA, where a group's batched solves may round otherwise, within TOLERANCE."""
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in (4, 8, 12)]
    together, one_by_one = swept(fixture_run, settings, device), swept(fixture_run, settings, device, together=1)
    for i in range(len(settings)):
        if device == "cpu":
            for key, value in together[i].items():
                assert torch.equal(one_by_one[i][key], value), key
        else:
            assert worst_difference(one_by_one[i], together[i], cpu_state(fixture_run[2])) <= TOLERANCE


def test_setting_groups_are_bounded_and_sorted_by_size():
    settings = [FeatCalParams(num_calibration_examples=n) for n in (64, 8, 32, 16)]
    assert list(setting_groups(settings, 2)) == [[1, 3], [2, 0]]
    assert list(setting_groups(settings, None)) == [[1, 3, 2, 0]]


def test_settings_must_share_the_batch_size(fixture_run):
    settings = [FeatCalParams(calibration_batch_size=4), FeatCalParams(calibration_batch_size=8)]
    with pytest.raises(FeatcalError, match="calibration_batch_size"):
        swept(fixture_run, settings, "cpu")


# --- the command -----------------------------------------------------------------------------------

FAST = ["--calibration-batch-size", "4", "--eval-num-workers", "0", "--eval-batch-size", "4"]
SWEEP_FAST = ["--eval-num-workers", "0", "--eval-batch-size", "4"]


@pytest.fixture(scope="module")
def run_dir(world, tmp_path_factory, device):
    from featcal.cli import main

    out = tmp_path_factory.mktemp("sweep-run") / "out"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out)]
    assert main([*argv, "--num-calibration-examples", "8", *FAST, "--device", device]) == 0
    return out


def read(path):
    import json

    return json.loads(path.read_text(encoding="utf-8"))


def test_sweep_over_n_writes_the_curve_and_its_n_of_the_run_matches_the_run(run_dir, world, capsys, device):
    from featcal.cli import main

    argv = ["-q", "sweep", str(run_dir), "--num-calibration-examples", "8,2,4", *SWEEP_FAST, "--device", device]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "n=2" in printed and "average" in printed and str(run_dir / "sweep" / "sweep.json") in printed
    sweep = read(run_dir / "sweep" / "sweep.json")
    assert sweep["num_calibration_examples"] == [2, 4, 8] and sweep["parameter"] is None
    assert [p["params"]["num_calibration_examples"] for p in sweep["points"]] == [2, 4, 8]
    assert sweep["run_id"] == read(run_dir / "run_config.json")["run_id"]
    assert (run_dir / "sweep" / "sweep.png").read_bytes().startswith(b"\x89PNG")
    calibrated, merged = read(run_dir / "featcal-ta" / "metrics.json"), read(run_dir / "ta" / "metrics.json")
    for task in world["tasks"]:  # n = 8 is the run's own setting: the same weights, the same accuracies
        assert sweep["points"][2]["tasks"][task] == calibrated[task]["accuracy"]
        assert sweep["merged"]["tasks"][task] == merged[task]["accuracy"]
    assert sweep["points"][2]["average"] == calibrated["average"]["accuracy"]


def test_sweep_of_lambda_uses_the_runs_n_and_shows_in_the_exported_card(run_dir, world, device):
    from featcal.cli import main
    from featcal.release.check import check_release

    argv = ["-q", "sweep", str(run_dir), "--param", "lambda-ratio=0.5,0.05", *SWEEP_FAST, "--device", device]
    assert main(argv) == 0
    sweep = read(run_dir / "sweep" / "sweep.json")
    assert sweep["parameter"] == {"name": "lambda_ratio", "values": [0.5, 0.05]}
    assert [p["params"]["lambda_ratio"] for p in sweep["points"]] == [0.5, 0.05]
    assert {p["params"]["num_calibration_examples"] for p in sweep["points"]} == {8}
    calibrated = read(run_dir / "featcal-ta" / "metrics.json")
    assert sweep["points"][1]["average"] == calibrated["average"]["accuracy"]  # λ = 0.05 is the run's
    assert main(["-q", "export", str(run_dir)]) == 0
    card = (run_dir / "release" / "README.md").read_text(encoding="utf-8")
    assert "| Task | λ=0.5 | λ=0.05 |" in card and "(sweep.png)" in card
    assert (run_dir / "release" / "sweep.png").is_file()
    check_release(run_dir / "release")  # the manifest lists sweep.png


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--param", "lambda=0.1"], "unknown FeatCal parameter to sweep 'lambda'"),
        (["--param", "num_calibration_examples=4,8"], "have their own option, --num-calibration-examples."),
        (["--param", "lambda_ratio=0.1,-1"], "lambda_ratio='-1' is invalid: it must be a finite number >= 0"),
        (["--param", "lambda_ratio"], "NAME=VALUE"),
        (["--num-calibration-examples", "4,0"], "--num-calibration-examples '4,0' is invalid"),
        (["--num-calibration-examples", "4,,8"], "--num-calibration-examples '4,,8' is invalid"),
        (["--num-calibration-examples", "13"], "fewer than the 13 calibration images"),
        (["--together", "0"], "--together '0' is invalid"),
        (["--device", "tpu"], "--device 'tpu' is invalid"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(run_dir, argv, message, capsys):
    from featcal.cli import main

    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    assert main(["-q", "sweep", str(run_dir), *argv, *SWEEP_FAST]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("featcal: error: "), err
    assert message.lower() in err[0].lower(), err[0]
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_a_skip_ta_run_is_swept_from_the_folder_it_started_from(run_dir, world, tmp_path, device):
    from featcal.cli import main

    out = tmp_path / "skip"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), "--no-export"]
    argv += ["--skip-ta", "--ta-model-path", str(run_dir / "ta"), "--num-calibration-examples", "8", *FAST]
    assert main([*argv, "--device", device]) == 0
    assert not (out / "ta" / "model.safetensors").exists()  # not merged here: ta/ holds its evaluation alone
    assert read(out / "ta" / "metrics.json")["average"]["accuracy"] > 0
    assert main(["-q", "sweep", str(out), "--num-calibration-examples", "8", *SWEEP_FAST, "--device", device]) == 0
    sweep, calibrated = read(out / "sweep" / "sweep.json"), read(out / "featcal-ta" / "metrics.json")
    assert sweep["merged_model"] == "ta"  # the folder's name
    assert sweep["points"][0]["average"] == calibrated["average"]["accuracy"]


def test_a_folder_that_is_not_a_run_is_refused(tmp_path, capsys):
    from featcal.cli import main

    assert main(["-q", "sweep", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err


# --- requests, report and plot ---------------------------------------------------------------------


def test_requests_are_parsed_and_checked():
    from featcal.errors import InvalidParameterError, UnknownNameError
    from featcal.sweep import SweptParameter, parse_parameter, parse_sizes
    from featcal.sweep.request import sweep_settings

    assert parse_sizes(" 32,8,16,8") == (8, 16, 32)
    assert parse_parameter("teacher-interp-alpha=0.5, 0,0.5") == SweptParameter("teacher_interp_alpha", (0.5, 0.0))
    for bad in ("", "8,", "8.5", "-8", "x"):
        with pytest.raises(InvalidParameterError):
            parse_sizes(bad)
    for bad in ("lambda_ratio=", "lambda_ratio=1,,2", "lambda_ratio=nan", "covariance_eps=-1", "=1"):
        with pytest.raises(InvalidParameterError):
            parse_parameter(bad)
    with pytest.raises(UnknownNameError):
        parse_parameter("calibration_batch_size=4,8")
    grid = sweep_settings(FeatCalParams(), (8, 16), SweptParameter("lambda_ratio", (0.1, 0.2)))
    assert [(p.num_calibration_examples, p.lambda_ratio) for p in grid] == [(8, 0.1), (16, 0.1), (8, 0.2), (16, 0.2)]
    assert all(p.anchor_blend_rho == 2.2 for p in grid)  # everything else as given


def _report(run_id="abc", parameter=None, sizes=(8, 16)):
    from featcal.sweep.report import SweepPoint, SweepReport

    values = (0.1, 0.2) if parameter else ()
    points = [
        SweepPoint({"num_calibration_examples": n, **({parameter: v} if parameter else {})}, 0.5, {"a": 0.4, "b": 0.6})
        for v in (values or (None,))
        for n in sizes
    ]
    merged = SweepPoint({"num_calibration_examples": 0}, 0.3, {"a": 0.2, "b": 0.4})
    return SweepReport(run_id, "ta", sizes, parameter, values, tuple(points), merged)


def test_sweep_json_round_trips_and_a_stale_sweep_is_ignored(tmp_path):
    from featcal.errors import RunFolderError
    from featcal.sweep.plot import write_sweep
    from featcal.sweep.report import SWEEP_FILE, SweepReport, read_sweep

    report = dataclasses.replace(_report(parameter="lambda_ratio"), precision="bf16")
    folder = write_sweep(tmp_path, report)
    assert read_sweep(tmp_path, "abc") == report
    assert read_sweep(tmp_path, "another recipe") is None
    assert [report.label(p) for p in report.points] == ["n=8 λ=0.1", "n=16 λ=0.1", "n=8 λ=0.2", "n=16 λ=0.2"]
    (folder / SWEEP_FILE).write_text('{"format": "featcal-sweep/1", "run_id": "abc"}')
    with pytest.raises(RunFolderError, match="not a featcal sweep"):
        read_sweep(tmp_path, "abc")
    with pytest.raises(RunFolderError):
        SweepReport.from_json([], where=tmp_path)


@pytest.mark.parametrize("parameter,sizes", [(None, (8, 16)), ("lambda_ratio", (8,)), ("lambda_ratio", (8, 16))])
def test_the_plot_draws_every_kind_of_sweep(tmp_path, parameter, sizes):
    from featcal.sweep.plot import save_sweep_plot

    assert save_sweep_plot(_report(parameter=parameter, sizes=sizes), tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("together,kept", [(None, False), (1, True)], ids=["one group", "two groups"])
def test_pixels_are_kept_only_for_a_later_group(fixture_run, monkeypatch, together, kept):
    """One group reads each task's images once and keeps none of them through the layers; with
    several groups each task's images are read once and kept for the next group."""
    base, experts, merged, pixels, _, _ = fixture_run
    images = ImagesAtSolves(pixels, monkeypatch)
    settings = [FeatCalParams(num_calibration_examples=n, calibration_batch_size=4) for n in (4, 12)]
    runs = featcal_calibrate_many(merged, base, experts, images, settings, together=together, progress=False)
    assert len(list(runs)) == 2
    assert len(images.handed_out) == len(experts)  # each task's images read once either way
    assert set(images.alive_at_solves) == ({len(experts)} if kept else {0})


def test_the_settings_share_one_set_of_solve_buffers(fixture_run, monkeypatch):
    """Each setting's layer state keeps only its joint buffers; the folds and solves of all settings
    (which run one after another) use one shared workspace, not one each."""
    from featcal.calibration import layer_state

    states, post_init = [], layer_state.LayerState.__post_init__

    def record(self):
        post_init(self)
        states.append(self)

    monkeypatch.setattr(layer_state.LayerState, "__post_init__", record)
    params = FeatCalParams(num_calibration_examples=8, calibration_batch_size=4)
    swept(fixture_run, [params, dataclasses.replace(params, lambda_ratio=0.5)], "cpu")
    assert len({id(s.workspace) for s in states}) == 1 and len(states) >= 2
    for state in states:
        arena = state.buffers[next(iter(state.buffers))].untyped_storage()
        joint = sum(b.numel() * b.element_size() for b in state.buffers.values())
        assert arena.nbytes() == joint  # nothing set aside for the solves
