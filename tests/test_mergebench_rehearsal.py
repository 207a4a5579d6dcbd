"""`featcal run --suite mergebench --backbone llama-3.2-3b`, end to end over HTTP against the Hub double.

Tiny stand-ins (tests/support/tiny_lm_world.py) are served under the real ids the suite names:
``meta-llama/Llama-3.2-3B``, ``MergeBench/Llama-3.2-3B_<task>`` and ``MergeBench/<task>_val`` (one split,
``train``, MergeBench's column names). The run starts from an empty ``HF_HOME`` in a fresh process, as a
user's would, and evaluates the base and the experts too; ``featcal push`` then publishes its release
and ``AutoModelForCausalLM.from_pretrained`` loads it back over HTTP.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from featcal.suites import suite_task_names
from tests.support.hub_double import Account, HubDouble
from tests.support.hub_world import featcal_cli, user_env

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")]

TOKEN = "hf_yanggangu_write"
RELEASE_REPO = "yanggangu/llama-3.2-3b-mergebench-featcal"
SMALL = [
    "--device", "cpu", "--num-calibration-examples", "8", "--calibration-batch-size", "8", "--eval-num-workers", "0",
    "--max-eval-samples", "8", "--eval-max-new-tokens", "6", "--threads", "1",
]  # fmt: skip


@pytest.fixture(scope="module")
def rehearsal(mergebench_world, tmp_path_factory):
    home = tmp_path_factory.mktemp("user")
    run = home / "run"
    with HubDouble() as hub:
        hub.add_token(TOKEN, Account("yanggangu"))
        mergebench_world.publish(hub)
        args = ["run", "--suite", "mergebench", "--backbone", "llama-3.2-3b", "--eval-zero-shot", "--eval-experts"]
        result = featcal_cli([*args, *SMALL, "--output-dir", str(run)], user_env(hub.url, home))
        served = list(hub.served)
        assert result.returncode == 0, result.stderr[-4000:]
        pushed = featcal_cli(["push", str(run), "--repo", RELEASE_REPO], user_env(hub.url, home, token=TOKEN))
        assert pushed.returncode == 0, pushed.stderr[-4000:]
        loaded = subprocess.run(
            [sys.executable, "-c", _LOAD, RELEASE_REPO], capture_output=True, text=True, timeout=300,
            env=user_env(hub.url, tmp_path_factory.mktemp("reader")),
        )  # fmt: skip
        assert loaded.returncode == 0, loaded.stderr[-4000:]
    return run, result, served, loaded.stdout


_LOAD = """
import sys
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print(sum(p.numel() for p in model.parameters()), tokenizer.eos_token)
"""


def test_the_suite_names_merge_bench_s_models_data_and_merge(rehearsal, mergebench_world):
    run, result, served, _ = rehearsal
    record = json.loads((run / "run_config.json").read_text())
    tasks = suite_task_names("mergebench")
    assert (record["suite"], record["backbone"], record["family"]) == ("mergebench", "llama-3.2-3b", "causal_lm")
    assert record["base_model_id"] == "meta-llama/Llama-3.2-3B"
    assert record["experts"] == {t: f"MergeBench/Llama-3.2-3B_{t}" for t in tasks}
    assert record["merge"]["params"] == {"scaling_factor": 0.4, "keep_embeddings": True}
    assert record["tasks_table"]["math"]["answer"] == "boxed"
    fetched = {s.path for s in served if s.method == "GET" and s.status == 200}
    for task in tasks:
        assert any(p.startswith(f"/datasets/MergeBench/{task}_val/resolve/") for p in fetched), task
        assert any(p.startswith(f"/cdn-lfs/models/MergeBench/Llama-3.2-3B_{task}/") for p in fetched), task
    assert run.joinpath("ta", "mergekit_config.yml").exists() is False  # no mergekit equivalent: embeddings kept
    published_base = mergebench_world.models["meta-llama/Llama-3.2-3B"] / "model.safetensors"
    merged, base = load_file(str(run / "ta" / "model.safetensors")), load_file(str(published_base))
    assert merged["model.embed_tokens.weight"].equal(base["model.embed_tokens.weight"])
    assert merged["lm_head.weight"].equal(base["lm_head.weight"])
    assert not merged["model.layers.0.mlp.up_proj.weight"].equal(base["model.layers.0.mlp.up_proj.weight"])
    for task in tasks:
        assert f"\n{task} loss " in f"\n{result.stdout}", task


def test_the_evaluation_is_sane_and_the_card_quotes_the_paper_as_such(rehearsal):
    run, _, _, loaded = rehearsal
    base = json.loads((run / "zero-shot" / "metrics.json").read_text())
    experts = json.loads((run / "experts" / "metrics.json").read_text())
    for task in suite_task_names("mergebench"):
        assert experts[task]["loss"] < base[task]["loss"], task
    card = (run / "release" / "README.md").read_text()
    assert "the FeatCal paper reports a MergeBench average of\n60.10 → 62.10 with FeatCal" in card
    assert "not measured here" in card and "cannot be compared with the losses above" in card
    assert "- coding: humanevalplus and mbppplus" in card and "- safety: wildguardtest" in card
    assert "`mergebench` suite (`llama-3.2-3b`)" in card
    assert "λ, ρ, α and ε are featcal's defaults, those of the CLIP ViT-B/32 reference run" in card
    assert loaded.split()[-1] == "</s>"  # the pushed release loads with its tokenizer over HTTP
