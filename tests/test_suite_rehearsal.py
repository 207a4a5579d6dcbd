"""`featcal run --suite ta14 --backbone b16`, end to end over HTTP against the Hub protocol double.

Tiny stand-ins (tests/support/hub_world.py) are served under the real ids the suite and backbone
name: ``openai/clip-vit-base-patch16``, ``tanganke/clip-vit-base-patch16_<task>`` and the fourteen
datasets with their real ids, configurations, splits (food101's test split is ``validation``),
column names (fer2013's ``jpg`` and ``cls``) and label types (PatchCamelyon's booleans). The run
starts from an empty ``HF_HOME`` in a fresh process, as a user's would.
"""

from __future__ import annotations

import json

import pytest

from featcal.suites import backbone, suite_table, suite_task_names
from tests.support.hub_double import HubDouble
from tests.support.hub_world import SMALL, build_world, featcal_cli, user_env

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")]

SUITE, BACKBONE = "ta14", "b16"


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory):
    standins = build_world(tmp_path_factory.mktemp("standins"), suite=SUITE, backbone=BACKBONE)
    home = tmp_path_factory.mktemp("user")
    run = home / "run"
    with HubDouble() as hub:
        standins.publish(hub)
        args = ["run", "--suite", SUITE, "--backbone", BACKBONE, *SMALL, "--output-dir", str(run)]
        result = featcal_cli(args, user_env(hub.url, home))
        served = list(hub.served)
    assert result.returncode == 0, result.stderr[-4000:]
    return run, result, served


def test_the_suite_and_backbone_choose_the_base_experts_and_tasks(suite_run):
    run, result, served = suite_run
    model = backbone(BACKBONE)
    tasks = suite_task_names(SUITE)
    recorded = json.loads((run / "run_config.json").read_text())
    assert recorded["suite"] == SUITE and recorded["backbone"] == BACKBONE
    assert recorded["base_model_id"] == "openai/clip-vit-base-patch16" == model.base_model
    assert recorded["tasks"] == tasks and len(tasks) == 14
    assert recorded["experts"] == {t: f"tanganke/clip-vit-base-patch16_{t}" for t in tasks}
    assert recorded["tasks_table"]["fer2013"]["dataset"]["image_column"] == "jpg"
    # every repository asked for is one of this backbone's: nothing of ViT-B/32 is fetched
    asked = {s.path for s in served if s.path.startswith("/api/models/")}
    assert asked and not [p for p in asked if "patch32" in p]
    for stage in ("ta", "featcal-ta"):
        metrics = json.loads((run / stage / "metrics.json").read_text())
        assert set(tasks) <= set(metrics), stage
    for task in tasks:
        assert f"\n{task} " in f"\n{result.stdout}", task  # a row per task in the printed table


def test_the_release_card_lists_the_suites_tasks_without_a_made_up_reference(suite_run):
    run, _, _ = suite_run
    card = (run / "release" / "README.md").read_text()
    assert "openai/clip-vit-base-patch16" in card
    for task in suite_task_names(SUITE):
        assert f"| {task} |" in card, task
    # FusionBench publishes no per-task merge accuracy for 14 tasks: the card shows none
    assert not any(t.reference_accuracy for t in suite_table(SUITE, BACKBONE).tasks.values())
    assert "Published reference" not in card
