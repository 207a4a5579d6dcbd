"""Task looks: whether the eight tasks share one look or each has a palette of its own.

Real benchmark tasks come from different sources, so their images differ in look before they differ
in label (MNIST is grey, EuroSAT is satellite colour, SVHN is house-number photos), and an expert's
change to the shared tower mostly touches inputs of its own look. The mini8 tasks are all drawn with
random colours (``"shared"``), so colour is a nuisance of six tasks and the label of ``colors``.
``"distinct"`` redraws each form task (whose label does not depend on colour) in a fixed two-colour
palette of its own: the image's brightness mapped from the palette's dark colour to its light one.
``colors`` and ``scenes``, whose labels are colours, keep their native colours. ``ZooConfig.mini8()``
uses ``"distinct"``; benchmarks/mini8.md measures both.
"""

from __future__ import annotations

import numpy as np
from PIL import Image

Color = tuple[int, int, int]

# dark and light ends of each form task's palette, chosen far apart in hue from one another
DUOTONES: dict[str, tuple[Color, Color]] = {
    "digits": ((0, 0, 0), (255, 255, 255)),
    "letters": ((20, 30, 90), (250, 240, 170)),
    "shapes": ((10, 70, 30), (255, 200, 225)),
    "textures": ((80, 45, 10), (180, 250, 255)),
    "arrows": ((100, 10, 10), (200, 255, 190)),
    "counting": ((55, 0, 80), (255, 205, 120)),
}

TASK_LOOKS = ("shared", "distinct")


def _duotone(image: Image.Image, dark: Color, light: Color) -> Image.Image:
    brightness = np.asarray(image.convert("L"), dtype=np.float32)[..., None] / 255.0
    low, high = np.array(dark, np.float32), np.array(light, np.float32)
    return Image.fromarray(np.clip(low + (high - low) * brightness, 0, 255).round().astype(np.uint8), "RGB")


def in_task_look(image: Image.Image, task: str, looks: str) -> Image.Image:
    """``image`` of ``task`` as the zoo's task looks ``looks`` (a value of :data:`TASK_LOOKS`) draw it."""
    if looks == "shared" or task not in DUOTONES:
        return image
    return _duotone(image, *DUOTONES[task])
