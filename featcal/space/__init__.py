"""The Gradio Space: zero-shot classification with a released vision tower, beside the original CLIP.

`space/app.py` (what runs on Hugging Face) and `featcal space` (a local launch) both call
:func:`create_space` then :meth:`Space.launch`; `featcal space push` lives in
:mod:`featcal.space.publish`.
"""

from featcal.space.model import SpaceModel, resolve_model_source
from featcal.space.predict import classify
from featcal.space.settings import DEFAULT_BASE_MODEL_ID, DEFAULT_MODEL_ID, SpaceSettings
from featcal.space.ui import Space, build_demo, create_space

__all__ = [
    "DEFAULT_BASE_MODEL_ID",
    "DEFAULT_MODEL_ID",
    "Space",
    "SpaceModel",
    "SpaceSettings",
    "build_demo",
    "classify",
    "create_space",
    "resolve_model_source",
]
