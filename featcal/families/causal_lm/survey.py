"""Every causal-LM model type of the installed transformers probed: supported, or refused with the reason.

``python -m featcal.families.causal_lm.survey`` rewrites the recorded list
(:data:`~featcal.families.causal_lm.architectures.KNOWN_FILE`) from the installed transformers.
"""

from __future__ import annotations

import warnings

from featcal.families.causal_lm.architectures import Architecture, table, write_known


def probe(model_type: str, model_class: str) -> Architecture:
    """``model_type`` probed from its default configuration."""
    from transformers import AutoConfig

    from featcal.families.causal_lm.adapter import UnsupportedArchitecture, describe

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as exc:  # noqa: BLE001 - a configuration transformers cannot build is a refusal
        return Architecture(model_type, model_class, f"its default configuration does not build ({type(exc).__name__})")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            describe(config)
        except UnsupportedArchitecture as exc:
            return Architecture(model_type, model_class, exc.reason)
    return Architecture(model_type, model_class)


def installed() -> list[Architecture]:
    """Every causal-LM model type of the installed transformers, probed, by model type."""
    import logging

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        return [probe(t, c) for t, c in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())]
    finally:
        quiet.setLevel(level)


if __name__ == "__main__":  # python -m featcal.families.causal_lm.survey: rewrite the recorded list
    found = installed()
    write_known(found)
    print(table(found))
