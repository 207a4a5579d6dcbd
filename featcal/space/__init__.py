"""The Gradio Space: zero-shot classification with a released vision tower, beside the original CLIP.

`space/app.py` (what runs on Hugging Face) and `featcal space` (a local launch) both call
:func:`create_space` then :meth:`Space.launch`; `featcal space push` lives in
:mod:`featcal.space.publish`. Names are imported on first use, so the CLI's parser does not load
torch or gradio through this package.
"""

from featcal.lazy import lazy_attributes

_EXPORTS = {
    "SpaceModel": "featcal.space.model",
    "resolve_model_source": "featcal.space.model",
    "classify": "featcal.space.predict",
    "DEFAULT_BASE_MODEL_ID": "featcal.space.settings",
    "DEFAULT_MODEL_ID": "featcal.space.settings",
    "SpaceSettings": "featcal.space.settings",
    "Space": "featcal.space.ui",
    "build_demo": "featcal.space.ui",
    "create_space": "featcal.space.ui",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_attributes(__name__, _EXPORTS)
