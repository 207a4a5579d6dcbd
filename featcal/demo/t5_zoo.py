"""The offline T5 benchmark ``t5x4``: a tiny T5 pretrained on masked spans, four text-to-text task experts.

Built and cached like the other zoos (:mod:`featcal.demo.cache`), as ordinary input folders of a seq2seq
run, GLUE's layout in small::

    <zoo>/base/                  T5ForConditionalGeneration + its word-level tokenizer (save_pretrained)
    <zoo>/experts/<task>/        T5ForConditionalGeneration fine-tuned from the base on one task (+ the tokenizer)
    <zoo>/data/<task>/data/{train,test}-00000-of-00001.parquet   (sentence, label: a class id)
    <zoo>/data.json              the calibration data file (``featcal run --data``): input and target
                                 templates, the label words
    <zoo>/zoo.json               version, seed, sizes, build time, exact match measured while building

A task's ``train`` split holds the rows a run calibrates on, its ``test`` split the rows it is evaluated on
(none of whose sentences is in ``train``); the experts are fine-tuned on rows drawn independently of both (a
short sentence may recur there). The tasks are :mod:`featcal.demo.t5_tasks`', the training
:mod:`featcal.demo.t5_training`'.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from featcal.demo import zoo_fields
from featcal.demo.cache import build_environment, build_trained_zoo, marked_complete, write_marker, zoo_path
from featcal.demo.t5_tasks import T5_TASKS_BY_NAME, T5Task, generic_pairs, t5_tokenizer, task_rows, vocabulary
from featcal.errors import FeatcalError

T5_ZOO_VERSION = 1  # bump whenever texts, training or file layout change: it keys the cache
# the run's settings on the zoo: inputs of a few words, targets of one
T5_MAX_LENGTH = 32
T5_TARGET_MAX_LENGTH = 4
T5_SCALING_FACTOR = 0.3  # Task Arithmetic's κ: FusionBench's for FLAN-T5 on GLUE (glue8's); benchmarks/t5x4.md
T5_CALIBRATION_EXAMPLES = 128
# the parts FeatCal keeps merged (the embedding, the LM head, the final norms, the relative-attention tables):
# the experts keep the base's, so that FeatCal calibrates every part the experts changed
T5_FROZEN = (
    "shared", "lm_head", "encoder.final_layer_norm", "decoder.final_layer_norm",
    "encoder.block.0.layer.0.SelfAttention.relative_attention_bias",
    "decoder.block.0.layer.0.SelfAttention.relative_attention_bias",
)  # fmt: skip


@dataclass(frozen=True)
class T5ZooConfig(zoo_fields.ZooConfigMethods):
    """A T5 benchmark zoo: a tiny T5 base and one expert per synthetic task, from one seed.

    ``t5x4()`` is the documented benchmark; ``tiny()`` a reduced one for the test suite. Every field takes
    part in the cache key.

    Raises:
        FeatcalError: for an unknown task, fewer than two tasks, a non-positive size, or a width that is not
            a multiple of the heads.
    """

    name: str = "t5x4"
    seed: int = 0
    tasks: tuple[str, ...] = tuple(T5_TASKS_BY_NAME)
    calibration_rows: int = 256  # rows per task of the train split (the run calibrates on the first n)
    test_rows: int = 400  # rows per task of the test split
    train_rows: int = 4000  # rows per task the expert is fine-tuned on (drawn apart from both splits)
    generic_pairs: int = 20000
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2  # encoder blocks, and as many decoder blocks
    heads: int = 4
    pretrain_steps: int = 600
    pretrain_lr: float = 3e-3
    batch_size: int = 64
    expert_steps: int = 300
    expert_lr: float = 1e-3
    expert_frozen: tuple[str, ...] = T5_FROZEN

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in T5_TASKS_BY_NAME]
        if unknown or len(set(self.tasks)) < 2:
            raise FeatcalError(
                f"T5ZooConfig.tasks must name at least two of {sorted(T5_TASKS_BY_NAME)}; got {list(self.tasks)}."
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and f.name != "seed" and value <= 0:
                raise FeatcalError(f"T5ZooConfig.{f.name} must be positive; got {value}.")
        if self.hidden % self.heads:
            raise FeatcalError(f"T5ZooConfig: hidden {self.hidden} is not a multiple of heads {self.heads}.")

    @classmethod
    def t5x4(cls, seed: int = 0) -> T5ZooConfig:
        """The t5x4 benchmark: four tasks, a T5 of two encoder and two decoder blocks 64 wide."""
        return cls(seed=seed)

    @classmethod
    def tiny(cls, seed: int = 0) -> T5ZooConfig:
        """A reduced zoo for the test suite (seconds to build): three tasks, fewer rows and steps."""
        return cls(
            name="tiny-t5",
            seed=seed,
            tasks=("sentiment", "topic", "tense"),
            calibration_rows=T5_CALIBRATION_EXAMPLES,
            test_rows=100,
            train_rows=1000,
            generic_pairs=4000,
            batch_size=32,
            pretrain_steps=150,
            expert_steps=80,
        )

    VERSION: ClassVar[int] = T5_ZOO_VERSION

    @classmethod
    def presets(cls) -> dict[str, Callable[[], T5ZooConfig]]:
        """The presets by name."""
        return {"t5x4": cls.t5x4, "tiny-t5": cls.tiny}


def is_complete_t5_zoo(folder: Path) -> bool:
    """Whether ``folder`` holds a finished T5 zoo of the current version."""
    return marked_complete(folder, "t5_version", T5_ZOO_VERSION)


def build_t5_zoo(
    config: T5ZooConfig | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    *,
    progress: bool = True,
) -> Path:
    """The folder of the T5 zoo for ``config`` (default :meth:`T5ZooConfig.t5x4`), built if needed.

    Args:
        config: The zoo.
        cache_dir: The cache folder (default :func:`featcal.demo.cache.default_cache_dir`).
        force: Rebuild even when the cache holds the zoo.
        progress: Show progress bars.

    Returns:
        The zoo's folder.

    Raises:
        FeatcalError: when the cache folder cannot be created.
    """
    config = config or T5ZooConfig.t5x4()
    return build_trained_zoo(
        zoo_path(config, cache_dir),
        lambda folder: _build_into(folder, config, progress=progress),
        is_complete_t5_zoo,
        force=force,
    )


def _t5_config(config: T5ZooConfig, vocab: dict[str, int]):
    from transformers import T5Config

    return T5Config(
        vocab_size=len(vocab), d_model=config.hidden, d_kv=config.hidden // config.heads, d_ff=config.intermediate,
        num_layers=config.layers, num_decoder_layers=config.layers, num_heads=config.heads,
        relative_attention_num_buckets=8, relative_attention_max_distance=T5_MAX_LENGTH,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0, pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["</s>"], decoder_start_token_id=vocab["<pad>"],
    )  # fmt: skip


def _new_base(config: T5ZooConfig, vocab: dict[str, int]):
    """A random T5 of ``config`` with an LM head of its own, as FLAN-T5's (transformers 5 ties a fresh one)."""
    import torch
    from transformers import T5ForConditionalGeneration

    torch.manual_seed(config.seed)
    model = T5ForConditionalGeneration(_t5_config(config, vocab))
    model.lm_head.weight = torch.nn.Parameter(torch.randn(model.lm_head.weight.shape))  # T5's init: std 1
    return model


def split_rows(task: T5Task, config: T5ZooConfig) -> dict[str, list[dict[str, str | int]]]:
    """A task's ``train`` rows (calibration) and ``test`` rows, none of the latter's sentences among the former's.

    Args:
        task: The task.
        config: The zoo (its seed and sizes).

    Returns:
        ``{"train": rows, "test": rows}``.
    """
    train = task_rows(task, random.Random(f"calibration-{config.seed}-{task.name}"), config.calibration_rows)
    seen = {row["sentence"] for row in train}
    rng = random.Random(f"test-{config.seed}-{task.name}")
    test: list[dict[str, str | int]] = []
    while len(test) < config.test_rows:
        test += [row for row in task_rows(task, rng, config.test_rows - len(test)) if row["sentence"] not in seen]
    return {"train": train, "test": test}


def expert_rows(task: T5Task, config: T5ZooConfig) -> list[dict[str, str | int]]:
    """The rows ``task``'s expert is fine-tuned on, drawn independently of the splits (from a seed of their own).

    Args:
        task: The task.
        config: The zoo (its seed and ``train_rows``).

    Returns:
        ``config.train_rows`` rows.
    """
    return task_rows(task, random.Random(f"train-{config.seed}-{task.name}"), config.train_rows)


def _build_into(folder: Path, config: T5ZooConfig, *, progress: bool) -> None:
    import copy

    from featcal.demo.t5_training import PairBatches, greedy_exact_match, train_t5

    started = time.time()
    vocab = {word: i for i, word in enumerate(vocabulary())}
    tokenizer = t5_tokenizer()
    tasks = [T5_TASKS_BY_NAME[name] for name in config.tasks]
    splits = {task.name: split_rows(task, config) for task in tasks}
    base = _new_base(config, vocab)
    train_t5(
        base, PairBatches(vocab, generic_pairs(random.Random(f"generic-{config.seed}"), config.generic_pairs)),
        steps=config.pretrain_steps, batch_size=config.batch_size, lr=config.pretrain_lr, seed=config.seed,
        desc=f"{config.name}: pretraining the base", progress=progress,
    )  # fmt: skip
    base.save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")

    results: dict[str, dict[str, float]] = {}
    for index, task in enumerate(tasks):
        rows = expert_rows(task, config)
        expert = copy.deepcopy(base)
        train_t5(
            expert, PairBatches(vocab, [task.pair(row) for row in rows]), steps=config.expert_steps,
            batch_size=config.batch_size, lr=config.expert_lr, seed=config.seed * 1000 + index,
            frozen=config.expert_frozen, desc=f"{config.name}: fine-tuning {task.name}", progress=progress,
        )  # fmt: skip
        expert.save_pretrained(folder / "experts" / task.name)
        tokenizer.save_pretrained(folder / "experts" / task.name)
        test = [task.pair(row) for row in splits[task.name]["test"]]
        results[task.name] = {
            "base_exact_match": greedy_exact_match(base, vocab, test),
            "expert_exact_match": greedy_exact_match(expert, vocab, test),
        }
    _write_data(folder, tasks, splits)
    _write_info(folder, config, results, build_seconds=time.time() - started)


def _write_data(folder: Path, tasks: Sequence[T5Task], splits: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    import datasets

    experts = {}
    for task in tasks:
        features = datasets.Features(
            {"sentence": datasets.Value("string"), "label": datasets.ClassLabel(names=list(task.labels))}
        )
        parquet = folder / "data" / task.name / "data"
        parquet.mkdir(parents=True, exist_ok=True)
        for split, rows in splits[task.name].items():
            table = datasets.Dataset.from_list(rows, features=features)
            table.to_parquet(str(parquet / f"{split}-00000-of-00001.parquet"))
        experts[f"experts/{task.name}"] = {
            "task": task.name,
            "dataset": f"data/{task.name}",
            "split": "train",
            "input": task.input_template,
            "target": "{label}",
            "labels": list(task.labels),
        }
    data = {"max_length": T5_MAX_LENGTH, "target_max_length": T5_TARGET_MAX_LENGTH, "experts": experts}
    (folder / "data.json").write_text(json.dumps(data, indent=1) + "\n")


def _write_info(
    folder: Path, config: T5ZooConfig, results: dict[str, dict[str, float]], *, build_seconds: float
) -> None:
    average = {
        key: sum(r[key] for r in results.values()) / len(results) for key in ("base_exact_match", "expert_exact_match")
    }
    info = {
        "name": config.name,
        "t5_version": T5_ZOO_VERSION,
        "seed": config.seed,
        "config": config.to_dict(),
        **build_environment(build_seconds),
        "probe": "exact match of greedy generations (at most 10 tokens) on each task's test split",
        "tasks": results,
        "average": average,
    }
    write_marker(folder, info)


def t5_run_spec(
    zoo: str | Path,
    output_dir: str | Path,
    *,
    device: str = "cpu",
    progress: bool = True,
    scaling_factor: float = T5_SCALING_FACTOR,
    merge_method: str = "task_arithmetic",
) -> Any:
    """A run over every task of a T5 zoo: base, experts, the merge and its calibration, evaluated.

    Args:
        zoo: The zoo's folder.
        output_dir: The run folder.
        device: cpu, cuda or cuda:N.
        progress: Show progress bars.
        scaling_factor: Task Arithmetic's κ.
        merge_method: The merging method.

    Returns:
        The :class:`~featcal.spec.RunSpec`.
    """
    from featcal.calibration.params import FeatCalParams
    from featcal.spec import RunSpec

    zoo = Path(zoo)
    return RunSpec(
        output_dir=str(output_dir),
        device=device,
        data=str(zoo / "data.json"),
        base_model_id=str(zoo / "base"),
        merge_method=merge_method,
        merge_params={"scaling_factor": scaling_factor} if merge_method == "task_arithmetic" else {},
        featcal=FeatCalParams(num_calibration_examples=T5_CALIBRATION_EXAMPLES),
        eval_num_workers=0,
        eval_batch_size=100,
        eval_zero_shot=True,
        eval_experts=True,
        progress=progress,
    )
