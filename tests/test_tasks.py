"""The built-in TA8 table and user task files."""

import json

import pytest

from featcal.errors import DatasetInputError, FeatcalError
from featcal.families.clip_vision.entries import image_classes
from featcal.suites import task_table
from featcal.tasks import builtin_tasks, load_task_file


def test_builtin_ta8_matches_the_reference_table():
    table = builtin_tasks()
    assert list(table.tasks) == ["sun397", "stanford-cars", "resisc45", "eurosat", "svhn", "gtsrb", "mnist", "dtd"]
    assert table.base_model == "openai/clip-vit-base-patch32"
    assert table.tasks["svhn"].dataset.path == "ufldl-stanford/svhn"
    assert table.tasks["svhn"].dataset.name == "cropped_digits"
    assert len(image_classes(table.tasks["sun397"]).classnames) == 397
    assert table.tasks["mnist"].expert == "tanganke/clip-vit-base-patch32_mnist"
    assert table.reference_average["task_arithmetic_featcal"] == pytest.approx(0.8547, abs=1e-4)
    refs = [t.reference_accuracy["task_arithmetic_featcal"] for t in table.tasks.values()]
    assert sum(refs) / len(refs) == pytest.approx(table.reference_average["task_arithmetic_featcal"])
    assert image_classes(table.tasks["dtd"]).prompts("banded")[0] == "a photo of a banded texture."


def test_yaml_file_adds_tasks_and_resolves_local_paths(tmp_path):
    (tmp_path / "data" / "mine").mkdir(parents=True)
    (tmp_path / "tasks.yaml").write_text(
        "tasks:\n  mine:\n    dataset: {path: data/mine}\n    classnames: [cat, dog]\n"
        "    templates: ['a photo of a {}.']\n    expert: someone/expert-on-hub\n"
    )
    table = task_table(tmp_path / "tasks.yaml")
    assert "mnist" in table.tasks and "mine" in table.tasks
    mine = table.tasks["mine"]
    assert mine.dataset.path == str((tmp_path / "data" / "mine").resolve())
    assert mine.expert == "someone/expert-on-hub"  # not a local path: stays a Hub id
    assert list(task_table(tmp_path / "tasks.yaml", replace=True).tasks) == ["mine"]


def test_a_dataset_is_pinned_by_revision_or_by_at_and_unpinned_entries_record_as_before(tmp_path):
    commit = "ab" * 20
    entry = {"classnames": ["a", "b"], "templates": ["{}"]}
    tasks = {
        "by_key": {**entry, "dataset": {"path": "ns/one", "revision": "v1.0"}},
        "by_at": {**entry, "dataset": f"ns/two@{commit}"},
        "unpinned": {**entry, "dataset": "ns/three"},
    }
    (tmp_path / "t.json").write_text(json.dumps({"tasks": tasks}))
    table = load_task_file(tmp_path / "t.json").tasks
    assert (table["by_key"].dataset.path, table["by_key"].dataset.revision) == ("ns/one", "v1.0")
    assert (table["by_at"].dataset.path, table["by_at"].dataset.revision) == ("ns/two", commit)
    assert table["by_at"].to_dict()["dataset"]["revision"] == commit
    assert "revision" not in table["unpinned"].to_dict()["dataset"]  # so an unpinned run's id is unchanged


@pytest.mark.parametrize(
    "entry, message",
    [
        ({"classnames": ["a", "b"], "templates": ["{}"]}, "'dataset' needs a 'path'"),
        ({"dataset": "x", "classnames": ["a", "b"], "templates": ["no slot"]}, "exactly one '{}'"),
        ({"dataset": "x", "classnames": ["a", "b"], "templates": ["{}"], "colour": 1}, "unknown field(s) ['colour']"),
        (
            {"dataset": {"path": "x", "img_col": "i"}, "classnames": ["a", "b"], "templates": ["{}"]},
            "unknown dataset field",
        ),
        ({"dataset": {"path": "x", "name": 5}, "classnames": ["a", "b"], "templates": ["{}"]}, "must be text"),
        ({"dataset": "x", "classnames": ["cat", "dog", "cat"], "templates": ["{}"]}, "'cat' more than once"),
        (
            {"dataset": {"path": "ns/x@v1", "revision": "v2"}, "classnames": ["a", "b"], "templates": ["{}"]},
            "pins a revision twice",
        ),
        ({"dataset": {"path": "ns/x", "revision": 3}, "classnames": ["a", "b"], "templates": ["{}"]}, "must be text"),
    ],
)
def test_invalid_entries_name_the_task_and_the_problem(tmp_path, entry, message):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"tasks": {"bad": entry}}))
    with pytest.raises(FeatcalError, match="task 'bad'") as info:
        load_task_file(path)
    assert message in str(info.value)


def test_unknown_task_lists_the_known_ones():
    with pytest.raises(FeatcalError, match="Unknown task.*mnist"):
        builtin_tasks().select(["imagenet"])


@pytest.mark.parametrize(
    "table, message",
    [
        ({"base_model": 5}, "'base_model' must be text"),
        ({"expert_model_pattern": ["x"]}, "'expert_model_pattern' must be text"),
        ({"base_modle": "openai/clip-vit-base-patch32"}, "unknown top-level key(s) ['base_modle']"),
        ({"reference_average": [1]}, "'reference_average' must map"),
    ],
)
def test_invalid_top_level_keys_are_named(tmp_path, table, message):
    path = tmp_path / "t.json"
    entry = {"dataset": "x", "classnames": ["a", "b"], "templates": ["{}"]}
    path.write_text(json.dumps({"tasks": {"ok": entry}, **table}))
    with pytest.raises(FeatcalError) as info:
        load_task_file(path)
    assert message in str(info.value) and str(path) in str(info.value)


def test_an_entry_keeps_its_key_order_with_its_family_s_format(tmp_path):
    image = {"dataset": "ns/pics", "templates": ["a {}."], "expert": "ns/e", "classnames": ["a", "b"]}
    text = {"family": "causal_lm", "dataset": "ns/texts", "text": "{t}", "expert": "ns/f"}
    (tmp_path / "t.json").write_text(json.dumps({"tasks": {"image": image, "text": text}}))
    table = load_task_file(tmp_path / "t.json").tasks
    # an image entry gives its class names and templates right after its dataset (as the built-in tables do and
    # as runs recorded them), a text entry its format last
    assert list(table["image"].to_dict()) == ["dataset", "classnames", "templates", "expert", "reference_accuracy"]
    assert list(table["text"].to_dict()) == [
        "dataset", "expert", "reference_accuracy", "family", "text", "weigh", "max_length"
    ]  # fmt: skip
    assert image_classes(table["image"]).to_dict() == {"classnames": ["a", "b"], "templates": ["a {}."]}
    assert image_classes(table["image"]).prompts("b") == ["a b."]


def test_a_task_of_another_family_has_no_image_classes(tmp_path):
    entry = {"family": "causal_lm", "dataset": "ns/texts", "text": "{t}"}
    (tmp_path / "t.json").write_text(json.dumps({"tasks": {"chat": entry}}))
    task = load_task_file(tmp_path / "t.json").tasks["chat"]
    with pytest.raises(DatasetInputError) as info:
        image_classes(task)
    assert str(info.value).splitlines() == [
        "Task 'chat' is a causal_lm task, with no class names and prompt templates: give an image task "
        "('classnames' and 'templates')."
    ]
