"""Data-using merges from the command line: `featcal merge --method regmean`, `featcal run --merge-method
regmean`, their calibration draw (FeatCal's), what they record, resume, and their refusals."""

from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file

from featcal.calibration.adapters import CalibrationBatch
from featcal.cli import main
from featcal.families import get_family
from featcal.families.clip_vision.images import calibration_pixels
from featcal.merging import get_method
from featcal.merging.data import MergeData
from featcal.model_recipe import read_model_recipe
from featcal.runfolder.layout import MERGE_STEP, STAGES_FILE
from featcal.tasks import load_task_file
from tests.support.runs import CPU

DRAW = ["--num-calibration-examples", "4", "--calibration-batch-size", "2"]


def test_merge_reads_featcals_draw_and_records_it(world, tmp_path) -> None:
    out = tmp_path / "regmean"
    argv = ["-q", "merge", "--method", "regmean", "--tasks-file", str(world["tasks_file"]), *DRAW, "--seed", "7"]
    assert main([*argv, "--merge-param", "reduce_non_diagonal_ratio=0.6", "--output", str(out), *CPU]) == 0

    recipe = read_model_recipe(out)
    assert recipe.merge.method == "regmean" and recipe.merge.params == {
        "reduce_non_diagonal_ratio": 0.6, "exclude_param_names_regex": ""
    }  # fmt: skip
    calibration = recipe.merge.calibration
    assert {k: calibration[k] for k in ("num_calibration_examples", "calibration_batch_size", "seed")} == {
        "num_calibration_examples": 4, "calibration_batch_size": 2, "seed": 7
    }  # fmt: skip
    assert set(calibration["datasets"]) == set(world["tasks"])
    assert all(entry["split"] == "train" and entry["fingerprint"] for entry in calibration["datasets"].values())
    assert not (out / "mergekit_config.yml").exists()  # mergekit has no RegMean

    # The same weights from FeatCal's own calibration images (the draw its calibration reads), to float32
    # rounding: the command computes with its own number of torch threads.
    family = get_family("clip_vision")
    tasks = {t.name: t for t in load_task_file(world["tasks_file"]).tasks.values()}
    processor = family.preprocessor(world["base"])
    base = family.checkpoint(world["base"])
    experts = [family.checkpoint(world["root"] / "experts" / name) for name in world["tasks"]]
    data = MergeData(
        family.adapter(), lambda device: family.skeleton(world["base"], base, device), tuple(world["tasks"]),
        lambda name: CalibrationBatch({"pixel_values": calibration_pixels(tasks[name], processor, 4, 7)}),
        batch_size=2, progress=False,
    )  # fmt: skip
    expected = get_method("regmean")(base, experts, data=data, reduce_non_diagonal_ratio=0.6)
    merged = load_file(str(out / "model.safetensors"))
    assert {key.removeprefix("vision_model.") for key in merged} == set(expected)
    for key, value in merged.items():
        torch.testing.assert_close(value, expected[key.removeprefix("vision_model.")], rtol=1e-5, atol=1e-6, msg=key)


def test_calibration_options_are_refused_for_a_data_free_method(world, tmp_path, capsys) -> None:
    argv = ["merge", "--method", "ties", "--tasks-file", str(world["tasks_file"]), "--seed", "3"]
    assert main([*argv, "--output", str(tmp_path / "m"), *CPU]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "--seed" in line and "regmean, regmean_plusplus" in line and "ties uses none" in line
    assert not (tmp_path / "m").exists()


def test_a_data_using_merge_without_a_train_split_names_it_before_any_work(world, tmp_path, capsys) -> None:
    root = tmp_path / "w"
    shutil.copytree(world["root"], root)
    for parquet in (root / "data" / "task1" / "data").glob("train-*"):
        parquet.unlink()
    argv = ["merge", "--method", "regmean_plusplus", "--tasks-file", str(root / "tasks.json"), *DRAW]
    assert main([*argv, "--output", str(tmp_path / "m"), *CPU]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "task1" in line and "train" in line
    assert not (tmp_path / "m").exists()
    # a data-free method does not read the train splits
    assert main(["-q", "merge", "--tasks-file", str(root / "tasks.json"), "--output", str(tmp_path / "ta"), *CPU]) == 0


def test_methods_say_which_use_calibration_data(capsys) -> None:
    assert main(["methods"]) == 0
    blocks = capsys.readouterr().out.split("\n")
    uses = {line.split()[0] for i, line in enumerate(blocks) if line and not line[0].isspace()
            for follow in blocks[i + 1 : i + 3] if "uses calibration data" in follow}  # fmt: skip
    assert uses == {"regmean", "regmean_plusplus"}


def test_a_run_merges_from_featcals_draw_and_resumes_by_it(world, tmp_path) -> None:
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--merge-method", "regmean", *DRAW, *CPU]
    argv += ["--skip-featcal", "--skip-eval-ta", "--no-export", "--eval-num-workers", "0", "--output-dir", str(out)]
    assert main(argv) == 0
    config = json.loads((out / "run_config.json").read_text())
    assert config["merge"]["calibration"] == {"num_calibration_examples": 4, "calibration_batch_size": 2, "seed": 42}
    assert "datasets" in read_model_recipe(out / "regmean").merge.calibration
    identity = json.loads((out / STAGES_FILE).read_text())[MERGE_STEP]["identity"]
    weights = load_file(str(out / "regmean" / "model.safetensors"))

    assert main(argv) == 0  # the same draw: the merge is not redone
    assert json.loads((out / STAGES_FILE).read_text())[MERGE_STEP]["identity"] == identity

    assert main([*argv, "--seed", "5"]) == 0  # another draw: another merge
    assert json.loads((out / STAGES_FILE).read_text())[MERGE_STEP]["identity"] != identity
    reseeded = load_file(str(out / "regmean" / "model.safetensors"))
    assert any(not torch.equal(reseeded[key], weights[key]) for key in weights)


def test_a_run_calibrates_a_regmean_plus_plus_merge_and_its_card_names_the_data(world, tmp_path) -> None:
    out = tmp_path / "run"
    argv = ["-q", "run", "--tasks-file", str(world["tasks_file"]), "--merge-method", "regmean_plusplus", *DRAW]
    assert main([*argv, "--eval-num-workers", "0", "--output-dir", str(out), *CPU]) == 0
    for stage in ("regmean_plusplus", "featcal-regmean_plusplus"):
        assert (out / stage / "model.safetensors").is_file() and (out / stage / "metrics.json").is_file()
    assert read_model_recipe(out / "featcal-regmean_plusplus").merge.method == "regmean_plusplus"
    card = (out / "release" / "README.md").read_text()
    assert "merged with **RegMean++**" in card and "| regmean_plusplus.reduce_non_diagonal_ratio | `0.95` |" in card
    assert "| merge data | the first `4` training images of each task after the shuffle with seed `42`" in card


def test_a_data_using_merge_asking_for_more_examples_than_a_split_holds_is_refused(world, tmp_path, capsys) -> None:
    argv = ["merge", "--method", "regmean", "--tasks-file", str(world["tasks_file"]), "--num-calibration-examples"]
    assert main([*argv, "100000", "--output", str(tmp_path / "m"), *CPU]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "100000" in line and any(task in line for task in world["tasks"])
    assert "--allow-fewer-calibration-examples" in line
    assert not (tmp_path / "m").exists()


def test_the_merge_identity_covers_the_draw_of_a_data_using_method_only(world) -> None:
    from featcal.cli import build_parser
    from featcal.cli.pipeline_commands import spec_from_args
    from featcal.data import DatasetFacts
    from featcal.resolve import resolve_inputs
    from featcal.runfolder.identities import stage_identities

    def merge_id(method: str, *options: str, train: str = "a", counts: dict | None = None) -> str:
        spec = spec_from_args(build_parser().parse_args(
            ["run", "--tasks-file", str(world["tasks_file"]), "--merge-method", method, *options]
        ))  # fmt: skip
        facts = DatasetFacts({t: {"train": f"{train}{t}", "test": "b"} for t in world["tasks"]}, counts or {})
        return stage_identities(spec, resolve_inputs(spec), facts)[MERGE_STEP]

    same = merge_id("regmean")
    changed = [
        merge_id("regmean", train="c"),  # another train split
        merge_id("regmean", "--seed", "5"),
        merge_id("regmean", "--num-calibration-examples", "8"),
        merge_id("regmean", "--calibration-batch-size", "4"),
        merge_id("regmean", counts={world["tasks"][0]: 3}),  # a task had fewer
        merge_id("regmean", "--merge-param", "reduce_non_diagonal_ratio=0.6"),
    ]
    assert merge_id("regmean") == same and same not in changed and len(set(changed)) == len(changed)
    # a data-free merge reads no draw: the same identity whatever it is
    assert merge_id("ties", train="c", counts={world["tasks"][0]: 3}) == merge_id("ties")
    assert merge_id("ties", "--seed", "5") == merge_id("ties")
