"""``featcal merge``: merge the experts of a spec's tasks into one model folder."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from featcal.merging.data import check_data_family
from featcal.outputs import check_output_folder
from featcal.prepare import DatasetCheck, Prepared, prepare
from featcal.runfolder.lock import OutputLock
from featcal.runfolder.recording import merge_calibration
from featcal.single_stage.compute import compute_settings
from featcal.stages import check_calibration_shares, merge, merge_data, save_merge

if TYPE_CHECKING:
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec


@dataclass(frozen=True)
class MergedFolder:
    """A merged model folder written, and the number of experts merged into it."""

    folder: Path
    experts: int


def merge_model(spec: RunSpec, output: str | Path, *, uses_data: bool) -> MergedFolder | None:
    """Merge the experts of ``spec``'s tasks by ``spec.merge_method`` and write the model folder ``output``.

    Under torchrun every process merges its share; rank 0 alone writes.

    Args:
        spec: The tasks, models, method and its hyper-parameters, and the calibration draw of a data-using
            method (``num_calibration_examples``, ``calibration_batch_size``, ``seed``).
        output: The model folder to write.
        uses_data: Whether the method reads each task's calibration examples.

    Returns:
        The folder written and the experts merged; None in the processes other than rank 0.

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used (the output folder,
            the tasks, base and experts, the method's family, the datasets), before anything is written.
    """
    from featcal.distributed import session
    from featcal.resolve import resolve_inputs

    output = check_output_folder(output, kind="merged model")  # before any download
    calibration, data = None, None
    with session(spec.device, spec.dist_timeout) as world, ExitStack() as held:
        device = world.compute_device(spec.device)

        def check_inputs(inputs: RunInputs) -> None:
            if world.is_main:  # one writer of the folder until it is written (released after the save)
                held.enter_context(OutputLock(output, kind="merged model"))
            check_output_folder(output, kind="merged model", inputs=inputs.local_folders())
            if uses_data:
                check_data_family(spec.merge_method, inputs.family)

        def check_data(prepared: Prepared) -> None:
            if uses_data:
                counts, n = prepared.data.calibration_counts, spec.featcal.num_calibration_examples
                check_calibration_shares(prepared.inputs.tasks, counts, n, world, prepared.family.noun)

        with world.main_first("checking the inputs"):
            # each task's calibration examples (a data-using method), read before the merge starts
            prepared = prepare(
                lambda: resolve_inputs(spec),
                DatasetCheck.calibration_draw(spec) if uses_data else None,
                check_inputs=check_inputs,
                check_data=check_data,
            )
            inputs = prepared.inputs
            if uses_data:
                facts = prepared.data
                calibration = merge_calibration(
                    spec.featcal, spec.seed, facts.calibration_counts, facts.fingerprints, inputs.tasks
                )
                data = merge_data(
                    inputs, prepared.preprocessor, spec.featcal, spec.seed, world=world, progress=spec.progress
                )
        with compute_settings(spec, inputs):
            state = merge(inputs, spec.merge_method, device, world=world, data=data, output_dtype=spec.output_dtype)
        if not world.is_main:
            return None
        folder = save_merge(inputs, spec.merge_method, state, output, calibration, output_dtype=spec.output_dtype)
    return MergedFolder(folder, len(inputs.tasks))
