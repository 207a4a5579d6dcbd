"""`featcal run --suite glue8 --backbone flan-t5-base`, end to end over HTTP against the Hub double.

Tiny stand-ins (tests/support/tiny_glue_world.py) are served under the real ids the suite names:
``google/flan-t5-base``, ``tanganke/flan-t5-base_glue-<task>`` and ``nyu-mll/glue``, one dataset repository
with GLUE's twelve configurations in the Hub's layout (``<config>/<split>-00000-of-00001.parquet`` and a README
declaring them), their splits (MNLI's ``validation_matched``), column names and label types. The run starts
from an empty ``HF_HOME`` in a fresh process, as a user's would, and evaluates the base and the experts too;
``featcal push`` then publishes its release, and a fresh process loads it back over HTTP with
``T5ForConditionalGeneration.from_pretrained`` and ``AutoTokenizer`` and generates (transformers 5 has no
``text2text-generation`` pipeline). Last, a second run into a new folder with ``HF_HUB_OFFLINE=1`` reads every
configuration from the cache the first one filled.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import pytest

from featcal.suites import suite_table, suite_task_names
from tests.support.hub_double import Account, HubDouble
from tests.support.hub_world import featcal_cli, same_tensors, user_env
from tests.support.tiny_glue_world import CONFIGS, GLUE

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")]

TOKEN = "hf_yanggangu_write"
RELEASE_REPO = "yanggangu/flan-t5-base-glue8-featcal"
SMALL = [
    "--device", "cpu", "--num-calibration-examples", "8", "--calibration-batch-size", "8", "--eval-num-workers", "0",
    "--max-eval-samples", "8", "--threads", "1",
]  # fmt: skip
TEST_SPLITS = {task: "validation_matched" if task == "mnli" else "validation" for task in suite_task_names("glue8")}


@pytest.fixture(scope="module")
def rehearsal(glue8_world, tmp_path_factory):
    home = tmp_path_factory.mktemp("user")
    run = home / "run"
    with HubDouble() as hub:
        hub.add_token(TOKEN, Account("yanggangu"))
        glue8_world.publish(hub)
        args = ["run", "--suite", "glue8", "--backbone", "flan-t5-base", "--eval-zero-shot", "--eval-experts"]
        result = featcal_cli([*args, *SMALL, "--output-dir", str(run)], user_env(hub.url, home))
        served = list(hub.served)
        assert result.returncode == 0, result.stderr[-4000:]
        pushed = featcal_cli(["push", str(run), "--repo", RELEASE_REPO], user_env(hub.url, home, token=TOKEN))
        assert pushed.returncode == 0, pushed.stderr[-4000:]
        loaded = subprocess.run(
            [sys.executable, "-c", _LOAD, RELEASE_REPO, str(run / "featcal-ta")], capture_output=True, text=True,
            timeout=300, env=user_env(hub.url, tmp_path_factory.mktemp("reader")),
        )  # fmt: skip
        assert loaded.returncode == 0, loaded.stderr[-4000:]
        glue_commit = hub.store("dataset")[GLUE].refs["main"]
        commits = [c for c in hub.commits if c.repo_id == RELEASE_REPO]
        asked = len(hub.served)
        args = ["run", "--suite", "glue8", "--backbone", "flan-t5-base", "--skip-eval-ta", "--no-export", *SMALL]
        args += ["--output-dir", str(home / "offline")]
        offline = featcal_cli(args, user_env(hub.url, home, offline=True))
        assert offline.returncode == 0, offline.stderr[-4000:]
        assert len(hub.served) == asked, hub.served[asked:]  # offline: nothing asked of the Hub
    return run, result, served, loaded.stdout, glue_commit, commits


# The release from the Hub against the calibrated stage's folder: the same logits, the base's tokenizer.
_LOAD = """
import sys, torch
from transformers import AutoTokenizer, T5ForConditionalGeneration
model = T5ForConditionalGeneration.from_pretrained(sys.argv[1]).eval()
stage = T5ForConditionalGeneration.from_pretrained(sys.argv[2]).eval()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
text = "Given the sentence 'w1 w2 w3', determine the sentiment. Is it positive or negative?"
inputs = tokenizer([text], return_tensors="pt")
with torch.no_grad():
    generated = model.generate(**inputs, max_length=10, do_sample=False, num_beams=1)
    same = torch.equal(model(**inputs, decoder_input_ids=generated).logits,
                       stage(**inputs, decoder_input_ids=generated).logits)
unknown = tokenizer.unk_token_id in inputs["input_ids"][0].tolist()
print(type(model).__name__, model.lm_head.weight is not model.shared.weight, same, unknown, tokenizer.eos_token)
"""


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_run_records_flan_t5_its_experts_and_glue_s_configurations_and_splits(rehearsal):
    run, result, _, _, glue_commit, _ = rehearsal
    record = json.loads((run / "run_config.json").read_text())
    tasks = suite_task_names("glue8")
    assert (record["suite"], record["backbone"], record["family"]) == ("glue8", "flan-t5-base", "seq2seq")
    assert record["base_model_id"] == "google/flan-t5-base"
    assert record["experts"] == {t: f"tanganke/flan-t5-base_glue-{t}" for t in tasks}
    assert record["merge"]["params"] == {"scaling_factor": 0.3}
    for task in tasks:
        dataset = record["tasks_table"][task]["dataset"]
        assert (dataset["path"], dataset["name"]) == (GLUE, task), task
        assert (dataset["train_split"], dataset["test_split"]) == ("train", TEST_SPLITS[task]), task
    assert record["hub_commits"]["datasets"] == dict.fromkeys(tasks, glue_commit)
    for task in tasks:
        assert f"\n{task} " in f"\n{result.stdout}", task  # a row per task in the printed table


def test_the_double_served_each_expert_and_each_configuration_s_train_and_evaluation_split(rehearsal, glue8_world):
    _, _, served, _, _, _ = rehearsal
    table = suite_table("glue8", "flan-t5-base")
    fetched = {s.path for s in served if s.method == "GET" and s.status == 200}
    base = glue8_world.models[table.base_model] / "model.safetensors"
    assert f"/cdn-lfs/models/google/flan-t5-base/{_sha256(base)}" in fetched
    glue = glue8_world.datasets[GLUE]
    for task in suite_task_names("glue8"):
        expert = glue8_world.models[table.tasks[task].expert] / "model.safetensors"
        assert f"/cdn-lfs/models/tanganke/flan-t5-base_glue-{task}/{_sha256(expert)}" in fetched, task
        for split in ("train", TEST_SPLITS[task]):
            parquet = glue / task / f"{split}-00000-of-00001.parquet"
            assert f"/cdn-lfs/datasets/{GLUE}/{_sha256(parquet)}" in fetched, (task, split)
    unread = {c.name for c in CONFIGS} - set(TEST_SPLITS)
    assert unread == {"ax", "mnli_matched", "mnli_mismatched", "wnli"}
    resolved = [s.path.split("/") for s in served if s.path.startswith(f"/datasets/{GLUE}/resolve/")]
    assert not [p for p in resolved if len(p) > 7 and p[6] in unread]  # no file of a configuration glue8 never reads
    assert not [s.path for s in served if s.path.endswith((".bin", ".h5", ".msgpack"))]


def test_every_evaluation_scores_each_task_by_its_metric(rehearsal):
    run, _, _, _, _, _ = rehearsal
    for stage in ("zero-shot", "experts", "ta", "featcal-ta"):
        metrics = json.loads((run / stage / "metrics.json").read_text())
        for task in suite_task_names("glue8"):
            entry = metrics[task]
            assert entry["metric"] == ("spearman" if task == "stsb" else "exact_match"), (stage, task)
            assert entry["num_samples"] == 8 and -1 <= entry[entry["metric"]] <= 1, (stage, task, entry)
            assert entry["loss"] > 0, (stage, task, entry)
        assert set(metrics["average"]) >= {"accuracy", "loss"}, stage


def test_the_pushed_release_loads_back_over_http_as_the_calibrated_model(rehearsal):
    run, _, _, loaded, _, commits = rehearsal
    # its own LM head, the calibrated stage's logits exactly, no unknown token in a glue8 input, T5's </s>
    assert loaded.split() == ["T5ForConditionalGeneration", "True", "True", "False", "</s>"]
    assert len(commits) == 1 and {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(
        commits[0].paths
    )
    config = json.loads((run / "release" / "config.json").read_text())
    assert config["tie_word_embeddings"] is False  # as FLAN-T5's own config says
    card = (run / "release" / "README.md").read_text()
    assert "pipeline_tag: text2text-generation" in card and "- google/flan-t5-base" in card
    assert "datasets:\n- nyu-mll/glue\n" in card
    assert "config: mnli\n      split: validation_matched[:8]" in card
    assert "type: spearmanr" in card
    assert "license: other" in card and "none was given" in card  # not CLIP's MIT: FLAN-T5's is not featcal's to say


def test_an_offline_run_reads_each_configuration_from_the_cache_and_calibrates_alike(rehearsal):
    run, _, _, _, _, _ = rehearsal
    offline = run.parent / "offline"
    assert same_tensors(run / "featcal-ta" / "model.safetensors", offline / "featcal-ta" / "model.safetensors")
    online, cached = (json.loads((r / "featcal-ta" / "metrics.json").read_text()) for r in (run, offline))
    assert {t: online[t] for t in TEST_SPLITS} == {t: cached[t] for t in TEST_SPLITS}
