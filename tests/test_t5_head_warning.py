"""Loading a T5 release with an LM head of its own: transformers 5 warns whatever its config.json says, and
featcal's own loads (the evaluation's, the export's check) drop that one message and keep the head apart."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from featcal.families import get_family
from featcal.families.seq2seq import release_config
from featcal.families.seq2seq.folders import load_t5_folder
from featcal.families.seq2seq.head_warning import LOADER_LOGGER, untied_head_warning_off
from featcal.release.export import load_released_model
from tests.support import tiny_t5

UNTIED = "tie shared.weight to lm_head.weight"


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    """A tiny FLAN-T5-style folder (a head of its own), its config.json as a release writes it."""
    folder = tmp_path_factory.mktemp("t5-release")
    tiny_t5.build(seed=1).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(release_config(config)))
    return folder


def _untied_messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if UNTIED in r.getMessage()]


@pytest.mark.parametrize("config_edit", [{"tie_word_embeddings": False}, {"tie_word_embeddings": True}])
def test_transformers_warns_of_the_head_whatever_the_config_says(release, tmp_path, caplog, config_edit) -> None:
    from transformers import T5ForConditionalGeneration

    folder = tmp_path / "m"
    folder.mkdir()
    for path in release.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    config = {**json.loads((release / "config.json").read_text()), **config_edit, "scale_decoder_outputs": False}
    (folder / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger=LOADER_LOGGER):
        T5ForConditionalGeneration.from_pretrained(folder)
    assert len(_untied_messages(caplog)) == 1  # the message featcal's loads drop is transformers' real one


def test_featcal_s_loads_of_a_t5_release_print_no_tie_warning_and_keep_the_head(release, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger=LOADER_LOGGER):
        loaded = load_t5_folder(release)
        checked = load_released_model(get_family("seq2seq"), release, "the release")
    assert _untied_messages(caplog) == []
    for model in (loaded, checked):
        assert not torch.equal(model.lm_head.weight, model.shared.weight)
        assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()


def test_the_filter_passes_every_other_message(caplog) -> None:
    logger = logging.getLogger(LOADER_LOGGER)
    with caplog.at_level(logging.WARNING, logger=LOADER_LOGGER), untied_head_warning_off():
        logger.warning("Some weights of the model checkpoint were not used")
        logger.warning("The tied weights mapping … tie model.embed_tokens.weight to lm_head.weight … NOT tie them")
    assert len(caplog.records) == 2
