"""Which causal-LM architectures of the installed transformers featcal calibrates, found by probing each.

Every ``model_type`` of transformers' causal-LM mapping (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) is built at
a tiny width from its default configuration and described (:mod:`.survey`): supported, or refused with the
reason. :data:`KNOWN_FILE` keeps the result as data (``architectures.json``, written by
:func:`write_known`), so that a folder's model type is recognised, and a refused one refused with its
reason, without importing torch; a test requires it to equal what the probes find.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# How a refusal of a model type that is no decoder-only LM ends (shape.py words them so).
ENCODER_DECODER, ENCODER = "an encoder-decoder", "an encoder's layers"
KNOWN_FILE = Path(__file__).with_name("architectures.json")


@dataclass(frozen=True)
class Architecture:
    """One causal-LM model type: its transformers class and why it is refused (None: supported)."""

    model_type: str
    model_class: str
    refused: str | None = None

    @property
    def supported(self) -> bool:
        return self.refused is None

    @property
    def decoder_only(self) -> bool:
        """Whether it is a decoder-only LM at all (refused ones included): not an encoder-decoder, nor an
        encoder's layers with an LM head (BERT's)."""
        return self.refused is None or not self.refused.endswith((ENCODER_DECODER, ENCODER))


def known() -> dict[str, Architecture]:
    """The architectures as :data:`KNOWN_FILE` records them, by model type (no torch imported)."""
    entries = json.loads(KNOWN_FILE.read_text(encoding="utf-8"))
    return {e["model_type"]: Architecture(e["model_type"], e["model_class"], e.get("refused")) for e in entries}


def write_known(architectures: list[Architecture]) -> None:
    """Record ``architectures`` in :data:`KNOWN_FILE`."""
    entries = [
        {"model_type": a.model_type, "model_class": a.model_class, **({"refused": a.refused} if a.refused else {})}
        for a in architectures
    ]
    KNOWN_FILE.write_text(json.dumps(entries, indent=1) + "\n", encoding="utf-8")


def table(architectures: list[Architecture]) -> str:
    """The architectures as lines: supported ones first, then the refused with their reason, and the counts."""
    supported = [a for a in architectures if a.supported]
    refused = [a for a in architectures if not a.supported]
    width = max((len(a.model_type) for a in architectures), default=0)
    lines = [f"supported ({len(supported)}):"]
    lines += [f"  {a.model_type:<{width}}  {a.model_class}" for a in supported]
    lines.append(f"refused ({len(refused)}):")
    lines += [f"  {a.model_type:<{width}}  {a.refused}" for a in refused]
    return "\n".join(lines)
