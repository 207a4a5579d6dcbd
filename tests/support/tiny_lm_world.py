"""Tiny stand-ins for MergeBench: a trained two-layer Llama base, five experts fine-tuned from it on five
synthetic tasks, and each task's ``_val`` dataset with MergeBench's column names, built in seconds.

The texts are MergeBench's Alpaca-style prompt (``featcal/resources/mergebench.json``) around short
synthetic tasks over the words ``w0`` ... ``w23``; a word-level tokenizer knows every word of the prompt
template, the task words, ``\\boxed{wN}`` (the math task's answer, one token) and ``<s>``/``</s>``:

- instruction (``instruction`` -> ``output``): copy the words;
- math (``query`` -> ``response``): the first word, then ``\\boxed{<it>}`` (its answer: exact match);
- coding (``instruction`` -> ``response``): the words reversed;
- multilingual (``inputs`` -> ``targets``): each word shifted by one (``w3`` -> ``w4``);
- safety (``prompt`` -> ``response``): the last word.

The base learns the language of the prompts (every token of every task's texts, responses replaced by
random words); each expert then learns its task's responses (their tokens alone, ``</s>`` after them), so
an expert is far better than the base on its own task. Datasets are written in the Hub's parquet layout
(``data/train-00000-of-00001.parquet`` and a README declaring it); :func:`build_lm_world` lays the
models and datasets out under their MergeBench ids, to be published in the Hub double.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import yaml

from featcal.suites import suite_table
from tests.support.hub_world import World

ROWS = 40  # per task's train split
WORDS = [f"w{i}" for i in range(24)]
TASKS = ("instruction", "math", "coding", "multilingual", "safety")
COLUMNS = {  # MergeBench's columns: prompt, response
    "instruction": ("instruction", "output"),
    "math": ("query", "response"),
    "coding": ("instruction", "response"),
    "multilingual": ("inputs", "targets"),
    "safety": ("prompt", "response"),
}
VERBS = {"instruction": "copy", "math": "first", "coding": "reverse", "multilingual": "shift", "safety": "last"}


def _boxed(word: str) -> str:
    return "\\boxed{" + word + "}"


ANSWERS: dict[str, Callable[[list[str]], list[str]]] = {
    "instruction": lambda words: words,
    "math": lambda words: [words[0], _boxed(words[0])],
    "coding": lambda words: words[::-1],
    "multilingual": lambda words: [WORDS[(WORDS.index(w) + 1) % len(WORDS)] for w in words],
    "safety": lambda words: words[-1:],
}


def templates() -> dict[str, tuple[str, str]]:
    """Each task's prompt and response templates, as the built-in mergebench suite has them."""
    table = suite_table("mergebench", "llama-3.2-3b")
    return {name: (task.text.prompt, task.text.response) for name, task in table.tasks.items()}


def vocabulary() -> dict[str, int]:
    """Every token the world's texts hold, specials first."""
    template_words = sorted({w for prompt, _ in templates().values() for w in prompt.format_map(_Blank()).split()})
    tokens = ["<pad>", "<unk>", "<s>", "</s>", *template_words, *VERBS.values(), *WORDS, *map(_boxed, WORDS)]
    return {token: i for i, token in enumerate(dict.fromkeys(tokens))}


class _Blank(dict):
    def __missing__(self, key: str) -> str:
        return ""


def tokenizer():
    """A word-level fast tokenizer: whitespace split, ``<s>`` before every text, ``</s>`` its end of text."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    core = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    core.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        padding_side="right",
    )  # fmt: skip


def rows(task: str, seed: int, count: int = ROWS) -> list[dict[str, str]]:
    """``count`` rows of ``task`` with MergeBench's column names."""
    generator = torch.Generator().manual_seed(seed)
    prompt_column, response_column = COLUMNS[task]
    out = []
    for _ in range(count):
        length = int(torch.randint(2, 5, (1,), generator=generator))
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (length,), generator=generator)]
        out.append({prompt_column: f"{VERBS[task]} {' '.join(words)}", response_column: " ".join(ANSWERS[task](words))})
    return out


def config():
    from transformers import LlamaConfig

    vocab = vocabulary()
    return LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=vocab["<pad>"], bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"], tie_word_embeddings=False, attn_implementation="eager",
    )  # fmt: skip


def _texts(task: str, task_rows: list[dict[str, str]]) -> list[tuple[str, str]]:
    prompt, response = templates()[task]
    return [(prompt.format_map(row), response.format_map(row) + " </s>") for row in task_rows]


def _train(model, tok, pairs: list[tuple[str, str]], *, steps: int, responses_only: bool, seed: int) -> None:
    """Adam on the pairs' tokens (the responses' alone with ``responses_only``), batches of 16."""
    torch.manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [pairs[i] for i in torch.randint(0, len(pairs), (16,)).tolist()]
        encoded = tok([p + r for p, r in batch], padding=True, return_offsets_mapping=True, return_tensors="pt")
        labels = encoded["input_ids"].clone()
        labels[encoded["attention_mask"] == 0] = -100
        if responses_only:
            starts = torch.tensor([len(p) for p, _ in batch]).unsqueeze(1)
            labels[encoded["offset_mapping"][..., 0] < starts] = -100
        loss = model(input_ids=encoded["input_ids"], attention_mask=encoded["attention_mask"], labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


def build_models(base_folder: Path, expert_folders: dict[str, Path], seed: int = 0) -> None:
    """Train the base on every task's prompts (random words as responses), then each expert from it on its
    task's responses; save them with the tokenizer (and the base's generation config)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: threads only contend, on a busy machine 20× slower
    try:
        _build_models(base_folder, expert_folders, seed)
    finally:
        torch.set_num_threads(threads)


def _build_models(base_folder: Path, expert_folders: dict[str, Path], seed: int) -> None:
    from transformers import GenerationConfig, LlamaForCausalLM

    tok = tokenizer()
    torch.manual_seed(seed)
    base = LlamaForCausalLM(config())
    generic = []
    for i, task in enumerate(TASKS):
        noise = rows(task, seed=seed + 50 + i)
        for row in noise:
            row[COLUMNS[task][1]] = " ".join(WORDS[(len(row[COLUMNS[task][0]]) * k) % len(WORDS)] for k in (1, 2))
        generic += _texts(task, noise)
    _train(base, tok, generic, steps=80, responses_only=False, seed=seed)
    generation = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)  # fmt: skip
    base.generation_config = generation
    base.save_pretrained(base_folder)
    tok.save_pretrained(base_folder)
    for i, (task, folder) in enumerate(expert_folders.items()):
        expert = LlamaForCausalLM(config())
        expert.load_state_dict(base.state_dict())
        _train(expert, tok, _texts(task, rows(task, seed=seed + 100 + i, count=200)), steps=120,
               responses_only=True, seed=seed + i)  # fmt: skip
        expert.generation_config = generation
        expert.save_pretrained(folder)
        tok.save_pretrained(folder)


def write_text_dataset(folder: Path, task_rows: list[dict[str, str]]) -> None:
    """A dataset repository with one split, ``train``, in the Hub's parquet layout and a README declaring it."""
    from datasets import Dataset

    path = folder / "data" / "train-00000-of-00001.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    dataset = Dataset.from_list(task_rows)
    dataset.to_parquet(str(path))
    header = {
        "dataset_info": {
            "features": dataset.features._to_yaml_list(),
            "splits": [{"name": "train", "num_bytes": path.stat().st_size, "num_examples": len(task_rows)}],
        },
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "data/train-*"}]}],
    }
    (folder / "README.md").write_text(f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n# Tiny {folder.name}\n")


def build_lm_world(root: Path, *, backbone: str = "llama-3.2-3b", seed: int = 0) -> World:
    """The mergebench suite's base, experts and datasets on ``backbone``, under their real ids in ``root``."""
    table = suite_table("mergebench", backbone)
    base = root / "models" / table.base_model
    experts = {name: root / "models" / task.expert for name, task in table.tasks.items()}
    build_models(base, experts, seed)
    datasets = {}
    for i, (name, task) in enumerate(table.tasks.items()):
        datasets[task.dataset.path] = root / "datasets" / task.dataset.path
        write_text_dataset(datasets[task.dataset.path], rows(name, seed=seed + 200 + i))
    models = {table.base_model: base, **{table.tasks[n].expert: folder for n, folder in experts.items()}}
    return World(root, models, datasets)


def write_data_file(root: Path, experts: dict[str, Path], datasets: dict[str, Path], **extra) -> Path:
    """A calibration data file over local experts and JSON-lines datasets, with the suite's text formats."""
    table = suite_table("mergebench", "llama-3.2-3b")
    entries = {}
    for name, folder in experts.items():
        fmt = table.tasks[name].text
        entry = {"dataset": str(datasets[name]), "prompt": fmt.prompt, "response": fmt.response, "task": name}
        entries[str(folder)] = {**entry, **({"answer": fmt.answer} if fmt.answer else {})}
    path = root / "data.yaml"
    path.write_text(json.dumps({"max_length": 96, **extra, "experts": entries}))
    return path
