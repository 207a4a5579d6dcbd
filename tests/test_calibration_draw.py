"""The one calibration draw every family uses (:func:`featcal.data.process_calibration_rows`)."""

from __future__ import annotations

import pytest

from featcal.data import calibration_indices, process_calibration_rows
from featcal.distributed import World
from featcal.errors import DatasetInputError
from featcal.tasks import DatasetSpec, Task

TASK = Task("t", DatasetSpec("some/data"))


def test_one_process_reads_the_whole_draw():
    assert process_calibration_rows(TASK, 50, 7, 3, World(), "text(s)") == calibration_indices(50, 7, 3)


def test_the_processes_split_the_draw_contiguously_and_whole():
    parts = [process_calibration_rows(TASK, 50, 7, 3, World(rank=r, size=3), "text(s)") for r in range(3)]
    assert [row for part in parts for row in part] == calibration_indices(50, 7, 3)
    assert all(parts)


def test_fewer_examples_than_processes_is_refused_in_one_line():
    with pytest.raises(DatasetInputError) as caught:
        process_calibration_rows(TASK, 2, 10, 0, World(rank=0, size=3), "pair(s)")
    assert str(caught.value) == (
        "Task 't': its 2 calibration pair(s) cannot be split over 3 processes; start at most 2 processes."
    )
