"""What a release publishes of a run's ``run_config.json``: local paths by folder name, every family's prose as
written."""

from __future__ import annotations

from featcal.release.published import published_config


def test_a_task_entry_s_own_fields_are_kept_and_its_paths_published() -> None:
    """A template or label word that starts with ``/`` is prose of the task's family, not a path: it is kept, while
    the entry's dataset folder, its expert and any other absolute-looking string are named by their last
    component."""
    config = {
        "base_model_id": "/home/me/models/base",
        "notes": "/home/me/secret/notes.txt",
        "tasks_table": {
            "chat": {"dataset": {"path": "/home/me/data/chat"}, "expert": "/home/me/experts/chat",
                     "family": "causal_lm", "text": "/no_think {query}", "weigh": "all", "max_length": 64},
            "nli": {"dataset": {"path": "glue"}, "family": "seq2seq", "input": "~{premise}", "target": "{label}",
                    "labels": ["/yes", "no"], "metric": "exact_match", "max_length": 8, "target_max_length": 4},
            "digits": {"dataset": {"path": "/data/digits"}, "classnames": ["/zero", "one"],
                       "templates": ["/a photo of {}."]},
        },
    }  # fmt: skip
    published = published_config(config)
    tasks = published["tasks_table"]
    assert tasks["chat"]["text"] == "/no_think {query}"
    assert (tasks["nli"]["input"], tasks["nli"]["labels"]) == ("~{premise}", ["/yes", "no"])
    assert (tasks["digits"]["classnames"], tasks["digits"]["templates"]) == (["/zero", "one"], ["/a photo of {}."])
    assert tasks["chat"]["dataset"]["path"] == "local:chat" and tasks["chat"]["expert"] == "local:chat"
    assert tasks["digits"]["dataset"]["path"] == "local:digits"
    assert published["base_model_id"] == "local:base" and published["notes"] == "local:notes.txt"
    assert config["tasks_table"]["chat"]["expert"] == "/home/me/experts/chat"  # the run's own record untouched
