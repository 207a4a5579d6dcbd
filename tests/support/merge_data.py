"""The tiny fixture's base, experts and calibration data, as a data-using merging method reads them."""

from __future__ import annotations

from functools import cache

import torch

from featcal.calibration.adapters import CalibrationBatch
from featcal.distributed import SINGLE
from featcal.families import get_family
from featcal.merging.common import StateDict
from featcal.merging.data import MergeData
from featcal.suites import task_table
from tests.support.builders import FIXTURE

TASKS = ("t0", "t1", "t2")
N, SEED, BATCH = 8, 42, 4  # as the FusionBench goldens were made (make_regmean_goldens.py)


@cache
def calibration_inputs() -> dict[str, CalibrationBatch]:
    """Each task's calibration examples as featcal draws them: the first 8 after the shuffle with seed 42."""
    family = get_family("clip_vision")
    preprocessor = family.preprocessor(FIXTURE / "base")
    tasks = task_table(str(FIXTURE / "tasks.json"), replace=True).select(list(TASKS))
    return {task.name: family.calibration_inputs(task, preprocessor, N, SEED, world=SINGLE) for task in tasks}


def fixture_merge(dtype: torch.dtype = torch.float32) -> tuple[StateDict, list[StateDict], MergeData]:
    """The fixture's base and experts (in ``dtype``: float32 reads the checkpoints lazily) and their MergeData."""
    family = get_family("clip_vision")
    base = family.checkpoint(FIXTURE / "base")
    experts = [family.checkpoint(FIXTURE / "experts" / task) for task in TASKS]
    if dtype != torch.float32:
        base = {key: value.to(dtype) for key, value in base.items()}
        experts = [{key: value.to(dtype) for key, value in expert.items()} for expert in experts]
    data = MergeData(
        family.adapter(), lambda device: family.skeleton(FIXTURE / "base", base, device).to(dtype), TASKS,
        calibration_inputs().__getitem__, batch_size=BATCH, progress=False,
    )  # fmt: skip
    return base, experts, data
