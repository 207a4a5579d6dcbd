"""MergeBench's five-domain evaluation (``--eval-protocol mergebench``), rehearsed offline: a tiny model goes
through every task of the protocol, lm-evaluation-harness reading small local copies of each benchmark in its
Hub format (tests/support/mergebench_data.py), the coding domain's programs run in featcal's sandbox."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import fmean

import pytest
import yaml

from featcal.cli import main
from featcal.families.causal_lm.mergebench_eval import coding
from featcal.families.causal_lm.mergebench_eval.protocol import (
    DOMAIN_NAMES,
    DOMAINS,
    SAFETY_VARIANT,
    domain,
    harness_task_names,
)
from featcal.families.causal_lm.mergebench_eval.scores import normalized_average, raw_average, stage_table
from tests.support.mergebench_data import HUMANEVAL_ROWS, MBPP_ROWS, save_eos_world, write_mergebench_data

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def benchmark_data(tmp_path_factory) -> Path:
    return write_mergebench_data(tmp_path_factory.mktemp("benchmarks"))


@pytest.fixture(scope="module")
def eos_world(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    return save_eos_world(tmp_path_factory.mktemp("eos"))


def write_punkt_tab(folder: Path) -> Path:
    """nltk data holding a ``punkt_tab`` for English in its real layout (four parameter files), with two
    abbreviations and no other learned parameter: built here, nothing downloaded."""
    english = folder / "tokenizers" / "punkt_tab" / "english"
    english.mkdir(parents=True)
    (english / "abbrev_types.txt").write_text("dr\nmr\n")
    for name in ("collocations.tab", "sent_starters.txt", "ortho_context.tab"):
        (english / name).write_text("")
    return folder


@pytest.fixture(scope="module")
def nltk_data(tmp_path_factory) -> Path:
    return write_punkt_tab(tmp_path_factory.mktemp("nltk_data"))


@pytest.fixture(autouse=True)
def punkt_tab_installed(nltk_data, monkeypatch) -> Path:
    """nltk reads the data built here alone (its path as NLTK_DATA sets it), never a folder of the machine's."""
    import nltk

    monkeypatch.setattr(nltk.data, "path", [str(nltk_data)])
    return nltk_data


def test_a_local_definition_is_the_harness_s_own_reading_the_local_copies(benchmark_data, tmp_path) -> None:
    from lm_eval.tasks._yaml_loader import load_yaml

    from featcal.families.causal_lm.mergebench_eval.local_data import harness_definition, write_definitions

    tasks = [t for t in domain("multilingual").harness if t.name == "arc_fr"] + list(domain("math").harness)
    write_definitions(tasks, tmp_path, benchmark_data)
    for task in tasks:
        own, local = harness_definition(task), load_yaml(tmp_path / f"{task.name}.yaml", resolve_func=False)
        data = ("dataset_path", "dataset_name", "dataset_kwargs")
        assert {k: v for k, v in local.items() if k not in data} == {k: v for k, v in own.items() if k not in data}
        files = local["dataset_kwargs"]["data_files"]
        splits = [own[k] for k in ("training_split", "validation_split", "test_split", "fewshot_split") if own.get(k)]
        assert sorted(files) == sorted(set(splits)) and local["dataset_path"] == "json", task.name
        assert all(Path(f).is_file() and Path(f).is_relative_to(benchmark_data.resolve()) for f in files.values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arc_fr.yaml", "gsm8k_cot.yaml"]
    hub = tmp_path / "hub"  # without local copies: the harness's own definition, data source included
    hub.mkdir()
    write_definitions(tasks, hub)
    assert all(load_yaml(hub / f"{t.name}.yaml", resolve_func=False) == harness_definition(t) for t in tasks)


def _samples(rows: list[dict], key: str, right: int) -> dict[str, list[str]]:
    """Ten samples per problem, ``right`` of them the canonical solution, the others a wrong body (a sample
    continues the stripped HumanEval+ prompt, as bigcode's do: from its line's end)."""
    out = {}
    for row in rows:
        problem = coding.problem(coding_task(key), row)
        good = "\n" + row["canonical_solution"] if key == "humanevalplus" else row["code"]
        out[problem.prompt] = [good] * right + ["    return None\n" if key == "humanevalplus" else "x = 1\n"] * (
            10 - right
        )
    return out


def coding_task(name: str):
    return next(c for c in domain("coding").code if c.name == name)


@pytest.mark.parametrize(("name", "rows"), [("humanevalplus", HUMANEVAL_ROWS), ("mbppplus", MBPP_ROWS)])
def test_the_coding_domain_scores_the_programs_it_runs_in_the_sandbox(monkeypatch, name, rows) -> None:
    """pass@1 of 10 samples, 3 of them right, is 0.3: the canonical solutions pass their tests in the sandbox,
    the wrong ones fail them."""
    right = 3
    samples = _samples(rows, name, right)
    monkeypatch.setattr(coding, "sample_completions", lambda model, tok, prompts, stop: [samples[p] for p in prompts])
    result = coding.run_code_task(None, None, coding_task(name), rows, allow_code_execution=True)
    assert result["pass@1"] == pytest.approx(right / 10) and result["samples"] == 10


def test_numpy_in_a_folder_the_sandbox_hides_is_shown_to_the_programs(monkeypatch) -> None:
    """This process's numpy, its site-packages made the HOME the sandbox hides (as a virtual environment under
    HOME), is shown to the programs at the sandbox's site, read-only: the canonical solutions still pass. Before,
    the programs imported numpy from its real folder, and the coding domain stopped as the sandbox hid it."""
    import numpy

    from featcal.sandbox.runner import hidden_folders

    site = str(Path(numpy.__file__).resolve().parent.parent)
    monkeypatch.setenv("HOME", site)
    monkeypatch.delenv(coding.SANDBOX_SITE, raising=False)
    assert site in hidden_folders()
    samples = _samples(HUMANEVAL_ROWS, "humanevalplus", 2)
    monkeypatch.setattr(coding, "sample_completions", lambda model, tok, prompts, stop: [samples[p] for p in prompts])
    result = coding.run_code_task(None, None, coding_task("humanevalplus"), HUMANEVAL_ROWS, allow_code_execution=True)
    assert result["pass@1"] == pytest.approx(0.2)
    libs = [f"{site}/numpy.libs"] if Path(site, "numpy.libs").is_dir() else []
    assert [str(Path(folder).resolve()) for folder in coding.numpy_folders()] == [f"{site}/numpy", *libs]


def test_a_sandbox_site_without_numpy_is_refused_before_any_sample(monkeypatch, tmp_path) -> None:
    """``FEATCAL_SANDBOX_SITE`` naming a folder that holds no numpy: one line naming it, before any sample."""
    from featcal.errors import SandboxUnavailableError

    monkeypatch.setenv(coding.SANDBOX_SITE, str(tmp_path))
    monkeypatch.setattr(coding, "sample_completions", lambda *args: pytest.fail("sampled"))
    with pytest.raises(SandboxUnavailableError) as caught:
        coding.run_code_task(None, None, coding_task("mbppplus"), MBPP_ROWS, allow_code_execution=True)
    assert caught.value.message == (
        f"No package 'numpy' installed in {tmp_path} to show to the sandbox's programs "
        f"(FEATCAL_SANDBOX_SITE={tmp_path}; MergeBench's coding tests import numpy; docs/code-eval.md)."
    )


def test_a_sandbox_that_cannot_import_numpy_is_refused_before_any_sample(monkeypatch) -> None:
    """HumanEval+'s and MBPP+'s tests import numpy: where the sandbox cannot, every program would fail, so
    the coding domain stops with the sandbox's reason instead of scoring 0."""
    from featcal.errors import SandboxUnavailableError
    from featcal.sandbox.runner import Outcome

    failed = Outcome("failed", "exit status 1: ModuleNotFoundError", "", "", 0.1)
    monkeypatch.setattr(coding, "run_program", lambda *args, **kwargs: failed)
    monkeypatch.setattr(coding, "sample_completions", lambda *args: pytest.fail("sampled"))
    with pytest.raises(SandboxUnavailableError, match="import numpy.*ModuleNotFoundError"):
        coding.run_code_task(None, None, coding_task("mbppplus"), MBPP_ROWS, allow_code_execution=True)


def test_the_coding_prompts_and_stops_are_bigcode_s() -> None:
    mbpp = coding.problem(coding_task("mbppplus"), MBPP_ROWS[0])
    assert mbpp.prompt == '"""\nWrite a function to double a number.\nassert double(2) == 4\n"""\n'
    assert mbpp.entry_point is None and mbpp.test == "\n" + MBPP_ROWS[0]["test"]  # bigcode's reference
    human = coding.problem(coding_task("humanevalplus"), HUMANEVAL_ROWS[0])
    assert human.prompt == HUMANEVAL_ROWS[0]["prompt"].strip() and human.entry_point == "add"
    text = "    return a + b\n\ndef other():\n    pass\n"
    assert coding.stop_at_stop_word(text, coding_task("humanevalplus").stop) == "    return a + b\n"
    assert coding.stop_at_stop_word("x = 1", ("\nif",)) == "x = 1"


def test_a_sample_stops_being_extended_once_its_text_after_the_prompt_holds_a_stop_word() -> None:
    import torch

    from tests.support.tiny_lm_world import tokenizer

    tok = tokenizer()
    ids = torch.tensor([tok("w1 w2 w3")["input_ids"], tok("w1 w4 w5")["input_ids"], tok("w2 w4 w5")["input_ids"]])
    # the prompt is "<s>" and one word: the third row's w2 is its prompt's, not its sample's
    assert coding._StopWords(2, ("w2",), tok)(ids, None).tolist() == [True, False, False]
    assert coding._StopWords(2, ("w3", "w5"), tok)(ids, None).tolist() == [True, True, True]


def test_the_averages_are_the_raw_mean_and_the_mean_normalised_by_each_expert() -> None:
    experts = {"instruction": 0.5, "math": 0.4, "multilingual": 0.5, "coding": 0.2, "safety": 0.8}
    merged = {"instruction": 0.25, "math": 0.4, "multilingual": 0.5, "coding": 0.1, "safety": 0.8}
    assert raw_average(merged) == pytest.approx(0.41)
    assert normalized_average(merged, experts) == pytest.approx((0.5 + 1 + 1 + 0.5 + 1) / 5)
    assert raw_average({**merged, "safety": None}) is None
    assert normalized_average(merged, {**experts, "coding": None}) is None
    table = stage_table(
        {"merged": {"domains": merged}, "base": None},
        {name: {"domains": {name: value}} for name, value in experts.items()},
    )
    assert table["experts"] == experts and set(table["stages"]) == {"expert", "merged"}
    assert table["stages"]["expert"]["normalized"] == pytest.approx(1.0)
    assert table["stages"]["merged"]["normalized"] == pytest.approx(0.8)


def _error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error:"), (code, err)
    return err[0]


def _run_args(world, benchmark_data: Path, data_file: Path, out: Path, *extra: str) -> list[str]:
    base, _ = world
    return [
        "run", "--suite", "mergebench", "--data", str(data_file), "--base-model-id", str(base), "--device", "cpu",
        "--num-calibration-examples", "8", "--calibration-batch-size", "8", "--eval-num-workers", "0",
        "--max-eval-samples", "2", "--eval-max-new-tokens", "4", "--threads", "1", "--output-dir", str(out),
        "--eval-protocol", "mergebench", "--benchmark-data", str(benchmark_data), *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data_file(eos_world, tmp_path_factory) -> Path:
    """The run's calibration data: the tiny LM world's rows of each MergeBench task, its text formats."""
    from tests.support.tiny_lm_world import TASKS, rows, write_data_file, write_text_dataset

    _, experts = eos_world
    root = tmp_path_factory.mktemp("data")
    datasets = {task: root / task for task in TASKS}
    for i, task in enumerate(TASKS):
        write_text_dataset(datasets[task], rows(task, seed=200 + i))
    return write_data_file(root, experts, datasets)


def test_bad_protocol_inputs_are_refused_in_one_line_before_any_work(
    eos_world, benchmark_data, data_file, tmp_path, capsys
) -> None:
    out = tmp_path / "run"
    argv = _run_args(eos_world, benchmark_data, data_file, out)  # no --allow-code-execution
    assert "--allow-code-execution" in _error(capsys, argv) and not out.exists()
    clip = ["run", "--eval-protocol", "mergebench", "--allow-code-execution", "--output-dir", str(out)]
    message = _error(capsys, clip)  # the ta8 suite: CLIP's family, not a mergebench run
    assert "--eval-protocol" in message and "mergebench suite" in message and not out.exists()
    alone = ["run", "--suite", "mergebench", "--allow-code-execution", "--output-dir", str(out)]
    assert "given with eval_protocol mergebench" in _error(capsys, alone) and not out.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = _run_args(eos_world, empty, data_file, out, "--allow-code-execution")
    message = _error(capsys, argv)  # a folder without the local copies: the first missing file is named
    assert "google/IFEval/default/train.jsonl" in message and "is missing" in message and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]
    assert "a folder of local copies" in _error(capsys, _run_args(eos_world, tmp_path / "no", data_file, out,
                                                                  "--allow-code-execution"))  # fmt: skip


def test_a_mergebench_run_scores_every_stage_by_the_protocol(eos_world, benchmark_data, data_file, tmp_path) -> None:
    """A tiny model whose generations end at once goes through every task of the protocol, lm-eval reading the
    local copies; each expert runs its own domain; the card and model-index show the scores. Safety is
    FusionBench's variant, asked for by name (``--mergebench-safety fusionbench``): its record and labels are
    those it always had (the judged default: tests/test_mergebench_judged_safety.py)."""
    out = tmp_path / "run"
    argv = _run_args(eos_world, benchmark_data, data_file, out, "--allow-code-execution", "--eval-zero-shot",
                     "--eval-experts", "--mergebench-safety", "fusionbench")  # fmt: skip
    assert main(["-q", *argv]) == 0
    record = json.loads((out / "run_config.json").read_text())["evaluation"]["protocol"]
    assert record == {"name": "mergebench", "benchmark_data": str(benchmark_data.resolve()),
                      "allow_code_execution": True}  # fmt: skip
    merged = json.loads((out / "ta" / "metrics.json").read_text())["mergebench"]
    codes = [c.name for d in DOMAINS for c in d.code]
    assert set(merged["tasks"]) == {*harness_task_names(), *codes}  # every task: 17 harness tasks, 2 coding
    for d in DOMAINS:  # every metric a domain's score reads was measured
        for t in d.harness:
            assert t.metric in merged["tasks"][t.name], (t.name, merged["tasks"][t.name])
    multilingual = [merged["tasks"][t.name]["acc,none"] for t in domain("multilingual").harness]
    assert merged["domains"]["multilingual"] == pytest.approx(fmean(multilingual))
    assert merged["tasks"]["humanevalplus"]["samples"] == 10 and merged["tasks"]["mbppplus"]["problems"] == 1
    # the model ends every generation at once: no answer, no passing program
    assert merged["domains"]["math"] == 0.0 and merged["domains"]["coding"] == 0.0
    assert list(merged["domains"]) == list(DOMAIN_NAMES) and merged["safety"] == SAFETY_VARIANT
    assert merged["average"] == pytest.approx(fmean(merged["domains"].values()))
    experts = json.loads((out / "experts" / "metrics.json").read_text())
    for name in DOMAIN_NAMES:  # each expert on its own domain alone
        assert list(experts[name]["mergebench"]["domains"]) == [name], name
    card = (out / "release" / "README.md").read_text()
    assert "### MergeBench" in card and "merged 60.1, calibrated 62.1" in card and SAFETY_VARIANT in card
    own = fmean(experts[name]["mergebench"]["domains"][name] for name in DOMAIN_NAMES)
    stages = {stage: json.loads((out / stage / "metrics.json").read_text())["mergebench"]["average"]
              for stage in ("zero-shot", "featcal-ta")}  # fmt: skip
    columns = [stages["zero-shot"], own, merged["average"], stages["featcal-ta"]]  # base, expert, merged, calibrated
    assert "| Domain | base | expert | merged | calibrated |" in card
    row = next(line for line in card.splitlines() if line.startswith("| raw average |"))
    assert row == "| raw average | " + " | ".join(f"{100 * v:.1f}" for v in columns) + " |"
    # the tiny experts score 0 on some domains: no ratio to them, no normalised average (the headline)
    assert "| normalised average (MergeBench's) | – | – | – | – |" in card
    released = json.loads((out / "release" / "metrics.json").read_text())["mergebench"]
    assert released["headline"] == "normalized" and released["normalized"] is None
    assert released["average"] == stages["featcal-ta"] and set(released["experts"]) == set(DOMAIN_NAMES)
    assert "- coding:" not in card and "- safety: wildguardtest" in card  # coding ran; MergeBench's safety did not
    index = yaml.safe_load(card.split("---")[1])["model-index"][0]["results"]
    mergebench = [r for r in index if r["dataset"]["type"] == "mergebench"]
    shown = {m["type"]: m["value"] for r in mergebench for m in r["metrics"]}
    assert shown["average"] == round(100 * stages["featcal-ta"], 2) and shown["math"] == 0.0  # the released stage


@pytest.mark.slow
def test_the_protocol_reads_every_benchmark_from_the_hub_under_its_real_id(
    eos_world, benchmark_data, tmp_path, punkt_tab_installed
):
    """Over HTTP against the Hub double: the base and the experts under MergeBench's ids, the calibration sets,
    and every benchmark dataset under its own id (``openai/gsm8k``, ``evalplus/humanevalplus``, ...); the run
    starts from an empty ``HF_HOME`` and names no local copy."""
    from tests.support.hub_double import HubDouble
    from tests.support.hub_world import featcal_cli, user_env
    from tests.support.mergebench_data import write_hub_cards
    from tests.support.tiny_lm_world import TASKS, rows, write_text_dataset

    base, experts = eos_world
    benchmarks = write_hub_cards(benchmark_data)
    run = tmp_path / "run"
    with HubDouble() as hub:
        hub.publish_folder("meta-llama/Llama-3.2-3B", base, summary="Upload model")
        for i, task in enumerate(TASKS):
            hub.publish_folder(f"MergeBench/Llama-3.2-3B_{task}", experts[task], summary="Upload model")
            write_text_dataset(tmp_path / "val" / task, rows(task, seed=200 + i))
            hub.publish_folder(f"MergeBench/{task}_val", tmp_path / "val" / task, repo_type="dataset")
        for repo_id in benchmarks:
            hub.publish_folder(repo_id, benchmark_data / repo_id, repo_type="dataset")
        args = [
            "run", "--suite", "mergebench", "--backbone", "llama-3.2-3b", "--skip-featcal", "--device", "cpu",
            "--num-calibration-examples", "8", "--max-eval-samples", "2", "--eval-max-new-tokens", "4", "--threads",
            "1", "--eval-protocol", "mergebench", "--allow-code-execution", "--mergebench-safety", "fusionbench",
            "--output-dir", str(run),
        ]  # fmt: skip
        env = user_env(hub.url, tmp_path / "user") | {"NLTK_DATA": str(punkt_tab_installed)}
        result = featcal_cli(args, env, timeout=900)
        served = list(hub.served)
    assert result.returncode == 0, result.stderr[-4000:]
    scores = json.loads((run / "ta" / "metrics.json").read_text())["mergebench"]
    assert list(scores["domains"]) == list(DOMAIN_NAMES) and None not in scores["domains"].values()
    fetched = {s.path for s in served if s.method == "GET" and s.status == 200}
    for repo_id in benchmarks:  # 11 datasets: each read from the Hub under its real id
        assert any(p.startswith(f"/datasets/{repo_id}/resolve/") for p in fetched), repo_id


@pytest.mark.parametrize("family", ["seq2seq", "clip_vision"])
@pytest.mark.parametrize("protocol", [False, True])
def test_a_mergebench_run_of_another_family_s_tasks_is_refused_before_any_work(tmp_path, capsys, family, protocol):
    """``--suite mergebench`` given a T5 data file or a CLIP tasks file (whose tasks would otherwise run as that
    family's, the suite's protocol and paper numbers silently left aside) is refused in one line, exit 2, before
    any model is looked for (the files name models that do not exist): nothing is written."""
    (tmp_path / "rows.jsonl").write_text('{"sentence": "w1 w2", "label": 0}\n')
    if family == "seq2seq":
        entry = {"dataset": str(tmp_path / "rows.jsonl"), "input": "{sentence}", "target": "{label}",
                 "labels": ["w1", "w2"]}  # fmt: skip
        (tmp_path / "data.yaml").write_text(json.dumps({"experts": {str(tmp_path / "no-expert"): entry}}))
        given = ["--data", str(tmp_path / "data.yaml"), "--base-model-id", str(tmp_path / "no-base")]
        holds = "holds T5 encoder-decoder tasks (seq2seq)"
    else:
        task = {
            "dataset": {"path": "no-data"},
            "expert": "no-expert",
            "classnames": ["a", "b"],
            "templates": ["a photo of a {}."],
        }
        (tmp_path / "tasks.json").write_text(json.dumps({"base_model": "no-base", "tasks": {"cars": task}}))
        given = ["--tasks-file", str(tmp_path / "tasks.json")]
        holds = "holds CLIP vision tower tasks (clip_vision)"
    out = tmp_path / "run"
    extra = ["--eval-protocol", "mergebench", "--allow-code-execution"] if protocol else []
    before = sorted(p.name for p in tmp_path.iterdir())
    message = _error(capsys, ["run", "--suite", "mergebench", *given, "--device", "cpu", "--output-dir", str(out),
                              *extra])  # fmt: skip
    assert message.startswith("featcal: error: --suite 'mergebench' is invalid") and holds in message, message
    assert "leave out --suite mergebench" in message and "causal_lm" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not out.exists()


def test_a_protocol_run_without_nltk_s_punkt_tab_is_refused_before_any_work(
    eos_world, benchmark_data, data_file, tmp_path, capsys, monkeypatch
) -> None:
    """ifeval's checks read nltk's punkt_tab; offline without it the harness would fail when scoring, after every
    ifeval prompt was generated: the run is refused in one line, exit 2, naming the data, the folders searched and
    the command that gets it; nothing is written, nothing downloaded."""
    import nltk

    empty = tmp_path / "no-nltk-data"
    empty.mkdir()
    monkeypatch.setattr(nltk.data, "path", [str(empty)])
    monkeypatch.setattr(nltk, "download", lambda *args, **kwargs: pytest.fail("downloaded"))
    out = tmp_path / "run"
    message = _error(capsys, _run_args(eos_world, benchmark_data, data_file, out, "--allow-code-execution"))
    assert "needs nltk's punkt_tab data" in message and str(empty) in message, message
    assert "`python -m nltk.downloader punkt_tab`" in message and "NLTK_DATA" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-nltk-data"] and not any(empty.iterdir())


def test_a_protocol_run_whose_sandbox_cannot_have_numpy_is_refused_before_any_work(
    eos_world, benchmark_data, data_file, tmp_path, capsys, monkeypatch
) -> None:
    """The coding domain's programs import numpy: ``FEATCAL_SANDBOX_SITE`` naming a folder without it is refused
    in one line, exit 2, before any model is loaded or file written (before, after every other domain ran)."""
    empty = tmp_path / "no-numpy"
    empty.mkdir()
    monkeypatch.setenv(coding.SANDBOX_SITE, str(empty))
    out = tmp_path / "run"
    message = _error(capsys, _run_args(eos_world, benchmark_data, data_file, out, "--allow-code-execution"))
    assert message == (
        f"featcal: error: No package 'numpy' installed in {empty} to show to the sandbox's programs "
        f"(FEATCAL_SANDBOX_SITE={empty}; MergeBench's coding tests import numpy; docs/code-eval.md)."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["no-numpy"] and not any(empty.iterdir())


def test_ifeval_s_checks_that_read_punkt_tab_score_with_the_data_the_check_asks_for(monkeypatch, tmp_path) -> None:
    """The instructions whose check tokenizes with Punkt (sentences, words) score a response with the punkt_tab
    built here, and fail with LookupError without it: what the check before any work prevents. (The rehearsal's
    model answers nothing, and ifeval checks no instruction on an empty response.)"""
    import nltk
    from lm_eval.tasks.ifeval import instructions_util
    from lm_eval.tasks.ifeval.utils import process_results

    def forget() -> None:  # nltk and ifeval keep the tokenizers they loaded
        nltk.data._resource_cache.clear()
        nltk.tokenize._get_punkt_tokenizer.cache_clear()
        instructions_util._get_sentence_tokenizer.cache_clear()

    doc = {
        "key": 1,
        "prompt": "Write three sentences, one word in capitals.",
        "instruction_id_list": ["length_constraints:number_sentences", "change_case:capital_word_frequency"],
        "kwargs": [
            {"num_sentences": 3, "relation": "at least"},
            {"capital_frequency": 1, "capital_relation": "at least"},
        ],
    }
    response = "Dr. Smith came home. He was TIRED. Then he slept."  # "Dr." ends no sentence: an abbreviation
    empty = tmp_path / "none"
    empty.mkdir()
    forget()
    monkeypatch.setattr(nltk.data, "path", [str(empty)])
    with pytest.raises(LookupError, match="punkt_tab"):
        process_results(doc, [response])
    forget()
    monkeypatch.setattr(nltk.data, "path", [str(write_punkt_tab(tmp_path / "nltk"))])
    scores = process_results(doc, [response])
    assert scores["prompt_level_strict_acc"] is True and scores["inst_level_strict_acc"] == [True, True]
    assert instructions_util.count_sentences(response) == 3
    short = process_results({**doc, "kwargs": [{"num_sentences": 4, "relation": "at least"}, doc["kwargs"][1]]},
                            [response])  # fmt: skip
    assert short["inst_level_strict_acc"] == [False, True]
    forget()
