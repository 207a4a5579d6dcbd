"""Turn whatever a visitor uploads into an 8-bit RGB image, or a message saying why not.

Limits are checked before pixels are decoded (file size, pixel count from the header, aspect ratio),
so a decompression bomb or a 1×100000 strip never reaches the image processor. Image data that ends
before the last pixel is an error: Pillow is never asked to pad a truncated image
(``ImageFile.LOAD_TRUNCATED_IMAGES`` stays off), and a PNG whose compressed data ends cleanly too
early, which Pillow would decode with black rows, is caught before decoding.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import warnings
import zlib
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
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow's names; JPEG includes phones' MPO files
ANIMATED = frozenset({"PNG", "GIF", "WEBP"})  # an MPO's later images are previews or depth maps, not frames
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # samples per pixel of each PNG colour type
# What Pillow raises for a file that is damaged or ends too early, while opening or decoding it.
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, IndexError, struct.error)
# The seven passes of an interlaced PNG: first column and row, column and row steps.
ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


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


def open_upload(source: str | Path | bytes, *, max_bytes: int, max_pixels: int, min_side: int = 0) -> Upload:
    """Open, check and convert an uploaded image (a file path or raw bytes) to 8-bit RGB.

    The size limits are checked from the header, before any pixel is decoded; a JPEG at least twice as
    large as ``min_side`` on both sides is decoded at 1/2, 1/4 or 1/8 scale (never below ``min_side``);
    image data that ends before the last pixel is refused, never padded.

    Args:
        source: The uploaded file's path, or its bytes.
        max_bytes: The largest file accepted.
        max_pixels: The most pixels an image may declare (width × height of the frame classified).
        min_side: The side, in pixels, the classifier's image processor needs (0: decode at full size).

    Returns:
        The image as 8-bit RGB, with its declared size and mode and notes on what was done to it.

    Raises:
        FeatcalError: with a one-line message for the visitor when the file is empty or too large, is
            not an image this Space reads, is corrupt or truncated, or has a size or mode that cannot be
            classified.
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
            image = Image.open(io.BytesIO(data) if data is not None else source, formats=FORMATS)
        except UnidentifiedImageError:
            raise FeatcalError(f"This file is not an image this Space can read: upload a {READABLE} file.") from None
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            raise FeatcalError(_too_many_pixels(None, max_pixels)) from None
        except DECODE_ERRORS as exc:  # a header that starts right, then breaks off or contradicts itself
            raise FeatcalError(_corrupt(exc)) from None
    width, height = image.size
    if width * height > max_pixels:
        raise FeatcalError(_too_many_pixels((width, height), max_pixels))
    if max(width, height) > MAX_ASPECT_RATIO * min(width, height):
        raise FeatcalError(
            f"The image is {width}×{height} pixels, a strip longer than {MAX_ASPECT_RATIO:.0f}:1; "
            "CLIP looks at a centred square crop, so crop the part you want classified and upload that."
        )
    if image.format == "PNG" and _png_data_ends_early(data if data is not None else Path(source).read_bytes()):
        raise FeatcalError(_corrupt(f"the image data ends before its last row of {width}×{height} pixels"))
    upload = Upload(image=image, original_size=(width, height), original_mode=image.mode)
    try:
        frames = getattr(image, "n_frames", 1)  # read before decoding: counting frames seeks through them
    except DECODE_ERRORS:
        frames = 1  # a damaged later frame: the first one is checked as it decodes
    if frames > 1 and image.format in ANIMATED:
        upload.notes.append(f"Animated image: classified its first frame of {frames}.")
    elif frames > 1 and image.format == "TIFF":
        upload.notes.append(f"Multi-page TIFF: classified its first page of {frames}.")
    if min_side:
        image.draft("RGB", (min_side, min_side))  # JPEG only: decode at reduced scale (others ignore it)
    try:
        image.load()
    except DECODE_ERRORS as exc:
        raise FeatcalError(_corrupt(exc)) from None
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
            f"Cannot convert this {image.mode} image to RGB ({_one_line(exc)}): save it as an RGB PNG or JPEG."
        ) from None
    if image.mode != "RGB":
        upload.notes.append(f"Converted from {MODE_NAMES.get(image.mode, image.mode)} to RGB.")
    if min(width, height) < SMALL_SIDE:
        upload.notes.append(
            f"The image is only {width}×{height} pixels: it was scaled up, so the prediction means little."
        )
    return upload


def _one_line(exc: BaseException | str) -> str:
    """An error's text on one line (some decoders' messages span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def _corrupt(exc: BaseException | str) -> str:
    return f"The image data is corrupt or truncated ({_one_line(exc)}): re-save the image and upload it again."


def _png_data_ends_early(data: bytes) -> bool:
    """Whether a PNG's image data inflates to fewer bytes than the rows its header declares.

    Pillow decodes a PNG whose compressed stream ends cleanly before the last row without an error,
    leaving the missing rows black; a file cut inside its data, or a damaged stream, fails as it
    decodes. Only the count of inflated bytes is kept, at most 1 MiB at a time.
    """
    header, rows, pos = None, [], len(PNG_SIGNATURE)
    while pos + 8 <= len(data):
        length, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR" and len(body) >= 13:
            header = struct.unpack(">IIBBBBB", body[:13])
        elif kind == b"IDAT":
            rows.append(body)
        elif rows:  # the image data is one run of IDAT chunks
            break
        pos += 12 + length
    if header is None or header[3] not in PNG_CHANNELS:
        return False  # Pillow refuses such a header itself
    width, height, depth, color, _, _, interlace = header
    bits = depth * PNG_CHANNELS[color]
    passes = ADAM7 if interlace else ((0, 0, 1, 1),)
    expected = 0
    for x0, y0, dx, dy in passes:
        columns, lines = (width - x0 + dx - 1) // dx, (height - y0 + dy - 1) // dy
        if columns > 0 and lines > 0:
            expected += lines * (1 + (columns * bits + 7) // 8)
    inflater, inflated = zlib.decompressobj(), 0
    try:
        for chunk in rows:
            while chunk and inflated < expected:
                inflated += len(inflater.decompress(chunk, 1 << 20))
                chunk = inflater.unconsumed_tail
    except zlib.error:
        return False  # a damaged stream: the decoder says so
    return inflated < expected


def _too_many_pixels(size: tuple[int, int] | None, max_pixels: int) -> str:
    what = f"{size[0]}×{size[1]} pixels ({size[0] * size[1] / 1e6:.1f} MP)" if size else "too many pixels"
    return (
        f"The image has {what}; this Space accepts up to {max_pixels / 1e6:g} megapixels. "
        "Upload a downscaled copy: CLIP sees it at 224×224 anyway."
    )
