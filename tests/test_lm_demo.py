"""The offline language-model benchmark lm5: its tasks, tokenizer, zoo and ``featcal demo --zoo lm5``.

The reduced zoo (``LMZooConfig.tiny()``, three tasks, a 2-layer Llama 64 wide) builds in seconds; the demo
runs the real pipeline on it, and Task Arithmetic must lose exact match against the experts and FeatCal
win some of it back.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from featcal.cli import main
from featcal.data_file import read_data_file
from featcal.demo.lm_tasks import (
    CLOSERS,
    LETTERS,
    LM_TASKS,
    TASKS_BY_NAME,
    generic_text,
    lm_tokenizer,
    substitution,
    task_rows,
)
from featcal.demo.lm_zoo import LM_ZOO_VERSION, LMZooConfig, build_lm_zoo, is_complete_lm_zoo
from featcal.errors import FeatcalError

# Measured on the tiny zoo (seed 0, one thread): TA 16.2 and TA + FeatCal 29.2 against experts at 87.0
# (benchmarks/lm5.md). The floors leave room for platform noise but fail if merging stops hurting or
# FeatCal stops helping.
TINY_MIN_TA_LOSS = 30.0
TINY_MIN_FEATCAL_GAIN = 5.0


def _expected(task: str, words: list[str], cipher: dict[str, str]) -> list[str]:
    if task == "add":
        return list(str(int(words[0]) + int("".join(words[2:]))))
    if task == "reverse":
        return words[::-1]
    if task == "cipher":
        return [cipher[w] for w in words]
    if task == "brackets":
        return [CLOSERS[w] for w in reversed(words)]
    return ["[", *" , ".join(words).split(), "]"]


def test_each_task_s_answer_is_its_rule() -> None:
    cipher = substitution(0)
    assert sorted(cipher.values()) == list(LETTERS) and all(a != b for a, b in cipher.items())
    assert substitution(0) == cipher != substitution(1)
    rng = random.Random(0)
    for task in LM_TASKS:
        for row in task_rows(task, rng, 50, cipher, 1, 3):
            verb, *words, equals = row["prompt"].split()
            answer = row["answer"].split()
            assert verb == task.verb and equals == "="
            assert answer == _expected(task.name, words, cipher), (task.name, row)


def test_the_base_s_text_never_holds_a_task_prompt_and_every_word_is_one_token() -> None:
    tokenizer = lm_tokenizer()
    verbs = {task.verb for task in LM_TASKS}
    texts = generic_text(random.Random(0), 500, 3)
    assert len(set(texts)) > 400
    for text in texts:
        assert text.split()[0] not in verbs or "=" not in text.split()[1:]  # a verb, yet no prompt
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id and tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("bad", ["tasks=reverse", "tasks=reverse,nope", "hidden=0", "min_len=4", "heads=3"])
def test_config_rejects_bad_fields(bad: str) -> None:
    with pytest.raises(FeatcalError):
        LMZooConfig.tiny().with_assignments([bad])


def test_cache_keys_name_the_preset_and_digest_a_variant() -> None:
    assert LMZooConfig.lm5(1).cache_key() == f"lm5-v{LM_ZOO_VERSION}-seed1"
    assert LMZooConfig.tiny().cache_key() == f"tiny-lm-v{LM_ZOO_VERSION}-seed0"
    variant = LMZooConfig.lm5().with_assignments(["hidden=96"]).cache_key()
    assert variant.startswith(f"lm5-v{LM_ZOO_VERSION}-seed0-") and len(variant.split("-")[-1]) == 10


@pytest.fixture(scope="module")
def tiny_lm_zoo(tmp_path_factory) -> Path:
    return build_lm_zoo(LMZooConfig.tiny(), cache_dir=tmp_path_factory.mktemp("lm-cache"), progress=False)


def test_the_zoo_is_a_run_s_inputs_and_the_experts_keep_the_frozen_parts(tiny_lm_zoo: Path) -> None:
    assert is_complete_lm_zoo(tiny_lm_zoo)
    table = read_data_file(tiny_lm_zoo / "data.json")
    assert list(table.tasks) == list(LMZooConfig.tiny().tasks)
    base = load_file(tiny_lm_zoo / "base" / "model.safetensors")
    for name, task in table.tasks.items():
        assert task.text is not None and task.text.answer == "line"
        rows = (tiny_lm_zoo / "data" / f"{name}.jsonl").read_text().splitlines()
        assert len(rows) == LMZooConfig.tiny().data_rows
        expert = load_file(Path(task.expert) / "model.safetensors")
        for key, value in base.items():
            frozen = key.startswith(LMZooConfig.tiny().expert_frozen)
            assert torch.equal(expert[key], value) == frozen, (name, key)
    info = json.loads((tiny_lm_zoo / "zoo.json").read_text())
    assert info["average"]["expert_exact_match"] > info["average"]["base_exact_match"] + 0.5


def test_demo_lm5_prints_the_table_and_featcal_beats_task_arithmetic(tiny_lm_zoo, tmp_path, capsys) -> None:
    out = tmp_path / "demo"
    argv = ["-q", "demo", "--zoo", "lm5", "--tiny", "--zoo-cache-dir", str(tiny_lm_zoo.parent.parent)]
    assert main([*argv, "--output-dir", str(out), "--threads", "1"]) == 0
    printed = capsys.readouterr().out
    for column in ("base", "expert", "TA", "TA+FeatCal"):
        assert column in printed.splitlines()[1]
    assert "exact match" in printed and (out / "release" / "model.safetensors").is_file()
    assert f"trained with torch's {torch.backends.cpu.get_cpu_capability()} CPU kernels" in printed.splitlines()[0]

    def exact_match(stage: str) -> float:
        report = json.loads((out / stage / "metrics.json").read_text())
        tasks = LMZooConfig.tiny().tasks
        return 100 * sum(report[task]["exact_match"] for task in tasks) / len(tasks)

    experts, merged, calibrated = exact_match("experts"), exact_match("ta"), exact_match("featcal-ta")
    average = next(line for line in printed.splitlines() if line.startswith("average exact match %"))
    shown = [float(cell) for cell in average.split("%")[1].split()]
    assert shown[1:4] == pytest.approx([experts, merged, calibrated], abs=0.006), average  # printed to 2 digits
    assert experts - merged >= TINY_MIN_TA_LOSS, (experts, merged)
    assert calibrated - merged >= TINY_MIN_FEATCAL_GAIN, (merged, calibrated)


def test_demo_refuses_an_unknown_zoo_in_one_line(capsys) -> None:
    assert main(["demo", "--zoo", "lm6"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("featcal: error: --zoo 'lm6'")


def test_tasks_by_name_lists_the_five_tasks() -> None:
    assert list(TASKS_BY_NAME) == ["add", "reverse", "cipher", "brackets", "format"]


def test_the_table_s_average_exact_match_row_needs_every_task_s_exact_match() -> None:
    from featcal.cli.common import format_losses
    from featcal.metrics import MetricsReport, TaskMetrics

    def report(*matches: float | None) -> MetricsReport:
        results = {
            f"t{i}": TaskMetrics(None, 1.0, 4, {} if m is None else {"exact_match": m}) for i, m in enumerate(matches)
        }
        return MetricsReport.from_results(results)

    rows = format_losses({"a": report(0.25, 0.5), "b": report(1.0, 0.0)}).splitlines()
    assert rows[-1].split() == ["average", "exact", "match", "%", "37.50", "50.00"]
    assert "average exact match" not in format_losses({"a": report(0.25, None)})


def test_a_small_language_model_is_evaluated_in_large_batches_on_the_cpu() -> None:
    from featcal.families.causal_lm.evaluation import SMALL_MODEL_TEXT_BATCH, default_text_batch_size

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert default_text_batch_size(cpu, LMZooConfig.lm5().hidden) == SMALL_MODEL_TEXT_BATCH == 100  # the demo's
    assert default_text_batch_size(cpu, 3072) == default_text_batch_size(cpu) == 4  # a real model's memory
    assert default_text_batch_size(cuda, 64) == default_text_batch_size(cuda, 3072) == 16
