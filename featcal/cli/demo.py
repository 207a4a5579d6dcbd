"""`featcal demo`: build (once) an offline benchmark zoo (mini8, lm5 or t5x4), run merge → calibrate → evaluate
→ export on it."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from featcal.cli.common import format_results, path_line, show_progress
from featcal.cli.options import add_options, command, given_values
from featcal.demo.options import TEXT_ZOOS, DemoOptions


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on an offline benchmark, mini8, lm5 or t5x4 (no downloads)",
        description="Build the benchmark zoo the first time (mini8: eight procedural image tasks, a small CLIP "
        "and one expert per task; --zoo lm5: five synthetic text tasks, a tiny Llama and one expert per task; "
        "--zoo t5x4: four synthetic text-to-text tasks, a tiny T5 and one expert per task; cached), then merge "
        "with Task Arithmetic, calibrate with FeatCal, evaluate the base, the experts and both models, and export "
        "a release folder. Prints the results table.",
    )
    add_options(parser, DemoOptions)
    command(parser, cmd_demo)


def _check_options(options: DemoOptions) -> None:
    """Every option, checked before the zoo is built (minutes): the run's options as the run will check
    them, the device, Task Arithmetic's κ and the output folder.

    Raises:
        FeatcalError: naming the option and what it must be.
    """
    from featcal.devices import resolve_device
    from featcal.merging import get_method
    from featcal.outputs import check_run_output_folder

    # Built to be checked, not kept: the zoo's folder does not exist yet, and no field here depends on it.
    _run_spec(options, Path(options.run_folder), progress=False)
    resolve_device(options.device)
    get_method("task_arithmetic").resolved_params(scaling_factor=options.ta_scaling_factor)
    check_run_output_folder(Path(options.run_folder))


def _run_spec(options: DemoOptions, zoo: Path, *, progress: bool):
    """The run on ``zoo`` that the options ask for."""
    if options.zoo == "lm5":
        from featcal.demo.lm_zoo import lm_run_spec as run_spec
    elif options.zoo == "t5x4":
        from featcal.demo.t5_zoo import t5_run_spec as run_spec
    else:
        from featcal.demo import demo_run_spec as run_spec
    spec = run_spec(
        zoo, options.run_folder, device=options.device, progress=progress, scaling_factor=options.ta_scaling_factor
    )
    return spec.replace(no_export=options.no_export, threads=options.threads)


def _build(options: DemoOptions, *, progress: bool) -> Path:
    """The zoo's folder, built when the cache has none (or ``--rebuild``)."""
    seed, cache, force = options.zoo_seed, options.zoo_cache_dir, options.rebuild
    if options.zoo == "lm5":
        from featcal.demo.lm_zoo import LMZooConfig, build_lm_zoo

        config = LMZooConfig.tiny(seed=seed) if options.tiny else LMZooConfig.lm5(seed=seed)
        return build_lm_zoo(config, cache_dir=cache, force=force, progress=progress)
    if options.zoo == "t5x4":
        from featcal.demo.t5_zoo import T5ZooConfig, build_t5_zoo

        t5_config = T5ZooConfig.tiny(seed=seed) if options.tiny else T5ZooConfig.t5x4(seed=seed)
        return build_t5_zoo(t5_config, cache_dir=cache, force=force, progress=progress)
    from featcal.demo import ZooConfig, build_zoo

    mini8 = ZooConfig.tiny(seed=seed) if options.tiny else ZooConfig.mini8(seed=seed)
    return build_zoo(mini8, cache_dir=cache, force=force, progress=progress)


def _kernels(zoo: Path) -> str:
    """What the zoo's marker says its training's CPU kernels were (its table depends on them)."""
    from featcal.demo.cache import ZOO_MARKER

    try:
        capability = json.loads((zoo / ZOO_MARKER).read_text()).get("cpu_capability")
    except (OSError, ValueError, AttributeError):
        capability = None
    return f"trained with torch's {capability} CPU kernels" if capability else "its CPU kernels not recorded"


def cmd_demo(args: argparse.Namespace) -> int:
    from featcal.pipeline import run_pipeline
    from featcal.runfolder.layout import (
        EXPERTS_DIR,
        RELEASE_DIR,
        ZERO_SHOT_DIR,
        calibrated_stage_name,
        merged_stage_name,
    )

    options = DemoOptions(**given_values(args, DemoOptions))
    labels = {
        ZERO_SHOT_DIR: "base" if options.zoo in TEXT_ZOOS else "zero-shot",
        EXPERTS_DIR: "expert",
        merged_stage_name("task_arithmetic"): "TA",
        calibrated_stage_name("task_arithmetic"): "TA+FeatCal",
    }
    _check_options(options)
    progress = show_progress(args)
    start = time.perf_counter()
    zoo = _build(options, progress=progress)
    built = time.perf_counter() - start
    print(path_line(f"Benchmark zoo ({built:.0f} s; {_kernels(zoo)})", zoo))
    results = run_pipeline(_run_spec(options, zoo, progress=progress))
    if options.zoo == "t5x4":
        print("Exact match (%) of greedy generations, each task's test split:")
    print(format_results({s: r for s, r in results.items() if s in labels}, labels, column=10))
    out = Path(options.run_folder)
    print(path_line("Run folder", out))
    if not options.no_export:
        print(path_line("Release folder", out / RELEASE_DIR))
    print(f"Total time: {time.perf_counter() - start:.0f} s")
    return 0
