"""Every refusal the docs promise is a tested refusal: the "Refused before any work" lists of
``docs/causal-lm.md`` and ``docs/seq2seq.md`` are read, each of their entries must be named by a case
below (and each case's phrase must be in an entry), and each case runs `featcal merge` or `featcal
calibrate` on tiny models and asserts exit status 2, one line on stderr holding what the refusal says,
and no output folder.

A new entry in a list fails :func:`test_every_documented_refusal_has_a_case` until a case runs it.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file, save_file

from featcal.cli import main
from tests.support import tiny_t5
from tests.support.text_worlds import jsonl, lm_rows, lm_world, t5_world

DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADING = "## Refused before any work\n"
CALIBRATE = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]


def documented_refusals(doc: str) -> list[str]:
    """The entries of a doc's "Refused before any work" list, each on one line."""
    text = (DOCS / doc).read_text(encoding="utf-8")
    section = text[text.index(HEADING) + len(HEADING) :]
    section = section[: section.find("\n## ")] if "\n## " in section else section
    entries: list[str] = []
    for line in section.splitlines():
        if line.startswith("- "):
            entries.append(line[2:])
        elif line.startswith("  ") and entries:
            entries[-1] += " " + line.strip()
    return entries


# --- the worlds -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    return lm_world(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> Path:
    return t5_world(tmp_path_factory.mktemp("t5"))


# --- what a case changes --------------------------------------------------------------------------


class Case:
    """A world copied into ``tmp``: its data file (as a dict), and the folders a case may change."""

    def __init__(self, world: Path, tmp: Path) -> None:
        self.world, self.tmp = world, tmp
        self.data = json.loads((world / "data.yaml").read_text())
        self.first = next(iter(self.data["experts"]))

    @property
    def entry(self) -> dict:
        return self.data["experts"][self.first]

    def expert_copy(self) -> Path:
        """The first expert copied, the data file naming the copy instead."""
        copy = self.tmp / "experts" / "copy"
        shutil.copytree(self.first, copy)
        self.data["experts"] = {str(copy) if k == self.first else k: v for k, v in self.data["experts"].items()}
        self.first = str(copy)
        return copy

    def merged_copy(self) -> Path:
        merged = self.tmp / "merged"
        shutil.copytree(self.world / "ta", merged)
        return merged

    def dataset(self, content: str | bytes, name: str = "rows.jsonl") -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        self.entry["dataset"] = str(path)
        return path

    def data_file(self) -> Path:
        path = self.tmp / "data.yaml"
        if not path.exists():
            path.write_text(json.dumps(self.data))
        return path

    def merge(self, *extra: str) -> list[str]:
        return ["merge", "--data", str(self.data_file()), "--base-model-id", str(self.world / "base"), "--device",
                "cpu", *extra, "--output", str(self.out)]  # fmt: skip

    def calibrate(self, merged: Path | None = None) -> list[str]:
        return ["calibrate", "--merged", str(merged or self.world / "ta"), "--data", str(self.data_file()),
                *CALIBRATE, "--output", str(self.out)]  # fmt: skip

    @property
    def out(self) -> Path:
        return self.tmp / "out"


def _edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _swap(data: dict) -> None:
    vocab = data["model"]["vocab"]
    vocab["w3"], vocab["w4"] = vocab["w4"], vocab["w3"]


def _nan(folder: Path) -> None:
    state = load_file(str(folder / "model.safetensors"))
    key = next(k for k in sorted(state) if k.endswith("weight"))
    state[key][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _shrink(folder: Path) -> Path:
    """One tensor of the folder's weights a row short: another shape than the base's."""
    state = load_file(str(folder / "model.safetensors"))
    key = "model.layers.0.mlp.down_proj.weight"
    state[key] = state[key][:-1].contiguous()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _pickle_only(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not opened")


def _twice(c: Case) -> list[str]:
    c.data["experts"][f"{Path(c.first).parent}/./{Path(c.first).name}"] = {**c.entry, "task": "again"}
    return c.merge()


def _foreign_output(c: Case) -> list[str]:
    c.out.mkdir()
    (c.out / "notes.txt").write_text("mine")
    return c.calibrate()


def _union_tokenizer(c: Case) -> list[str]:
    merged = c.merged_copy()
    (merged / "featcal_recipe.json").unlink()
    config = yaml.safe_load((merged / "mergekit_config.yml").read_text())
    (merged / "mergekit_config.yml").write_text(yaml.safe_dump({**config, "tokenizer_source": "union"}))
    return c.calibrate(merged)


def _lm_rows(c: Case, **row: str) -> list[str]:
    rows = lm_rows(5, 8)
    rows[3].update(row)
    c.dataset(jsonl(rows))
    return c.calibrate()


@dataclass(frozen=True)
class Refusal:
    """A case of a documented refusal: ``phrase`` is in its entry of the doc's list, ``run`` sets the case up
    and gives featcal's arguments, ``said`` is in the one line of the refusal."""

    phrase: str
    run: Callable[[Case], list[str]]
    said: str


LM = [
    Refusal("not a mapping with `experts:`", lambda c: (c.data.clear(), c.data.update(tasks={}), c.merge())[-1],
            "expected 'experts:'"),
    Refusal("has unknown keys", lambda c: (c.data.update(seed=1), c.merge())[-1], "unknown key(s) ['seed']"),
    Refusal("misses an expert the merge", lambda c: (c.data["experts"].pop(c.first), c.calibrate())[-1], "lacks"),
    Refusal("names one it did not",
            lambda c: (c.data["experts"].update({str(c.world / "base"): {**c.entry, "task": "extra"}}),
                       c.calibrate())[-1],
            "also names"),
    Refusal("two experts with one task name",
            lambda c: ([e.update(task="same") for e in c.data["experts"].values()], c.merge())[-1],
            "task name 'same' is taken"),
    Refusal("template reads a column the dataset lacks", lambda c: (c.entry.update(prompt="{nope}"), c.calibrate())[-1],
            "['nope']"),
    Refusal("with neither `text` nor `prompt` and `response`",
            lambda c: (c.entry.pop("response"), c.calibrate())[-1], "'prompt' and 'response'"),
    Refusal("a `max_length` below 2", lambda c: (c.entry.update(max_length=1), c.calibrate())[-1], "at least 2"),
    Refusal("an `answer` that is neither", lambda c: (c.entry.update(answer="(a)(b)"), c.calibrate())[-1], "answer"),
    Refusal("a calibration row whose text", lambda c: _lm_rows(c, query="", response=""), "row 3"),
    Refusal("a `max_length` that every calibration text of a task exceeds",
            lambda c: (c.data.update(max_length=2), c.calibrate())[-1], "max_length 2"),
    Refusal("a dataset that does not exist", lambda c: (c.entry.update(dataset="./nowhere.jsonl"), c.calibrate())[-1],
            "does not exist"),
    Refusal("a local file of another kind", lambda c: (c.dataset("w1 w2\n", "rows.txt"), c.calibrate())[-1],
            "is neither a dataset folder nor"),
    Refusal("a model type featcal does not calibrate",
            lambda c: (_edit_json(c.expert_copy() / "config.json", lambda d: d.update(model_type="gpt2")),
                       c.merge())[-1],
            "featcal cannot calibrate 'gpt2' models"),
    Refusal("with pickle weights only", lambda c: (_pickle_only(c.expert_copy()), c.merge())[-1], "pytorch_model.bin"),
    Refusal("with non-finite tensors", lambda c: (_nan(c.expert_copy()), c.merge())[-1], "not finite"),
    Refusal("whose tensors' shapes differ", lambda c: c.calibrate(_shrink(c.merged_copy())), "down_proj"),
    Refusal("configuration differs from the base's",
            lambda c: (_edit_json(c.expert_copy() / "config.json", lambda d: d.update(model_type="mistral")),
                       c.merge())[-1], "model_type 'mistral'"),  # fmt: skip
    Refusal("tokenizer vocabulary differs",
            lambda c: (_edit_json(c.merged_copy() / "tokenizer.json", _swap), c.calibrate(c.tmp / "merged"))[-1],
            "another tokenizer vocabulary"),
    Refusal("not UTF-8", lambda c: (c.dataset(b'{"query": "caf\xe9", "response": "w1"}\n'), c.calibrate())[-1],
            "is not UTF-8 text (line 1: byte 0xe9)"),
    Refusal("one expert under two names", _twice, "name one expert"),
    Refusal("an `--output` folder holding files featcal did not write", _foreign_output, "notes.txt"),
    Refusal("a mergekit merge featcal cannot calibrate", _union_tokenizer, "union"),
]  # fmt: skip


def _t5_labels(c: Case, rows: list[dict]) -> list[str]:
    c.dataset(jsonl(rows))
    return c.calibrate()


T5 = [
    Refusal("a pool mixing T5 sizes or vocabularies",
            lambda c: (tiny_t5.save_model(c.tmp / "wide", seed=3, d_ff=80), c.data["experts"].update(
                {str(c.tmp / "wide"): c.data["experts"].pop(c.first)}), c.merge())[-1], "DenseReluDense"),
    Refusal("a data-using merging method", lambda c: c.merge("--method", "regmean"), "regmean"),
    Refusal("a LoRA adapter",
            lambda c: ((c.tmp / "lora").mkdir(), (c.tmp / "lora" / "adapter_config.json").write_text("{}"),
                       c.data["experts"].update({str(c.tmp / "lora"): c.data["experts"].pop(c.first)}), c.merge())[-1],
            "LoRA adapter"),
    Refusal("a row whose class id has no word",
            lambda c: _t5_labels(c, [{"sentence": "w3 w4", "label": 5}] * 8), "is 5, not a class id"),
    Refusal("a GLUE configuration that does not exist",
            lambda c: (c.entry.update(dataset="nyu-mll/glue", config="sts-b"), c.calibrate())[-1],
            "GLUE has no configuration 'sts-b'"),
    Refusal("a template that reads a missing column", lambda c: (c.entry.update(input="{nope}"), c.calibrate())[-1],
            "['nope']"),
    Refusal("a `metric` other than the two", lambda c: (c.entry.update(metric="f1"), c.calibrate())[-1],
            "'metric' must be one of"),
    Refusal("duplicate `labels`", lambda c: (c.entry.update(labels=["w1", "w1"]), c.calibrate())[-1],
            "each with a word of its own"),
    Refusal("keys of the causal-LM entries", lambda c: (c.entry.update(weigh="response"), c.calibrate())[-1],
            "unknown field(s) ['weigh']"),
    Refusal("that is not a T5",
            lambda c: (_edit_json(c.expert_copy() / "config.json", lambda d: d.update(model_type="bart")),
                       c.merge())[-1],
            "holds a 'bart' model"),
    Refusal("has pickle weights only", lambda c: (_pickle_only(c.expert_copy()), c.merge())[-1], "pytorch_model.bin"),
    Refusal("or non-finite tensors", lambda c: (_nan(c.expert_copy()), c.merge())[-1], "not finite"),
    Refusal("configuration differs from the base's",
            lambda c: (_edit_json(c.expert_copy() / "config.json", lambda d: d.update(num_heads=8, d_kv=8)),
                       c.merge())[-1], "the base model"),  # fmt: skip
    Refusal("tokenizer vocabulary differs",
            lambda c: (_edit_json(c.expert_copy() / "tokenizer.json", _swap), c.merge())[-1],
            "another tokenizer vocabulary"),
    Refusal("not UTF-8", lambda c: (c.dataset(b'{"sentence": "caf\xe9", "label": 0}\n'), c.calibrate())[-1],
            "is not UTF-8 text (line 1: byte 0xe9)"),
    Refusal("one expert under two names", _twice, "name one expert"),
    Refusal("an `--output` folder holding files featcal did not write", _foreign_output, "notes.txt"),
]  # fmt: skip

DOCUMENTED = {"causal-lm.md": ("lm", LM), "seq2seq.md": ("t5", T5)}


@pytest.mark.parametrize("doc", list(DOCUMENTED))
def test_every_documented_refusal_has_a_case(doc) -> None:
    entries = documented_refusals(doc)
    cases = DOCUMENTED[doc][1]
    assert entries, f"{doc} lists no refusals"
    uncovered = [entry for entry in entries if not any(case.phrase in entry for case in cases)]
    assert not uncovered, f"{doc}: entries no case runs: {uncovered}"
    stale = [case.phrase for case in cases if not any(case.phrase in entry for entry in entries)]
    assert not stale, f"{doc}: cases of no entry: {stale}"


@pytest.mark.parametrize(
    ("world", "refusal"),
    [(world, r) for world, cases in DOCUMENTED.values() for r in cases],
    ids=[f"{doc}:{r.phrase}" for doc, (_, cases) in DOCUMENTED.items() for r in cases],
)
def test_a_documented_refusal_is_one_line_exit_2_and_nothing_written(request, tmp_path, capsys, world, refusal):
    case = Case(request.getfixturevalue(world), tmp_path)
    argv = refusal.run(case)
    capsys.readouterr()
    code = main(["-q", *argv])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and refusal.said in err[0], (code, err)
    assert not case.out.exists() or list(case.out.iterdir()) == [case.out / "notes.txt"]
    assert not list(tmp_path.glob(".out*"))
