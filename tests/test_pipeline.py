"""`featcal run` on the tiny published-code fixture keeps writing the same weights and metrics.

`tests/golden/tiny_fixture_run.json` holds the SHA-256 of each stage's `model.safetensors` and every
stage's metrics (without `run_id`, which hashes local paths) as written by the command it records.
The weights were measured identical with 1 and 2 torch threads; any change to merging, calibration,
evaluation or saving that moves a single byte fails here.
"""

import hashlib
import json
from pathlib import Path

import pytest

from featcal.cli import main
from tests.support.builders import FIXTURE

GOLDEN = json.loads((Path(__file__).parent / "golden" / "tiny_fixture_run.json").read_text())


@pytest.fixture(scope="module")
def golden_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("golden") / "run"
    argv = GOLDEN["command"].split()[1:]  # drop the program name
    argv = [
        str(FIXTURE / a.removeprefix("tests/fixtures/tiny-clip-3task/")) if a.startswith("tests/") else a for a in argv
    ]
    assert main([*argv, "--output-dir", str(out)]) == 0
    return out


@pytest.mark.parametrize("stage", ["ta", "featcal-ta"])
def test_weights_are_byte_identical(golden_run: Path, stage: str) -> None:
    digest = hashlib.sha256((golden_run / stage / "model.safetensors").read_bytes()).hexdigest()
    assert digest == GOLDEN["weights_sha256"][stage]


@pytest.mark.parametrize("stage", ["zero-shot", "experts", "ta", "featcal-ta"])
def test_metrics_are_equal(golden_run: Path, stage: str) -> None:
    metrics = json.loads((golden_run / stage / "metrics.json").read_text())
    metrics.pop("run_id", None)
    assert metrics == GOLDEN["metrics"][stage]
