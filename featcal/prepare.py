"""The preparation every command that computes on models shares: resolve → preprocessor → datasets → evaluator.

``featcal run`` (:mod:`featcal.pipeline`), ``merge``, ``calibrate`` (and its repairs), ``evaluate``
(:mod:`featcal.single_stage`), ``sweep`` (:mod:`featcal.sweep.runner`) and ``diagnose``
(:mod:`featcal.diagnostics.run`) call :func:`prepare`: it resolves the inputs (tasks, base, experts),
runs the command's own checks of them, makes the base's preprocessor, loads and checks each task's
datasets and, when asked, makes the family's evaluator. Each step raises the typed error of
:mod:`featcal.errors` naming its input, before anything is written; the checks run in this fixed order,
so that a command given two bad inputs always names the same one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from featcal.data import DatasetFacts, validate_datasets
from featcal.distributed import SINGLE, World

if TYPE_CHECKING:
    from featcal.families.base import Evaluator, ModelFamily
    from featcal.resolve import RunInputs
    from featcal.spec import RunSpec


@dataclass(frozen=True)
class DatasetCheck:
    """Which splits of each task's dataset a command reads, and what is checked of them
    (:func:`featcal.data.validate_datasets`).

    Attributes:
        splits: The splits loaded and checked (``train``: the calibration's, ``test``: the evaluation's).
        calibration_examples: The calibration examples each task must hold (None: no such check).
        allow_fewer: Use every train example of a task with fewer instead of refusing it.
        seed: The calibration shuffle's seed: with it, the drawn examples themselves are read and checked.
        held_out_after: The run's ``num_calibration_examples``, which a task whose evaluation reads its
            calibration rows must leave rows after.
        with_preprocessor: Make the base's preprocessor first and let the family check what it makes of the
            drawn examples (a text family: their tokens against its length limit).
    """

    splits: tuple[str, ...]
    calibration_examples: int | None = None
    allow_fewer: bool = False
    seed: int | None = None
    held_out_after: int | None = None
    with_preprocessor: bool = True

    @classmethod
    def calibration_draw(
        cls, spec: RunSpec, splits: tuple[str, ...] = ("train",), *, held_out: bool = False
    ) -> DatasetCheck:
        """FeatCal's calibration draw of ``spec`` (``num_calibration_examples``, ``seed``,
        ``allow_fewer_calibration_examples``) over ``splits``; with ``held_out``, the test splits must
        leave rows after the draw too."""
        n = spec.featcal.num_calibration_examples
        return cls(splits, n, spec.allow_fewer_calibration_examples, spec.seed, n if held_out else None)


@dataclass(frozen=True)
class Evaluation:
    """What makes the family's evaluator of the base: the ``device`` option (resolved for this process by
    :meth:`~featcal.distributed.World.compute_device` when the evaluator is made), the processes, and its
    settings (:meth:`~featcal.families.base.ModelFamily.evaluation_settings`, read from the inputs)."""

    device: str
    world: World = SINGLE
    settings: Callable[[RunInputs], Mapping[str, Any] | None] = lambda _inputs: None

    @classmethod
    def of_spec(cls, spec: RunSpec, world: World = SINGLE) -> Evaluation:
        """The evaluation ``spec`` asks for on its device, with its family's settings for its tasks."""
        return cls(spec.device, world, lambda inputs: inputs.family.evaluation_settings(spec, inputs.tasks))


@dataclass
class Prepared:
    """What a command's stages need, checked.

    Attributes:
        inputs: The tasks, base and experts, resolved.
        data: What the dataset check learnt (calibration counts, fingerprints, commits); None when the
            command reads no dataset.
        evaluator: The family's evaluator of the base, when asked for.
    """

    inputs: RunInputs
    data: DatasetFacts | None = None
    evaluator: Evaluator | None = None
    _preprocessor: Any = field(default=None, repr=False)

    @property
    def family(self) -> ModelFamily:
        """The tasks' model family."""
        return self.inputs.family

    @property
    def preprocessor(self) -> Any:
        """The base's preprocessor (CLIP's image processor, a tokenizer), made on first use when the dataset
        check did not need it."""
        if self._preprocessor is None:
            self._preprocessor = self.family.preprocessor(self.inputs.base_folder)
        return self._preprocessor


def prepare(
    resolve: Callable[[], RunInputs],
    datasets: DatasetCheck | Callable[[RunInputs], DatasetCheck | None] | None = None,
    *,
    check_inputs: Callable[[RunInputs], None] | None = None,
    check_data: Callable[[Prepared], None] | None = None,
    evaluation: Evaluation | None = None,
) -> Prepared:
    """Resolve a command's inputs and check everything its stages read, in one fixed order.

    1. ``resolve()``: the tasks, base and experts (:func:`featcal.resolve.resolve_inputs` of a spec, or
       :func:`featcal.resolve.run_inputs` of a run folder);
    2. ``check_inputs(inputs)``: the command's own checks of them (its output folder, what its method
       is defined for), before any dataset is read;
    3. the base's preprocessor, when ``datasets`` checks the drawn examples with it;
    4. the datasets (``datasets``, or what it returns given the inputs; none when None);
    5. ``check_data(prepared)``: the command's checks that need the data (a model folder, the
       calibration's share of each process);
    6. the evaluator (``evaluation``; none when None).

    Args:
        resolve: Returns the resolved inputs.
        datasets: The splits read and what is checked of them, or a function of the inputs that says it.
        check_inputs: Checks of the resolved inputs.
        check_data: Checks once the datasets are known.
        evaluation: The evaluator's device, processes and settings.

    Returns:
        The inputs, the datasets' facts, the evaluator and (on first use) the preprocessor.

    Raises:
        FeatcalError: a typed subclass naming the first input that cannot be used (raised by each step
            and check in the order above).
    """
    inputs = resolve()
    if check_inputs is not None:
        check_inputs(inputs)
    prepared = Prepared(inputs)
    if callable(datasets):
        datasets = datasets(inputs)
    if datasets is not None:
        preprocessor = prepared.preprocessor if datasets.with_preprocessor else None
        prepared.data = validate_datasets(
            inputs.family,
            inputs.tasks,
            datasets.splits,
            calibration_examples=datasets.calibration_examples,
            allow_fewer=datasets.allow_fewer,
            seed=datasets.seed,
            preprocessor=preprocessor,
            held_out_after=datasets.held_out_after,
        )
    if check_data is not None:
        check_data(prepared)
    if evaluation is not None:
        device = evaluation.world.compute_device(evaluation.device)
        prepared.evaluator = inputs.family.evaluator(
            inputs.base_folder, device, world=evaluation.world, settings=evaluation.settings(inputs)
        )
    return prepared
