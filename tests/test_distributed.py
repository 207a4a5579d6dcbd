"""`featcal run` over several processes with torchrun (gloo, CPU): the same results as one process,
rank 0 alone writing, and clean failures; `featcal calibrate` of a language model likewise.

The torchrun tests launch ``python -m torch.distributed.run --standalone`` (a free port each) on the
tiny published-code fixture, or a tiny Llama (``tests/support/tiny_decoder.py``), one thread per process.
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import featcal.calibration.driver as driver
from featcal.cli import main
from featcal.distributed import SINGLE, World, launched, start
from featcal.errors import InvalidParameterError
from featcal.families.clip_vision.images import _TaskBatches
from featcal.release.run_card import render_card
from featcal.runfolder.layout import RUN_CONFIG
from featcal.runfolder.ledger import StageLedger
from featcal.runfolder.reader import read_run
from featcal.runfolder.record import PROCESSES, RunRecord, recipe_sha256, write_run_config
from tests.support.builders import FIXTURE
from tests.support.release_runs import tiny_config
from tests.support.runs import fast_run
from tests.support.tiny_decoder import save_model, texts, tokenizer

REPO = Path(__file__).parents[1]
RUN = [
    "run", "--tasks-file", str(FIXTURE / "tasks.json"), "--base-model-id", str(FIXTURE / "base"),
    *fast_run(calibration=8), "--eval-batch-size", "4", "--device", "cpu", "--no-export",
]  # fmt: skip
FAULT_BOUND_S = 120  # a failure must end the run well before the --dist-timeout given (600 s)


def torchrun(nproc: int, args: list[str], **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """``featcal ARGS`` in ``nproc`` processes under torchrun; the completed process and its seconds."""
    environ = {
        **os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env,
    }  # fmt: skip
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "FEATCAL_KILL_AT", "FEATCAL_FAIL_AT"):
        if name not in env:
            environ.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    start_s = time.monotonic()
    done = subprocess.run([*command, "-m", "featcal", *args], env=environ, capture_output=True, text=True, timeout=300)
    return done, time.monotonic() - start_s


def weights(run: Path, stage: str) -> dict[str, torch.Tensor]:
    return load_file(str(run / stage / "model.safetensors"))


def relative_change(run: Path, other: Path) -> float:
    """‖W_other − W_run‖ / ‖W_run − W_merged‖ over the calibrated tensors: the difference in units of
    FeatCal's own update."""
    calibrated, merged, moved = weights(run, "featcal-ta"), weights(run, "ta"), weights(other, "featcal-ta")
    diff = sum(float((moved[k].double() - calibrated[k].double()).square().sum()) for k in calibrated)
    update = sum(float((calibrated[k].double() - merged[k].double()).square().sum()) for k in calibrated)
    return (diff / update) ** 0.5


def metrics(run: Path, stage: str) -> dict:
    data = json.loads((run / stage / "metrics.json").read_text())
    data.pop("run_id")
    return data


def assert_same_metrics(one: Path, many: Path, stage: str, *, exact: bool) -> None:
    """Accuracies and counts equal; losses equal (``exact``) or up to float rounding."""
    a, b = metrics(one, stage), metrics(many, stage)
    if exact:
        assert a == b
        return
    assert a.keys() == b.keys()
    for key, value in a.items():
        if isinstance(value, dict) and "accuracy" in value:
            assert (value["accuracy"], value.get("num_samples")) == (b[key]["accuracy"], b[key].get("num_samples"))
            assert value["loss"] == pytest.approx(b[key]["loss"], rel=1e-6)


def leftovers(run: Path) -> list[str]:
    """Hidden temporary entries of interrupted writes anywhere in the run folder."""
    return [str(p) for p in run.rglob(".*") if p.name != ".featcal.lock"]


# --- the pieces, in one process --------------------------------------------------------------------


def test_one_process_without_torchrun_is_the_single_world(monkeypatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched() == (0, 1)
    assert start("cpu") is SINGLE and not torch.distributed.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert start("cpu") is SINGLE
    assert SINGLE.record() is None and SINGLE.part(7) == slice(0, 7)
    tensor = torch.ones(3)
    SINGLE.all_reduce_sum_([tensor])
    SINGLE.broadcast_([tensor])
    assert tensor.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [4, 5, 8, 11])
def test_parts_cover_every_item_once_and_balance(size: int, count: int) -> None:
    parts = [World(rank=r, size=size).part(count) for r in range(size)]
    items = [i for part in parts for i in range(count)[part]]
    assert items == list(range(count))  # contiguous, in order: the concatenation is one process's list
    lengths = [part.stop - part.start for part in parts]
    assert max(lengths) - min(lengths) <= 1


def test_owners_balance_the_tensor_sizes_the_same_way_on_every_rank() -> None:
    sizes = [1000, 10, 10, 990, 500, 500, 3]
    owners = [World(rank=r, size=2).owners(sizes) for r in range(2)]
    assert owners[0] == owners[1]
    loads = [sum(s for s, o in zip(sizes, owners[0]) if o == r) for r in range(2)]
    assert abs(loads[0] - loads[1]) <= max(sizes) and sorted(loads) == [1503, 1510]


@pytest.mark.parametrize("size", [2, 3])
def test_each_test_batch_is_evaluated_by_exactly_one_rank(size: int) -> None:
    offsets, sizes, batch = [0, 10], [10, 7], 4
    for task in range(2):
        one = _TaskBatches(offsets, sizes, batch)
        one.task = task
        seen, rows = [], 0
        for rank in range(size):
            batches = _TaskBatches(offsets, sizes, batch, World(rank=rank, size=size))
            batches.task = task
            mine = list(batches)
            assert len(batches) == len(mine)
            seen += mine
            rows += batches.rows(task)
        assert sorted(seen) == list(one)  # the very batches of one process
        assert rows == sizes[task]


def test_the_processes_record_is_outside_the_recipe_hash(tmp_path: Path) -> None:
    record = RunRecord.from_json(tiny_config())
    run_id = write_run_config(tmp_path, record, processes={"world_size": 2, "backend": "gloo"})
    config = json.loads((tmp_path / RUN_CONFIG).read_text())
    assert config[PROCESSES] == {"world_size": 2, "backend": "gloo"}
    assert recipe_sha256(config) == run_id == write_run_config(tmp_path / "one", record)
    assert PROCESSES not in json.loads((tmp_path / "one" / RUN_CONFIG).read_text())


def test_a_ledger_that_does_not_write_decides_the_same_and_touches_nothing(tmp_path: Path) -> None:
    (tmp_path / "ta").mkdir()
    writer = StageLedger(tmp_path)
    writer.mark("merge", "id", ["ta"])
    reader = StageLedger.read(tmp_path, writes=False)
    before = (tmp_path / "stages.json").read_text()
    reader.mark("calibrate", "id2", ["featcal-ta"])
    reader.discard("merge")
    assert reader.done == {"calibrate": {"identity": "id2", "outputs": ["featcal-ta"]}}
    assert (tmp_path / "stages.json").read_text() == before and (tmp_path / "ta").is_dir()


def test_cuda_needs_a_gpu_per_process(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(torch.cuda.device_count() + 1))
    with pytest.raises(InvalidParameterError, match="GPU"):
        start("cuda")
    with pytest.raises(InvalidParameterError, match="LOCAL_RANK"):
        start("cuda:0")


# --- torchrun ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict[str, Path]:
    """Single-process runs: the reference, and the same with the statistics products chunked
    differently, which measures how far float32 rounding alone moves the calibrated weights."""
    root = tmp_path_factory.mktemp("one")
    full = [*RUN, "--eval-zero-shot", "--eval-experts"]
    assert main(["-q", *full, "--output-dir", str(root / "run")]) == 0
    assert main(["-q", *RUN, "--tasks", "t0", "t1", "--output-dir", str(root / "two-tasks")]) == 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(driver, "STATISTICS_CHUNK_TOKENS", 100)
        assert main(["-q", *full, "--output-dir", str(root / "chunked")]) == 0
    return {"run": root / "run", "two-tasks": root / "two-tasks", "chunked": root / "chunked"}


def rounding_floor(one_process: dict[str, Path]) -> float:
    """The float rounding of one process, in units of the update (about 2e-5 on the fixture)."""
    return relative_change(one_process["run"], one_process["chunked"])


def test_two_processes_give_one_process_results(one_process, tmp_path: Path) -> None:
    out = tmp_path / "run"
    done, _ = torchrun(2, [*RUN, "--eval-zero-shot", "--eval-experts", "--output-dir", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    one = one_process["run"]
    assert weights(one, "ta").keys() == weights(out, "ta").keys()
    assert all(torch.equal(a, weights(out, "ta")[k]) for k, a in weights(one, "ta").items())  # bit for bit
    floor = rounding_floor(one_process)
    assert 0 < relative_change(one, out) <= max(1e-5, 2 * floor)
    for stage in ("zero-shot", "experts", "ta"):  # the same models, the same batches: the same numbers
        assert_same_metrics(one, out, stage, exact=True)
    assert_same_metrics(one, out, "featcal-ta", exact=False)
    config, reference = (json.loads((run / RUN_CONFIG).read_text()) for run in (out, one))
    assert config.pop(PROCESSES) == {"world_size": 2, "backend": "gloo"}
    assert config == reference and read_run(out).recipe_sha256 == reference["run_id"]
    assert "Computed by 2 processes under torchrun (gloo)." in str(render_card(read_run(out), plot=None))
    # rank 0 alone logs and prints: one log line per evaluation of t0, one results table
    assert done.stderr.count("INFO featcal.families.clip_vision.evaluation: t0: accuracy") == 3, done.stderr[-3000:]
    assert done.stdout.count("Run folder: ") == 1 and done.stdout.count("featcal-ta") == 1
    # one process resumes the folder: the number of processes is no part of a stage's identity
    models = {path: path.stat().st_mtime_ns for path in out.rglob("model.safetensors")}
    assert main(["-q", *RUN, "--eval-zero-shot", "--eval-experts", "--output-dir", str(out)]) == 0
    assert {path: path.stat().st_mtime_ns for path in out.rglob("model.safetensors")} == models
    assert PROCESSES not in json.loads((out / RUN_CONFIG).read_text())  # the record is the last invocation's


def test_three_processes_with_uneven_shares(one_process, tmp_path: Path) -> None:
    """2 tasks, 8 calibration images (3 + 3 + 2) and 3 test batches per task over 3 processes."""
    out = tmp_path / "run"
    done, _ = torchrun(3, ["-q", *RUN, "--tasks", "t0", "t1", "--output-dir", str(out)])
    assert done.returncode == 0, done.stderr[-3000:]
    one = one_process["two-tasks"]
    assert all(torch.equal(a, weights(out, "ta")[k]) for k, a in weights(one, "ta").items())
    assert 0 < relative_change(one, out) <= max(1e-5, 2 * rounding_floor(one_process))
    assert_same_metrics(one, out, "ta", exact=True)
    assert_same_metrics(one, out, "featcal-ta", exact=False)
    assert json.loads((out / RUN_CONFIG).read_text())[PROCESSES] == {"world_size": 3, "backend": "gloo"}


def test_a_rank_that_raises_stops_the_run_with_its_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["-q", *RUN, "--dist-timeout", "600", "--output-dir", str(out)]
    done, seconds = torchrun(2, args, FEATCAL_FAIL_AT="calibrate:layer1", FEATCAL_FAULT_RANK="1")
    assert done.returncode != 0 and seconds < FAULT_BOUND_S
    errors = [line for line in done.stderr.splitlines() if line.startswith("featcal: error:")]
    assert errors == ["featcal: error: rank 1 of 2: Stopped at calibrate:layer1 as FEATCAL_FAIL_AT asks."]
    assert not (out / "featcal-ta").exists() and not leftovers(out)
    assert "calibrate" not in json.loads((out / "stages.json").read_text())


def test_a_killed_rank_stops_every_rank_without_a_trace(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["-q", *RUN, "--dist-timeout", "600", "--output-dir", str(out)]
    done, seconds = torchrun(2, args, FEATCAL_KILL_AT="calibrate:layer1", FEATCAL_FAULT_RANK="1")
    assert done.returncode != 0 and seconds < FAULT_BOUND_S
    assert "SIGKILL" in done.stderr  # torchrun names the killed rank
    # no traceback from featcal's own code in any process; the survivors were stopped quietly (torchrun's
    # own traceback may follow: its files are not featcal's, even in a checkout in a folder named featcal)
    package = f'  File "{Path(driver.__file__).parents[1]}/'
    assert not [line for line in done.stderr.splitlines() if line.startswith(package)]
    assert not (out / "featcal-ta").exists() and not leftovers(out)
    assert "calibrate" not in json.loads((out / "stages.json").read_text())


def test_more_processes_than_gpus_is_one_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "run"
    done, _ = torchrun(torch.cuda.device_count() + 1, ["-q", *RUN, "--device", "cuda", "--output-dir", str(out)])
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("featcal: error:")]
    assert len(errors) == 1 and "--device 'cuda' is invalid" in errors[0], done.stderr[-2000:]
    assert not out.exists()


@pytest.mark.parametrize("method", ["tsv", "ties"])
def test_merging_over_two_processes_is_bit_identical(method: str, tmp_path: Path) -> None:
    """TSV deals its tensors to the processes; TIES (whole-model) is computed by each. One thread per
    process in both runs: an SVD's last bit depends on the thread count."""
    args = ["merge", "--tasks-file", str(FIXTURE / "tasks.json"), "--base-model-id", str(FIXTURE / "base")]
    args += ["--method", method, "--device", "cpu"]
    done, _ = torchrun(1, ["-q", *args, "--output", str(tmp_path / "one")])  # one process, as without torchrun
    assert done.returncode == 0, done.stderr[-3000:]
    done, _ = torchrun(2, ["-q", *args, "--output", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


@pytest.mark.parametrize("method", ["regmean", "regmean_plusplus"])
def test_a_data_using_merge_over_two_processes_sums_their_statistics(method: str, tmp_path: Path) -> None:
    """Each process streams its half of every task's 8 calibration images; the Grams summed over both are
    the whole draw's, so the merge is one process's to float32 rounding (1.5e-7 of a tensor's norm is the
    distance of either to FusionBench's float64 run: tests/test_regmean.py)."""
    args = ["merge", "--tasks-file", str(FIXTURE / "tasks.json"), "--base-model-id", str(FIXTURE / "base")]
    args += ["--method", method, "--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
    done, _ = torchrun(1, ["-q", *args, "--output", str(tmp_path / "one")])
    assert done.returncode == 0, done.stderr[-3000:]
    done, _ = torchrun(2, ["-q", *args, "--output", str(tmp_path / "two")])
    assert done.returncode == 0, done.stderr[-3000:]
    one, two = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("one", "two"))
    assert one.keys() == two.keys()
    for key in one:
        assert float((two[key].double() - one[key].double()).norm()) <= 1e-6 * float(one[key].double().norm()), key


# --- a language model: featcal calibrate ------------------------------------------------------------

LM_UPDATE_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def lm_merge(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama base, two experts with 16 texts each (3 to 10 words: padded lengths differ by task and
    by process), their data file and Task Arithmetic merge."""
    root = tmp_path_factory.mktemp("lm")
    base = save_model(root / "base", seed=0)
    tokenizer().save_pretrained(root / "base")
    data = {"max_length": 16, "experts": {}}
    for i, name in enumerate(("math", "coding")):
        expert = root / f"Llama-tiny_{name}"
        save_model(expert, seed=10 + i, base=base)
        tokenizer().save_pretrained(expert)
        words = texts(20 + i, 32)
        rows = [{"query": words[2 * j], "response": words[2 * j + 1]} for j in range(16)]
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data["experts"][str(expert)] = {"dataset": f"{name}.jsonl", "text": "{query} {response}"}
    (root / "data.yaml").write_text(json.dumps(data))
    argv = ["merge", "--data", str(root / "data.yaml"), "--base-model-id", str(root / "base"), "--device", "cpu"]
    assert main(["-q", *argv, "--output", str(root / "merged")]) == 0
    return {"root": root, "merged": root / "merged", "data": root / "data.yaml"}


def lm_calibrate(lm_merge: dict[str, Path], output: Path, *extra: str) -> list[str]:
    """`featcal calibrate`'s arguments: 12 texts per task (6 a process: a batch of 4 and one of 2)."""
    return [
        "calibrate", "--merged", str(lm_merge["merged"]), "--data", str(lm_merge["data"]), "--device", "cpu",
        "--num-calibration-examples", "12", "--calibration-batch-size", "4", *extra, "--output", str(output),
    ]  # fmt: skip


def update_units(reference: Path, other: Path, merged: Path) -> float:
    """‖W_other − W_reference‖ / ‖W_reference − W_merged‖ over every tensor of the model folders."""
    ref, moved, start = (load_file(str(folder / "model.safetensors")) for folder in (reference, other, merged))
    diff = sum(float((moved[k].double() - ref[k].double()).square().sum()) for k in ref)
    update = sum(float((ref[k].double() - start[k].double()).square().sum()) for k in ref)
    return (diff / update) ** 0.5


def test_two_processes_calibrate_a_language_model_as_one_does(lm_merge, tmp_path: Path, monkeypatch) -> None:
    """Each process tokenises its half of every task's texts, pads them to its own longest and sums its
    tokens' statistics; the sums are added over the processes. The weights equal one process's up to the
    float32 rounding of the statistics products, which are summed in another order: 9.3e-7 of FeatCal's
    update on this model (3 processes: 9.5e-7), as for one process with its products cut into 16-token
    chunks (9.4e-7). The tolerance, 1e-5, is ten times that; λ changed by 1 % (0.05 → 0.0505) moves the
    weights by 3.6e-3, 360 times the tolerance."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["-q", *lm_calibrate(lm_merge, one)]) == 0  # one thread: the calibrate command's for width 64
    done, _ = torchrun(2, lm_calibrate(lm_merge, two))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("Calibrated model: ") == 1  # rank 0 alone writes and prints
    assert 0 < update_units(one, two, lm_merge["merged"]) <= LM_UPDATE_TOLERANCE
    recipes = [json.loads((folder / "featcal_recipe.json").read_text()) for folder in (one, two)]
    assert recipes[0] == recipes[1]  # the number of processes is not part of what the folder is
    monkeypatch.setattr(driver, "STATISTICS_CHUNK_TOKENS", 16)
    assert main(["-q", *lm_calibrate(lm_merge, tmp_path / "chunked")]) == 0
    assert update_units(one, tmp_path / "chunked", lm_merge["merged"]) <= LM_UPDATE_TOLERANCE  # the rounding floor
    monkeypatch.undo()
    assert main(["-q", *lm_calibrate(lm_merge, tmp_path / "lambda", "--lambda-ratio", "0.0505")]) == 0
    assert update_units(one, tmp_path / "lambda", lm_merge["merged"]) > 100 * LM_UPDATE_TOLERANCE


def test_tasks_need_a_calibration_image_per_process() -> None:
    from featcal.errors import DatasetInputError
    from featcal.stages import check_calibration_shares
    from featcal.tasks import load_task_file

    tasks = list(load_task_file(FIXTURE / "tasks.json").tasks.values())
    check_calibration_shares(tasks, {}, 8, World(rank=0, size=8))
    with pytest.raises(DatasetInputError, match="'t1': its 2 calibration image.* over 3 processes"):
        check_calibration_shares(tasks, {"t1": 2}, 8, World(rank=0, size=3), "image")


def test_other_commands_refuse_torchrun(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert main(["methods"]) == 2
    assert "featcal: error: rank 0 of 2: featcal methods runs in one process" in capsys.readouterr().err
