"""The mini8 benchmark run: the pipeline's RunSpec for a zoo, with the benchmark's defaults."""

from __future__ import annotations

from pathlib import Path

from featcal.calibration.params import FeatCalParams
from featcal.demo.options import MINI8_SCALING_FACTOR
from featcal.spec import RunSpec

# Task Arithmetic and FeatCal settings of the benchmark: the reference run's (κ 0.3, n 256, λ 0.05,
# ρ 2.2, α 0.25, seed 42), measured on mini8 in benchmarks/mini8.md.
MINI8_DEFAULTS = {"scaling_factor": MINI8_SCALING_FACTOR}


def demo_run_spec(
    zoo: str | Path,
    output_dir: str | Path,
    *,
    device: str = "cpu",
    progress: bool = True,
    scaling_factor: float = MINI8_DEFAULTS["scaling_factor"],
    featcal: FeatCalParams | None = None,
) -> RunSpec:
    """A run over every task of ``zoo``: zero-shot base, experts, TA, TA+FeatCal, all evaluated."""
    zoo = Path(zoo)
    return RunSpec(
        output_dir=str(output_dir),
        device=device,
        tasks_file=str(zoo / "tasks.json"),
        base_model_id=str(zoo / "base"),
        merge_method="task_arithmetic",
        merge_params={"scaling_factor": scaling_factor},
        featcal=featcal or FeatCalParams(),
        eval_num_workers=0,  # the images are tiny: worker processes cost more than they save
        eval_zero_shot=True,
        eval_experts=True,
        progress=progress,
    )
