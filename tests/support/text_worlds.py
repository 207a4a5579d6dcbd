"""Tiny language-model and T5 worlds for the command-line refusal tests, built in seconds: a base, two experts
fine-tuned from it in ``experts/``, each expert's rows as a JSON-lines file, the data file naming them
(``data.yaml``) and featcal's Task Arithmetic merge of the two (``ta``)."""

from __future__ import annotations

import json
from pathlib import Path

from featcal.cli import main
from tests.support import tiny_t5
from tests.support.tiny_decoder import save_model, texts, tokenizer

LM_EXPERTS = ("math", "count")
T5_EXPERTS = ("sst", "nli")


def jsonl(rows: list[dict]) -> str:
    """Rows as JSON lines."""
    return "".join(json.dumps(row) + "\n" for row in rows)


def lm_rows(seed: int, count: int = 10) -> list[dict[str, str]]:
    """Rows with a query and a response of a few words each."""
    words = texts(seed, 2 * count)
    return [{"query": words[2 * i], "response": words[2 * i + 1]} for i in range(count)]


def _finish(root: Path, data: dict) -> Path:
    (root / "data.yaml").write_text(json.dumps(data))
    argv = ["-q", "merge", "--data", str(root / "data.yaml"), "--base-model-id", str(root / "base"), "--device", "cpu"]
    assert main([*argv, "--output", str(root / "ta")]) == 0
    return root


def lm_world(root: Path) -> Path:
    """A tiny Llama base with its tokenizer, the experts ``math`` and ``count`` (prompt: ``{query}``, response:
    ``{response}``), the data file and the merge, in ``root``."""
    base = save_model(root / "base", seed=0)
    tokenizer().save_pretrained(root / "base")
    data = {"max_length": 16, "experts": {}}
    for i, name in enumerate(LM_EXPERTS):
        save_model(root / "experts" / name, seed=10 + i, base=base)
        tokenizer().save_pretrained(root / "experts" / name)
        (root / f"{name}.jsonl").write_text(jsonl(lm_rows(20 + i)))
        data["experts"][str(root / "experts" / name)] = {
            "dataset": str(root / f"{name}.jsonl"), "prompt": "{query}", "response": "{response}",
        }  # fmt: skip
    return _finish(root, data)


def t5_world(root: Path) -> Path:
    """A tiny FLAN-T5-like base, the experts ``sst`` and ``nli`` (sentences and class ids made the words ``w1``
    and ``w2``), the data file and the merge, in ``root``."""
    base = tiny_t5.save_model(root / "base", seed=0)
    data = {"max_length": 32, "experts": {}}
    for i, name in enumerate(T5_EXPERTS):
        tiny_t5.save_model(root / "experts" / name, seed=10 + i, base=base)
        rows = [{"sentence": text, "label": j % 2} for j, (text, _) in enumerate(tiny_t5.pairs(20 + i, 12))]
        (root / f"{name}.jsonl").write_text(jsonl(rows))
        data["experts"][str(root / "experts" / name)] = {
            "dataset": str(root / f"{name}.jsonl"), "input": "classify: {sentence}", "target": "{label}",
            "labels": ["w1", "w2"],
        }  # fmt: skip
    return _finish(root, data)
