"""The Space's one endpoint: an uploaded image in, the top classes per task out, never an exception."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal.errors import FeatcalError
from featcal.memory import trim_heap
from featcal.space.images import open_upload, read_data_url
from featcal.space.model import SpaceModel

logger = logging.getLogger(__name__)

MAX_TOP_K = 20


def _source(payload: Any, max_bytes: int) -> str | bytes:
    """The file path or bytes an image input holds (Gradio's FileData dict, a path, or a data URL)."""
    if isinstance(payload, Mapping):
        if payload.get("path"):
            return str(payload["path"])
        payload = payload.get("url")
    if isinstance(payload, str) and payload.startswith("data:"):
        return read_data_url(payload, max_bytes)
    if isinstance(payload, (str, Path)) and Path(payload).is_file():
        return str(payload)
    raise FeatcalError("No image: upload or paste an image first.")


def _top_k(value: Any) -> int:
    try:
        k = int(round(float(value)))
    except (TypeError, ValueError):
        raise FeatcalError(f"top_k must be a number from 1 to {MAX_TOP_K}, not {value!r}.") from None
    return max(1, min(MAX_TOP_K, k))


def classify(model: SpaceModel, payload: Any, task: str, top_k: Any = 5, compare: Any = False) -> dict[str, Any]:
    """Top classes of the image for one task (or ``"all"``), from the model and optionally the base CLIP.

    The memory the request freed is handed back to the system afterwards (:func:`featcal.memory.trim_heap`),
    so a burst of large uploads does not leave the server holding it.

    Returns ``{"results": {task: {"model": {class: p}, "base": {...}}}, "notes": [...], "error": None, ...}``;
    on bad input ``error`` holds a message for the visitor and ``results`` is empty.
    """
    try:
        return _classify(model, payload, task, top_k, compare)
    finally:
        trim_heap()


def _classify(model: SpaceModel, payload: Any, task: str, top_k: Any, compare: Any) -> dict[str, Any]:
    settings = model.settings
    max_bytes = int(settings.max_file_mb * 1e6)
    reply: dict[str, Any] = {
        "model": settings.model_id,
        "base_model": model.base_ref,
        "task": task,
        "image": None,
        "notes": [],
        "results": {},
        "error": None,
    }
    try:
        names = model.task_names(str(task))
        k = _top_k(top_k)
        upload = open_upload(
            _source(payload, max_bytes),
            max_bytes=max_bytes,
            max_pixels=int(settings.max_megapixels * 1e6),
            min_side=model.input_side,
        )
        reply["image"] = {
            "width": upload.original_size[0],
            "height": upload.original_size[1],
            "mode": upload.original_mode,
        }
        reply["notes"] = upload.notes
        ours = model.top_classes(upload.image, names, k)
        base = model.top_classes(upload.image, names, k, base=True) if compare else {}
        reply["results"] = {name: {"model": ours[name], **({"base": base[name]} if compare else {})} for name in names}
    except FeatcalError as exc:
        reply["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - the page must answer whatever arrives
        logger.exception("Classifying an upload failed")
        reply["error"] = f"Something went wrong while classifying this image ({type(exc).__name__}). Try another image."
    return reply
