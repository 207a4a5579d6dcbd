"""Tiny run folders for the release tests, in the layout the pipeline writes.

The weights are the tiny fixture's vision tower, nudged by seeded noise (one stage per seed); the
metrics are made up but consistent (per-task accuracies, their mean, the recipe's run_id).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from featcal.files.hashing import config_hash
from featcal.metrics import WEIGHTS_SHA256, weights_sha256
from featcal.runfolder.layout import calibrated_stage_name, merged_stage_name

FIXTURE = Path(__file__).parents[1] / "fixtures" / "tiny-clip-3task"
TA8 = Path(__file__).parents[2] / "featcal" / "resources" / "ta8_tasks.json"

MERGED_ACC = {"t0": 0.4, "t1": 0.5, "t2": 0.3}
CALIBRATED_ACC = {"t0": 0.7, "t1": 0.8, "t2": 0.6}
BASE_ACC = {"t0": 0.2, "t1": 0.1, "t2": 0.3}
EXPERT_ACC = {"t0": 0.9, "t1": 0.95, "t2": 0.85}
FEATCAL = {
    "num_calibration_examples": 12,
    "calibration_batch_size": 4,
    "lambda_ratio": 0.05,
    "anchor_blend_rho": 2.2,
    "teacher_interp_alpha": 0.25,
    "covariance_eps": 1e-8,
}


def metrics(accuracies: dict[str, float], run_id: str | None) -> dict:
    report = {"model_info": {"trainable_params": 1, "all_params": 1, "trainable_percentage": 1.0}}
    report |= {t: {"accuracy": a, "loss": 1.0 - a} for t, a in accuracies.items()}
    report["average"] = {"accuracy": sum(accuracies.values()) / len(accuracies), "loss": 0.5}
    if run_id is not None:
        report["run_id"] = run_id
    return report


def with_run_id(recipe: dict) -> dict:
    """run_config.json as the pipeline writes it: the recipe plus its hash."""
    return {**recipe, "run_id": config_hash(recipe)}


def tiny_config(*, calibrated: bool = True, max_eval_samples: int | None = None) -> dict:
    """The recipe of a run on the tiny fixture (local base, experts and datasets)."""
    table = json.loads((FIXTURE / "tasks.json").read_text())["tasks"]
    for entry in table.values():
        entry["dataset"]["path"] = str((FIXTURE / entry["dataset"]["path"]).resolve())
        entry["expert"] = str((FIXTURE / entry["expert"]).resolve())
    return {
        "featcal_version": "0.1.0",
        "base_model_id": str((FIXTURE / "base").resolve()),
        "tasks": list(table),
        "tasks_table": table,
        "merge": {"method": "task_arithmetic", "params": {"scaling_factor": 0.3}},
        "featcal": FEATCAL if calibrated else None,
        "seed": 42,
        "experts": {t: e["expert"] for t, e in table.items()},
        "evaluation": {"max_eval_samples": max_eval_samples},
    }


def ta8_config() -> dict:
    """The recipe of the TA8 reference setting: Hub ids everywhere (no weights needed for a card)."""
    data = json.loads(TA8.read_text())
    return {
        "featcal_version": "0.1.0",
        "base_model_id": data["base_model"],
        "tasks": list(data["tasks"]),
        "tasks_table": data["tasks"],
        "merge": {"method": "task_arithmetic", "params": {"scaling_factor": 0.3}},
        "featcal": {**FEATCAL, "num_calibration_examples": 256, "calibration_batch_size": 16},
        "seed": 42,
        "experts": {t: e["expert"] for t, e in data["tasks"].items()},
        "evaluation": {"max_eval_samples": None},
    }


def measured(report: dict, stage: Path) -> dict:
    """A stage's report recording the weights it measured, as the pipeline writes it."""
    return {**report, WEIGHTS_SHA256: weights_sha256(stage)}


def save_stage(folder: Path, seed: int) -> torch.nn.Module:
    """A CLIPVisionModel stage folder: the fixture's vision tower plus seeded noise."""
    from transformers import CLIPVisionModel

    model = CLIPVisionModel.from_pretrained(str(FIXTURE / "experts" / "t0")).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))
    model.save_pretrained(str(folder))
    return model


def make_run(
    root: Path,
    *,
    calibrated: bool = True,
    base_dir: str | None = "zero-shot",
    with_experts: bool = False,
    max_eval_samples: int | None = None,
    base_model_id: str | None = None,
) -> tuple[Path, dict]:
    """A tiny run folder as `featcal run` writes it; returns it and facts about it.

    Its recipe names ``base_model_id`` as the base when given (a Hub id, say), else the fixture's folder.
    The facts: ``model`` (the released model in memory), ``config`` (run_config.json), ``run_id``.
    """
    run = root / "run"
    run.mkdir(parents=True)
    recipe = tiny_config(calibrated=calibrated, max_eval_samples=max_eval_samples)
    if base_model_id is not None:
        recipe["base_model_id"] = base_model_id
    config = with_run_id(recipe)
    (run / "run_config.json").write_text(json.dumps(config, indent=2))
    run_id = config["run_id"]
    model = save_stage(run / "ta", seed=1)
    (run / "ta" / "metrics.json").write_text(json.dumps(measured(metrics(MERGED_ACC, run_id), run / "ta")))
    if calibrated:
        model = save_stage(run / "featcal-ta", seed=2)
        report = measured(metrics(CALIBRATED_ACC, run_id), run / "featcal-ta")
        (run / "featcal-ta" / "metrics.json").write_text(json.dumps(report))
    if base_dir is not None:
        (run / base_dir).mkdir()
        (run / base_dir / "metrics.json").write_text(json.dumps(metrics(BASE_ACC, run_id)))
    if with_experts:
        (run / "experts").mkdir()
        (run / "experts" / "metrics.json").write_text(json.dumps(metrics(EXPERT_ACC, run_id)))
    timings = {"merge_s": 0.5, "eval_ta_s": 1.0, "calibrate_s": 2.25, "eval_featcal-ta_s": 1.0}
    (run / "timings.json").write_text(json.dumps(timings))
    return run, {"model": model, "config": config, "run_id": run_id}


def make_ta8_run(
    root: Path, *, base_model_id: str | None = None, hub_commits: dict | None = None, merge: dict | None = None
) -> Path:
    """A TA8 run folder with the published reference numbers as its metrics (metrics only); its recipe
    names ``base_model_id`` as the base when given (a local folder, say), else the Hub id, records
    ``hub_commits`` when given, and ``merge`` (its record, the stages named after its method) when given."""
    run = root / "ta8"
    run.mkdir(parents=True)
    recipe = ta8_config()
    if base_model_id is not None:
        recipe["base_model_id"] = base_model_id
    if hub_commits is not None:
        recipe["hub_commits"] = hub_commits
    if merge is not None:
        recipe["merge"] = merge
    merged, calibrated = (name(recipe["merge"]["method"]) for name in (merged_stage_name, calibrated_stage_name))
    config = with_run_id(recipe)
    (run / "run_config.json").write_text(json.dumps(config))
    run_id = config["run_id"]
    refs = {t: e["reference_accuracy"] for t, e in config["tasks_table"].items()}
    (run / merged).mkdir()
    (run / merged / "metrics.json").write_text(
        json.dumps(metrics({t: r["task_arithmetic"] for t, r in refs.items()}, run_id))
    )
    (run / calibrated).mkdir()
    (run / calibrated / "metrics.json").write_text(
        json.dumps(metrics({t: r["task_arithmetic_featcal"] for t, r in refs.items()}, run_id))
    )
    (run / "timings.json").write_text(
        json.dumps({"merge_s": 4.1, f"eval_{merged}_s": 305.0, "calibrate_s": 53.0, f"eval_{calibrated}_s": 305.2})
    )
    return run
