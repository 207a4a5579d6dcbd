"""`featcal code-eval`: HumanEval+-format problems and completions scored in the sandbox; what it refuses
before any program runs (one line, exit status 2, nothing written)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from featcal.cli import main
from featcal.errors import InputError
from featcal.sandbox.files import read_completions, read_problems

PROBLEMS = [
    {"task_id": "t/add", "prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == 5\n",
     "entry_point": "add", "canonical_solution": "    return a + b\n"},
    {"task_id": "t/mbpp", "prompt": "", "test": "assert double(4) == 8\n", "entry_point": None},
]  # fmt: skip
SAMPLES = [
    {"task_id": "t/add", "completion": "    return a + b\n"},
    {"task_id": "t/add", "completion": "    return a - b\n"},
    {"task_id": "t/mbpp", "completion": "def double(x):\n    return 2 * x\n"},
    {"task_id": "t/mbpp", "completion": "def double(x):\n    return 2 * x\n"},
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return path


@pytest.fixture
def files(tmp_path):
    marker = tmp_path / "ran"
    samples = [
        *SAMPLES[:3],
        {"task_id": "t/mbpp", "completion": f"open({str(marker)!r}, 'w')\n" + SAMPLES[3]["completion"]},
    ]
    return write_jsonl(tmp_path / "problems.jsonl", PROBLEMS), write_jsonl(tmp_path / "samples.jsonl", samples)


def run(capsys, argv):
    code = main(["-q", "code-eval", *argv])
    out, err = capsys.readouterr()
    return code, out.strip().splitlines(), err.strip().splitlines()


def test_code_eval_prints_and_writes_pass_at_k(files, tmp_path, capsys):
    problems, samples = files
    report = tmp_path / "report.json"
    argv = ["--problems", str(problems), "--completions", str(samples), "--allow-code-execution"]
    code, out, err = run(capsys, [*argv, "--k", "2", "--timeout", "5", "--output", str(report)])
    assert code == 0 and err == []
    # t/add: 1 of 2 passes; t/mbpp: the sample writing outside its folder fails, the other passes
    assert out[:2] == ["2 problems, 4 programs: 2 passed, 2 failed, 0 timeout, 0 killed", "pass@2: 1.0000"]
    written = json.loads(report.read_text())
    assert written["kind"] == "featcal code-eval" and written["pass@2"] == 1.0
    assert [run["status"] for run in written["problems"]["t/add"]] == ["passed", "failed"]
    refused = ("FileNotFoundError", "PermissionError", "OSError: [Errno 30] Read-only file system")
    assert written["problems"]["t/mbpp"][1]["reason"].startswith(tuple(f"exit status 1: {e}" for e in refused))
    assert not (tmp_path / "ran").exists()
    code, out, _ = run(capsys, [*argv, "--output", str(report)])  # its own report may be replaced
    assert code == 0 and out[1] == "pass@1: 0.5000" and json.loads(report.read_text())["pass@1"] == 0.5


def test_code_eval_runs_nothing_without_the_flag(files, tmp_path, capsys):
    problems, samples = files
    report = tmp_path / "report.json"
    code, out, err = run(capsys, ["--problems", str(problems), "--completions", str(samples), "--output", str(report)])
    assert code == 2 and out == [] and len(err) == 1
    assert err[0] == (
        "featcal: error: Running model-generated code is off: it runs, in featcal's sandbox (docs/code-eval.md), "
        "only when --allow-code-execution is given."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["problems.jsonl", "samples.jsonl"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "bad_line",
            "samples.jsonl line 2 is not JSON (Expecting property name enclosed in double quotes): "
            "write one object a line.",
        ),
        ("unknown_task", "problems.jsonl has: 't/typo'; fix or remove those lines."),
        (
            "too_few",
            "holds 2 completion(s) of 't/add'; pass@3 needs at least 3 of each problem: "
            "generate more samples, or lower --k.",
        ),
        ("not_a_report", "exists and is not a featcal code-eval report: name a new file, or remove it first."),
        ("no_entry", "problems.jsonl line 1: 'prompt' must be a string, not NoneType."),
    ],
)
def test_code_eval_refuses_bad_input_before_running(files, tmp_path, capsys, change, message):
    problems, samples = files
    report = tmp_path / "report.json"
    k = "1"
    if change == "bad_line":
        samples.write_text(json.dumps(SAMPLES[0]) + "\n{not json\n")
    elif change == "unknown_task":
        write_jsonl(samples, [*SAMPLES, {"task_id": "t/typo", "completion": ""}])
    elif change == "too_few":
        k = "3"
    elif change == "not_a_report":
        report.write_text("my notes")
    else:
        write_jsonl(problems, [{**PROBLEMS[0], "prompt": None}])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    argv = ["--problems", str(problems), "--completions", str(samples), "--allow-code-execution", "--k", k]
    code, out, err = run(capsys, [*argv, "--output", str(report)])
    assert code == 2 and out == [] and len(err) == 1 and err[0].endswith(message), err
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # nothing ran, nothing written


def test_readers_refuse_repeated_problems_and_non_utf8(tmp_path):
    problems = write_jsonl(tmp_path / "p.jsonl", [PROBLEMS[0], PROBLEMS[0]])
    with pytest.raises(InputError, match=r"line 2: task_id 't/add' appears twice: keep one\.$"):
        read_problems(problems)
    (tmp_path / "s.jsonl").write_bytes(b'{"task_id": "t/add", "completion": "\xff"}\n')
    with pytest.raises(InputError, match=r"is not UTF-8 text \(byte 36\): save it as UTF-8\.$"):
        read_completions(tmp_path / "s.jsonl")
    assert read_completions(write_jsonl(tmp_path / "ok.jsonl", SAMPLES)) == {
        "t/add": ["    return a + b\n", "    return a - b\n"],
        "t/mbpp": ["def double(x):\n    return 2 * x\n"] * 2,
    }
