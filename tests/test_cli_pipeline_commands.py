"""`featcal run` end to end on tiny local Hub-format folders, and its errors."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import CLIPImageProcessor, CLIPVisionModel

from featcal.cli import main
from featcal.families.clip_vision.images import calibration_pixels
from featcal.model_recipe import read_model_recipe
from featcal.tasks import load_task_file
from tests.support.rounding import FLOAT32_UPDATE_TOLERANCE, worst_update_difference

FAST = [
    "--num-calibration-examples",
    "8",
    "--calibration-batch-size",
    "4",
    "--eval-num-workers",
    "0",
    "--eval-batch-size",
    "4",
]
CPU = ["--device", "cpu"]  # for the refusals, which come before any model runs


@pytest.fixture(scope="module")
def run_dir(world, tmp_path_factory, device):
    out = tmp_path_factory.mktemp("run") / "out"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST]
    code = main([*argv, "--device", device])
    assert code == 0
    return out


def assert_same_calibration(run_dir: Path, calibrated: Path, exact: bool) -> None:
    """``calibrated``/model.safetensors is the run's calibration again. ``exact`` (both on the CPU): the
    same bits, as the same computation in the same process gives them (measured under every kernel
    setting of `benchmarks/comparison_spread.py`: MKL's COMPATIBLE branch, ATen without SIMD, oneDNN at
    SSE4.1, two threads); else (CUDA on either side) within the calibration's float32 rounding of the
    update (tests/support/rounding.py)."""
    cal = load_file(str(calibrated / "model.safetensors"))
    ref = load_file(str(run_dir / "featcal-ta" / "model.safetensors"))
    assert cal.keys() == ref.keys()
    if exact:
        assert all(torch.equal(cal[k], ref[k]) for k in ref), [k for k in ref if not torch.equal(cal[k], ref[k])]
    else:
        ta = load_file(str(run_dir / "ta" / "model.safetensors"))
        worst, name = worst_update_difference(cal, ref, ta, prefix="encoder.layers.")
        assert worst <= FLOAT32_UPDATE_TOLERANCE, (name, worst)
        assert all(torch.equal(cal[k], ta[k]) for k in ref if not k.startswith("encoder.layers."))


def test_run_writes_the_reference_layout(run_dir, world):
    for stage in ("ta", "featcal-ta"):
        folder = run_dir / stage
        recipe = ["featcal_recipe.json", *(["mergekit_config.yml"] if stage == "ta" else [])]
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            ["config.json", "metrics.json", "model.safetensors", "run.log", *recipe]
        )
        metrics = json.loads((folder / "metrics.json").read_text())
        assert set(world["tasks"]) < set(metrics)
        assert metrics["average"]["accuracy"] == pytest.approx(
            sum(metrics[t]["accuracy"] for t in world["tasks"]) / len(world["tasks"])
        )
        assert metrics["model_info"]["all_params"] > 0
        assert json.loads((folder / "run.log").read_text()) == metrics
        assert "\n" not in (folder / "run.log").read_text().strip()
    release = run_dir / "release"  # the last stage: the release folder, exactly what `featcal push` uploads
    assert {"README.md", "config.json", "model.safetensors", "metrics.json", "run_config.json"} <= {
        p.name for p in release.iterdir()
    }
    config = json.loads((run_dir / "run_config.json").read_text())
    assert config["tasks"] == world["tasks"]
    assert config["featcal"]["num_calibration_examples"] == 8
    assert config["merge"] == {"method": "task_arithmetic", "params": {"scaling_factor": 0.3}, "from": None}
    assert config["run_id"] == json.loads((run_dir / "featcal-ta" / "metrics.json").read_text())["run_id"]


def feature_drift(model, world):
    """Mean over tasks of ‖h_model − h_expert‖² / ‖h_expert‖² on the pooled (CLS) outputs."""
    table = load_task_file(world["tasks_file"])
    processor = CLIPImageProcessor.from_pretrained(str(world["base"]))
    drifts = []
    for name in world["tasks"]:
        expert = CLIPVisionModel.from_pretrained(str(world["root"] / "experts" / name))
        pixels = calibration_pixels(table.tasks[name], processor, 8, 42)
        with torch.no_grad():
            h_m = model(pixel_values=pixels).pooler_output
            h_e = expert(pixel_values=pixels).pooler_output
        drifts.append(float((h_m - h_e).pow(2).sum() / h_e.pow(2).sum()))
    return sum(drifts) / len(drifts)


def test_featcal_weights_are_finite_differ_from_ta_and_lower_drift(run_dir, world):
    ta = load_file(str(run_dir / "ta" / "model.safetensors"))
    cal = load_file(str(run_dir / "featcal-ta" / "model.safetensors"))
    assert set(ta) == set(cal)
    assert all(torch.isfinite(v).all() for v in cal.values())
    changed = [k for k in cal if not torch.equal(cal[k], ta[k])]
    assert changed and all("encoder.layers." in k for k in changed)
    ta_model = CLIPVisionModel.from_pretrained(str(run_dir / "ta")).eval()
    cal_model = CLIPVisionModel.from_pretrained(str(run_dir / "featcal-ta")).eval()
    assert feature_drift(cal_model, world) < 0.9 * feature_drift(ta_model, world)


def test_single_stages_match_run(run_dir, world, tmp_path, device):
    common = ["--tasks-file", str(world["tasks_file"]), "--device", device]
    assert main(["-q", "merge", "--output", str(tmp_path / "m"), *common]) == 0
    merged = load_file(str(tmp_path / "m" / "model.safetensors"))
    ta = load_file(str(run_dir / "ta" / "model.safetensors"))
    assert all(torch.equal(merged[k], ta[k]) for k in ta)
    assert (
        main(
            [
                "-q",
                "calibrate",
                "--merged",
                str(tmp_path / "m"),
                "--output",
                str(tmp_path / "c"),
                *common,
                "--num-calibration-examples",
                "8",
                "--calibration-batch-size",
                "4",
            ]
        )
        == 0
    )
    assert_same_calibration(run_dir, tmp_path / "c", exact=device == "cpu")
    assert main(["-q", "evaluate", "--model", str(tmp_path / "c"), *common, "--eval-num-workers", "0"]) == 0
    metrics = json.loads((tmp_path / "c" / "metrics.json").read_text())
    expected = json.loads((run_dir / "featcal-ta" / "metrics.json").read_text())
    assert metrics["average"]["accuracy"] == pytest.approx(expected["average"]["accuracy"])
    # each output says what it is, beside its weights; the merge in mergekit's words too
    merge_recipe, calibration = read_model_recipe(tmp_path / "m"), read_model_recipe(tmp_path / "c")
    assert (merge_recipe.kind, merge_recipe.merge.method, merge_recipe.merge.params) == (
        "merge", "task_arithmetic", {"scaling_factor": 0.3}
    )  # fmt: skip
    assert calibration.kind == "calibration" and calibration.merge == merge_recipe.merge
    assert calibration.featcal.params.num_calibration_examples == 8 and calibration.seed == 42
    mergekit = yaml.safe_load((tmp_path / "m" / "mergekit_config.yml").read_text())
    assert mergekit["merge_method"] == "task_arithmetic" and mergekit["base_model"] == merge_recipe.base_model
    assert [m["model"] for m in mergekit["models"]] == list(merge_recipe.experts.values())
    assert {m["parameters"]["weight"] for m in mergekit["models"]} == {0.3}
    assert not (tmp_path / "c" / "mergekit_config.yml").exists()  # a calibration is no mergekit merge


def test_calibrate_with_bf16_forwards_moves_the_weights_a_little(run_dir, world, tmp_path, device):
    """`featcal calibrate --precision bf16` reaches the engine: its weights differ from the float32 run's
    by bfloat16 rounding, a few percent of the calibration's update at most."""
    common = ["--tasks-file", str(world["tasks_file"]), "--device", device, "--num-calibration-examples", "8"]
    args = ["-q", "calibrate", "--merged", str(run_dir / "ta"), "--output", str(tmp_path / "c"), *common]
    assert main([*args, "--calibration-batch-size", "4", "--precision", "bf16"]) == 0
    ours = load_file(str(tmp_path / "c" / "model.safetensors"))
    reference = load_file(str(run_dir / "featcal-ta" / "model.safetensors"))
    merged = load_file(str(run_dir / "ta" / "model.safetensors"))
    layers = [k for k in reference if k.startswith("encoder.layers.")]
    gaps = [float((ours[k] - reference[k]).norm() / (reference[k] - merged[k]).norm()) for k in layers]
    assert 1e-3 < max(gaps) < 0.1, max(gaps)


def test_skip_ta_starts_from_a_merged_folder(run_dir, world, tmp_path, device):
    out = tmp_path / "resumed"
    assert (
        main(
            [
                "-q",
                "run",
                "--tasks-file",
                str(world["tasks_file"]),
                "--output-dir",
                str(out),
                *FAST,
                "--device",
                device,
                "--skip-ta",
                "--ta-model-path",
                str(run_dir / "ta"),
                "--skip-eval-ta",
            ]
        )
        == 0
    )
    assert not (out / "ta").exists()
    assert_same_calibration(run_dir, out / "featcal-ta", exact=device == "cpu")


def test_a_card_describes_the_merge_a_skip_ta_run_started_from(world, tmp_path, device):
    """The card names the method the merged folder's own recipe records, else says it is not recorded:
    never the run's default (Task Arithmetic) for a merge it did not make."""
    from huggingface_hub import ModelCard

    common = ["--tasks-file", str(world["tasks_file"]), "--device", device]
    assert main(["-q", "merge", "--method", "ties", "--output", str(tmp_path / "ties"), *common]) == 0
    ties_run = tmp_path / "from-ties"
    argv = ["-q", "run", *common, *FAST, "--skip-ta", "--ta-model-path", str(tmp_path / "ties")]
    assert main([*argv, "--output-dir", str(ties_run)]) == 0
    card = ModelCard.load(ties_run / "release" / "README.md")
    assert "merged with **TIES-Merging**" in card.text and "Task Arithmetic" not in card.text
    assert "| ties.top_k | `20.0` |" in card.text and "| ties.scaling_factor | `0.3` |" in card.text
    assert "ties" in card.data.tags and "task-arithmetic" not in card.data.tags
    assert "TIES-Merging |" in card.text  # the merged model's accuracy column, beside + FeatCal

    unrecorded = tmp_path / "unrecorded"
    shutil.copytree(tmp_path / "ties", unrecorded)
    (unrecorded / "featcal_recipe.json").unlink()
    (unrecorded / "mergekit_config.yml").unlink(missing_ok=True)
    plain_run = tmp_path / "from-unrecorded"
    argv = ["-q", "run", *common, *FAST, "--skip-ta", "--ta-model-path", str(unrecorded)]
    assert main([*argv, "--output-dir", str(plain_run)]) == 0
    card = ModelCard.load(plain_run / "release" / "README.md")
    assert "an existing merge" in card.text and "not recorded" in card.text
    assert "Task Arithmetic" not in card.text and "task-arithmetic" not in card.data.tags


def run_error(capsys, argv):
    code = main(["-q", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err[-1] if err else ""


def test_unknown_task(world, tmp_path, capsys):
    code, err = run_error(
        capsys,
        [
            "run",
            "--tasks-file",
            str(world["tasks_file"]),
            "--tasks",
            "nope",
            "--output-dir",
            str(tmp_path / "o"),
            *FAST,
            *CPU,
        ],
    )
    assert code == 2 and "Unknown task(s) ['nope']" in err
    assert not (tmp_path / "o").exists()


def test_invalid_tasks_file(tmp_path, capsys):
    bad = tmp_path / "tasks.yaml"
    bad.write_text("tasks:\n  a:\n    dataset: {path: x}\n    classnames: [one]\n    templates: ['{}']\n")
    code, err = run_error(capsys, ["run", "--tasks-file", str(bad), "--output-dir", str(tmp_path / "o")])
    assert code == 2 and "'classnames' must be a list of at least two strings" in err and str(bad) in err
    assert not (tmp_path / "o").exists()


def copy_world(world, tmp_path):
    root = tmp_path / "w"
    shutil.copytree(world["root"], root)
    return root


def test_expert_with_other_shapes(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    path = root / "experts" / "task1" / "model.safetensors"
    state = load_file(str(path))
    key = next(k for k in state if k.endswith("encoder.layers.0.mlp.fc1.weight"))
    state[key] = torch.zeros(5, 5)
    save_file(state, str(path), metadata={"format": "pt"})
    code, err = run_error(
        capsys, ["run", "--tasks-file", str(root / "tasks.json"), "--output-dir", str(tmp_path / "o"), *FAST, *CPU]
    )
    assert code == 2 and "task1" in err and "encoder.layers.0.mlp.fc1.weight" in err and "shape" in err
    assert not (tmp_path / "o").exists()


def test_non_finite_expert(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    path = root / "experts" / "task0" / "model.safetensors"
    state = load_file(str(path))
    state[next(k for k in state if k.endswith("post_layernorm.weight"))][0] = float("nan")
    save_file(state, str(path), metadata={"format": "pt"})
    code, err = run_error(
        capsys, ["run", "--tasks-file", str(root / "tasks.json"), "--output-dir", str(tmp_path / "o"), *FAST, *CPU]
    )
    assert code == 2 and "post_layernorm.weight" in err and "'task0'" in err and "not finite" in err
    assert not (tmp_path / "o").exists()


def test_dataset_without_named_column(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    table = json.loads((root / "tasks.json").read_text())
    table["tasks"]["task1"]["dataset"]["label_column"] = "fine_label"
    (root / "tasks.json").write_text(json.dumps(table))
    code, err = run_error(
        capsys, ["run", "--tasks-file", str(root / "tasks.json"), "--output-dir", str(tmp_path / "o"), *FAST, *CPU]
    )
    assert code == 2 and "'task1'" in err and "['fine_label']" in err
    assert not (tmp_path / "o").exists()


def test_pickle_only_expert_is_refused(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    folder = root / "experts" / "task0"
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    code, err = run_error(
        capsys, ["run", "--tasks-file", str(root / "tasks.json"), "--output-dir", str(tmp_path / "o"), *FAST, *CPU]
    )
    assert code == 2 and "never loads pickles" in err
    assert not (tmp_path / "o").exists()


def test_offline_hub_id_fails_fast_with_a_hint(tmp_path, capsys):
    code, err = run_error(capsys, ["merge", "--output", str(tmp_path / "m"), "--tasks", "mnist", "svhn"])
    assert code == 2 and "openai/clip-vit-base-patch32" in err and "HF_HUB_OFFLINE" in err
    assert not (tmp_path / "m").exists()


def test_module_entry_points():
    for module in ("featcal", "featcal.run_ta8"):
        result = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        assert "--output-dir" in result.stdout or "run" in result.stdout


def test_recipe_values_apply_and_flags_win(world, tmp_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"tasks-file: {world['tasks_file']}\nskip-featcal: true\neval-num-workers: 0\n"
        "merge-param: {scaling_factor: 0.5}\ntasks: task1\n"
    )
    assert main(["-q", "run", "--recipe", str(recipe), "--output-dir", str(tmp_path / "a")]) == 0
    config = json.loads((tmp_path / "a" / "run_config.json").read_text())
    assert config["merge"]["params"] == {"scaling_factor": 0.5} and config["tasks"] == ["task1"]
    assert config["featcal"] is None and not (tmp_path / "a" / "featcal-ta").exists()
    assert (
        main(["-q", "run", "--recipe", str(recipe), "--output-dir", str(tmp_path / "b"), "--ta-scaling-factor", "0.1"])
        == 0
    )
    assert json.loads((tmp_path / "b" / "run_config.json").read_text())["merge"]["params"] == {"scaling_factor": 0.1}
    recipe.write_text("lambda: 3\n")
    code, err = run_error(capsys, ["run", "--recipe", str(recipe)])
    assert code == 2 and "unknown option 'lambda'" in err


def test_shipped_recipes_are_valid():
    from pathlib import Path

    from featcal.spec import build_spec, load_recipe

    recipes = sorted((Path(__file__).parent.parent / "recipes").glob("*.yaml"))
    assert recipes
    for path in recipes:
        assert load_recipe(path)
        assert build_spec(recipe=load_recipe(path), recipe_source=path)


def test_a_stop_request_during_calibrate_leaves_neither_output_nor_temporaries(run_dir, world, tmp_path):
    """SIGTERM while the calibrated folder is being written layer by layer: exit status 143, and the
    hidden temporary folder beside the output is removed on the way out."""
    import os

    env = {**os.environ, "FEATCAL_KILL_AT": "calibrate:layer1", "FEATCAL_KILL_SIGNAL": "TERM"}
    env.update(FEATCAL_NO_PROGRESS="1", OMP_NUM_THREADS="1")
    args = ["-q", "calibrate", "--merged", str(run_dir / "ta"), "--output", str(tmp_path / "c")]
    args += ["--tasks-file", str(world["tasks_file"]), "--num-calibration-examples", "4", "--device", "cpu"]
    stopped = subprocess.run(
        [sys.executable, "-m", "featcal", *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert stopped.returncode == 143, stopped.stderr
    assert "Traceback" not in stopped.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("skip_ta", [False, True])
def test_no_whole_model_is_held_during_a_run_s_calibration(run_dir, world, tmp_path, monkeypatch, skip_ta, device):
    """The calibration reads the merged model a layer at a time: when it starts, no vision tower with
    all its weights that the run made is alive in the process (the merged one was evaluated and
    dropped, a --ta-model-path model was checked, not kept). Towers other tests keep are not the run's.
    A merge made in this run is not read back for a check first: only a --ta-model-path model is."""
    import gc
    import warnings
    import weakref

    import featcal.pipeline as pipeline
    from featcal.families.clip_vision import FAMILY

    def live_towers() -> list:
        gc.collect()
        with warnings.catch_warnings():  # isinstance on some of torch's deprecated objects warns
            warnings.simplefilter("ignore")
            return [o for o in gc.get_objects() if isinstance(o, CLIPVisionModel)]

    calibrate, whole_towers, earlier = pipeline.calibrate, [], weakref.WeakSet(live_towers())

    def watched(*args, **kwargs):
        towers = [t for t in live_towers() if t not in earlier]
        whole_towers.extend(t for t in towers if all(p.device.type != "meta" for p in t.parameters()))
        return calibrate(*args, **kwargs)

    checked, check_model_folder = [], FAMILY.check_model_folder

    def recorded_check(path, base=None):
        checked.append(Path(path))
        return check_model_folder(path, base)

    monkeypatch.setattr(pipeline, "calibrate", watched)
    monkeypatch.setattr(FAMILY, "check_model_folder", recorded_check)
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(tmp_path / "run"), *FAST]
    argv += ["--device", "cpu", "--no-export"]
    if skip_ta:
        argv += ["--skip-ta", "--ta-model-path", str(run_dir / "ta")]
    assert main(argv) == 0
    assert whole_towers == []
    assert checked == ([run_dir / "ta"] if skip_ta else [])
    assert_same_calibration(run_dir, tmp_path / "run" / "featcal-ta", exact=device == "cpu")


def test_a_resumed_run_refuses_a_damaged_merged_folder_before_calibrating_from_it(run_dir, world, tmp_path, capsys):
    """The merge is up to date by its ledger entry, which records no weights to compare (a ledger that
    does records them, and redoes the merge: tests/faults/test_resume.py), but its folder was damaged
    since: the calibration, which reads that folder layer by layer, is refused in one line naming file
    and tensor, before any calibrated folder is written (the stale one of the earlier λ is gone), with
    no temporary folder left."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    ledger = json.loads((out / "stages.json").read_text())
    (out / "stages.json").write_text(json.dumps({k: {**v, "weights": None} for k, v in ledger.items()}))
    merged_file = out / "ta" / "model.safetensors"
    tensors = load_file(str(merged_file))
    tensors["encoder.layers.1.mlp.fc1.weight"][0, 0] = float("nan")
    save_file(tensors, str(merged_file), metadata={"format": "pt"})
    argv = ["run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, *CPU]
    code, line = run_error(capsys, [*argv, "--lambda-ratio", "0.5", "--skip-eval-ta", "--no-export"])
    assert code == 2
    assert line.startswith("featcal: error:") and "encoder.layers.1.mlp.fc1.weight" in line and "not finite" in line
    assert str(merged_file) in line
    assert not (out / "featcal-ta").exists()
    assert merged_file.is_file()
    assert not [p for p in out.rglob(".*") if p.name != ".featcal.lock"]
