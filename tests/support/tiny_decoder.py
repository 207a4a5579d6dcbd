"""A model family for tests: a tiny two-layer ``LlamaForCausalLM`` built in seconds, with a word-level
tokenizer built in code and synthetic texts, that runs through featcal's family-agnostic calibration.

It is the proof that the calibration driver, the streamed calibration and the pipeline's calibrate
stage know no model: everything Llama-specific comes from :class:`~featcal.families.causal_lm.adapter.DecoderAdapter`
and this family; padding weighs 0 through the batches' token weights.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from featcal.calibration.adapters import CalibrationBatch
from featcal.checkpoint import Checkpoint, load_params
from featcal.data import calibration_indices
from featcal.distributed import SINGLE, World
from featcal.families.base import ReleaseParts
from featcal.families.causal_lm.adapter import ATTENTION_MASK, INPUT_IDS, DecoderAdapter
from featcal.files.model_files import MODEL_CONFIG
from featcal.files.model_folders import save_model_state, streamed_model_folder
from featcal.tasks import DatasetSpec, Task

WORDS = [f"w{i}" for i in range(150)]  # more words than the width: the inputs span it
VOCAB = {"<pad>": 0, "<unk>": 1, **{word: i + 2 for i, word in enumerate(WORDS)}}


def tiny_config(attn: str = "eager", *, tied: bool = False):
    """Hidden 64, 2 layers, 4 heads over 2 key-value heads (grouped-query attention)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, pad_token_id=0,
        attn_implementation=attn,
    )  # fmt: skip


def tokenizer():
    """A word-level fast tokenizer over :data:`VOCAB` (whitespace split, right padding)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(WordLevel(VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", padding_side="right")


def texts(seed: int, count: int = 12) -> list[str]:
    """Synthetic texts of 3 to 10 words: batches of them need padding."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 11, (count,), generator=generator).tolist()
    return [
        " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=generator).tolist()) for n in lengths
    ]


def save_model(folder: Path, seed: int, base: nn.Module | None = None, scale: float = 0.05, **config_kw) -> nn.Module:
    """A tiny Llama (random, or ``base`` plus small noise: an expert) saved as a folder."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(tiny_config(**config_kw)).eval()
    if base is not None:
        with torch.no_grad():
            for (_, p), (_, q) in zip(model.named_parameters(), base.named_parameters()):
                p.copy_(q + scale * torch.randn_like(q))
    model.save_pretrained(folder)
    return model


def encode(text_list: Sequence[str], max_length: int | None = None) -> CalibrationBatch:
    """Texts as a calibration batch: right-padded token ids, the attention mask, padding weighing 0."""
    encoded = tokenizer()(list(text_list), padding="max_length" if max_length else True, max_length=max_length,
                          return_tensors="pt")  # fmt: skip
    mask = encoded[ATTENTION_MASK]
    return CalibrationBatch({INPUT_IDS: encoded[INPUT_IDS]}, {ATTENTION_MASK: mask}, mask.float())


@dataclass
class TinyDecoderFamily:
    """A :class:`~featcal.families.base.ModelFamily` of tiny Llamas whose tasks' texts live in memory.

    Attributes:
        corpora: Each task's calibration texts, by task name.
        max_length: Pad every batch to this length (None: to its longest text).
    """

    corpora: Mapping[str, Sequence[str]]
    max_length: int | None = None
    name: str = "tiny_decoder"
    title: str = "tiny Llama (tests)"
    model_types: tuple[str, ...] = ("llama",)
    noun: str = "text"
    output_dtypes: tuple[str, ...] = ("base",)
    head_point: str = "last token's final norm"
    release = ReleaseParts(
        model_class="LlamaForCausalLM", pipeline_tag="text-generation", tags=("llama",), files=(),
        task_type="text-generation", task_name="Text Generation", card_template=("featcal", "missing.j2"),
    )  # fmt: skip

    def task(self, name: str) -> Task:
        return Task(name, DatasetSpec(f"memory:{name}"), family=self.name)

    def check_base_folder(self, folder: Path) -> None:
        assert json.loads((folder / MODEL_CONFIG).read_text())["model_type"] == "llama"

    def checkpoint(self, folder: Path, name: str | None = None) -> Checkpoint:
        return Checkpoint(folder, name=name)

    def model_config(self, base_folder: Path) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(base_folder))

    def hidden_size(self, config: Any) -> int:
        return int(config.hidden_size)

    def check_like_base(self, folder: Path, base_folder: Path, what: str) -> None:
        """Nothing: the test family's models are built alike."""

    def check_model_folder(self, folder: Path, base: Checkpoint | None = None) -> Checkpoint:
        return self.checkpoint(folder)

    def load_model(self, folder: Path, base: Checkpoint | None = None) -> nn.Module:
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

    def _meta(self, config: Any) -> nn.Module:
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            return LlamaForCausalLM(config)

    def build_model(self, config: Any, state: Mapping[str, torch.Tensor]) -> nn.Module:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM(config)
        model.load_state_dict(dict(state), strict=True)
        return model.eval()

    def save_model(
        self, state: Mapping[str, torch.Tensor], config: Any, folder: Path, *, output_dtype: str = "base"
    ) -> Path:
        return save_model_state(self._meta(config), state, folder)

    def adapter(self) -> DecoderAdapter:
        return DecoderAdapter()

    def skeleton(self, folder: Path, merged: Checkpoint, device: torch.device) -> nn.Module:
        """The merged model with its embedding, final norm, head and rotary embedding on ``device`` and its
        decoder layers on the meta device."""
        from transformers import LlamaForCausalLM

        config = self.model_config(folder)
        layers = self._meta(config).model.layers
        shallow = copy.deepcopy(config)
        shallow.num_hidden_layers = 0
        model = LlamaForCausalLM(shallow).to(device)
        load_params(model, merged, "")
        model.config = config
        model.model.layers.extend(layers)
        return model.eval()

    def streamed_model(self, config: Any, folder: Path, *, output_dtype: str = "base"):
        return streamed_model_folder(self._meta(config), folder)

    def preprocessor(self, base_folder: Path) -> Any:
        return tokenizer()

    def load_split(self, task: Task, split: str) -> Any:
        return self.corpora[task.name]

    def check_examples(
        self, task: Task, dataset: Any, split: str, rows: Sequence[int], preprocessor: Any = None
    ) -> None:
        assert all(dataset[row] for row in rows)

    def check_split(self, task: Task, dataset: Any, split: str) -> None:
        assert all(isinstance(text, str) and text for text in dataset)

    def calibration_inputs(self, task: Task, preprocessor: Any, n: int, seed: int, *, world: World = SINGLE):
        corpus = self.corpora[task.name]
        rows = calibration_indices(len(corpus), n, seed)
        rows = rows[world.part(len(rows))]
        return encode([corpus[i] for i in rows], self.max_length)

    def test_inputs(self, task: Task, preprocessor: Any, n: int) -> CalibrationBatch:
        return encode(list(self.corpora[task.name][:n]), self.max_length)
