"""``featcal calibrate`` with FeatCal: calibrate a merged model folder on the tasks' calibration draw."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from featcal.outputs import check_output_folder
from featcal.prepare import DatasetCheck, Prepared, prepare
from featcal.runfolder.lock import OutputLock
from featcal.single_stage.compute import compute_settings
from featcal.stages import calibrate

if TYPE_CHECKING:
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec


def calibrate_model(spec: RunSpec, merged: str, output: str | Path) -> Path | None:
    """Calibrate the merged model folder ``merged`` with FeatCal and write the model folder ``output``.

    Under torchrun every process calibrates on its share of the examples; rank 0 alone writes.

    Args:
        spec: The tasks, models, FeatCal's parameters and calibration draw, and where to compute.
        merged: The merged model folder (featcal's merge or mergekit's output).
        output: The model folder to write.

    Returns:
        The folder written; None in the processes other than rank 0.

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used (the output folder,
            the tasks, base and experts, the datasets, the merged folder), before anything is written.
    """
    from featcal.distributed import session
    from featcal.resolve import resolve_inputs

    output = check_output_folder(output, kind="calibrated model", inputs=[merged])  # before any download
    with session(spec.device, spec.dist_timeout) as world, ExitStack() as held:
        device = world.compute_device(spec.device)

        def check_inputs(inputs: RunInputs) -> None:
            if world.is_main:  # one writer of the folder until it is written
                held.enter_context(OutputLock(output, kind="calibrated model"))
            check_output_folder(output, kind="calibrated model", inputs=[*inputs.local_folders(), merged])

        def check_data(prepared: Prepared) -> None:
            prepared.family.check_model_folder(Path(merged), prepared.inputs.base)

        with world.main_first("checking the inputs"):
            prepared = prepare(
                lambda: resolve_inputs(spec, merged=merged),
                DatasetCheck.calibration_draw(spec),
                check_inputs=check_inputs,
                check_data=check_data,
            )
        inputs = prepared.inputs
        with compute_settings(spec, inputs):
            calibrate(
                inputs, merged, output if world.is_main else None, spec.featcal, seed=spec.seed,
                device=device, preprocessor=prepared.preprocessor, progress=spec.progress, world=world,
                precision=spec.precision, counts=prepared.data.calibration_counts, output_dtype=spec.output_dtype,
                stream_storage=spec.stream_storage,
            )  # fmt: skip
    return output if world.is_main else None
