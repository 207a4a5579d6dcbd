"""The interface a model family implements: everything featcal knows of one kind of model.

Merge, calibrate, evaluate, export, push, diagnose, sweep, resume, lock and torchrun are written
once, over this interface; a family (:mod:`featcal.families.clip_vision`) is the only place that
knows its models: which classes load them and how a folder is checked, the calibration's adapter and
batches, the evaluator, and what a release of it says.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from featcal.calibration.adapters import CalibrationBatch, LayerAdapter
    from featcal.checkpoint import Checkpoint
    from featcal.distributed import World
    from featcal.files.safetensors_writer import ShardedSafetensorsWriter
    from featcal.metrics import MetricsReport, TaskMetrics
    from featcal.runfolder.reader import RunFolder
    from featcal.spec import RunSpec
    from featcal.tasks import Task


class Evaluator(Protocol):
    """A family's evaluation of models on tasks, sharing what every evaluation of a run reads.

    Built from the base model (:meth:`ModelFamily.evaluator`); under torchrun each process evaluates
    its share of every task's test examples and the counts are summed over the processes. A task's
    result is its accuracy and loss (CLIP), or its loss alone with the family's own measures beside it
    (a language model: held-out response loss, exact match; see :class:`~featcal.metrics.TaskMetrics`).
    """

    def base_model(self) -> nn.Module:
        """The base model's own part that the family merges (its zero-shot evaluation)."""

    def prepare(self, tasks: Sequence[Task]) -> None:
        """Compute what later evaluations of ``tasks`` need from the base (class heads), then free the base."""

    def test_data(self, tasks: Sequence[Task], *, batch_size: int | None, num_workers: int,
                  max_samples: int | None) -> Any:  # fmt: skip
        """The tasks' test examples behind one loader, shared by every evaluation of a run."""

    def evaluate(self, model: nn.Module, tasks: Sequence[Task], *, data: Any, progress: bool) -> MetricsReport:
        """``model``'s results on each task, their average and the model's size."""

    def evaluate_task(self, model: nn.Module, task: Task, *, data: Any, progress: bool) -> TaskMetrics:
        """``model``'s result on one task."""


@dataclass(frozen=True)
class ReleaseParts:
    """What a release of a family's model says and holds beside the weights.

    Attributes:
        model_class: The transformers class that loads the released folder (``CLIPVisionModel``).
        pipeline_tag: The Hub's task tag for it.
        tags: The card's tags besides the merging method's.
        files: Files a release holds from the base model's preprocessor (the image processor's config).
        task_type: The ``model-index`` task type of its results (``image-classification``).
        task_name: That task's name for people.
        card_template: The package and file name of the family's model card template of a run's release.
        optional_files: Files a release may hold beside those (a tokenizer's optional files), which a new export
            may replace.
        edit_config: Rewrites the released ``config.json`` (as a dict) after transformers wrote it, or None.
        default_license: The license a run's card claims when none is given (CLIP's: ``mit``, that of the CLIP
            weights its suites' bases carry); None: ``other``, and the card says none was given (a T5 or a
            language model inherits the licenses of a base and experts featcal knows nothing of).
        folder_card_template: The package and file name of the card template of a model folder's own release
            (``featcal export DIR`` on a folder of ``featcal merge`` or ``featcal calibrate``: no run, no results);
            None for a family whose model folders are released only from the run that made them (CLIP).
        run_as_model_folder: Whether a run is released as its released stage's model folder, with the run's
            results (:func:`featcal.release.folder_release.write_folder_release`, the card of that folder with the
            family's :meth:`~ModelFamily.card_context`), rather than as a release of the run's own (the stage saved
            as :attr:`model_class`); both by :func:`featcal.release.export.export_release`.
        quiet_loading: A context in which loading the released class drops a transformers message that reports
            no fault of the release (a T5's LM head of its own), or None.
        run_metrics: What a run's release adds to its ``metrics.json`` beside the released stage's results, from
            the whole run (a language model's MergeBench averages normalised by the run's experts), or None.
    """

    model_class: str
    pipeline_tag: str
    tags: tuple[str, ...]
    files: tuple[str, ...]
    task_type: str
    task_name: str
    card_template: tuple[str, str]
    optional_files: tuple[str, ...] = ()
    edit_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    default_license: str | None = None
    folder_card_template: tuple[str, str] | None = None
    run_as_model_folder: bool = False
    quiet_loading: Callable[[], AbstractContextManager[Any]] | None = None
    run_metrics: Callable[[RunFolder], Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class DataFileEntries:
    """What an expert's entry of a calibration data file (``--data FILE``, :mod:`featcal.data_file`) may say for a
    family's tasks, beside the dataset, split, config and task name every entry may give.

    Attributes:
        keys: The keys copied into the expert's task entry when given (a causal LM's ``text``, ``prompt``, ...).
        defaults: The keys copied likewise, which the file's top level may also set for every entry of the family.
        marks: Keys whose presence makes an entry this family's when the file names no ``family`` (a T5's
            ``input``, ``target``); the one built-in family with none reads every other entry.
    """

    keys: tuple[str, ...]
    defaults: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()


class ModelFamily(Protocol):
    """One kind of model featcal merges, calibrates, evaluates and releases.

    Attributes:
        name: The registry name, recorded in each run (``clip_vision``).
        title: The name for people (``CLIP vision tower``).
        model_types: The ``model_type`` values of the folders the family reads.
        noun: What one example is called in messages (``image``).
        output_dtypes: The ``--output-dtype`` values it writes models in (:data:`featcal.precision.OUTPUT_DTYPES`;
            ``base`` always); another is refused before any work.
        head_point: What the diagnostics call the adapter's head, their last measuring point
            (``pooled (CLS) output``).
        task_schema: Which kind of task entry the family reads (:data:`featcal.families.TASK_SCHEMAS`):
            ``image`` (class names and templates), ``text`` (:class:`~featcal.tasks.TextFormat`) or ``pair``
            (:class:`~featcal.tasks.TextPairFormat`). Optional: a family without it reads ``image`` entries.
        tasks_hint: How to give its tasks to ``featcal evaluate``, in words (a refusal's hint). Optional.
        task_fields: The keys a task entry of the family gives beside the common ones (dataset, expert,
            references, family); with ``parse_task_fields``. Optional: a family without them reads ``image`` entries
            (the default family's).
        parse_task_fields: A method ``(entry, where) -> dict`` that checks those keys of one entry and returns the
            :class:`~featcal.tasks.Task` field they make (``text``: the task's :class:`~featcal.tasks.TaskFormat`),
            raising a :class:`~featcal.errors.FeatcalError` that names ``where``. Optional, with ``task_fields``.
        data_file: The family's :class:`DataFileEntries`, for a family whose experts a calibration data file
            describes. Optional.
        command_module: The module of the family's own CLI commands (``register(subparsers)``: the causal-LM
            family's ``featcal architectures``), or none. Optional.
        mergekit_module: The module of the family that reads mergekit's files (``read_mergekit_folder``,
            ``parse_mergekit_config``), for the one family whose merges mergekit makes. Optional.

    Generic modules read the optional attributes through :mod:`featcal.families` (:func:`~featcal.families.task_schema`,
    :func:`~featcal.families.task_entry_reader`, :func:`~featcal.families.data_file_family`,
    :func:`~featcal.families.tasks_hint`, :func:`~featcal.families.mergekit_reader`,
    :func:`~featcal.families.command_modules`), never by a family's name. A built-in family is written as a
    declaration (:class:`featcal.families.declared.DeclaredFamily`): its facts, and a table of its members.
    """

    name: str
    title: str
    model_types: tuple[str, ...]
    noun: str
    output_dtypes: tuple[str, ...]
    head_point: str

    # --- models -------------------------------------------------------------------------------
    def check_base_folder(self, folder: Path) -> None:
        """Refuse a base model folder the family cannot use (one line, naming the folder and the fix)."""

    def checkpoint(self, folder: Path, name: str | None = None) -> Checkpoint:
        """The tensors of a base, expert or merged folder that the family merges and calibrates, read lazily."""

    def model_config(self, base_folder: Path) -> Any:
        """The configuration merged and calibrated models are written with (the base's)."""

    def hidden_size(self, config: Any) -> int:
        """The model's width, which chooses torch's threads on the CPU."""

    def check_like_base(self, folder: Path, base_folder: Path, what: str) -> None:
        """Refuse an expert or merged model whose configuration or tokenizer vocabulary differ from the base's
        (:mod:`featcal.families.likeness`), naming ``what`` and both values."""

    def check_model_folder(self, folder: Path, base: Checkpoint | None = None) -> Checkpoint:
        """Check a merged or calibrated model folder without loading the model (against ``base``'s
        shapes, configuration and tokenizer vocabulary when given); returns its tensors."""

    def load_model(self, folder: Path, base: Checkpoint | None = None) -> nn.Module:
        """A merged, calibrated or released model from its folder, checked, in float32, in eval mode."""

    def build_model(self, config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """A model of ``config`` holding ``state``."""

    def save_model(
        self, state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = "base"
    ) -> Path:
        """Write ``state`` as a model folder of ``config``, atomically, its weights stored in ``output_dtype``
        (one of :attr:`output_dtypes`)."""

    # --- calibration --------------------------------------------------------------------------
    def adapter(self) -> LayerAdapter:
        """The calibration's view of the family's models."""

    def skeleton(self, folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
        """The model in ``folder`` with everything but its calibrated layers on ``device`` (read from
        ``merged``) and its layers on the meta device."""

    def streamed_model(
        self, config: Any, folder: Path, *, output_dtype: str = "base"
    ) -> AbstractContextManager[ShardedSafetensorsWriter]:
        """A model folder of ``config`` written tensor by tensor (keyed as :meth:`checkpoint` keys them), its
        weights stored in ``output_dtype`` (one of :attr:`output_dtypes`), appearing whole when the block ends."""

    def preprocessor(self, base_folder: Path) -> Any:
        """What turns a task's raw examples into tensors (CLIP's image processor), read from the base."""

    def calibration_inputs(self, task: Task, preprocessor: Any, n: int, seed: int, *, world: World) -> CalibrationBatch:
        """The task's calibration examples (the first ``n`` of its train split after one shuffle with
        ``seed``; this process's part under torchrun)."""

    def load_split(self, task: Task, split: str) -> Any:
        """A task's ``train`` or ``test`` split, its columns checked (a ``datasets.Dataset``)."""

    def test_inputs(self, task: Task, preprocessor: Any, n: int) -> CalibrationBatch:
        """The first ``n`` examples of the task's test split (all of them when it has fewer)."""

    def check_examples(
        self, task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
    ) -> Mapping[str, Any] | None:
        """Read the examples ``rows`` of a split whole (CLIP: decode each image; a text family: render and,
        with ``preprocessor``, tokenise each text), so that a damaged one is named (task, split, row)
        before any work reads it. Returns what the run records of them (a text family: how many were
        cut), or None."""

    def check_split(self, task: Task, dataset: Any, split: str) -> None:
        """Refuse a split whose examples the family cannot read (columns, labels), naming task and split."""

    # --- evaluation and release ---------------------------------------------------------------
    def evaluator(
        self, base_folder: Path, device: torch.device, *, world: World, settings: Mapping[str, Any] | None = None
    ) -> Evaluator:
        """The evaluation of models of this family against the base in ``base_folder``, with the run's
        :meth:`evaluation_settings`."""

    def evaluation_settings(self, spec: RunSpec, tasks: Sequence[Task] = ()) -> Mapping[str, Any]:
        """What the family's evaluations depend on besides the test data and ``max_eval_samples``, from the
        run's options and its ``tasks`` (a language model: the held-out rows' shuffle, the greedy answers' length,
        the harness's tasks; a T5: the shuffle holding out the evaluated rows of tasks whose calibration reads
        their test split); recorded in ``run_config.json`` and part of every evaluation's identity. Empty for
        CLIP."""

    def evaluation_record(self) -> Mapping[str, Any]:
        """What a run records of how it evaluated, besides ``max_eval_samples`` (CLIP's image processor)."""

    @property
    def release(self) -> ReleaseParts:
        """What a release of this family's model says and holds beside the weights."""

    def card_context(self, run: RunFolder) -> Mapping[str, Any]:
        """The family's results section of a run's card: the variables its run card template reads beside
        featcal's own (CLIP: the usage snippet; T5: each task's metric; language models: the held-out results,
        the harness table and the suite's reference numbers)."""
