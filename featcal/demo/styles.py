"""Looks the base's pretraining images are drawn in: the benchmark's tasks in styles it is never tested on.

CLIP learned its features and its text-image alignment on web images, not on the test sets of the
eight TA8 tasks, so its zero-shot accuracy there is weak while its features are good. The zoo's base
is pretrained the same way: on the benchmark's task families, but with every pretraining image
re-drawn in a *pretraining style* that the test images (and the experts' training images) never have.
Each style keeps every label of every task recognisable to a model that adapts to it.
``"negative"`` is the one ``ZooConfig.mini8()`` uses; benchmarks/mini8.md measures the others.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from PIL import Image, ImageFilter, ImageOps

Style = Callable[[Image.Image], Image.Image]


def _native(image: Image.Image) -> Image.Image:
    return image


def _negative(image: Image.Image) -> Image.Image:
    return ImageOps.invert(image)


def _swapped(image: Image.Image) -> Image.Image:
    """The colour channels rotated: red shows as green, green as blue, blue as red."""
    r, g, b = image.split()
    return Image.merge("RGB", (b, r, g))


def _negative_swapped(image: Image.Image) -> Image.Image:
    return _swapped(_negative(image))


ZOOM_OUT = 0.55  # side of the shrunk picture, as a share of the image side


def _zoomed_out(image: Image.Image) -> Image.Image:
    """The picture shrunk to ``ZOOM_OUT`` of its side, centred on a frame of its mean border colour."""
    n = image.size[0]
    m = max(round(n * ZOOM_OUT), 1)
    pixels = np.asarray(image, dtype=np.float32)
    border = np.concatenate([pixels[0], pixels[-1], pixels[:, 0], pixels[:, -1]]).mean(axis=0)
    canvas = Image.new("RGB", image.size, tuple(int(c) for c in border))
    canvas.paste(image.resize((m, m), Image.Resampling.BOX), ((n - m) // 2, (n - m) // 2))
    return canvas


def _edges(image: Image.Image) -> Image.Image:
    """A sketch: the picture's edges (after a light smoothing), bright on black, contrast stretched."""
    return ImageOps.autocontrast(image.filter(ImageFilter.SMOOTH).filter(ImageFilter.FIND_EDGES), cutoff=1)


def _negative_zoomed_out(image: Image.Image) -> Image.Image:
    return _negative(_zoomed_out(image))


PRETRAIN_STYLES: dict[str, Style] = {
    "native": _native,
    "negative": _negative,
    "negative-swapped": _negative_swapped,
    "zoomed-out": _zoomed_out,
    "negative-zoomed-out": _negative_zoomed_out,
    "edges": _edges,
}


def restyle(images: list[Image.Image], style: str) -> list[Image.Image]:
    """``images`` re-drawn in the pretraining style ``style`` (a key of :data:`PRETRAIN_STYLES`)."""
    return [PRETRAIN_STYLES[style](image) for image in images]
