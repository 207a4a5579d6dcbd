"""LOT Merging as a repair: its linears' closed form against a float64 least-squares oracle (its norms':
tests/test_lot_norms.py), a merge equal to its one expert as a fixed point, the linears-only variant,
`featcal calibrate --method lot` on a tiny CLIP and a tiny Llama (what it records; the Llama's result
exports), and what it refuses before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from featcal.cli import main
from featcal.distributed import SINGLE
from featcal.merging.regmean_solve import RegMeanSystem
from featcal.repairs.catalog import get_repair
from tests.support.tiny_decoder import save_model, texts, tokenizer

F = Path(__file__).parent / "fixtures" / "tiny-clip-3task"
DRAW = ["--num-calibration-examples", "8", "--calibration-batch-size", "4", "--device", "cpu"]
BASE = ["--base-model-id", str(F / "base")]


# --- the closed form ----------------------------------------------------------------------------------


def lot_by_lstsq(xs: list[torch.Tensor], w0: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """The oracle: W_0 + the minimum-norm T of min_T Σ_t ‖X_t Tᵀ − X_t T_tᵀ‖² (T_t = W_t − W_0), by LAPACK's
    gelsd on the tasks' rows stacked."""
    a = torch.cat(xs)
    b = torch.cat([x @ (w - w0).T for x, w in zip(xs, ws)])
    return w0 + torch.linalg.lstsq(a, b, driver="gelsd").solution.T


def lot_system(xs: list[torch.Tensor], w0: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """featcal's solve: each task's Gram summed over its rows, folded in as RegMean folds it (ratio 1)."""
    system = RegMeanSystem.empty(w0.shape[1], w0.shape[0], device="cpu")
    for x, w in zip(xs, ws):
        system.add_task(x.T @ x, w, 1.0)
    return system.solve_update(w0)


@pytest.mark.parametrize("rows", [(40, 9, 25), (3, 2, 4)])  # full column rank; rank-deficient (9 < 12 inputs)
def test_the_closed_form_equals_the_least_squares_oracle_in_float64(rows) -> None:
    g = torch.Generator().manual_seed(sum(rows))
    d_in, d_out = 12, 5
    xs = [torch.randn(n, d_in, generator=g, dtype=torch.float64) * (1 + i) for i, n in enumerate(rows)]
    w0 = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    ws = [w0 + 0.1 * torch.randn(d_out, d_in, generator=g, dtype=torch.float64) for _ in rows]
    solved = lot_system(xs, w0, ws)
    assert torch.allclose(solved, lot_by_lstsq(xs, w0, ws), rtol=0, atol=1e-10)
    # where no task's input reaches (the null space of Σ G_t), W_0 is kept, not zeroed
    basis = torch.linalg.svd(torch.cat(xs)).Vh
    null = basis[sum(rows) :]
    if len(null):
        assert torch.allclose((solved - w0) @ null.T, torch.zeros(d_out, len(null), dtype=torch.float64), atol=1e-10)


def test_tasks_weigh_by_their_token_counts_not_equally() -> None:
    """Σ_t X_tᵀX_t: a task with more rows pulls harder (a mean Gram per task, RegMean's, would not)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 3, generator=g, dtype=torch.float64)
    w0, w1, w2 = (torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(3))
    once, twice = lot_system([x, x], w0, [w1, w2]), lot_system([x, torch.cat([x, x])], w0, [w1, w2])
    assert torch.allclose(once, (w1 + w2) / 2, atol=1e-12)  # same features: the plain mean
    assert torch.allclose(twice, (w1 + 2 * w2) / 3, atol=1e-12)


def lot_from_streams(xs: list[torch.Tensor], w0: torch.Tensor, ws: list[torch.Tensor]) -> torch.Tensor:
    """featcal's LOT as a layer's run computes it: float32 inputs ``[examples, seq, d]`` per task, their Gram
    accumulated by the input group of :mod:`featcal.merging.regmean_layers`, solved around ``w0``."""
    from featcal.merging.regmean_layers import _InputGroup

    linear = torch.nn.Linear(w0.shape[1], w0.shape[0], bias=False)
    group = _InputGroup(["fc"], {"fc": linear}, torch.float32, torch.device("cpu"), exact=True)
    for x, w in zip(xs, ws):
        linear.weight.data.copy_(w)
        group.add(x, None)
        group.fold({"fc": linear}, 1.0, SINGLE, summed=True)
    return group.solved({"fc": linear}, "", {"fc.weight": w0.double()})[0]["fc.weight"].double()


def test_float32_features_spanning_few_directions_are_solved_as_the_float64_oracle_solves_them() -> None:
    """A decoder's first layer reads token embeddings: few distinct vectors, so Σ X_tᵀX_t is singular. Its
    Gram from float32 products had eigenvalues of rounding noise (~1e-7 of the largest) where it is zero,
    which the pseudo-inverse inverted: weights ~1e3 times the experts' (lm5's exact match 0 on every task)."""
    g = torch.Generator().manual_seed(7)
    d_in, d_out, vocab = 48, 6, 12
    embeddings = 30 * torch.randn(vocab, d_in, generator=g)  # norms ~2e2, as an LM's hidden states' are
    xs = [embeddings[torch.randint(vocab, (8, 25), generator=g)] for _ in range(3)]  # rank 12 of 48, exactly
    w0 = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    ws = [w0 + 0.05 * torch.randn(d_out, d_in, generator=g) for _ in xs]
    rows = [x.reshape(-1, d_in).double() for x in xs]
    want = lot_by_lstsq(rows, w0.double(), [w.double() for w in ws])
    solved = lot_from_streams(xs, w0, ws)
    assert solved.norm() < 2 * max(w.norm() for w in ws)
    assert torch.allclose(solved, want, rtol=0, atol=1e-6), float((solved - want).abs().max())


def test_lot_is_registered_as_a_releasable_repair_that_reads_data() -> None:
    lot = get_repair("lot")
    assert (lot.uses_data, lot.releasable, lot.kernel) == (True, True, None)
    assert [(p.name, p.type, p.default) for p in lot.params] == [("norms", bool, True)]
    assert lot.reference_url == "https://arxiv.org/abs/2505.23859"


# --- from the command line: a tiny CLIP ---------------------------------------------------------------


@pytest.fixture(scope="module")
def clip(tmp_path_factory) -> Path:
    """The fixture's tasks file (absolute paths), a Task Arithmetic merge (κ = 0.3) of its three experts,
    one of expert t0 alone (κ = 1), and LOT of the first."""
    root = tmp_path_factory.mktemp("lot")
    table = json.loads((F / "tasks.json").read_text())
    for entry in table["tasks"].values():
        entry["expert"] = str(F / entry["expert"])
        entry["dataset"]["path"] = str(F / entry["dataset"]["path"])
    (root / "tasks.json").write_text(json.dumps(table))
    argv = ["-q", "merge", "--tasks-file", str(root / "tasks.json"), "--base-model-id", str(F / "base"), *DRAW[-2:]]
    assert main([*argv, "--ta-scaling-factor", "0.3", "--output", str(root / "ta")]) == 0
    assert main([*argv, "--tasks", "t0", "--ta-scaling-factor", "1", "--output", str(root / "t0")]) == 0
    lot = ["-q", "calibrate", "--method", "lot", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW]
    assert main([*lot, "--merged", str(root / "ta"), "--output", str(root / "ta-lot")]) == 0
    return root


def linear_weights(state: dict[str, torch.Tensor]) -> list[str]:
    """The keys of the weights of the encoder layers' linears (what LOT solves)."""
    return [k for k in state if ".layers." in k and k.endswith(".weight") and state[k].dim() == 2]


def norm_tensors(state: dict[str, torch.Tensor]) -> list[str]:
    """The keys of the encoder layers' LayerNorm scales and shifts (what LOT solves by default too)."""
    return [k for k in state if ".layers." in k and ".layer_norm" in k]


def test_lot_solves_the_linears_and_norms_and_keeps_the_merge_s_other_tensors(clip) -> None:
    merged, repaired = load_file(clip / "ta" / "model.safetensors"), load_file(clip / "ta-lot" / "model.safetensors")
    solved = linear_weights(merged) + norm_tensors(merged)
    assert len(solved) == 2 * 6 + 2 * 4 and list(repaired) == list(merged)  # 2 layers × (q, k, v, out, fc1, fc2;
    assert all(not torch.equal(repaired[k], merged[k]) for k in solved)  # layer_norm1/2's weight and bias)
    assert all(torch.equal(repaired[k], merged[k]) for k in merged if k not in solved)
    recipe = json.loads((clip / "ta-lot" / "featcal_recipe.json").read_text())
    (entry,) = recipe["repairs"]
    assert recipe["kind"] == "repair" and entry["method"] == "lot" and entry["params"]["norms"] is True
    draw = entry["params"]["calibration"]
    assert (draw["num_calibration_examples"], draw["calibration_batch_size"], draw["seed"]) == (8, 4, 42)
    assert recipe["merge"] == json.loads((clip / "ta" / "featcal_recipe.json").read_text())["merge"]


def test_norms_false_keeps_the_merge_s_norms_and_the_same_linears(clip, tmp_path) -> None:
    """The linears-only variant: the linears are those of the default (their solve reads the experts' streams,
    which no norm of the result touches), every norm the merge's; the choice is recorded."""
    out = tmp_path / "ta-lot-linears"
    argv = ["-q", "calibrate", "--method", "lot", "--tasks-file", str(clip / "tasks.json"), *BASE, *DRAW]
    assert main([*argv, "--merged", str(clip / "ta"), "--output", str(out), "--repair-param", "norms=false"]) == 0
    merged, default = load_file(clip / "ta" / "model.safetensors"), load_file(clip / "ta-lot" / "model.safetensors")
    linears_only = load_file(out / "model.safetensors")
    assert all(torch.equal(linears_only[k], default[k]) for k in linear_weights(merged))
    assert all(torch.equal(linears_only[k], merged[k]) for k in merged if k not in linear_weights(merged))
    (entry,) = json.loads((out / "featcal_recipe.json").read_text())["repairs"]
    assert entry["params"]["norms"] is False


def test_a_merge_equal_to_its_one_expert_is_a_fixed_point(clip, tmp_path) -> None:
    out = tmp_path / "t0-lot"
    argv = [
        "-q",
        "calibrate",
        "--method",
        "lot",
        "--tasks-file",
        str(clip / "tasks.json"),
        "--tasks",
        "t0",
        *BASE,
        *DRAW,
    ]
    assert main([*argv, "--merged", str(clip / "t0"), "--output", str(out)]) == 0
    expert, repaired = load_file(F / "experts" / "t0" / "model.safetensors"), load_file(out / "model.safetensors")
    merged = load_file(clip / "t0" / "model.safetensors")
    for key in linear_weights(merged) + norm_tensors(merged):
        want = expert[next(k for k in expert if k.endswith(key.split("vision_model.", 1)[-1]))]
        assert torch.allclose(repaired[key], want, rtol=0, atol=1e-4), key  # 8 × 17 tokens ≥ every input width


def test_the_solved_tensors_do_not_depend_on_the_merge(clip, tmp_path) -> None:
    out = tmp_path / "t0-lot"
    argv = ["-q", "calibrate", "--method", "lot", "--tasks-file", str(clip / "tasks.json"), *BASE, *DRAW]
    assert main([*argv, "--merged", str(clip / "t0"), "--output", str(out)]) == 0  # from another merge
    a, b = load_file(clip / "ta-lot" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in linear_weights(a) + norm_tensors(a))


# --- from the command line: a tiny Llama --------------------------------------------------------------


def test_lot_runs_on_a_tiny_causal_lm(tmp_path) -> None:
    base = save_model(tmp_path / "base", seed=0)
    tokenizer().save_pretrained(tmp_path / "base")
    data = {"max_length": 16, "experts": {}}
    for i, name in enumerate(("math", "coding")):
        expert = tmp_path / f"Llama-tiny_{name}"
        save_model(expert, seed=10 + i, base=base)
        tokenizer().save_pretrained(expert)
        words = texts(20 + i, 40)
        rows = "".join(json.dumps({"query": words[2 * j], "response": words[2 * j + 1]}) + "\n" for j in range(20))
        (tmp_path / f"{name}.jsonl").write_text(rows)
        data["experts"][str(expert)] = {"dataset": f"{name}.jsonl", "text": "{query} {response}"}
    (tmp_path / "data.yaml").write_text(json.dumps(data))
    common = ["--data", str(tmp_path / "data.yaml"), "--device", "cpu"]
    merge = ["-q", "merge", *common, "--base-model-id", str(tmp_path / "base")]
    assert main([*merge, "--output", str(tmp_path / "ta")]) == 0
    assert main(["-q", "calibrate", "--method", "lot", *common, *DRAW, "--merged", str(tmp_path / "ta"),
                 "--output", str(tmp_path / "lot")]) == 0  # fmt: skip
    merged, repaired = (
        load_file(tmp_path / "ta" / "model.safetensors"),
        load_file(tmp_path / "lot" / "model.safetensors"),
    )
    solved = [k for k in merged if k.endswith(("_proj.weight", "input_layernorm.weight", "attention_layernorm.weight"))]
    assert len(solved) == 2 * (7 + 2) and all(not torch.equal(repaired[k], merged[k]) for k in solved)
    assert all(torch.equal(repaired[k], merged[k]) for k in merged if k not in solved)
    assert json.loads((tmp_path / "lot" / "featcal_recipe.json").read_text())["repairs"][0]["method"] == "lot"
    # released as a merge is: the repaired weights, unchanged
    assert main(["-q", "export", str(tmp_path / "lot"), "--repo", "someone/tiny-lot", "--license", "mit"]) == 0
    released = load_file(tmp_path / "lot-release" / "model.safetensors")
    assert all(torch.equal(released[k], repaired[k]) for k in repaired)
    card = (tmp_path / "lot-release" / "README.md").read_text()
    assert "LOT Merging" in card and "norms = True, 8 calibration examples per task, seed 42" in card
    assert "{'" not in card


def test_a_tiny_causal_lm_s_rmsnorms_come_back_as_the_one_expert_s(tmp_path) -> None:
    """One task merged with κ 0.3: LOT gives back the expert's RMSNorm scales, not the merge's (each dimension's
    weighted average of one task vector), with the padding of its texts weighing 0."""
    base = save_model(tmp_path / "base", seed=0)
    tokenizer().save_pretrained(tmp_path / "base")
    expert = tmp_path / "Llama-tiny_math"
    save_model(expert, seed=10, base=base)
    tokenizer().save_pretrained(expert)
    words = texts(20, 40)
    rows = "".join(json.dumps({"query": words[2 * j], "response": words[2 * j + 1]}) + "\n" for j in range(20))
    (tmp_path / "math.jsonl").write_text(rows)
    data = {"max_length": 16, "experts": {str(expert): {"dataset": "math.jsonl", "text": "{query} {response}"}}}
    (tmp_path / "data.yaml").write_text(json.dumps(data))
    common = ["--data", str(tmp_path / "data.yaml"), "--device", "cpu"]
    merge = ["-q", "merge", *common, "--base-model-id", str(tmp_path / "base"), "--ta-scaling-factor", "0.3"]
    assert main([*merge, "--output", str(tmp_path / "ta")]) == 0
    assert main(["-q", "calibrate", "--method", "lot", *common, *DRAW, "--merged", str(tmp_path / "ta"),
                 "--output", str(tmp_path / "lot")]) == 0  # fmt: skip
    repaired, want = load_file(tmp_path / "lot" / "model.safetensors"), load_file(expert / "model.safetensors")
    norms = [k for k in repaired if k.endswith(("input_layernorm.weight", "post_attention_layernorm.weight"))]
    assert len(norms) == 4 and all(torch.allclose(repaired[k], want[k], rtol=0, atol=1e-6) for k in norms)
    merged = load_file(tmp_path / "ta" / "model.safetensors")
    assert all((merged[k] - want[k]).abs().max() > 1e-3 for k in norms)  # the expert's own, not the merge's


# --- refusals -----------------------------------------------------------------------------------------


def run_error(capsys, argv: list[str]) -> tuple[int, list[str]]:
    code = main(["-q", *argv])
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def test_lot_without_calibration_data_is_refused_before_any_work(clip, tmp_path, capsys) -> None:
    root = tmp_path / "w"
    table = json.loads((clip / "tasks.json").read_text())
    shutil.copytree(F / "data" / "t1", root / "t1")
    for parquet in (root / "t1" / "data").glob("train-*"):
        parquet.unlink()
    table["tasks"]["t1"]["dataset"]["path"] = str(root / "t1")
    (root / "tasks.json").write_text(json.dumps(table))
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "lot", "--tasks-file", str(root / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(clip / "ta"), "--output", str(out)])
    assert code == 2 and len(err) == 1 and err[0].startswith("featcal: error: "), err
    assert "t1" in err[0] and "train" in err[0]
    assert not out.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--lambda-ratio", "0.5"], "--lambda-ratio '0.5' is invalid: it must be given only with --method featcal: "
         "lot reads FeatCal's calibration draw (--num-calibration-examples, --seed) but none of its parameters."),
        (["--repair-param", "alpha=0.1"], "Unknown parameter of repair 'lot' ['alpha']"),
        (["--repair-param", "norms=maybe"], "repair 'lot': norms='maybe' is invalid: it must be true or false."),
    ],
)  # fmt: skip
def test_lot_refuses_what_it_would_not_read_before_any_work(clip, tmp_path, capsys, extra, message) -> None:
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "lot", "--tasks-file", str(clip / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(clip / "ta"), "--output", str(out), *extra])
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_featcal_methods_lists_lot_as_needing_data_and_releasable(capsys) -> None:
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    block = text[text.index("\nlot ") :].split("\nsvc ")[0]
    assert "LOT Merging  https://arxiv.org/abs/2505.23859" in block
    assert "needs calibration data: yes" in block and "releasable: yes" in block


def test_lot_on_a_t5_merge_is_refused_in_one_line_before_any_work(tmp_path, capsys) -> None:
    from tests.support import tiny_t5

    base = tiny_t5.save_model(tmp_path / "base", seed=0)
    data = {"max_length": 32, "experts": {}}
    for i, name in enumerate(("sst", "nli")):
        tiny_t5.save_model(tmp_path / f"t5-tiny_glue-{name}", seed=10 + i, base=base)
        rows = [{"sentence": text, "label": j % 2} for j, (text, _) in enumerate(tiny_t5.pairs(20 + i))]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
        data["experts"][str(tmp_path / f"t5-tiny_glue-{name}")] = {
            "dataset": f"{name}.jsonl", "input": "classify: {sentence}", "target": "{label}", "labels": ["w1", "w2"],
        }  # fmt: skip
    (tmp_path / "data.yaml").write_text(json.dumps(data))
    common = ["--data", str(tmp_path / "data.yaml"), "--device", "cpu"]
    merge = ["-q", "merge", *common, "--base-model-id", str(tmp_path / "base")]
    assert main([*merge, "--output", str(tmp_path / "ta")]) == 0
    out = tmp_path / "out"
    capsys.readouterr()  # the fixture's own output
    code, err = run_error(capsys, ["calibrate", "--method", "lot", *common, "--merged", str(tmp_path / "ta"),
                                   "--output", str(out)])  # fmt: skip
    assert code == 2 and len(err) == 1, err
    assert "--method 'lot' is invalid" in err[0] and "family seq2seq: featcal or svc" in err[0]
    assert "encoder-decoder" in err[0] and not out.exists()


def test_lot_on_a_calibrated_folder_is_refused_before_any_work(clip, tmp_path, capsys) -> None:
    calibrated = tmp_path / "calibrated"
    shutil.copytree(clip / "ta", calibrated)
    recipe = json.loads((calibrated / "featcal_recipe.json").read_text())
    recipe["featcal"], recipe["kind"], recipe["seed"] = {"lambda_ratio": 1.0}, "calibration", 42
    (calibrated / "featcal_recipe.json").write_text(json.dumps(recipe))
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "lot", "--tasks-file", str(clip / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(calibrated), "--output", str(out)])
    assert code == 2 and len(err) == 1, err
    assert "is calibrated with FeatCal already: lot repairs a merge" in err[0] and not out.exists()


def test_lot_under_torchrun_is_refused_in_one_line(clip, tmp_path, capsys, monkeypatch) -> None:
    """A world of several processes (as torchrun starts) is refused before any model is read."""
    import contextlib

    import featcal.distributed
    import featcal.resolve

    @contextlib.contextmanager
    def two_processes(device, timeout):
        yield featcal.distributed.World(rank=0, size=2, backend="gloo")

    def read(*args, **kwargs):
        raise AssertionError("no model is read under torchrun")

    monkeypatch.setattr(featcal.distributed, "session", two_processes)
    monkeypatch.setattr(featcal.resolve, "resolve_inputs", read)
    out = tmp_path / "out"
    argv = ["calibrate", "--method", "lot", "--tasks-file", str(clip / "tasks.json"), *BASE, *DRAW]
    code, err = run_error(capsys, [*argv, "--merged", str(clip / "ta"), "--output", str(out)])
    assert code == 2 and err == [
        "featcal: error: featcal calibrate --method lot runs in one process: start it without torchrun."
    ]
    assert not out.exists()


def test_lot_then_featcal_records_the_chain(clip, tmp_path) -> None:
    out = tmp_path / "lot-featcal"
    argv = ["-q", "calibrate", "--merged", str(clip / "ta-lot"), "--tasks-file", str(clip / "tasks.json"), *BASE]
    assert main([*argv, *DRAW, "--output", str(out)]) == 0
    recipe = json.loads((out / "featcal_recipe.json").read_text())
    repaired = json.loads((clip / "ta-lot" / "featcal_recipe.json").read_text())
    assert recipe["kind"] == "calibration" and recipe["repairs"] == repaired["repairs"]
    assert recipe["merge"] == repaired["merge"]
