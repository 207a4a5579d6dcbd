"""`featcal demo`: build (once) the offline mini8 benchmark, run merge → calibrate → evaluate → export on it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from featcal.cli.common import format_results, path_line, show_progress
from featcal.demo.run_spec import MINI8_DEFAULTS

DEFAULT_OUTPUT_DIR = "outputs/mini8"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on the offline mini8 benchmark (no downloads)",
        description="Build the mini8 benchmark zoo the first time (eight procedural image tasks, a small CLIP "
        "and one expert per task, cached), then merge with Task Arithmetic, calibrate with FeatCal, "
        "evaluate zero-shot and export a release folder. Prints the results table.",
    )
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"run folder (default {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--zoo-seed", type=int, default=0, help="seed the zoo is generated from (default 0)")
    parser.add_argument("--tiny", action="store_true", help="the reduced zoo of the test suite (faster, weaker)")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the zoo even if it is cached")
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="featcal cache folder (default $FEATCAL_CACHE, else $XDG_CACHE_HOME/featcal, else ~/.cache/featcal)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads for the zoo build (default: one per core) and the run (default: one, the "
        "models are small)",
    )
    parser.add_argument(
        "--ta-scaling-factor",
        type=float,
        default=MINI8_DEFAULTS["scaling_factor"],
        metavar="K",
        help=f"Task Arithmetic κ (default {MINI8_DEFAULTS['scaling_factor']})",
    )
    parser.add_argument("--no-export", action="store_true", help="do not write the release folder")
    parser.set_defaults(func=cmd_demo)


def _check_options(args: argparse.Namespace) -> None:
    """Every option, checked before the zoo is built (minutes): the run's options as the run will check
    them, the device, Task Arithmetic's κ and the output folder.

    Raises:
        FeatcalError: naming the option and what it must be.
    """
    from featcal.demo import demo_run_spec
    from featcal.devices import resolve_device
    from featcal.errors import InvalidParameterError
    from featcal.merging import get_method
    from featcal.outputs import check_run_output_folder

    if args.zoo_seed < 0:
        raise InvalidParameterError("zoo_seed", args.zoo_seed, "a whole number >= 0")
    # Built to be checked, not kept: the zoo's folder does not exist yet, and no field here depends on it.
    demo_run_spec(Path(args.output_dir), args.output_dir, device=args.device, progress=False).replace(
        threads=args.threads
    )
    resolve_device(args.device)
    get_method("task_arithmetic").resolved_params(scaling_factor=args.ta_scaling_factor)
    check_run_output_folder(Path(args.output_dir))


def cmd_demo(args: argparse.Namespace) -> int:
    import torch

    from featcal.demo import ZooConfig, build_zoo, demo_run_spec
    from featcal.pipeline import run_pipeline
    from featcal.runfolder.layout import (
        EXPERTS_DIR,
        RELEASE_DIR,
        ZERO_SHOT_DIR,
        calibrated_stage_name,
        merged_stage_name,
    )

    labels = {
        ZERO_SHOT_DIR: "zero-shot",
        EXPERTS_DIR: "expert",
        merged_stage_name("task_arithmetic"): "TA",
        calibrated_stage_name("task_arithmetic"): "TA+FeatCal",
    }

    _check_options(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    progress = show_progress(args)
    config = ZooConfig.tiny(seed=args.zoo_seed) if args.tiny else ZooConfig.mini8(seed=args.zoo_seed)
    start = time.perf_counter()
    zoo = build_zoo(config, cache_dir=args.cache_dir, force=args.rebuild, progress=progress)
    built = time.perf_counter() - start
    print(path_line(f"Benchmark zoo ({built:.0f} s)", zoo))
    spec = demo_run_spec(
        zoo, args.output_dir, device=args.device, progress=progress, scaling_factor=args.ta_scaling_factor
    ).replace(no_export=args.no_export, threads=args.threads)
    results = run_pipeline(spec)
    print(format_results({s: r for s, r in results.items() if s in labels}, labels, column=10))
    out = Path(args.output_dir)
    print(path_line("Run folder", out))
    if not args.no_export:
        print(path_line("Release folder", out / RELEASE_DIR))
    print(f"Total time: {time.perf_counter() - start:.0f} s")
    return 0
