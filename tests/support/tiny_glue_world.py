"""Tiny stand-ins for the glue8 suite: FLAN-T5-base, FusionBench's eight GLUE experts and GLUE itself, built in
seconds, to be served by the Hub double under their real ids.

- ``google/flan-t5-base``: a tiny random ``T5ForConditionalGeneration`` (:mod:`tests.support.tiny_t5`: width 64,
  two encoder and two decoder blocks, an LM head of its own as FLAN-T5's) with a word-level tokenizer, saved
  with ``save_pretrained`` (safetensors only, ``tokenizer.json``, ``generation_config.json``), so that
  ``AutoTokenizer.from_pretrained`` reads it; its ``config.json`` says what FLAN-T5's own says of the head,
  ``tie_word_embeddings: false`` (transformers 5 would write ``true`` and ``scale_decoder_outputs: false``);
- ``tanganke/flan-t5-base_glue-<task>``: the base plus small noise, with the same tokenizer;
- ``nyu-mll/glue``: the real repository's layout for a dataset of several configurations, one parquet file per
  configuration and split (``<config>/<split>-00000-of-00001.parquet``) and a README whose YAML declares them
  (``configs:`` with each configuration's ``data_files``, ``dataset_info`` with its features and splits), as
  ``push_to_hub`` writes it. All twelve of GLUE's configurations are there (``ax``, ``wnli``, ``mnli_matched``
  and ``mnli_mismatched`` too, which glue8 never reads), with GLUE's splits (MNLI's ``validation_matched``,
  ``validation_mismatched``, ``test_matched``, ``test_mismatched``; ``ax``'s ``test`` alone), column names
  (``sentence``; ``premise``/``hypothesis``; ``sentence1``/``sentence2``; ``question``/``sentence``;
  ``question1``/``question2``; ``label``; ``idx``), label types (``ClassLabel`` with GLUE's class names, STS-B's
  float32 score) and unlabelled test splits (label -1, as GLUE's).

The tokenizer knows every word of the suite's input templates (punctuation split off), every label word, every
STS-B target (``0.0`` ... ``5.0``) and the words the rows are made of (``w0`` ... ``w47``), with T5's special ids
(pad 0, ``</s>`` 1, unk 2): every input and target tokenises to known tokens. The models are random, so the
scores mean nothing; the rehearsal checks the path from the Hub to a pushed release, not FeatCal's gain.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from featcal.suites import suite_table
from tests.support.hub_world import World
from tests.support.tiny_t5 import save_model

SUITE, BACKBONE = "glue8", "flan-t5-base"
GLUE = "nyu-mll/glue"
ROWS = 24  # in each split glue8 reads (train, and validation or validation_matched)
EXTRA_ROWS = 4  # in the other splits, and the configurations glue8 never reads
WORDS = [f"w{i}" for i in range(48)]
SCORES = [f"{i / 10:.1f}" for i in range(51)]  # STS-B's targets, '{:.1f}' of a score in [0, 5]
PUNCTUATION = r"[^\w\s.]|\.(?!\d)"  # split off as tokens of their own; a dot inside a number ("3.2") is not
SPECIALS = {"<pad>": 0, "</s>": 1, "<unk>": 2}  # T5's ids


@dataclass(frozen=True)
class GlueConfig:
    """One configuration of GLUE on the Hub: its text columns, class names (none: STS-B's float score) and splits."""

    name: str
    columns: tuple[str, ...]
    classes: tuple[str, ...] | None
    splits: tuple[str, ...] = ("train", "validation", "test")


NLI = ("entailment", "neutral", "contradiction")
PAIR = ("sentence1", "sentence2")
MNLI_SPLITS = ("train", "validation_matched", "validation_mismatched", "test_matched", "test_mismatched")
CONFIGS = (
    GlueConfig("ax", ("premise", "hypothesis"), NLI, ("test",)),
    GlueConfig("cola", ("sentence",), ("unacceptable", "acceptable")),
    GlueConfig("mnli", ("premise", "hypothesis"), NLI, MNLI_SPLITS),
    GlueConfig("mnli_matched", ("premise", "hypothesis"), NLI, ("validation", "test")),
    GlueConfig("mnli_mismatched", ("premise", "hypothesis"), NLI, ("validation", "test")),
    GlueConfig("mrpc", PAIR, ("not_equivalent", "equivalent")),
    GlueConfig("qnli", ("question", "sentence"), ("entailment", "not_entailment")),
    GlueConfig("qqp", ("question1", "question2"), ("not_duplicate", "duplicate")),
    GlueConfig("rte", PAIR, ("entailment", "not_entailment")),
    GlueConfig("sst2", ("sentence",), ("negative", "positive")),
    GlueConfig("stsb", PAIR, None),
    GlueConfig("wnli", PAIR, ("not_entailment", "entailment")),
)


def pre_tokenizer():
    """Whitespace, then punctuation split off (``'{sentence}'.`` gives ``'``, the words, ``'`` and ``.``)."""
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(PUNCTUATION), behavior="isolated")]
    )


def vocabulary() -> dict[str, int]:
    """T5's special ids, then every token of the suite's input templates, its label words, STS-B's targets and the
    row words."""
    table = suite_table(SUITE, BACKBONE)
    split = pre_tokenizer()
    template_words = [
        token
        for task in table.tasks.values()
        for token, _ in split.pre_tokenize_str(task.text.input.format_map({c: "" for c in _fields(task.text.input)}))
    ]
    labels = [word for task in table.tasks.values() for word in task.text.labels]
    tokens = [*SPECIALS, *template_words, *labels, *SCORES, *WORDS]
    return {token: i for i, token in enumerate(dict.fromkeys(tokens))}


def _fields(template: str) -> list[str]:
    from featcal.families.seq2seq.texts import template_fields

    return template_fields(template)


def tokenizer():
    """A word-level fast tokenizer over :func:`vocabulary` that ends every text with ``</s>`` and pads on the right."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel(vocabulary(), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizer()
    core.post_processor = TemplateProcessing(single="$A </s>", special_tokens=[("</s>", SPECIALS["</s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", padding_side="right"
    )


def build_models(base_folder: Path, expert_folders: dict[str, Path], seed: int = 0) -> None:
    """The base (random from ``seed``) and each expert (the base plus small noise), saved with the tokenizer."""
    tok, size = tokenizer(), len(vocabulary())
    base = save_model(base_folder, seed=seed, tok=tok, vocab_size=size)
    as_flan_t5_config(base_folder)
    for i, folder in enumerate(expert_folders.values()):
        save_model(folder, seed=seed + 10 + i, base=base, tok=tok, vocab_size=size)
        as_flan_t5_config(folder)


def as_flan_t5_config(folder: Path) -> None:
    """The folder's ``config.json`` as FLAN-T5's own writes its LM head of its own: ``tie_word_embeddings: false``
    and no ``scale_decoder_outputs`` (transformers 5's record of it, which transformers 4 did not know)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    assert config.pop("scale_decoder_outputs") is False, "a tiny T5 with an LM head of its own"
    path.write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2, sort_keys=True) + "\n")


def rows(config: GlueConfig, split: str, seed: int, count: int) -> dict[str, list]:
    """``count`` rows of ``config``'s ``split`` as columns: texts of 3 to 8 row words, labels spread over the
    classes (STS-B: scores in [0, 5]), -1 in a test split (GLUE's are unlabelled), ``idx`` 0, 1, ..."""
    generator = torch.Generator().manual_seed(seed)

    def text() -> str:
        n = int(torch.randint(3, 9, (), generator=generator))
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=generator).tolist())

    columns: dict[str, list] = {c: [text() for _ in range(count)] for c in config.columns}
    if split.startswith("test"):
        labels: list = [-1.0 if config.classes is None else -1] * count
    elif config.classes is None:
        labels = [round(float(s), 2) for s in torch.rand(count, generator=generator) * 5]
    else:
        labels = [(i * len(config.classes)) // count for i in range(count)]
    return {**columns, "label": labels, "idx": list(range(count))}


def features(config: GlueConfig):
    from datasets import ClassLabel, Features, Value

    label = Value("float32") if config.classes is None else ClassLabel(names=list(config.classes))
    return Features({**{c: Value("string") for c in config.columns}, "label": label, "idx": Value("int32")})


def write_glue(folder: Path, read: dict[str, tuple[str, ...]], seed: int = 0) -> None:
    """GLUE's repository: ``<config>/<split>-00000-of-00001.parquet`` per configuration and split, and the README
    declaring them. The splits ``read`` names per configuration hold :data:`ROWS` rows, the others
    :data:`EXTRA_ROWS`."""
    from datasets import Dataset

    infos, card_configs = [], []
    for c, config in enumerate(CONFIGS):
        splits = []
        for s, split in enumerate(config.splits):
            count = ROWS if split in read.get(config.name, ()) else EXTRA_ROWS
            path = folder / config.name / f"{split}-00000-of-00001.parquet"
            path.parent.mkdir(parents=True, exist_ok=True)
            data = rows(config, split, seed=seed + 100 * c + s, count=count)
            Dataset.from_dict(data, features=features(config)).to_parquet(str(path))
            splits.append({"name": split, "num_bytes": path.stat().st_size, "num_examples": count})
        infos.append({"config_name": config.name, "features": features(config)._to_yaml_list(), "splits": splits})
        card_configs.append(
            {
                "config_name": config.name,
                "data_files": [{"split": s, "path": f"{config.name}/{s}-*"} for s in config.splits],
            }
        )
    header = {"language": ["en"], "task_categories": ["text-classification"], "pretty_name": "GLUE",
              "dataset_info": infos, "configs": card_configs}  # fmt: skip
    readme = f"---\n{yaml.safe_dump(header, sort_keys=False)}---\n\n# Tiny stand-in of GLUE\n"
    (folder / "README.md").write_text(readme)


def build_glue_world(root: Path, seed: int = 0) -> World:
    """The glue8 suite's base, experts and GLUE on flan-t5-base, under their real ids in ``root``."""
    table = suite_table(SUITE, BACKBONE)
    base = root / "models" / table.base_model
    experts = {name: root / "models" / task.expert for name, task in table.tasks.items()}
    build_models(base, experts, seed)
    for name, folder in experts.items():
        (folder / "README.md").write_text(f"---\nbase_model: {table.base_model}\n---\n\n# Tiny expert: {name}\n")
    read: dict[str, tuple[str, ...]] = {}
    for task in table.tasks.values():
        assert task.dataset.path == GLUE, task.dataset.path
        read[task.dataset.name] = (task.dataset.train_split, task.dataset.test_split)
    write_glue(root / "datasets" / GLUE, read, seed=seed + 200)
    models = {table.base_model: base, **{table.tasks[n].expert: folder for n, folder in experts.items()}}
    return World(root, models, {GLUE: root / "datasets" / GLUE})
