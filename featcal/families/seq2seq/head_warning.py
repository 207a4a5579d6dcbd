"""transformers 5's warning on loading a T5 with an LM head of its own, kept out of featcal's own loads.

transformers 5's ``T5Config`` sets ``tie_word_embeddings`` to true whatever ``config.json`` says (it reads a
``false`` there as ``scale_decoder_outputs: false``), so loading any T5 whose checkpoint holds an LM head of its
own beside the embedding (FLAN-T5's, and every model featcal writes from one) logs "… tie shared.weight to
lm_head.weight, but both are present in the checkpoints with different values, so we will NOT tie them. You
should update the config with `tie_word_embeddings=False` …", whatever the configuration says: no
``config.json`` silences it. transformers then keeps the two apart, which is what the model is, so featcal's own
loads of such folders drop that one message; every other message passes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

# The logger transformers' loader writes the message with, and the words that make it the T5 head's.
LOADER_LOGGER = "transformers.modeling_utils"
UNTIED_HEAD_WORDS = ("tie shared.weight to lm_head.weight", "we will NOT tie them")


class UntiedHeadFilter(logging.Filter):
    """Drops transformers' message about a T5 LM head kept apart from the embedding; passes every other."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not all(words in message for words in UNTIED_HEAD_WORDS)


@contextmanager
def untied_head_warning_off() -> Iterator[None]:
    """Load T5 folders in the body without transformers' untied-head message (:class:`UntiedHeadFilter`)."""
    logger = logging.getLogger(LOADER_LOGGER)
    quiet = UntiedHeadFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
