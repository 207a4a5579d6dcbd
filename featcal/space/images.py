"""Turn whatever a visitor uploads into an 8-bit RGB image, or a message saying why not.

Limits are checked before pixels are decoded (file size, pixel count from the header, aspect ratio),
so a decompression bomb or a 1×100000 strip never reaches the image processor.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image, ImageOps, UnidentifiedImageError

from featcal.errors import FeatcalError
from featcal.families.clip_vision.images import to_rgb

MAX_ASPECT_RATIO = 25.0
ORIENTATION = 0x0112  # the EXIF orientation tag
SMALL_SIDE = 16
MODE_NAMES = {
    "1": "black-and-white",
    "L": "grayscale",
    "LA": "grayscale with transparency",
    "P": "palette",
    "PA": "palette with transparency",
    "RGBA": "RGBA (transparency on white)",
    "CMYK": "CMYK",
    "YCbCr": "YCbCr",
    "LAB": "Lab",
    "HSV": "HSV",
    "I": "32-bit integer",
    "F": "32-bit float",
    "I;16": "16-bit grayscale",
    "I;16B": "16-bit grayscale",
    "I;16L": "16-bit grayscale",
}
READABLE = "PNG, JPEG, WebP, GIF, BMP or TIFF"


@dataclass
class Upload:
    """An image ready for the classifier, and what was done to get it there."""

    image: Image.Image
    original_size: tuple[int, int]
    original_mode: str
    notes: list[str] = field(default_factory=list)


def read_data_url(url: str, max_bytes: int) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL (what a pasted image can arrive as)."""
    header, _, payload = url.partition(",")
    if not header.startswith("data:") or not header.endswith(";base64"):
        raise FeatcalError("The image arrived as a data URL that is not base64: upload the file instead.")
    if len(payload) * 3 // 4 > max_bytes:
        raise FeatcalError(_too_big(len(payload) * 3 // 4, max_bytes))
    try:
        return base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise FeatcalError("The pasted image data is not valid base64: upload the file instead.") from None


def _too_big(size: int, max_bytes: int) -> str:
    return (
        f"The file is {size / 1e6:.1f} MB; this Space accepts images up to {max_bytes / 1e6:.0f} MB. "
        "Save a smaller copy (JPEG, at most a few thousand pixels a side) and upload that."
    )


def open_upload(source: str | Path | bytes, *, max_bytes: int, max_pixels: int) -> Upload:
    """Open, check and convert an uploaded image (a file path or raw bytes) to 8-bit RGB.

    Raises :class:`FeatcalError` with a message for the visitor when the file is too large, is not an
    image, is corrupt, or has a size or mode that cannot be classified.
    """
    data = source if isinstance(source, bytes) else None
    size = len(data) if data is not None else Path(source).stat().st_size
    if size == 0:
        raise FeatcalError("The file is empty: upload an image.")
    if size > max_bytes:
        raise FeatcalError(_too_big(size, max_bytes))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data) if data is not None else source)
        except UnidentifiedImageError:
            raise FeatcalError(f"This file is not an image this Space can read: upload a {READABLE} file.") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise FeatcalError(_too_many_pixels(None, max_pixels)) from None
        width, height = image.size
        if width * height > max_pixels:
            raise FeatcalError(_too_many_pixels((width, height), max_pixels))
        if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
            raise FeatcalError(
                f"The image is {width}×{height} pixels, a strip longer than {MAX_ASPECT_RATIO:.0f}:1; "
                "CLIP looks at a centred square crop, so crop the part you want classified and upload that."
            )
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as exc:
            raise FeatcalError(
                f"The image data is corrupt or truncated ({exc}): re-save the image and upload it again."
            ) from None
    upload = Upload(image=image, original_size=(width, height), original_mode=image.mode)
    try:
        frames = getattr(image, "n_frames", 1)
    except (OSError, EOFError, ValueError):
        frames = 1  # a damaged later frame: the first one decoded fine
    if frames > 1:
        upload.notes.append(f"Animated image: classified its first frame of {frames}.")
    try:
        rotated = ImageOps.exif_transpose(image) if image.getexif().get(ORIENTATION, 1) != 1 else image
    except (OSError, SyntaxError, ValueError, TypeError, KeyError):
        rotated = image  # unreadable EXIF: keep the stored orientation
    if rotated is not image:
        upload.notes.append("Rotated as its EXIF orientation says.")
    try:
        upload.image = to_rgb(rotated)
    except (OSError, ValueError, TypeError) as exc:
        raise FeatcalError(
            f"Cannot convert this {image.mode} image to RGB ({exc}): save it as an RGB PNG or JPEG."
        ) from None
    if image.mode != "RGB":
        upload.notes.append(f"Converted from {MODE_NAMES.get(image.mode, image.mode)} to RGB.")
    if min(width, height) < SMALL_SIDE:
        upload.notes.append(
            f"The image is only {width}×{height} pixels: it was scaled up, so the prediction means little."
        )
    return upload


def _too_many_pixels(size: tuple[int, int] | None, max_pixels: int) -> str:
    what = f"{size[0]}×{size[1]} pixels ({size[0] * size[1] / 1e6:.0f} MP)" if size else "too many pixels"
    return (
        f"The image has {what}; this Space accepts up to {max_pixels / 1e6:.0f} megapixels. "
        "Upload a downscaled copy: CLIP sees it at 224×224 anyway."
    )
