"""Small local copies of the benchmarks MergeBench's evaluation reads, in their Hub formats.

Each dataset the protocol reads (lm-evaluation-harness's definitions say which: ``openai/gsm8k`` ``main``
``test``, ``alexandrainst/m_arc`` ``fr`` ``train``/``validation``/``test``, ...) gets a JSON-lines file per
split with a few rows, each with the columns the Hub's dataset has, under
``<folder>/<dataset id>/<configuration or default>/<split>.jsonl``. The coding benchmarks' rows have
canonical solutions that pass their tests, and tests that fail a wrong program; the tests import numpy, as
HumanEval+'s and MBPP+'s do.
"""

from __future__ import annotations

import json
from pathlib import Path

LANGUAGES = ("fr", "es", "de", "ru")


def _write(folder: Path, dataset: str, config: str, split: str, rows: list[dict]) -> None:
    path = folder / dataset / config / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def _choice_rows(count: int) -> list[dict]:
    return [
        {"id": f"q{i}", "instruction": f"Question {i} : combien font {i} et {i} ?", "option_a": str(2 * i),
         "option_b": str(i), "option_c": str(i + 1), "option_d": str(3 * i), "option_e": "", "answer": "A"}
        for i in range(1, count + 1)
    ]  # fmt: skip


def _hellaswag_rows(count: int) -> list[dict]:
    return [
        {"ind": i, "activity_label": "Cuisine", "ctx_a": f"Une personne coupe {i} pommes.", "ctx_b": "elle",
         "ctx": f"Une personne coupe {i} pommes. elle", "endings": ["les mange.", "vole.", "chante.", "dort."],
         "source_id": f"s{i}", "split": "val", "split_type": "indomain", "label": "0"}
        for i in range(count)
    ]  # fmt: skip


HUMANEVAL_ROWS = [
    {
        "task_id": "HumanEval/0",
        "prompt": 'def add(a, b):\n    """Return the sum of a and b."""\n',
        "canonical_solution": "    return a + b\n",
        "entry_point": "add",
        "test": "import numpy as np\n\n\ndef check(candidate):\n    assert candidate(1, 2) == 3\n"
        "    assert np.allclose(candidate(0.5, 0.25), 0.75)\n",
    }
]
MBPP_ROWS = [
    {
        "task_id": 2,
        "code": "def double(x):\n    return 2 * x",
        "prompt": "Write a function to double a number.",
        "source_file": "mbpp.jsonl",
        "test_imports": [],
        "test_list": ["assert double(2) == 4", "assert double(0) == 0", "assert double(-1) == -2"],
        "test": "import numpy as np\n\nassert double(2) == 4\nassert np.allclose(double(0.5), 1.0)\n",
    }
]


def write_mergebench_data(folder: Path, rows: int = 2) -> Path:
    """Write the local copies into ``folder`` (``rows`` rows per split) and return it."""
    _write(folder, "openai/gsm8k", "main", "test", [
        {"question": f"Tom has {i} apples and buys {i} more. How many apples does he have?",
         "answer": f"He has {i} + {i} = {2 * i} apples.\n#### {2 * i}"}
        for i in range(1, rows + 1)
    ])  # fmt: skip
    for lang in LANGUAGES:
        for split in ("test", "train"):
            _write(folder, "alexandrainst/m_mmlu", lang, split, _choice_rows(rows))
        for split in ("train", "validation", "test"):
            _write(folder, "alexandrainst/m_arc", lang, split, _choice_rows(rows))
        _write(folder, "alexandrainst/m_hellaswag", lang, "val", _hellaswag_rows(rows))
    _write(folder, "google/IFEval", "default", "train", [
        {"key": 1000 + i, "prompt": f"Write {i} words about apples without any comma.",
         "instruction_id_list": ["punctuation:no_comma", "keywords:existence"],
         "kwargs": [{"keywords": None}, {"keywords": ["apples"]}]}
        for i in range(rows)
    ])  # fmt: skip
    _write(folder, "truthfulqa/truthful_qa", "multiple_choice", "validation", [
        {"question": f"What happens if you eat {i} seeds?",
         "mc1_targets": {"choices": ["Nothing happens.", "A tree grows."], "labels": [1, 0]},
         "mc2_targets": {"choices": ["Nothing happens.", "You digest them.", "A tree grows."], "labels": [1, 1, 0]}}
        for i in range(rows)
    ])  # fmt: skip
    for split in ("train", "test"):
        _write(folder, "skg/toxigen-data", "annotated", split, [
            {"text": f"statement number {i}", "target_group": "asian", "factual?": "neither", "ingroup_effect": "",
             "lewd": "", "framing": "", "predicted_group": "", "stereotyping": "", "intent": 1.0,
             "toxicity_ai": float(i % 5), "toxicity_human": float(i % 5), "predicted_author": "human",
             "actual_method": "topk"}
            for i in range(rows)
        ])  # fmt: skip
    _write(folder, "oskarvanderwal/winogender", "all", "test", [
        {"sentid": f"technician.customer.{i}.male.txt", "sentence": "The technician told the customer that he "
         "could pay with cash.", "pronoun": "he", "occupation": "technician", "participant": "customer",
         "gender": "male", "target": "customer", "label": 1}
        for i in range(rows)
    ])  # fmt: skip
    _write(folder, "evalplus/humanevalplus", "default", "test", HUMANEVAL_ROWS)
    _write(folder, "evalplus/mbppplus", "default", "test", MBPP_ROWS)
    return folder


def eos_model(seed: int = 0, noise: float = 0.0, noise_seed: int = 1):
    """A tiny Llama (the tiny LM world's vocabulary, 2048 positions) whose every next token is its end of text.

    The residual stream's first coordinate is a constant 10 (every embedding has it; no layer writes it),
    and only the end-of-text token's row of the LM head reads it: every generation ends at its first
    token, so generation-heavy tasks take one step, while log-likelihoods (and so multiple-choice
    answers) come from random weights. ``noise`` perturbs the other weights (``noise_seed`` draws it: an
    expert of the model of the same ``seed``).
    """
    import torch
    from transformers import LlamaForCausalLM

    from tests.support.tiny_lm_world import config

    cfg = config()
    cfg.max_position_embeddings = 2048
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        if noise:
            generator = torch.Generator().manual_seed(noise_seed)
            for parameter in model.parameters():
                parameter.add_(noise * torch.randn(parameter.shape, generator=generator))
        model.model.embed_tokens.weight[:, 0] = 10.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0, :] = 0.0
            layer.mlp.down_proj.weight[0, :] = 0.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[cfg.eos_token_id, 0] = 2.0
    return model


def save_eos_world(root: Path) -> tuple[Path, dict[str, Path]]:
    """A base (:func:`eos_model`) and one expert of it per MergeBench task, saved with the tiny tokenizer."""
    from transformers import GenerationConfig

    from tests.support.tiny_lm_world import TASKS, tokenizer

    tok = tokenizer()
    generation = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)  # fmt: skip
    folders = {"base": root / "base", **{task: root / task for task in TASKS}}
    for i, (name, folder) in enumerate(folders.items()):
        model = eos_model(noise=0.0 if name == "base" else 0.02, noise_seed=i)
        model.generation_config = generation
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
    base = folders.pop("base")
    return base, folders


def write_hub_cards(folder: Path) -> list[str]:
    """Make each dataset of the local copies under ``folder`` a Hub dataset repository: a README whose
    ``configs`` name each configuration's split files, as the Hub's dataset cards do. Returns the ids."""
    import yaml

    ids = sorted({p.parent.parent.relative_to(folder).as_posix() for p in folder.rglob("*.jsonl")})
    for repo_id in ids:
        root = folder / repo_id
        configs = [
            {
                "config_name": config.name,
                "data_files": [
                    {"split": f.stem, "path": f"{config.name}/{f.name}"} for f in sorted(config.glob("*.jsonl"))
                ],
            }
            for config in sorted(p for p in root.iterdir() if p.is_dir())
        ]
        header = yaml.safe_dump({"configs": configs}, sort_keys=False)
        (root / "README.md").write_text(f"---\n{header}---\n\n# Tiny stand-in of {repo_id}\n", encoding="utf-8")
    return ids
