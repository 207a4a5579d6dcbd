"""`featcal calibrate --method surgery`: Representation Surgery of a CLIP merge, its modules and report."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from featcal.cli.common import path_line
from featcal.cli.options import given_values
from featcal.cli.pipeline_commands import CALIBRATION_DRAW, compute_settings, one_process, spec_from_args

if TYPE_CHECKING:
    from featcal.repairs.registry import Repair


def surgery_folder(args: argparse.Namespace, repair: Repair, params: dict[str, Any], *, evaluate: bool) -> int:
    """Train each task's module on FeatCal's calibration draw (``-n``, ``--seed``) of the tasks, write the
    modules, recipe and report to ``--output``, and evaluate them with ``--evaluate``; one process.

    Raises:
        InvalidParameterError: for a FeatCal parameter, a bad hyper-parameter, or a family other than CLIP.
        ModelInputError: for a folder calibrated already, or a model that does not fit.
        DatasetInputError: for a task without a train split (or, with ``--evaluate``, a test split).
        FeatcalError: under torchrun with more than one process.
    """
    from featcal.calibration.params import FeatCalParams
    from featcal.data import validate_datasets
    from featcal.errors import InvalidParameterError
    from featcal.families.clip_vision.adapter import PIXELS
    from featcal.outputs import check_output_folder
    from featcal.repairs.apply import check_uncalibrated
    from featcal.repairs.surgery import check_surgery_family
    from featcal.repairs.surgery_run import evaluate_surgery, run_surgery, save_surgery
    from featcal.resolve import resolve_inputs
    from featcal.stages import merge_calibration

    values = given_values(args)
    featcal_only = [n for n in values if n in FeatCalParams.__dataclass_fields__ and n not in CALIBRATION_DRAW]
    if featcal_only:
        raise InvalidParameterError(
            featcal_only[0], values[featcal_only[0]], f"given only with --method featcal: {repair.name} reads "
            "FeatCal's calibration draw (--num-calibration-examples, --seed) but none of its parameters",
        )  # fmt: skip
    resolved = repair.resolved_params(**params)
    spec = spec_from_args(args)
    output = check_output_folder(args.output, kind="repair output", inputs=[args.merged])  # before any download
    with one_process(spec, repair) as world:
        check_uncalibrated(args.merged, repair)
        inputs = resolve_inputs(spec, merged=args.merged)
        family = inputs.family
        check_surgery_family(family)
        check_output_folder(output, kind="repair output", inputs=[*inputs.local_folders(), args.merged])
        preprocessor = family.preprocessor(inputs.base_folder)
        n, seed = spec.featcal.num_calibration_examples, spec.seed
        facts = validate_datasets(
            family, inputs.tasks, splits=("train", "test") if evaluate else ("train",), calibration_examples=n,
            allow_fewer=spec.allow_fewer_calibration_examples, seed=seed, preprocessor=preprocessor,
        )  # fmt: skip
        family.check_model_folder(Path(args.merged), inputs.base)
        draw = merge_calibration(spec.featcal, seed, facts.calibration_counts, facts.fingerprints, inputs.tasks)
        device = world.compute_device(spec.device)
        evaluator = family.evaluator(inputs.base_folder, device, world=world, settings=family.evaluation_settings(spec))
        with compute_settings(spec, inputs):
            merged = family.load_model(Path(args.merged), inputs.base)
            experts = {t.name: family.build_model(inputs.config, inputs.experts[t.name]) for t in inputs.tasks}
            pixels = {
                t.name: family.calibration_inputs(t, preprocessor, n, seed, world=world).inputs[PIXELS]
                for t in inputs.tasks
            }
            result, cost = run_surgery(
                evaluator.classifier, merged, experts, pixels, resolved, seed=seed,
                batch_size=spec.featcal.calibration_batch_size,
            )  # fmt: skip
            report: dict[str, Any] = {**cost, "loss_first_step": result.losses[0], "loss_last_step": result.losses[-1]}
            if evaluate:
                evaluator.prepare(inputs.tasks)
                images = evaluator.test_data(
                    inputs.tasks, batch_size=spec.eval_batch_size, num_workers=spec.eval_num_workers,
                    max_samples=spec.max_eval_samples,
                )  # fmt: skip
                report["accuracy"] = evaluate_surgery(
                    evaluator.classifier, merged, result.modules, inputs.tasks, images
                )
    folder = save_surgery(inputs, args.merged, {**resolved, "calibration": draw}, result, report, output)
    print(path_line(f"Representation Surgery modules ({len(inputs.tasks)} tasks)", folder))
    if evaluate:
        for task, acc in report["accuracy"].items():
            print(f"{task}: accuracy {acc['accuracy']:.4f} (merge alone {acc['accuracy_without']:.4f})")
    return 0
