"""The command-line flags the tests' runs share: tiny runs on the CPU that take seconds.

``fast_run()`` is the calibration and evaluation a test run needs no more of: 4 calibration images per
task in one batch, no data-loading workers; ``max_eval_samples`` cuts the evaluation to the first test
images. ``CPU`` is for refusals, which come before any model runs.
"""

from __future__ import annotations

CPU = ["--device", "cpu"]


def fast_run(*, calibration: int = 4, batch: int = 4, max_eval_samples: int | None = None) -> list[str]:
    """The flags of a tiny run: ``calibration`` images per task in batches of ``batch``, no data-loading
    workers, and (when given) only the first ``max_eval_samples`` test images of each task."""
    flags = [
        "--num-calibration-examples", str(calibration), "--calibration-batch-size", str(batch),
        "--eval-num-workers", "0",
    ]  # fmt: skip
    return flags if max_eval_samples is None else [*flags, "--max-eval-samples", str(max_eval_samples)]
