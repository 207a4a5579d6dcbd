"""Dataset faults: labels outside the classes, missing splits and columns, parquet however written."""

import json
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from featcal.cli import main
from tests.support.runs import fast_run

FAST = fast_run(max_eval_samples=2)


@pytest.fixture
def world_copy(world, tmp_path):
    root = tmp_path / "w"
    shutil.copytree(world["root"], root)
    return root


def rewrite_labels(parquet, change) -> None:
    table = pq.read_table(parquet)
    labels = table.column("label").to_pylist()
    labels = change(labels)
    index = table.schema.get_field_index("label")
    table = table.set_column(index, pa.field("label", pa.int64()), pa.array(labels, pa.int64()))
    pq.write_table(table.replace_schema_metadata(None), parquet)  # written by pyarrow directly


def run(capsys, root, out, device, *extra):
    argv = ["-q", "run", "--tasks-file", str(root / "tasks.json"), "--output-dir", str(out), *FAST, *extra]
    code = main([*argv, "--device", device])
    return code, capsys.readouterr().err.strip()


@pytest.mark.parametrize(("split", "bad"), [("test", 99), ("train", -1)])
def test_a_label_outside_the_classes_is_refused_up_front(world_copy, tmp_path, capsys, split, bad) -> None:
    # The bad label sits in the last row: evaluation of the first two images alone would never see it.
    parquet = next((world_copy / "data" / "task1" / "data").glob(f"{split}-*.parquet"))
    rewrite_labels(parquet, lambda labels: [*labels[:-1], bad])
    out = tmp_path / "out"
    code, err = run(capsys, world_copy, out, "cpu")  # refused before any model runs
    assert code == 2 and len(err.splitlines()) == 1
    assert f"'task1': the {split} split" in err and f"has label {bad}" in err and "class names" in err
    assert not out.exists()


def test_parquet_written_by_pyarrow_directly_is_read(world_copy, tmp_path, capsys, device) -> None:
    for parquet in (world_copy / "data").rglob("*.parquet"):
        rewrite_labels(parquet, lambda labels: labels)
    assert run(capsys, world_copy, tmp_path / "out", device, "--skip-featcal")[0] == 0


def test_a_missing_split_is_refused_before_writing(world_copy, tmp_path, capsys) -> None:
    table = json.loads((world_copy / "tasks.json").read_text())
    table["tasks"]["task0"]["dataset"]["test_split"] = "validation"
    (world_copy / "tasks.json").write_text(json.dumps(table))
    out = tmp_path / "out"
    code, err = run(capsys, world_copy, out, "cpu")  # refused before any model runs
    assert code == 2 and "'task0'" in err and "validation" in err
    assert not out.exists()


def test_fewer_calibration_images_need_the_explicit_option_and_are_recorded(world, tmp_path, capsys, device) -> None:
    out = tmp_path / "out"
    argv = ["run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *FAST, "--device", device]
    assert main(["-q", *argv, "--num-calibration-examples", "50"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has 12 images, fewer than the 50 calibration images asked for" in err
    assert "--num-calibration-examples" in err and "--allow-fewer-calibration-examples" in err
    assert not out.exists()
    assert main(["-q", *argv, "--num-calibration-examples", "50", "--allow-fewer-calibration-examples"]) == 0
    used = {"task0": 12, "task1": 12}
    assert json.loads((out / "run_config.json").read_text())["featcal"]["calibration_examples_used"] == used
    assert json.loads((out / "featcal-ta" / "metrics.json").read_text())["calibration_examples_used"] == used
    assert "calibration_examples_used" not in json.loads((out / "ta" / "metrics.json").read_text())
    card = (out / "release" / "README.md").read_text()
    assert "featcal.calibration_examples_used" in card and "'task0': 12" in card and "fewer than n" in card


def png_bytes(size: tuple[int, int] = (32, 32)) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


def damage_image(parquet, row: int, how: str) -> None:
    """Replace the image bytes of ``row`` as a broken download or a hostile file would."""
    import struct
    import zlib

    table = pq.read_table(parquet)
    images = table.column("image").to_pylist()
    good = images[row]["bytes"]
    if how == "garbage":
        data = b"not an image at all" * 3
    elif how == "truncated":
        data = good[: len(good) // 2]
    else:  # a header declaring 60000 x 60000 pixels: decoding it would take gigabytes
        header = struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)
        chunk = b"IHDR" + header
        data = good[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk)) + good[33:]
    images[row] = {"bytes": data, "path": None}
    index = table.schema.get_field_index("image")
    table = table.set_column(index, table.schema.field(index), pa.array(images, table.schema.field(index).type))
    pq.write_table(table, parquet)


@pytest.mark.parametrize("how", ["garbage", "truncated", "bomb"])
def test_a_damaged_calibration_image_is_named_before_anything_is_written(world_copy, tmp_path, capsys, how) -> None:
    from featcal.data import calibration_indices

    parquet = next((world_copy / "data" / "task1" / "data").glob("train-*.parquet"))
    row = calibration_indices(pq.read_metadata(parquet).num_rows, 4, 42)[2]  # one of the 4 the run reads
    damage_image(parquet, row, how)
    out = tmp_path / "out"
    code, err = run(capsys, world_copy, out, "cpu")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"Task 'task1': row {row} of the train split of" in err and "is not a readable image" in err
    assert not out.exists()


@pytest.mark.parametrize("how", ["garbage", "truncated"])
def test_a_damaged_test_image_is_named_by_its_row_before_any_stage_is_written(world_copy, tmp_path, capsys, how):
    """The test images are decoded when the datasets are checked: the message names the row (not the file
    object PIL read it from) and the run folder is not made."""
    parquet = next((world_copy / "data" / "task0" / "data").glob("test-*.parquet"))
    damage_image(parquet, 1, how)
    out = tmp_path / "out"
    code, err = run(capsys, world_copy, out, "cpu", "--skip-featcal")
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "Task 'task0': row 1 of the test split of" in err and "is not a readable image" in err
    assert " object at 0x" not in err
    assert not out.exists()
