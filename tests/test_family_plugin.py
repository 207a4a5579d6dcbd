"""A new model family is a new package: the test suite's own MLP family (:mod:`tests.support.mlp_family`),
registered at test time, runs ``featcal merge`` -> ``calibrate`` -> ``evaluate`` -> ``export`` through the CLI.

Nothing of featcal names it: the registry learns it from :func:`featcal.families.register_family`, the task table
hands its entries (``features``, ``classes``) to its own parser, and every command reaches it through the registry.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file

from featcal.cli import main
from featcal.errors import FeatcalError
from featcal.families import family_names, register_family, unregister_family
from featcal.tasks import load_task_file
from tests.support.mlp_family import FAMILY
from tests.support.mlp_family.model import MLPConfig, MLPModel, register_auto_classes

TASKS = ("even", "odd")
IN, CLASSES = 6, 3


def _write_split(folder: Path, split: str, seed: int, count: int, teacher: torch.Tensor) -> None:
    """``count`` random vectors labelled by the task's teacher, as a local parquet split."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, IN, generator=generator)
    labels = (x @ teacher).argmax(-1)
    (folder / "data").mkdir(parents=True, exist_ok=True)
    rows = {"x": x.tolist(), "label": labels.tolist()}
    datasets.Dataset.from_dict(rows).to_parquet(str(folder / "data" / f"{split}-00000-of-00001.parquet"))


@pytest.fixture
def world(tmp_path):
    """A base, two experts (the base plus noise), each task's vectors and a tasks file of the test family."""
    register_auto_classes()
    register_family(FAMILY)
    try:
        torch.manual_seed(0)
        base = MLPModel(MLPConfig(in_features=IN, classes=CLASSES)).eval()
        for p in base.parameters():
            torch.nn.init.normal_(p, std=0.3)
        base.save_pretrained(tmp_path / "base")
        entries = {}
        for i, task in enumerate(TASKS):
            expert = MLPModel(base.config).eval()
            with torch.no_grad():
                for p, q in zip(expert.parameters(), base.parameters()):
                    p.copy_(q + 0.1 * torch.randn_like(q))
            expert.save_pretrained(tmp_path / "experts" / task)
            teacher = torch.randn(IN, CLASSES, generator=torch.Generator().manual_seed(10 + i))
            _write_split(tmp_path / "data" / task, "train", 100 + i, 40, teacher)
            _write_split(tmp_path / "data" / task, "test", 200 + i, 24, teacher)
            entries[task] = {
                "family": FAMILY.name, "dataset": f"data/{task}", "expert": f"experts/{task}", "features": "x",
                "classes": CLASSES,
            }  # fmt: skip
        (tmp_path / "tasks.json").write_text(json.dumps({"tasks": entries}))
        yield tmp_path
    finally:
        unregister_family(FAMILY.name)


def test_the_family_s_task_entries_are_its_own(world) -> None:
    table = load_task_file(world / "tasks.json")
    assert FAMILY.name in family_names()
    assert [task.text.to_dict() for task in table.tasks.values()] == [{"features": "x", "classes": CLASSES}] * 2
    entry = table.tasks["even"].to_dict()
    assert entry["family"] == FAMILY.name and "classnames" not in entry and entry["classes"] == CLASSES
    bad = json.loads((world / "tasks.json").read_text())
    bad["tasks"]["even"]["classes"] = 1
    (world / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(FeatcalError, match="'classes' must be a whole number, at least 2, not 1"):
        load_task_file(world / "bad.json")


def test_merge_calibrate_evaluate_and_export_a_new_family_through_the_cli(world) -> None:
    common = ["--tasks-file", str(world / "tasks.json"), "--base-model-id", str(world / "base"), "--device", "cpu"]
    assert main(["merge", "--output", str(world / "merged"), *common]) == 0
    draw = ["--num-calibration-examples", "16", "--calibration-batch-size", "8"]
    assert main(["calibrate", "--merged", str(world / "merged"), "--output", str(world / "cal"), *draw, *common]) == 0
    metrics = world / "cal-metrics.json"
    assert main(["evaluate", "--model", str(world / "cal"), "--output", str(metrics), "--eval-num-workers", "0",
                 *common]) == 0  # fmt: skip
    assert main(["export", str(world / "cal")]) == 0

    merged = load_file(world / "merged" / "model.safetensors")
    calibrated = load_file(world / "cal" / "model.safetensors")
    base = load_file(world / "base" / "model.safetensors")
    experts = [load_file(world / "experts" / task / "model.safetensors") for task in TASKS]
    # Task Arithmetic at its default scaling: base + 0.3 * the sum of the task vectors.
    want = base["stem.weight"] + 0.3 * sum(e["stem.weight"] - base["stem.weight"] for e in experts)
    torch.testing.assert_close(merged["stem.weight"], want)
    # FeatCal solves each block's fc; the stem and the head stay the merge's.
    assert torch.equal(calibrated["stem.weight"], merged["stem.weight"])
    assert torch.equal(calibrated["head.weight"], merged["head.weight"])
    assert all(not torch.equal(calibrated[f"layers.{i}.fc.weight"], merged[f"layers.{i}.fc.weight"]) for i in (0, 1))

    report = json.loads(metrics.read_text())
    model = MLPModel.from_pretrained(str(world / "cal")).eval()
    for task in TASKS:  # the family's evaluator: the calibrated model's accuracy on each task's test vectors
        test = datasets.load_dataset(str(world / "data" / task), split="test")
        with torch.no_grad():
            right = model(torch.tensor(test["x"])).argmax(-1) == torch.tensor(test["label"])
        assert report[task]["accuracy"] == pytest.approx(float(right.float().mean()))

    release = world / "cal-release"
    assert (release / "model.safetensors").is_file() and "# cal" in (release / "README.md").read_text()
    released = load_file(release / "model.safetensors")
    assert released.keys() == calibrated.keys()
    assert all(torch.equal(released[key], calibrated[key]) for key in calibrated)
