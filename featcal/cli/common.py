"""Option groups shared by several subcommands, and small printing helpers."""

from __future__ import annotations

import argparse
import os
from typing import Any

from featcal.calibration import FeatCalParams
from featcal.errors import FeatcalError
from featcal.pipeline import default_eval_workers


def add_model_args(parser: argparse.ArgumentParser, *, experts: bool = True) -> None:
    g = parser.add_argument_group("tasks and models")
    g.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        metavar="TASK",
        help="tasks to use (default: every task of --tasks-file, else the eight TA8 tasks)",
    )
    g.add_argument(
        "--tasks-file",
        default=None,
        metavar="FILE",
        help="JSON or YAML task table adding to (or replacing) the built-in TA8 tasks",
    )
    g.add_argument(
        "--base-model-id",
        default=None,
        metavar="ID_OR_DIR",
        help="base CLIPModel, Hub id or folder (default: the task table's, openai/clip-vit-base-patch32)",
    )
    if experts:
        g.add_argument(
            "--expert-model-format",
            default=None,
            metavar="PATTERN",
            help="expert id or folder pattern with {task} (default: each task's 'expert' entry)",
        )
    g.add_argument("--cache-dir", default=None, help="Hub cache folder")


def add_merge_args(parser: argparse.ArgumentParser, *, flag: str = "--merge-method") -> None:
    g = parser.add_argument_group("merging")
    g.add_argument(
        flag,
        dest="merge_method",
        default="task_arithmetic",
        metavar="NAME",
        help="merging method (see `featcal methods`); default task_arithmetic",
    )
    g.add_argument(
        "--ta-scaling-factor",
        type=float,
        default=None,
        metavar="K",
        help="scaling factor κ of the task vectors (methods that have one; default 0.3)",
    )
    g.add_argument(
        "--merge-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other hyper-parameter of the merging method, repeatable",
    )


def merge_params(args: argparse.Namespace) -> dict[str, Any]:
    import yaml

    params: dict[str, Any] = {}
    for item in args.merge_param:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise FeatcalError(f"--merge-param {item!r} must look like KEY=VALUE.")
        params[key.strip().replace("-", "_")] = yaml.safe_load(value)
    if args.ta_scaling_factor is not None:
        params["scaling_factor"] = args.ta_scaling_factor
    return params


def add_featcal_args(parser: argparse.ArgumentParser) -> None:
    d = FeatCalParams()
    g = parser.add_argument_group("FeatCal (defaults: the published reference run)")
    g.add_argument(
        "--num-calibration-examples",
        type=int,
        default=d.num_calibration_examples,
        metavar="N",
        help=f"calibration images per task, from the train split (default {d.num_calibration_examples})",
    )
    g.add_argument(
        "--calibration-batch-size",
        type=int,
        default=d.calibration_batch_size,
        metavar="B",
        help=f"default {d.calibration_batch_size}",
    )
    g.add_argument(
        "--lambda-ratio",
        type=float,
        default=d.lambda_ratio,
        metavar="λ",
        help=f"ridge towards the anchor (default {d.lambda_ratio})",
    )
    g.add_argument(
        "--anchor-blend-rho",
        type=float,
        default=d.anchor_blend_rho,
        metavar="ρ",
        help=f"anchor ρ·merged + (1−ρ)·base (default {d.anchor_blend_rho})",
    )
    g.add_argument(
        "--teacher-interp-alpha",
        type=float,
        default=d.teacher_interp_alpha,
        metavar="α",
        help=f"teacher input α·expert + (1−α)·student (default {d.teacher_interp_alpha})",
    )
    g.add_argument(
        "--covariance-eps", type=float, default=d.covariance_eps, metavar="ε", help=f"default {d.covariance_eps}"
    )


def featcal_params(args: argparse.Namespace) -> FeatCalParams:
    return FeatCalParams(
        num_calibration_examples=args.num_calibration_examples,
        calibration_batch_size=args.calibration_batch_size,
        lambda_ratio=args.lambda_ratio,
        anchor_blend_rho=args.anchor_blend_rho,
        teacher_interp_alpha=args.teacher_interp_alpha,
        covariance_eps=args.covariance_eps,
    )


def add_runtime_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("runtime")
    g.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N (default auto)")
    g.add_argument("--seed", type=int, default=42, help="seed of the calibration shuffle (default 42)")


def add_eval_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("evaluation")
    g.add_argument("--eval-batch-size", type=int, default=256, metavar="B", help="default 256")
    g.add_argument(
        "--eval-num-workers",
        type=int,
        default=default_eval_workers(),
        metavar="W",
        help=f"data-loading workers (default {default_eval_workers()} here: min(8, CPUs))",
    )
    g.add_argument(
        "--max-eval-samples",
        type=int,
        default=None,
        metavar="N",
        help="evaluate only the first N test images per task (quick runs)",
    )


def format_results(results: dict[str, dict], tasks: list[str]) -> str:
    """A plain-text table: one row per task, one column per evaluated stage, accuracies in %."""
    stages = list(results)
    width = max([len(t) for t in tasks] + [7])
    lines = [f"{'task':<{width}}  " + "  ".join(f"{s:>14}" for s in stages)]
    for name in [*tasks, "average"]:
        cells = []
        for stage in stages:
            row = results[stage].get(name)
            cells.append(f"{100 * row['accuracy']:>14.2f}" if row else f"{'-':>14}")
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def show_progress(args: argparse.Namespace) -> bool:
    return not getattr(args, "quiet", False) and os.environ.get("FEATCAL_NO_PROGRESS") is None
