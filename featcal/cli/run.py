"""`featcal run` (the whole pipeline) and the single stages `merge`, `calibrate`, `evaluate`, `methods`."""

from __future__ import annotations

import argparse
from pathlib import Path

from featcal.cli.common import (
    add_eval_args,
    add_featcal_args,
    add_merge_args,
    add_model_args,
    add_runtime_args,
    featcal_params,
    format_results,
    merge_params,
    show_progress,
)
from featcal.io import atomic_write_json
from featcal.pipeline import (
    DEFAULT_OUTPUT_DIR,
    RunConfig,
    calibrate,
    load_vision_folder,
    merge,
    resolve_device,
    resolve_setup,
    run_pipeline,
    stage_dir_name,
)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """The reference run's options, under the same names."""
    parser.add_argument(
        "--recipe",
        default=None,
        metavar="FILE",
        help="YAML recipe: option names (without --) mapped to values; flags given here win",
    )
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR, help=f"run folder (default {DEFAULT_OUTPUT_DIR})")
    add_model_args(parser)
    add_merge_args(parser)
    add_featcal_args(parser)
    add_eval_args(parser)
    add_runtime_args(parser)
    g = parser.add_argument_group("stages")
    g.add_argument("--skip-ta", action="store_true", help="start from --ta-model-path instead of merging")
    g.add_argument("--ta-model-path", default=None, metavar="DIR", help="merged model folder for --skip-ta")
    g.add_argument("--skip-eval-ta", action="store_true", help="do not evaluate the merged baseline")
    g.add_argument("--skip-featcal", action="store_true", help="merge (and evaluate) only")
    g.add_argument("--eval-zero-shot", action="store_true", help="also evaluate the base model zero-shot")
    g.add_argument("--eval-experts", action="store_true", help="also evaluate each expert on its own task")
    g.add_argument("--no-export", action="store_true", help="do not write the release folder (<output-dir>/release)")


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        output_dir=args.output_dir,
        device=args.device,
        seed=args.seed,
        tasks=args.tasks,
        tasks_file=args.tasks_file,
        base_model_id=args.base_model_id,
        expert_model_format=args.expert_model_format,
        merge_method=args.merge_method,
        merge_params=merge_params(args),
        featcal=featcal_params(args),
        eval_batch_size=args.eval_batch_size,
        eval_num_workers=args.eval_num_workers,
        max_eval_samples=args.max_eval_samples,
        skip_ta=args.skip_ta,
        ta_model_path=args.ta_model_path,
        skip_eval_ta=args.skip_eval_ta,
        skip_featcal=args.skip_featcal,
        eval_zero_shot=args.eval_zero_shot,
        eval_experts=args.eval_experts,
        cache_dir=args.cache_dir,
        progress=show_progress(args),
    )


def apply_recipe(args: argparse.Namespace, parser: argparse.ArgumentParser, argv_flags: set[str]) -> None:
    """Fill ``args`` from the YAML recipe, except for options given on the command line."""
    from featcal.recipes import load_recipe

    known = {a.dest: a for a in parser._actions if a.dest not in {"help", "recipe", "func"}}
    for key, value in load_recipe(args.recipe, known).items():
        flags = set(known[key].option_strings)
        if not flags & argv_flags:
            setattr(args, key, value)


def cmd_run(args: argparse.Namespace) -> int:
    if args.recipe:
        apply_recipe(args, args.parser, args.argv_flags)
    config = config_from_args(args)
    results = run_pipeline(config)
    if results:
        tasks = [k for k in next(iter(results.values())) if k not in {"model_info", "average", "run_id"}]
        print(format_results(results, tasks))
    print(f"Run folder: {Path(config.output_dir).resolve()}")
    released_stage_evaluated = not config.skip_featcal or not (config.skip_ta or config.skip_eval_ta)
    if released_stage_evaluated and not args.no_export:
        from featcal.release import export_release

        print(f"Release folder: {export_release(config.output_dir)}")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    config = RunConfig(
        tasks=args.tasks,
        tasks_file=args.tasks_file,
        base_model_id=args.base_model_id,
        expert_model_format=args.expert_model_format,
        merge_method=args.merge_method,
        merge_params=merge_params(args),
        cache_dir=args.cache_dir,
    )
    setup = resolve_setup(config)
    from featcal.io import save_vision_model

    folder = save_vision_model(merge(setup, args.merge_method), setup.vision_config, args.output)
    print(f"Merged model ({args.merge_method}, {len(setup.tasks)} experts): {folder.resolve()}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    config = RunConfig(
        tasks=args.tasks,
        tasks_file=args.tasks_file,
        base_model_id=args.base_model_id,
        expert_model_format=args.expert_model_format,
        cache_dir=args.cache_dir,
        seed=args.seed,
    )
    setup = resolve_setup(config)
    merged = load_vision_folder(args.merged)
    from featcal.evaluation import load_base_clip
    from featcal.io import save_vision_model

    device = resolve_device(args.device)
    _, _, processor = load_base_clip(setup.base_folder)
    model = calibrate(
        setup,
        merged,
        featcal_params(args),
        seed=args.seed,
        device=device,
        processor=processor,
        progress=show_progress(args),
    )
    folder = save_vision_model(model.state_dict(), setup.vision_config, args.output)
    print(f"Calibrated model: {folder.resolve()}")
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from featcal.evaluation import ZeroShotClassifier, load_base_clip

    config = RunConfig(
        tasks=args.tasks, tasks_file=args.tasks_file, base_model_id=args.base_model_id, cache_dir=args.cache_dir
    )
    setup = resolve_setup(config, need_experts=False)
    device = resolve_device(args.device)
    clip, tokenizer, processor = load_base_clip(setup.base_folder, device)
    model = load_vision_folder(args.model) if args.model else clip.vision_model
    report = ZeroShotClassifier(clip, tokenizer, device).evaluate(
        model,
        setup.tasks,
        processor,
        batch_size=args.eval_batch_size,
        num_workers=args.eval_num_workers,
        max_samples=args.max_eval_samples,
        progress=show_progress(args),
    )
    output = args.output or (Path(args.model) / "metrics.json" if args.model else None)
    if output:
        atomic_write_json(output, report)
    print(format_results({Path(args.model).name if args.model else "zero-shot": report}, [t.name for t in setup.tasks]))
    if output:
        print(f"Metrics: {Path(output).resolve()}")
    return 0


def cmd_methods(args: argparse.Namespace) -> int:
    from featcal.merging import available_methods, get_method

    for name in available_methods():
        method = get_method(name)
        print(f"{name:<18} {method.pretty_name}  {method.reference_url}  → folder {stage_dir_name(name)}/")
        for line in [method.description, *map(str, method.params)]:
            print(f"{'':<18} {line}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="merge → evaluate → FeatCal → evaluate, into a run folder",
        description="The whole pipeline, with the FeatCal reference run's options.",
    )
    add_run_args(p)
    p.set_defaults(func=cmd_run, parser=p)

    p = subparsers.add_parser("merge", help="merge experts into one model folder")
    p.add_argument("--output", required=True, metavar="DIR", help="model folder to write")
    add_model_args(p)
    add_merge_args(p, flag="--method")
    p.set_defaults(func=cmd_merge)

    p = subparsers.add_parser("calibrate", help="calibrate a merged model folder with FeatCal")
    p.add_argument("--merged", required=True, metavar="DIR", help="merged CLIPVisionModel folder")
    p.add_argument("--output", required=True, metavar="DIR", help="model folder to write")
    add_model_args(p)
    add_featcal_args(p)
    add_runtime_args(p)
    p.set_defaults(func=cmd_calibrate)

    p = subparsers.add_parser("evaluate", help="zero-shot accuracy of a vision model folder per task")
    p.add_argument(
        "--model", default=None, metavar="DIR", help="CLIPVisionModel folder (default: the base model's own tower)"
    )
    p.add_argument("--output", default=None, metavar="FILE", help="metrics JSON (default DIR/metrics.json)")
    add_model_args(p, experts=False)
    add_eval_args(p)
    p.add_argument("--device", default="auto")
    p.set_defaults(func=cmd_evaluate)

    p = subparsers.add_parser("methods", help="list the merging methods and their hyper-parameters")
    p.set_defaults(func=cmd_methods)
