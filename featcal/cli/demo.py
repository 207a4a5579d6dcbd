"""`featcal demo`: build (once) the offline mini8 benchmark, run merge → calibrate → evaluate → export on it."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from featcal.cli.common import format_results, path_line, show_progress
from featcal.cli.options import add_options, command, given_values
from featcal.demo.options import DemoOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on the offline mini8 benchmark (no downloads)",
        description="Build the mini8 benchmark zoo the first time (eight procedural image tasks, a small CLIP "
        "and one expert per task, cached), then merge with Task Arithmetic, calibrate with FeatCal, "
        "evaluate zero-shot and export a release folder. Prints the results table.",
    )
    add_options(parser, DemoOptions)
    command(parser, cmd_demo)


def _check_options(options: DemoOptions) -> None:
    """Every option, checked before the zoo is built (minutes): the run's options as the run will check
    them, the device, Task Arithmetic's κ and the output folder.

    Raises:
        FeatcalError: naming the option and what it must be.
    """
    from featcal.demo import demo_run_spec
    from featcal.devices import resolve_device
    from featcal.merging import get_method
    from featcal.outputs import check_run_output_folder

    # Built to be checked, not kept: the zoo's folder does not exist yet, and no field here depends on it.
    demo_run_spec(Path(options.output_dir), options.output_dir, device=options.device, progress=False).replace(
        threads=options.threads
    )
    resolve_device(options.device)
    get_method("task_arithmetic").resolved_params(scaling_factor=options.ta_scaling_factor)
    check_run_output_folder(Path(options.output_dir))


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

    options = DemoOptions(**given_values(args, DemoOptions))
    _check_options(options)
    if options.threads:
        torch.set_num_threads(options.threads)
    progress = show_progress(args)
    config = ZooConfig.tiny(seed=options.zoo_seed) if options.tiny else ZooConfig.mini8(seed=options.zoo_seed)
    start = time.perf_counter()
    zoo = build_zoo(config, cache_dir=options.zoo_cache_dir, force=options.rebuild, progress=progress)
    built = time.perf_counter() - start
    print(path_line(f"Benchmark zoo ({built:.0f} s)", zoo))
    spec = demo_run_spec(
        zoo, options.output_dir, device=options.device, progress=progress, scaling_factor=options.ta_scaling_factor
    ).replace(no_export=options.no_export, threads=options.threads)
    results = run_pipeline(spec)
    print(format_results({s: r for s, r in results.items() if s in labels}, labels, column=10))
    out = Path(options.output_dir)
    print(path_line("Run folder", out))
    if not options.no_export:
        print(path_line("Release folder", out / RELEASE_DIR))
    print(f"Total time: {time.perf_counter() - start:.0f} s")
    return 0
