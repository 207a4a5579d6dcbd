"""nltk's sentence tokenizer data that ifeval's checks read, looked for before any work.

lm-evaluation-harness's ifeval counts sentences and words with nltk's Punkt tokenizer, whose data is
``punkt_tab`` (instructions such as ``length_constraints:number_sentences`` and
``change_case:capital_word_frequency``). Where the data is not installed, the harness tries to download it
when it loads the task and, offline, goes on without it: the run then fails when the first such response is
scored, after every ifeval prompt was generated. The protocol therefore asks for the data before any work;
featcal downloads nothing.
"""

from __future__ import annotations

from featcal.errors import FeatcalError

PUNKT_TAB = "tokenizers/punkt_tab/english/"
FETCH_COMMAND = "python -m nltk.downloader punkt_tab"


def check_punkt_tab() -> None:
    """Refuse a protocol run where nltk's ``punkt_tab`` data (English) is in none of nltk's data folders.

    Raises:
        FeatcalError: naming the data, the folders searched and how to get it; or when nltk is not installed.
    """
    try:
        import nltk
    except ImportError as exc:
        from featcal.families.causal_lm.harness import INSTALL_HINT

        raise FeatcalError(f"MergeBench's ifeval needs nltk ({exc}): {INSTALL_HINT}.") from None
    try:
        nltk.data.find(PUNKT_TAB)
    except LookupError:
        folders = ", ".join(str(folder) for folder in nltk.data.path)
        raise FeatcalError(
            f"MergeBench's instruction domain (ifeval) needs nltk's punkt_tab data, found in none of nltk's data "
            f"folders ({folders}): get it with `{FETCH_COMMAND}`, or set NLTK_DATA to a folder holding "
            "tokenizers/punkt_tab (docs/causal-lm.md)."
        ) from None
