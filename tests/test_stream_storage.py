"""Where the feature streams live: the placement rule of ``--stream-storage`` and its option."""

from __future__ import annotations

import pytest
import torch

from featcal.calibration.stream_storage import AUTO_DEVICE_SHARE, StreamPlacement
from featcal.cli import main

GIB = 2**30


@pytest.mark.parametrize("where", ["cpu", "cuda"])
def test_device_keeps_every_task_on_the_device_and_host_none(where) -> None:
    everywhere = StreamPlacement("device", where, device_bytes=GIB)
    nowhere = StreamPlacement("host", where, device_bytes=GIB)
    assert all(everywhere.on_device(f"t{i}", 10 * GIB) for i in range(3))
    assert not any(nowhere.on_device(f"t{i}", 1) for i in range(3))


def test_auto_keeps_the_streams_on_a_cpu_whatever_their_size() -> None:
    placement = StreamPlacement("auto", "cpu", device_bytes=GIB)
    assert all(placement.on_device(f"t{i}", 100 * GIB) for i in range(5))


def test_auto_on_cuda_keeps_tasks_on_the_device_up_to_its_share_of_the_memory() -> None:
    """Llama-3.1-8B at the MergeBench size on an 80 GB card: five tasks of 16 GiB of streams each; a third of
    the card (26.7 GiB) holds one, the other four live in host memory."""
    placement = StreamPlacement("auto", "cuda:0", device_bytes=80 * GIB)
    assert [placement.on_device(f"t{i}", 16 * GIB) for i in range(5)] == [True, False, False, False, False]
    small = StreamPlacement("auto", torch.device("cuda"), device_bytes=80 * GIB)
    fits = int(AUTO_DEVICE_SHARE * 80 * GIB) // 4
    assert [small.on_device(f"t{i}", fits) for i in range(5)] == [True, True, True, True, False]


def test_an_unknown_storage_is_refused() -> None:
    with pytest.raises(ValueError, match="stream storage must be one of"):
        StreamPlacement("disk", "cpu")


def test_the_option_refuses_an_unknown_value_in_one_line(tmp_path, capsys) -> None:
    code = main(["calibrate", "--merged", str(tmp_path), "--output", str(tmp_path / "out"), "--stream-storage", "disk"])
    assert code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "featcal: error: --stream-storage 'disk' is invalid: it must be one of auto, device, host."
    ]
    assert not (tmp_path / "out").exists()
