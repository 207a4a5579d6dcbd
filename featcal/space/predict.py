"""The Space's one endpoint: an uploaded image in, the top classes per task out, never an exception."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal.errors import FeatcalError, InvalidParameterError
from featcal.memory import trim_heap
from featcal.space.images import open_upload, read_data_url
from featcal.space.model import SpaceModel

logger = logging.getLogger(__name__)

MAX_TOP_K = 20
COMPARE_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


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


def _whole_number(value: Any) -> int | None:
    """The integer ``value`` holds exactly (an int, or a float or text such as ``5.0`` or ``"5"``), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    if isinstance(value, int):
        return value
    try:
        number = float(value)
    except ValueError:
        return None
    return int(number) if number.is_integer() else None  # inf and nan are not integers


def _top_k(value: Any) -> int:
    """``top_k`` as an integer from 1 to :data:`MAX_TOP_K`.

    Args:
        value: An integer, or a float or text that holds one exactly (``5.0``, ``"5"``); never a boolean.

    Returns:
        The integer.

    Raises:
        InvalidParameterError: for anything else, a fraction or a number out of range.
    """
    k = _whole_number(value)
    if k is None or not 1 <= k <= MAX_TOP_K:
        raise InvalidParameterError("top_k", value, f"a whole number from 1 to {MAX_TOP_K}")
    return k


def _compare(value: Any) -> bool:
    """``compare`` as a boolean.

    Args:
        value: ``True`` or ``False``, the integers 1 and 0, or the words true/false, yes/no, 1/0 (any case).

    Returns:
        The boolean.

    Raises:
        InvalidParameterError: for anything else (``"maybe"``, ``2``, ``None``).
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in COMPARE_WORDS:
        return COMPARE_WORDS[value.strip().lower()]
    raise InvalidParameterError("compare", value, "true or false (or the words yes/no, 1/0)")


def classify(model: SpaceModel, payload: Any, task: str, top_k: Any = 5, compare: Any = False) -> dict[str, Any]:
    """Top classes of the image for one task (or ``"all"``), from the model and optionally the base CLIP.

    The task, ``top_k`` and ``compare`` are checked before the image is read. The memory the request
    freed is handed back to the system afterwards (:func:`featcal.memory.trim_heap`), so a burst of
    large uploads does not leave the server holding it.

    Args:
        model: The Space's model.
        payload: The image: Gradio's file dict, a file path, or a ``data:image/...;base64,`` URL.
        task: A task's name, or ``"all"``.
        top_k: How many classes to return per task (see :func:`_top_k` for what is read as a number).
        compare: Whether to add the original CLIP's answer (see :func:`_compare`).

    Returns:
        ``{"results": {task: {"model": {class: p}, "base": {...}}}, "notes": [...], "error": None, ...}``;
        on bad input ``error`` holds a one-line message for the visitor and ``results`` is empty.
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
        compare = _compare(compare)
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
