"""The offline language-model benchmark ``lm5``: a tiny Llama pretrained on generic text, five task experts.

Built and cached like the mini8 zoo (:mod:`featcal.demo.cache`), as ordinary input folders of a language-model
run::

    <zoo>/base/                  LlamaForCausalLM + its word-level tokenizer (save_pretrained)
    <zoo>/experts/<task>/        LlamaForCausalLM fine-tuned from the base on one task (+ the tokenizer)
    <zoo>/data/<task>.jsonl      the task's rows (prompt, answer): calibration rows, then held-out rows
    <zoo>/data.json              the calibration data file (``featcal run --data``): answers by exact match
    <zoo>/zoo.json               version, seed, sizes, build time, exact match measured while building

The tasks are :mod:`featcal.demo.lm_tasks`'; the training :mod:`featcal.demo.lm_training`'.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from featcal.demo import zoo_fields
from featcal.demo.cache import build_environment, build_trained_zoo, marked_complete, write_marker, zoo_path
from featcal.demo.lm_tasks import TASKS_BY_NAME, generic_text, lm_tokenizer, substitution, task_rows, vocabulary
from featcal.errors import FeatcalError

LM_ZOO_VERSION = 1  # bump whenever texts, training or file layout change: it keys the cache
# the run's settings on the zoo: the answers are short, the texts too
LM_MAX_NEW_TOKENS = 16
LM_MAX_LENGTH = 64
LM_SCALING_FACTOR = 0.3  # Task Arithmetic's κ: the best of 0.2 ... 1.0 on the seed-0 zoo (benchmarks/lm5.md)
LM_CALIBRATION_EXAMPLES = 128


@dataclass(frozen=True)
class LMZooConfig(zoo_fields.ZooConfigMethods):
    """A language-model benchmark zoo: a tiny Llama base and one expert per synthetic task, from one seed.

    ``lm5()`` is the documented benchmark; ``tiny()`` a reduced one for the test suite. Every field takes
    part in the cache key.

    Raises:
        FeatcalError: for an unknown task, fewer than two tasks, a non-positive size or bad answer lengths.
    """

    name: str = "lm5"
    seed: int = 0
    tasks: tuple[str, ...] = tuple(TASKS_BY_NAME)
    min_len: int = 1  # words of a task's input
    max_len: int = 3
    data_rows: int = 640  # rows per task in data/<task>.jsonl: calibration, then held out
    train_rows: int = 5000  # rows per task the expert is fine-tuned on (drawn apart from data_rows)
    generic_texts: int = 20000
    hidden: int = 128
    intermediate: int = 256
    layers: int = 3
    heads: int = 4
    pretrain_steps: int = 600
    pretrain_lr: float = 3e-3
    batch_size: int = 64
    expert_steps: int = 400
    expert_lr: float = 2e-3
    # parameters the experts keep at the base's values: FeatCal calibrates the decoder layers only
    expert_frozen: tuple[str, ...] = ("model.embed_tokens", "model.norm", "lm_head")

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS_BY_NAME]
        if unknown or len(set(self.tasks)) < 2:
            raise FeatcalError(
                f"LMZooConfig.tasks must name at least two of {sorted(TASKS_BY_NAME)}; got {list(self.tasks)}."
            )
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and f.name != "seed" and value <= 0:
                raise FeatcalError(f"LMZooConfig.{f.name} must be positive; got {value}.")
        if self.min_len > self.max_len:
            raise FeatcalError(f"LMZooConfig: min_len {self.min_len} exceeds max_len {self.max_len}.")
        if self.hidden % self.heads:
            raise FeatcalError(f"LMZooConfig: hidden {self.hidden} is not a multiple of heads {self.heads}.")

    @classmethod
    def lm5(cls, seed: int = 0) -> LMZooConfig:
        """The lm5 benchmark: five tasks, a 3-layer Llama 128 wide."""
        return cls(seed=seed)

    @classmethod
    def tiny(cls, seed: int = 0) -> LMZooConfig:
        """A reduced zoo for the test suite (seconds to build): three tasks, a 2-layer Llama 64 wide."""
        return cls(
            name="tiny-lm",
            seed=seed,
            tasks=("reverse", "brackets", "format"),
            data_rows=200,
            train_rows=1000,
            generic_texts=4000,
            hidden=64,
            intermediate=128,
            layers=2,
            pretrain_steps=200,
            batch_size=32,
            expert_steps=150,
        )

    VERSION: ClassVar[int] = LM_ZOO_VERSION

    @classmethod
    def presets(cls) -> dict[str, Callable[[], LMZooConfig]]:
        """The presets by name."""
        return {"lm5": cls.lm5, "tiny-lm": cls.tiny}


def is_complete_lm_zoo(folder: Path) -> bool:
    """Whether ``folder`` holds a finished language-model zoo of the current version."""
    return marked_complete(folder, "lm_version", LM_ZOO_VERSION)


def build_lm_zoo(
    config: LMZooConfig | None = None,
    cache_dir: str | Path | None = None,
    force: bool = False,
    *,
    progress: bool = True,
) -> Path:
    """The folder of the language-model zoo for ``config`` (default :meth:`LMZooConfig.lm5`), built if needed.

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
    config = config or LMZooConfig.lm5()
    return build_trained_zoo(
        zoo_path(config, cache_dir),
        lambda folder: _build_into(folder, config, progress=progress),
        is_complete_lm_zoo,
        force=force,
    )


def _llama_config(config: LMZooConfig, vocab: dict[str, int]):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(vocab), hidden_size=config.hidden, intermediate_size=config.intermediate,
        num_hidden_layers=config.layers, num_attention_heads=config.heads, num_key_value_heads=config.heads,
        max_position_embeddings=LM_MAX_LENGTH, pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"], tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip


def _build_into(folder: Path, config: LMZooConfig, *, progress: bool) -> None:
    import copy

    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    from featcal.demo.lm_training import TextBatches, greedy_exact_match, train_lm

    started = time.time()
    vocab = {word: i for i, word in enumerate(vocabulary())}
    cipher = substitution(config.seed)
    tokenizer = lm_tokenizer()
    tasks = [TASKS_BY_NAME[name] for name in config.tasks]
    data_rows = {
        t.name: task_rows(t, random.Random(f"data-{config.seed}-{t.name}"), config.data_rows, cipher,
                          config.min_len, config.max_len)
        for t in tasks
    }  # fmt: skip
    generic = generic_text(random.Random(f"generic-{config.seed}"), config.generic_texts, config.max_len)
    torch.manual_seed(config.seed)
    base = LlamaForCausalLM(_llama_config(config, vocab))
    train_lm(
        base, TextBatches(vocab, [(text, "") for text in generic], responses_only=False, end_of_text=True),
        steps=config.pretrain_steps, batch_size=config.batch_size, lr=config.pretrain_lr, seed=config.seed,
        desc=f"{config.name}: pretraining the base", progress=progress,
    )  # fmt: skip
    generation = GenerationConfig(bos_token_id=vocab["<s>"], eos_token_id=vocab["</s>"], pad_token_id=vocab["<pad>"])
    base.generation_config = generation
    base.save_pretrained(folder / "base")
    tokenizer.save_pretrained(folder / "base")

    # the exact match measured while building: the last 200 data rows (held out of any calibration of
    # data_rows - 200 rows or fewer)
    probe = {name: rows[-min(200, len(rows) // 2) :] for name, rows in data_rows.items()}
    results: dict[str, dict[str, float]] = {}
    for index, task in enumerate(tasks):
        rows = task_rows(task, random.Random(f"train-{config.seed}-{task.name}"), config.train_rows, cipher,
                         config.min_len, config.max_len)  # fmt: skip
        expert = copy.deepcopy(base)
        train_lm(
            expert, TextBatches(vocab, [(r["prompt"], r["answer"]) for r in rows], responses_only=True,
                                end_of_text=True),
            steps=config.expert_steps, batch_size=config.batch_size, lr=config.expert_lr,
            seed=config.seed * 1000 + index, frozen=config.expert_frozen,
            desc=f"{config.name}: fine-tuning {task.name}", progress=progress,
        )  # fmt: skip
        expert.save_pretrained(folder / "experts" / task.name)
        tokenizer.save_pretrained(folder / "experts" / task.name)
        results[task.name] = {
            "base_exact_match": greedy_exact_match(base, vocab, probe[task.name], max_new_tokens=LM_MAX_NEW_TOKENS),
            "expert_exact_match": greedy_exact_match(expert, vocab, probe[task.name], max_new_tokens=LM_MAX_NEW_TOKENS),
        }
    _write_data(folder, config, data_rows)
    _write_info(folder, config, results, build_seconds=time.time() - started)


def _write_data(folder: Path, config: LMZooConfig, data_rows: dict[str, list[dict[str, str]]]) -> None:
    experts = {}
    for name, rows in data_rows.items():
        path = folder / "data" / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        experts[f"experts/{name}"] = {
            "task": name,
            "dataset": f"data/{name}.jsonl",
            "prompt": "{prompt}",
            "response": " {answer}",
            "answer": "line",
        }
    data = {"max_length": LM_MAX_LENGTH, "experts": experts}
    (folder / "data.json").write_text(json.dumps(data, indent=1) + "\n")


def _write_info(
    folder: Path, config: LMZooConfig, results: dict[str, dict[str, float]], *, build_seconds: float
) -> None:
    average = {
        key: sum(r[key] for r in results.values()) / len(results) for key in ("base_exact_match", "expert_exact_match")
    }
    info = {
        "name": config.name,
        "lm_version": LM_ZOO_VERSION,
        "seed": config.seed,
        "config": config.to_dict(),
        **build_environment(build_seconds),
        "probe": "exact match on the last min(200, data_rows / 2) rows of each task's data file",
        "tasks": results,
        "average": average,
    }
    write_marker(folder, info)


def lm_run_spec(
    zoo: str | Path,
    output_dir: str | Path,
    *,
    device: str = "cpu",
    progress: bool = True,
    scaling_factor: float = LM_SCALING_FACTOR,
    merge_method: str = "task_arithmetic",
) -> Any:
    """A run over every task of a language-model zoo: base, experts, the merge and its calibration, evaluated.

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
        featcal=FeatCalParams(num_calibration_examples=LM_CALIBRATION_EXAMPLES),
        eval_num_workers=0,
        eval_batch_size=100,
        family_options={"eval_max_new_tokens": LM_MAX_NEW_TOKENS},
        eval_zero_shot=True,
        eval_experts=True,
        progress=progress,
    )
