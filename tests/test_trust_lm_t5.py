"""What `featcal merge` and `featcal calibrate` refuse, and replace, on the language-model, T5 and CLIP paths:

- a model whose configuration or tokenizer vocabulary differs from the base's (same tensor shapes included:
  two words' ids swapped, another model type, another split of the width into heads), as an expert or as the
  merged folder, for every family (the keys compared are each family's ``folders.LIKE_BASE_KEYS``, the
  table the docs list);
- a text file featcal reads that is not UTF-8 (datasets, the data file, model and tokenizer configurations,
  ``mergekit_config.yml``): one line naming the file and line;
- one expert under two names (``experts/count`` and ``experts/./count``, a symbolic link);
- an output folder featcal wrote before is replaced (same or other settings), one holding anything else refused;
- two processes writing one output: the second is refused at once, the first's folder whole.

Every refusal: exit status 2, one line on stderr, and no output folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from importlib import import_module
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from featcal.cli import main
from tests.support.builders import build_world
from tests.support.text_worlds import jsonl, lm_rows, lm_world, t5_world
from tests.test_documented_refusals import documented_refusals

CALIBRATE = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
DOCS = Path(__file__).resolve().parents[1] / "docs"


@pytest.fixture(scope="module")
def lm(tmp_path_factory) -> Path:
    return lm_world(tmp_path_factory.mktemp("lm"))


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> Path:
    return t5_world(tmp_path_factory.mktemp("t5"))


def _refused(capsys, argv: list[str], out: Path, *said: str) -> str:
    """Run featcal; assert exit status 2, one line on stderr holding every ``said``, and no ``out``."""
    capsys.readouterr()
    code = main(["-q", *map(str, argv)])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1, (code, err)
    for text in said:
        assert text in err[0], err
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}*"))  # no temporary, no lock
    return err[0]


def _merge(root: Path, data: Path, out: Path) -> list:
    return ["merge", "--data", data, "--base-model-id", root / "base", "--device", "cpu", "--output", out]


def _calibrate(root: Path, merged: Path, out: Path, data: Path | None = None) -> list:
    return ["calibrate", "--merged", merged, "--data", data or root / "data.yaml", *CALIBRATE, "--output", out]


def _with_expert(root: Path, tmp_path: Path, old: str, new: Path | str, *, dataset: Path | None = None) -> Path:
    """The data file with expert ``old`` replaced by ``new`` (and its texts by ``dataset``), written to tmp_path."""
    data = json.loads((root / "data.yaml").read_text())
    entry = data["experts"].pop(str(root / "experts" / old))
    data["experts"][str(new)] = {**entry, **({"dataset": str(dataset)} if dataset else {})}
    path = tmp_path / f"data-{len(list(tmp_path.glob('data-*')))}.yaml"
    path.write_text(json.dumps(data))
    return path


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _swap_two_ids(data: dict, a: str, b: str) -> None:
    vocab = data["model"]["vocab"]
    vocab[a], vocab[b] = vocab[b], vocab[a]


# --- a model unlike its base ----------------------------------------------------------------------


def _lm_swapped(folder: Path) -> None:
    _edit_json(folder / "tokenizer.json", lambda d: _swap_two_ids(d, "w0", "w1"))


def _lm_bigger_vocabulary(folder: Path) -> None:
    _edit_json(folder / "tokenizer.json", lambda d: d["model"]["vocab"].update({"extra": len(d["model"]["vocab"])}))


def _lm_mistral(folder: Path) -> None:
    _edit_json(folder / "config.json", lambda d: d.update(model_type="mistral", architectures=["MistralForCausalLM"]))


def _lm_eight_heads(folder: Path) -> None:  # 8 heads of 8 over 4 key-value heads: the tensors of 4 of 16 over 2
    _edit_json(folder / "config.json", lambda d: d.update(num_attention_heads=8, num_key_value_heads=4))


LM_UNLIKE = {
    "swapped ids": (_lm_swapped, "another tokenizer vocabulary"),
    "a larger vocabulary": (_lm_bigger_vocabulary, "another tokenizer vocabulary"),
    "mistral under llama": (_lm_mistral, "model_type 'mistral', the base model"),
    "other heads": (_lm_eight_heads, "num_attention_heads 8, the base model"),
}


@pytest.mark.parametrize("case", list(LM_UNLIKE))
def test_an_lm_expert_unlike_the_base_is_refused(lm, tmp_path, capsys, case) -> None:
    change, said = LM_UNLIKE[case]
    expert = tmp_path / "experts" / "odd"
    shutil.copytree(lm / "experts" / "count", expert)
    change(expert)
    data = _with_expert(lm, tmp_path, "count", expert)
    _refused(capsys, _merge(lm, data, tmp_path / "m"), tmp_path / "m", said, "expert for task", str(expert))


@pytest.mark.parametrize("case", list(LM_UNLIKE))
def test_an_lm_merge_unlike_the_base_is_refused(lm, tmp_path, capsys, case) -> None:
    """A mergekit folder (its ``mergekit_config.yml`` names the base and experts) or featcal's own merge."""
    change, said = LM_UNLIKE[case]
    merged = tmp_path / "mergekit-out"
    shutil.copytree(lm / "ta", merged)
    (merged / "featcal_recipe.json").unlink()
    change(merged)
    _refused(capsys, _calibrate(lm, merged, tmp_path / "out"), tmp_path / "out", said, f"model {merged}")


def _t5_swapped(folder: Path) -> None:
    _edit_json(folder / "tokenizer.json", lambda d: _swap_two_ids(d, "w3", "w4"))


def _t5_eight_heads(folder: Path) -> None:  # 8 heads of 8: the tensors of 4 of 16
    _edit_json(folder / "config.json", lambda d: d.update(num_heads=8, d_kv=8))


def _t5_relu(folder: Path) -> None:  # T5 v1.0's feed-forward under a FLAN-T5 base: the same tensors
    _edit_json(folder / "config.json", lambda d: d.update(feed_forward_proj="gated-relu"))


def _t5_rescaled(folder: Path) -> None:  # T5 v1.0's output scaling with a head of its own: the same tensors
    _edit_json(folder / "config.json", lambda d: d.update(scale_decoder_outputs=True))


T5_UNLIKE = {
    "swapped ids": (_t5_swapped, "another tokenizer vocabulary"),
    "other output scaling": (_t5_rescaled, "scale_decoder_outputs True"),
    "a larger vocabulary": (_lm_bigger_vocabulary, "another tokenizer vocabulary"),
    "other heads": (_t5_eight_heads, "the base model"),
    "another feed-forward": (_t5_relu, "feed_forward_proj 'gated-relu'"),
}


@pytest.mark.parametrize("case", list(T5_UNLIKE))
def test_a_t5_expert_unlike_the_base_is_refused(t5, tmp_path, capsys, case) -> None:
    change, said = T5_UNLIKE[case]
    expert = tmp_path / "experts" / "odd"
    shutil.copytree(t5 / "experts" / "nli", expert)
    change(expert)
    data = _with_expert(t5, tmp_path, "nli", expert)
    _refused(capsys, _merge(t5, data, tmp_path / "m"), tmp_path / "m", said, str(expert))


@pytest.mark.parametrize("case", list(T5_UNLIKE))
def test_a_t5_merge_unlike_the_base_is_refused(t5, tmp_path, capsys, case) -> None:
    change, said = T5_UNLIKE[case]
    merged = tmp_path / "merged"
    shutil.copytree(t5 / "ta", merged)
    change(merged)
    _refused(capsys, _calibrate(t5, merged, tmp_path / "out"), tmp_path / "out", said, f"model {merged}")


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> dict:
    return build_world(tmp_path_factory.mktemp("clip"))


def test_a_clip_expert_or_merge_with_other_heads_is_refused(clip, tmp_path, capsys) -> None:
    """8 heads of 4 over a width of 32: the tensors of 4 heads of 8, another model."""
    root = tmp_path / "world"
    shutil.copytree(clip["root"], root)
    expert = root / "experts" / "task1"
    _edit_json(expert / "config.json", lambda d: d.update(num_attention_heads=8))
    argv = ["merge", "--tasks-file", root / "tasks.json", "--device", "cpu", "--output", tmp_path / "m"]
    _refused(capsys, argv, tmp_path / "m", "num_attention_heads 8, the base model", str(expert))
    shutil.copytree(clip["root"] / "experts" / "task1", expert, dirs_exist_ok=True)  # the expert as it was
    assert main(["-q", *map(str, argv[:-1]), str(tmp_path / "ta")]) == 0
    _edit_json(tmp_path / "ta" / "config.json", lambda d: d.update(num_attention_heads=8))
    argv = ["calibrate", "--merged", tmp_path / "ta", "--tasks-file", root / "tasks.json", "--num-calibration-examples",
            "4", "--device", "cpu", "--output", tmp_path / "out"]  # fmt: skip
    _refused(capsys, argv, tmp_path / "out", "num_attention_heads 8, the base model")


@pytest.mark.parametrize("family", ["causal_lm", "seq2seq", "clip_vision"])
def test_the_docs_list_the_keys_compared_with_the_base(family) -> None:
    """The docs' refusal of a model unlike its base names exactly the configuration keys the check compares: the
    language models' and T5s' in their "Refused before any work" lists, CLIP's in the fault catalogue."""
    if family == "clip_vision":
        entries = (DOCS / "reliability.md").read_text(encoding="utf-8").splitlines()
    else:
        entries = documented_refusals({"causal_lm": "causal-lm.md", "seq2seq": "seq2seq.md"}[family])
    entry = next(e for e in entries if "configuration differs from the base's in any of" in e)
    keys = entry.split("in any of", 1)[1].split("(", 1)[0]  # the list, before the examples in parentheses
    listed = set(keys.split("`")[1::2])
    assert listed == set(import_module(f"featcal.families.{family}.folders").LIKE_BASE_KEYS), entry


# --- text files that are not UTF-8 ----------------------------------------------------------------


def _latin1(path: Path, old: bytes = b"w", *, count: int = 1, after: int = 0) -> None:
    """Replace the first ``count`` ``old`` after byte ``after`` with an é in Latin-1 (0xe9), not UTF-8."""
    data = path.read_bytes()
    path.write_bytes(data[:after] + data[after:].replace(old, b"\xe9", count))


def _dataset_case(lm: Path, tmp_path: Path, kind: str) -> tuple[Path, Path, int]:
    """A data file whose ``count`` texts are a JSON-lines, CSV or JSON file with a Latin-1 byte on line 3."""
    rows = lm_rows(21)
    path = tmp_path / f"count.{kind}"
    if kind == "jsonl":
        path.write_text(jsonl(rows))
    elif kind == "csv":
        path.write_text("query,response\n" + "".join(f"{r['query']},{r['response']}\n" for r in rows))
    else:
        path.write_text(json.dumps(rows, indent=0))
    lines = path.read_bytes().split(b"\n")
    _latin1(path, after=len(b"\n".join(lines[:2])) + 1)
    return _with_expert(lm, tmp_path, "count", lm / "experts" / "count", dataset=path), path, 3


@pytest.mark.parametrize("kind", ["jsonl", "csv", "json"])
def test_a_dataset_file_that_is_not_utf8_is_one_line_naming_it(lm, tmp_path, capsys, kind) -> None:
    data, path, line = _dataset_case(lm, tmp_path, kind)
    _refused(capsys, _calibrate(lm, lm / "ta", tmp_path / "out", data), tmp_path / "out",
             f"Task 'count': the dataset file {path} is not UTF-8 text (line {line}: byte 0xe9)")  # fmt: skip


def test_a_dataset_folder_holding_a_file_that_is_not_utf8_is_one_line(t5, tmp_path, capsys) -> None:
    folder = tmp_path / "nli-folder"
    (folder / "data").mkdir(parents=True)
    shutil.copy(t5 / "nli.jsonl", folder / "data" / "train.jsonl")
    _latin1(folder / "data" / "train.jsonl")
    data = _with_expert(t5, tmp_path, "nli", t5 / "experts" / "nli", dataset=folder)
    _refused(capsys, _calibrate(t5, t5 / "ta", tmp_path / "out", data), tmp_path / "out",
             f"the dataset file {folder / 'data' / 'train.jsonl'} is not UTF-8 text (line 1")  # fmt: skip


# (which folder, which file): the merged folder (a mergekit one), an expert, the base
MODEL_FILES = [
    ("merged", "mergekit_config.yml"),
    ("merged", "tokenizer.json"),
    ("merged", "config.json"),
    ("expert", "config.json"),
    ("expert", "tokenizer_config.json"),
    ("base", "tokenizer_config.json"),
    ("base", "generation_config.json"),
]


@pytest.mark.parametrize(("which", "name"), MODEL_FILES)
def test_a_model_file_that_is_not_utf8_is_one_line_naming_it(lm, tmp_path, capsys, which, name) -> None:
    merged, base = tmp_path / "merged", tmp_path / "base"
    shutil.copytree(lm / "ta", merged)
    (merged / "featcal_recipe.json").unlink()  # mergekit's record names the base and the experts
    shutil.copytree(lm / "base", base)
    expert = tmp_path / "experts" / "count"
    shutil.copytree(lm / "experts" / "count", expert)
    data = _with_expert(lm, tmp_path, "count", expert)
    config = yaml.safe_load((merged / "mergekit_config.yml").read_text())
    config["base_model"] = str(base)
    config["models"] = [
        {**m, "model": str(expert) if m["model"].endswith("count") else m["model"]} for m in config["models"]
    ]
    (merged / "mergekit_config.yml").write_text(yaml.safe_dump(config))
    target = {"merged": merged, "expert": expert, "base": base}[which] / name
    _latin1(target, b"e", after=3)
    _refused(capsys, _calibrate(lm, merged, tmp_path / "out", data), tmp_path / "out",
             f"{target} is not UTF-8 text (line ", "byte 0xe9")  # fmt: skip


def test_a_data_file_that_is_not_utf8_is_one_line_naming_it(lm, tmp_path, capsys) -> None:
    data = tmp_path / "data.yaml"
    data.write_bytes((lm / "data.yaml").read_bytes() + b"\n# caf\xe9\n")
    _refused(capsys, _calibrate(lm, lm / "ta", tmp_path / "out", data), tmp_path / "out",
             f"Calibration data file {data} is not UTF-8 text (line 2: byte 0xe9)")  # fmt: skip


def test_export_of_a_model_folder_with_a_file_that_is_not_utf8_is_one_line(lm, tmp_path, capsys) -> None:
    folder = tmp_path / "ta"
    shutil.copytree(lm / "ta", folder)
    _latin1(folder / "tokenizer_config.json", b"e", after=3)
    _refused(capsys, ["export", folder, "--repo", "someone/model", "--license", "apache-2.0"],
             tmp_path / "ta-release", f"{folder / 'tokenizer_config.json'} is not UTF-8 text (line ")  # fmt: skip


def test_a_space_settings_file_that_is_not_utf8_is_named(tmp_path) -> None:
    from featcal.errors import FeatcalError
    from featcal.space.settings import CONFIG_FILE, SpaceSettings

    (tmp_path / CONFIG_FILE).write_bytes(b'{"title": "caf\xe9"}\n')
    with pytest.raises(FeatcalError, match=r"space_config.json is not UTF-8 text \(line 1: byte 0xe9\)"):
        SpaceSettings.from_app_dir(tmp_path, environ={})


# --- one expert under two names -------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["dot", "link"])
@pytest.mark.parametrize("command", ["merge", "calibrate"])
def test_one_expert_under_two_names_is_refused(lm, tmp_path, capsys, alias, command) -> None:
    """``experts/count`` and ``experts/./count`` (or a link to it), the second with the other task's texts."""
    second = f"{lm / 'experts'}/./count"
    if alias == "link":
        second = str(tmp_path / "count-link")
        os.symlink(lm / "experts" / "count", second)
    data = json.loads((lm / "data.yaml").read_text())
    data["experts"][second] = {**data["experts"][str(lm / "experts" / "math")], "task": "again"}
    path = tmp_path / "twice.yaml"
    path.write_text(json.dumps(data))
    out = tmp_path / "out"
    argv = _merge(lm, path, out) if command == "merge" else _calibrate(lm, lm / "ta", out, path)
    _refused(capsys, argv, out, "Tasks 'count' and 'again' name one expert,", str(lm / "experts" / "count"),
             "list each expert once")  # fmt: skip


def test_one_hub_expert_under_two_references_is_refused(lm, tmp_path) -> None:
    """``me/count`` and ``me/count@main`` are one commit, so one snapshot folder: one expert."""
    from tests.support.hub_double import HubDouble
    from tests.support.hub_world import user_env

    data = json.loads((lm / "data.yaml").read_text())
    entries = list(data["experts"].values())
    data["experts"] = {str(lm / "experts" / "math"): entries[0], "me/count": entries[1],
                       "me/count@main": {**entries[0], "task": "again"}}  # fmt: skip
    (tmp_path / "hub.yaml").write_text(json.dumps(data))
    out = tmp_path / "out"
    with HubDouble() as hub:
        hub.publish_folder("me/count", lm / "experts" / "count")
        argv = [sys.executable, "-m", "featcal", "-q", *map(str, _merge(lm, tmp_path / "hub.yaml", out))]
        result = subprocess.run(argv, capture_output=True, text=True, env=user_env(hub.url, tmp_path / "home"))
    err = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(err) == 1, (result.returncode, err)
    assert "Tasks 'count' and 'again' name one expert" in err[0] and "(as 'me/count' and 'me/count@main')" in err[0]
    assert not out.exists()


def test_one_clip_expert_under_two_tasks_is_refused(clip, tmp_path, capsys) -> None:
    table = json.loads(clip["tasks_file"].read_text())
    for task in table["tasks"].values():
        task["dataset"]["path"] = str(clip["root"] / task["dataset"]["path"])
        task["expert"] = str(clip["root"] / task["expert"])
    table["tasks"]["task1"]["expert"] = str(clip["root"] / "experts" / "task0")
    (tmp_path / "tasks.json").write_text(json.dumps({**table, "base_model": str(clip["base"])}))
    argv = ["merge", "--tasks-file", tmp_path / "tasks.json", "--device", "cpu", "--output", tmp_path / "m"]
    _refused(capsys, argv, tmp_path / "m", "Tasks 'task0' and 'task1' name one expert")


# --- rerunning into one's own output --------------------------------------------------------------


@pytest.mark.parametrize("family", ["lm", "t5"])
def test_merge_and_calibrate_again_replace_their_own_output(request, tmp_path, family) -> None:
    """Into the folder each wrote before, with other settings: the folder then holds the new result, as a
    fresh write of those settings does."""
    root = request.getfixturevalue(family)
    out, cal = tmp_path / "ta", tmp_path / "cal"
    merge = ["-q", *map(str, _merge(root, root / "data.yaml", out))]
    assert main(merge) == 0 and (out / "tokenizer.json").is_file()
    assert main([*merge, "--merge-param", "scaling_factor=0.5"]) == 0  # over its own, other settings
    assert main([*merge[:-1], str(tmp_path / "fresh"), "--merge-param", "scaling_factor=0.5"]) == 0
    assert (
        load_file(str(out / "model.safetensors")).keys()
        == load_file(str(tmp_path / "fresh" / "model.safetensors")).keys()
    )
    _same_weights(out, tmp_path / "fresh")
    calibrate = ["-q", *map(str, _calibrate(root, out, cal))]
    assert main(calibrate) == 0
    assert main([*calibrate, "--lambda-ratio", "0.5"]) == 0
    assert main([*calibrate[:-1], str(tmp_path / "fresh-cal"), "--lambda-ratio", "0.5"]) == 0
    _same_weights(cal, tmp_path / "fresh-cal")
    assert sorted(p.name for p in cal.iterdir()) == sorted(p.name for p in (tmp_path / "fresh-cal").iterdir())


def _same_weights(a: Path, b: Path) -> None:
    ours, theirs = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("foreign", ["someone's model", "featcal's with a note"])
def test_an_output_holding_what_featcal_did_not_write_is_still_refused(lm, tmp_path, capsys, foreign) -> None:
    out = tmp_path / "out"
    if foreign == "someone's model":  # a model folder with tokenizer files, but no featcal recipe
        shutil.copytree(lm / "experts" / "math", out)
    else:
        shutil.copytree(lm / "ta", out)
        (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    assert main(["-q", *map(str, _calibrate(lm, lm / "ta", out))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds files that are not a calibrated model's" in err[0], err
    assert ("notes.txt" if foreign != "someone's model" else "tokenizer.json") in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


# --- two writers, one output ----------------------------------------------------------------------


def _read_or_empty(path: Path) -> str:
    """A lock file's text, or "" while it does not exist."""
    try:
        return path.read_text()
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("command", ["calibrate", "merge"])
def test_a_second_writer_of_one_output_is_refused_and_the_first_s_result_stays(lm, tmp_path, command) -> None:
    """Two real processes: the first is stopped (SIGSTOP) while it holds the output's lock; the second is
    refused in one line naming it; the first, continued, writes the folder a lone run writes."""
    out = tmp_path / "out"
    argv = _calibrate(lm, lm / "ta", out) if command == "calibrate" else _merge(lm, lm / "data.yaml", out)
    cmd = [sys.executable, "-m", "featcal", "-q", *map(str, argv)]
    lock = tmp_path / ".out.featcal.lock"
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        # the holder's record is written after its flock is taken: the file alone may exist a moment before
        while f'"pid": {first.pid},' not in _read_or_empty(lock) and first.poll() is None:
            assert time.monotonic() < deadline, "the first writer never took the lock"
            time.sleep(0.001)
        os.kill(first.pid, signal.SIGSTOP)
        assert f'"pid": {first.pid},' in _read_or_empty(lock), "the first writer never took the lock"
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        os.kill(first.pid, signal.SIGCONT)
        err = [line for line in second.stderr.splitlines() if line.strip()]
        assert second.returncode == 2 and len(err) == 1, (second.returncode, err)
        assert f"folder {out} is being written by process {first.pid}" in err[0], err
        _, first_err = first.communicate(timeout=300)
    finally:
        if first.poll() is None:  # a failed assertion above: leave no stopped process behind
            os.kill(first.pid, signal.SIGCONT)
            first.kill()
            first.wait()
    assert first.returncode == 0, first_err
    assert not lock.exists()
    alone = tmp_path / "alone"
    assert main(["-q", *map(str, argv[:-1]), str(alone)]) == 0
    _same_weights(out, alone)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in alone.iterdir())
