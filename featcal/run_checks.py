"""What ``featcal run`` checks before its folder is touched, through the shared preparation
(:func:`featcal.prepare.prepare`): the output folder, the inputs, the datasets the steps read, the run
record, an earlier run in the folder, and a merged model to start from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from featcal.distributed import World
from featcal.errors import InvalidParameterError
from featcal.merging.data import check_data_family
from featcal.outputs import check_run_output_folder
from featcal.prepare import DatasetCheck, Evaluation, Prepared, prepare
from featcal.resolve import RunInputs, resolve_inputs
from featcal.runfolder.reader import check_same_run
from featcal.runfolder.record import RunRecord
from featcal.runfolder.recording import merges_from_data, run_record
from featcal.spec import RunSpec
from featcal.stages import check_calibration_shares
from featcal.threads import choose_threads


@dataclass(frozen=True)
class PreparedRun:
    """A run's checked inputs and what its steps need of them.

    Attributes:
        prepared: The inputs, datasets' facts, preprocessor and evaluator.
        record: The run record (``run_config.json``).
        threads: The torch threads the run computes with.
    """

    prepared: Prepared
    record: RunRecord
    threads: int


class _RunChecks:
    """The run's own checks, in the order :func:`~featcal.prepare.prepare` calls them, and what they learn."""

    def __init__(self, spec: RunSpec, out: Path, world: World) -> None:
        self.spec, self.out, self.world = spec, out, world
        self.calibrates = False
        self.record: RunRecord | None = None
        self.threads = 0

    def inputs(self, inputs: RunInputs) -> None:
        """A data-using merge's method must read the tasks' family."""
        if merges_from_data(self.spec):
            check_data_family(self.spec.merge_method, inputs.family)

    def datasets(self, inputs: RunInputs) -> DatasetCheck:
        """The calibration draw's train splits when some step reads them, and the test splits."""
        spec = self.spec
        self.calibrates = not spec.skip_featcal or merges_from_data(spec)  # some step reads the calibration draw
        if self.calibrates:
            return DatasetCheck.calibration_draw(spec, ("train", "test"), held_out=True)
        return DatasetCheck(("test",), held_out_after=spec.featcal.num_calibration_examples)

    def data(self, prepared: Prepared) -> None:
        """Each process's share of the calibration, the run record, an earlier run in the folder, threads."""
        spec, inputs, data = self.spec, prepared.inputs, prepared.data
        if self.calibrates:
            check_calibration_shares(
                inputs.tasks, data.calibration_counts, spec.featcal.num_calibration_examples, self.world,
                inputs.family.noun,
            )  # fmt: skip
        self.record = run_record(spec, inputs, data)
        if not spec.force:
            check_same_run(self.out, list(self.record.tasks), self.record.base_model_id)
        self.threads = choose_threads(spec.threads, inputs.family.hidden_size(inputs.config))


def prepare_run(spec: RunSpec, out: Path, world: World) -> PreparedRun:
    """Check everything a run reads before its folder ``out`` is touched (rank 0 first under torchrun).

    Args:
        spec: The run's options.
        out: The run folder.
        world: The processes.

    Returns:
        The checked inputs, the run record and the threads.

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used: the output folder, a
            ``ta_model_path`` inside it, the tasks, base and experts, the method's family, the datasets, each
            process's share of the calibration, the record, an earlier run of other inputs in the folder, the
            threads, the evaluator's settings, then the merged folder to start from.
    """
    check_run_output_folder(out)
    merged_from = Path(spec.ta_model_path).resolve() if spec.skip_ta else None
    if merged_from is not None and out.resolve() in (merged_from, *merged_from.parents):
        raise InvalidParameterError(
            "ta_model_path", spec.ta_model_path, "a folder outside the output folder, whose stage folders the run "
            "replaces (run without skip_ta to reuse the run's own merge, or copy the folder elsewhere)",
        )  # fmt: skip
    torch.manual_seed(spec.seed)
    need_experts = not (spec.skip_ta and spec.skip_featcal and not spec.eval_experts)
    checks = _RunChecks(spec, out, world)
    prepared = prepare(
        lambda: resolve_inputs(spec, need_experts=need_experts),
        checks.datasets,
        check_inputs=checks.inputs,
        check_data=checks.data,
        evaluation=Evaluation.of_spec(spec, world),
    )
    # A merged model to start from is checked before the folder is touched (and read when needed).
    if spec.skip_ta:
        prepared.family.check_model_folder(Path(spec.ta_model_path), prepared.inputs.base)
    return PreparedRun(prepared, checks.record, checks.threads)
