"""The one preparation step (:func:`featcal.prepare.prepare`): its fixed order, and what it makes.

A recording family stands in for a real one: each step it is asked for is logged, so the order the
commands rely on (the first bad input named is always the same one) is checked here once for all.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from featcal.distributed import SINGLE
from featcal.errors import InvalidParameterError
from featcal.prepare import DatasetCheck, Evaluation, prepare


class _Split(list):
    _fingerprint = "fp"


class RecordingFamily:
    """The family calls :func:`prepare` makes, logged in order."""

    name, noun = "recording", "example"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def preprocessor(self, base_folder: Any) -> str:
        self.log.append("preprocessor")
        return "tokenizer"

    def load_split(self, task: Any, split: str) -> _Split:
        self.log.append(f"load {task.name}/{split}")
        return _Split(range(4))

    def check_split(self, task: Any, dataset: Any, split: str) -> None:
        pass

    def check_examples(self, task: Any, dataset: Any, split: str, rows: Any, preprocessor: Any = None) -> None:
        self.log.append(f"examples {task.name} with {preprocessor}")

    def evaluator(self, base_folder: Any, device: Any, *, world: Any, settings: Any = None) -> str:
        self.log.append(f"evaluator {device} {settings}")
        return "evaluator"


def _inputs(log: list[str]) -> SimpleNamespace:
    task = SimpleNamespace(name="a", dataset=SimpleNamespace(path="local-folder"))
    return SimpleNamespace(family=RecordingFamily(log), tasks=[task], base_folder="base")


def test_the_steps_run_in_one_order() -> None:
    log: list[str] = []

    def resolve() -> SimpleNamespace:
        log.append("resolve")
        return _inputs(log)

    prepared = prepare(
        resolve,
        DatasetCheck(("train",), calibration_examples=2, seed=0),
        check_inputs=lambda inputs: log.append("check inputs"),
        check_data=lambda p: log.append(f"check data {p.data.calibration_counts}"),
        evaluation=Evaluation("cpu", SINGLE, lambda inputs: {"held_out": None}),
    )
    assert log == [
        "resolve", "check inputs", "preprocessor", "load a/train", "examples a with tokenizer", "check data {}",
        "evaluator cpu {'held_out': None}",
    ]  # fmt: skip
    assert prepared.evaluator == "evaluator" and prepared.data.fingerprints == {"a": {"train": "fp"}}
    assert prepared.preprocessor == "tokenizer" and log.count("preprocessor") == 1  # made once


def test_without_the_preprocessor_the_examples_are_checked_without_it_and_it_is_made_on_first_use() -> None:
    log: list[str] = []
    prepared = prepare(lambda: _inputs(log), DatasetCheck(("train",), 2, seed=0, with_preprocessor=False))
    assert log == ["load a/train", "examples a with None"]
    assert prepared.evaluator is None
    assert prepared.preprocessor == "tokenizer" and log[-1] == "preprocessor"


def test_a_refused_input_stops_before_any_dataset_is_read() -> None:
    log: list[str] = []

    def refuse(inputs: Any) -> None:
        raise InvalidParameterError("output", "x", "a folder outside the inputs")

    with pytest.raises(InvalidParameterError, match="a folder outside the inputs"):
        prepare(lambda: _inputs(log), DatasetCheck(("train", "test")), check_inputs=refuse)
    assert log == []


def test_a_dataset_check_given_as_a_function_of_the_inputs_and_none_at_all() -> None:
    log: list[str] = []
    prepared = prepare(lambda: _inputs(log), lambda inputs: DatasetCheck(("test",), with_preprocessor=False))
    assert log == ["load a/test"] and prepared.data.fingerprints == {"a": {"test": "fp"}}
    log.clear()
    assert prepare(lambda: _inputs(log)).data is None and log == []
