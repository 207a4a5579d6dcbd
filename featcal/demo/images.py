"""The eight procedural image tasks of the mini8 benchmark.

Each task draws small RGB images with Pillow from a seeded ``numpy`` generator: glyphs in Pillow's
built-in font, shapes, textures, colour fields, arrows, simple scenes and dot counts. Nuisances
(colours, position, size, rotation, noise) vary on purpose, and one task's label is often another's
nuisance (colour for ``shapes`` is the label of ``colors``; rotation for ``shapes`` is the label of
``arrows``), so that experts fine-tuned on different tasks pull shared features apart.
"""

from __future__ import annotations

import colorsys
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

SUPERSAMPLE = 2  # draw at twice the size, then downsample (anti-aliasing)

Color = tuple[int, int, int]
Renderer = Callable[[np.random.Generator, int, int], Image.Image]


@dataclass(frozen=True)
class ImageTask:
    """A procedural classification task: class names, prompt templates and a renderer."""

    name: str
    classnames: tuple[str, ...]
    templates: tuple[str, ...]
    caption: str  # a short description of the task, for the zoo's tasks table
    render: Renderer  # (rng, label, size) -> RGB image of size × size

    def sample(self, rng: np.random.Generator, label: int, size: int) -> Image.Image:
        return self.render(rng, label, size)


# ---------------------------------------------------------------- colour and canvas helpers


def _hsv(h: float, s: float, v: float) -> Color:
    r, g, b = colorsys.hsv_to_rgb(h % 1.0, min(max(s, 0.0), 1.0), min(max(v, 0.0), 1.0))
    return int(r * 255), int(g * 255), int(b * 255)


def _luma(c: Color) -> float:
    return 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2]


def _random_color(rng: np.random.Generator) -> Color:
    return _hsv(rng.random(), rng.uniform(0.0, 1.0), rng.uniform(0.1, 1.0))


def _contrasting_pair(rng: np.random.Generator, min_gap: float = 80.0) -> tuple[Color, Color]:
    """A (foreground, background) pair whose brightness differs by at least ``min_gap``."""
    while True:
        fg, bg = _random_color(rng), _random_color(rng)
        if abs(_luma(fg) - _luma(bg)) >= min_gap:
            return fg, bg


def _background(rng: np.random.Generator, n: int, color: Color) -> Image.Image:
    """A flat or gently graded background around ``color``."""
    base = np.array(color, dtype=np.float32)
    if rng.random() < 0.5:
        return Image.new("RGB", (n, n), color)
    direction = rng.normal(size=3).astype(np.float32) * 40.0
    ramp = np.linspace(-0.5, 0.5, n, dtype=np.float32)
    grid = ramp[:, None] if rng.random() < 0.5 else ramp[None, :]
    arr = base[None, None, :] + grid[..., None] * direction[None, None, :]
    arr = np.broadcast_to(arr, (n, n, 3))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def _finish(rng: np.random.Generator, image: Image.Image, size: int, noise: float = 10.0) -> Image.Image:
    """Downsample to ``size`` and add pixel noise and a brightness jitter."""
    small = image.resize((size, size), Image.Resampling.BOX)
    arr = np.asarray(small, dtype=np.float32)
    arr = arr * rng.uniform(0.85, 1.15) + rng.normal(0.0, rng.uniform(0.0, noise), size=arr.shape)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def _paste_layer(canvas: Image.Image, mask: Image.Image, color: Color) -> None:
    canvas.paste(Image.new("RGB", canvas.size, color), (0, 0), mask)


# ---------------------------------------------------------------- glyphs (digits, letters)


@lru_cache(maxsize=64)
def _font(size: int) -> ImageFont.FreeTypeFont | ImageFont.ImageFont:
    return ImageFont.load_default(size=size)


def _glyph(rng: np.random.Generator, text: str, size: int) -> Image.Image:
    n = size * SUPERSAMPLE
    fg, bg = _contrasting_pair(rng, min_gap=100.0)
    canvas = _background(rng, n, bg)
    mask = Image.new("L", (n, n), 0)
    font = _font(int(n * rng.uniform(0.7, 0.9)))
    draw = ImageDraw.Draw(mask)
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    x = (n - (right - left)) / 2 - left + rng.uniform(-0.06, 0.06) * n
    y = (n - (bottom - top)) / 2 - top + rng.uniform(-0.06, 0.06) * n
    draw.text((x, y), text, fill=255, font=font)
    mask = mask.filter(ImageFilter.MaxFilter(3))  # bold enough to survive downsampling
    mask = mask.rotate(rng.uniform(-12, 12), resample=Image.Resampling.BILINEAR)
    _paste_layer(canvas, mask, fg)
    return _finish(rng, canvas, size)


DIGITS = ("0", "1", "2", "3", "4", "5", "6", "7", "8", "9")
LETTERS = ("A", "C", "E", "F", "H", "K", "M", "R", "T", "X")


def render_digit(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    return _glyph(rng, DIGITS[label], size)


def render_letter(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    return _glyph(rng, LETTERS[label], size)


# ---------------------------------------------------------------- shapes


SHAPES = ("circle", "square", "triangle", "star", "cross", "diamond", "hexagon", "ring")


def _polygon(cx: float, cy: float, radius: float, sides: int, angle: float) -> list[tuple[float, float]]:
    return [
        (
            cx + radius * math.cos(angle + 2 * math.pi * k / sides),
            cy + radius * math.sin(angle + 2 * math.pi * k / sides),
        )
        for k in range(sides)
    ]


def _star(cx: float, cy: float, radius: float, angle: float) -> list[tuple[float, float]]:
    points = []
    for k in range(10):
        r = radius if k % 2 == 0 else radius * 0.45
        a = angle + math.pi * k / 5
        points.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    return points


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, r: float, angle: float) -> None:
    if shape == "circle":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    elif shape == "ring":
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
        draw.ellipse((cx - 0.55 * r, cy - 0.55 * r, cx + 0.55 * r, cy + 0.55 * r), fill=0)
    elif shape == "square":
        draw.polygon(_polygon(cx, cy, r * 1.15, 4, angle + math.pi / 4), fill=255)
    elif shape == "diamond":
        pts = [(cx, cy - 1.2 * r), (cx + 0.7 * r, cy), (cx, cy + 1.2 * r), (cx - 0.7 * r, cy)]
        c, s = math.cos(angle * 0.3), math.sin(angle * 0.3)
        draw.polygon([(cx + (x - cx) * c - (y - cy) * s, cy + (x - cx) * s + (y - cy) * c) for x, y in pts], fill=255)
    elif shape == "triangle":
        draw.polygon(_polygon(cx, cy, r * 1.2, 3, angle), fill=255)
    elif shape == "hexagon":
        draw.polygon(_polygon(cx, cy, r * 1.05, 6, angle), fill=255)
    elif shape == "star":
        draw.polygon(_star(cx, cy, r * 1.25, angle), fill=255)
    elif shape == "cross":
        w = 0.38 * r
        arm = [
            (-w, -r),
            (w, -r),
            (w, -w),
            (r, -w),
            (r, w),
            (w, w),
            (w, r),
            (-w, r),
            (-w, w),
            (-r, w),
            (-r, -w),
            (-w, -w),
        ]
        c, s = math.cos(angle), math.sin(angle)
        draw.polygon([(cx + x * c - y * s, cy + x * s + y * c) for x, y in arm], fill=255)
    else:  # pragma: no cover - SHAPES is closed
        raise ValueError(shape)


def _shape_mask(rng: np.random.Generator, n: int, shape: str, scale: tuple[float, float]) -> Image.Image:
    mask = Image.new("L", (n, n), 0)
    r = n * rng.uniform(*scale)
    cx = rng.uniform(r, n - r) if n - 2 * r > 0 else n / 2
    cy = rng.uniform(r, n - r) if n - 2 * r > 0 else n / 2
    _draw_shape(ImageDraw.Draw(mask), shape, cx, cy, r, rng.uniform(0, 2 * math.pi))
    return mask


def render_shape(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    n = size * SUPERSAMPLE
    fg, bg = _contrasting_pair(rng)
    canvas = _background(rng, n, bg)
    _paste_layer(canvas, _shape_mask(rng, n, SHAPES[label], (0.2, 0.36)), fg)
    return _finish(rng, canvas, size)


# ---------------------------------------------------------------- colours


COLORS = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink")
_HUES = (0.0, 30.0, 58.0, 120.0, 180.0, 225.0, 275.0, 320.0)


def render_color(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    """An object of one hue class (any shape) on an achromatic, possibly cluttered background."""
    n = size * SUPERSAMPLE
    gray = int(rng.uniform(20, 235))
    canvas = _background(rng, n, (gray, gray, gray))
    for _ in range(int(rng.integers(0, 3))):  # achromatic clutter
        g = int(rng.uniform(0, 255))
        _paste_layer(canvas, _shape_mask(rng, n, SHAPES[int(rng.integers(len(SHAPES)))], (0.08, 0.16)), (g, g, g))
    hue = (_HUES[label] + rng.uniform(-10, 10)) / 360.0
    value = rng.uniform(0.55, 1.0) if COLORS[label] != "pink" else rng.uniform(0.8, 1.0)
    sat = rng.uniform(0.35, 0.6) if COLORS[label] == "pink" else rng.uniform(0.7, 1.0)
    shape = SHAPES[int(rng.integers(len(SHAPES)))]
    _paste_layer(canvas, _shape_mask(rng, n, shape, (0.14, 0.3)), _hsv(hue, sat, value))
    return _finish(rng, canvas, size)


# ---------------------------------------------------------------- textures


TEXTURES = ("striped", "checkered", "dotted", "grid", "speckled", "zigzag", "wavy", "brick")


def render_texture(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    n = size * SUPERSAMPLE
    a, b = _contrasting_pair(rng, min_gap=60.0)
    yy, xx = np.mgrid[0:n, 0:n].astype(np.float32)
    angle = rng.uniform(0, math.pi)
    u = xx * math.cos(angle) + yy * math.sin(angle)
    v = -xx * math.sin(angle) + yy * math.cos(angle)
    period = rng.uniform(9, 16)
    phase = rng.uniform(0, period)
    kind = TEXTURES[label]
    if kind == "striped":
        mask = ((u + phase) % period) < period / 2
    elif kind == "checkered":
        mask = (((u + phase) // (period / 1.3)) + ((v + phase) // (period / 1.3))) % 2 == 0
    elif kind == "dotted":
        cu = ((u + phase) % period) - period / 2
        cv = ((v + phase) % period) - period / 2
        mask = cu**2 + cv**2 < (period * rng.uniform(0.22, 0.32)) ** 2
    elif kind == "grid":
        width = max(2.0, period * 0.18)
        mask = (((u + phase) % period) < width) | (((v + phase) % period) < width)
    elif kind == "speckled":
        mask = rng.random((n, n)) < rng.uniform(0.15, 0.4)
        mask = np.asarray(Image.fromarray(mask.astype(np.uint8) * 255).resize((n, n))) > 0
    elif kind == "zigzag":
        tri = np.abs(((u / period) % 1.0) - 0.5) * period
        mask = ((v + tri + phase) % period) < period / 2
    elif kind == "wavy":
        mask = ((v + 0.25 * period * np.sin(2 * math.pi * u / (1.7 * period)) + phase) % period) < period / 2
    elif kind == "brick":
        row = (yy + phase) // (period * 0.8)
        offset = (row % 2) * period
        mortar = max(2.0, period * 0.15)
        mask = (((yy + phase) % (period * 0.8)) < mortar) | (((xx + offset) % (2 * period)) < mortar)
    else:  # pragma: no cover - TEXTURES is closed
        raise ValueError(kind)
    arr = np.where(mask[..., None], np.array(a, np.float32), np.array(b, np.float32))
    return _finish(rng, Image.fromarray(arr.astype(np.uint8), "RGB"), size)


# ---------------------------------------------------------------- arrows


ARROWS = ("up", "upper right", "right", "lower right", "down", "lower left", "left", "upper left")


def render_arrow(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    n = size * SUPERSAMPLE
    fg, bg = _contrasting_pair(rng)
    canvas = _background(rng, n, bg)
    r = n * rng.uniform(0.28, 0.42)
    cx, cy = n / 2 + rng.uniform(-0.1, 0.1) * n, n / 2 + rng.uniform(-0.1, 0.1) * n
    shaft, head = rng.uniform(0.12, 0.2) * r * 1.6, rng.uniform(0.45, 0.6) * r
    # Arrow pointing along +x, then rotated: label 0 points up, then clockwise in 45° steps.
    pts = [
        (-r, -shaft / 2),
        (r - head, -shaft / 2),
        (r - head, -head),
        (r, 0),
        (r - head, head),
        (r - head, shaft / 2),
        (-r, shaft / 2),
    ]
    angle = math.radians(-90 + 45 * label + rng.uniform(-8, 8))
    c, s = math.cos(angle), math.sin(angle)
    mask = Image.new("L", (n, n), 0)
    ImageDraw.Draw(mask).polygon([(cx + x * c - y * s, cy + x * s + y * c) for x, y in pts], fill=255)
    _paste_layer(canvas, mask, fg)
    return _finish(rng, canvas, size)


# ---------------------------------------------------------------- scenes


SCENES = ("beach", "forest", "desert", "ocean", "snowfield", "night sky", "city", "meadow")


def _jitter(rng: np.random.Generator, color: Color, amount: float = 25.0) -> Color:
    return tuple(int(np.clip(c + rng.uniform(-amount, amount), 0, 255)) for c in color)  # type: ignore[return-value]


def render_scene(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    n = size * SUPERSAMPLE
    kind = SCENES[label]
    sky = {"night sky": (15, 20, 50), "snowfield": (190, 205, 225), "desert": (150, 200, 240)}.get(
        kind, (110, 170, 235)
    )
    ground = {
        "beach": (225, 205, 140),
        "forest": (40, 90, 40),
        "desert": (215, 170, 90),
        "ocean": (30, 80, 160),
        "snowfield": (240, 242, 248),
        "night sky": (20, 25, 30),
        "city": (95, 95, 100),
        "meadow": (110, 190, 70),
    }[kind]
    horizon = int(n * rng.uniform(0.35, 0.6))
    canvas = Image.new("RGB", (n, n), _jitter(rng, sky))
    draw = ImageDraw.Draw(canvas)
    draw.rectangle((0, horizon, n, n), fill=_jitter(rng, ground))
    if kind == "beach":
        draw.rectangle((0, horizon, n, horizon + int(n * rng.uniform(0.08, 0.18))), fill=_jitter(rng, (40, 110, 190)))
    elif kind == "forest":
        for _ in range(int(rng.integers(4, 8))):
            x, h = rng.uniform(0, n), rng.uniform(0.25, 0.45) * n
            base_y = horizon + rng.uniform(0, 0.3) * n
            draw.rectangle((x - 2, base_y - h * 0.25, x + 2, base_y), fill=(90, 60, 30))
            draw.polygon(
                [(x, base_y - h), (x - h * 0.3, base_y - h * 0.2), (x + h * 0.3, base_y - h * 0.2)],
                fill=_jitter(rng, (20, 110, 40)),
            )
    elif kind == "desert":
        for _ in range(int(rng.integers(1, 3))):
            x, w = rng.uniform(0, n), rng.uniform(0.3, 0.6) * n
            draw.ellipse((x - w, horizon - w * 0.25, x + w, horizon + w * 0.25), fill=_jitter(rng, (200, 150, 80)))
    elif kind == "ocean":
        for _ in range(int(rng.integers(4, 9))):
            x, y = rng.uniform(0, n), rng.uniform(horizon, n)
            draw.line((x - 6, y, x, y - 3, x + 6, y), fill=(220, 235, 250), width=2)
    elif kind == "night sky":
        for _ in range(int(rng.integers(6, 16))):
            x, y = rng.uniform(0, n), rng.uniform(0, horizon)
            draw.point((x, y), fill=(255, 255, 220))
            draw.point((x + 1, y), fill=(255, 255, 220))
        if rng.random() < 0.6:
            x, y, r = rng.uniform(0.2, 0.8) * n, rng.uniform(0.1, 0.3) * n, rng.uniform(3, 6)
            draw.ellipse((x - r, y - r, x + r, y + r), fill=(240, 240, 200))
    elif kind == "city":
        x = 0.0
        while x < n:
            w, h = rng.uniform(6, 14), rng.uniform(0.2, 0.55) * n
            draw.rectangle((x, horizon - h, x + w, n), fill=_jitter(rng, (80, 80, 90), 30))
            for wy in np.arange(horizon - h + 3, horizon, 5):
                draw.rectangle((x + 2, wy, x + 3, wy + 1), fill=(240, 220, 120))
            x += w + rng.uniform(1, 4)
    elif kind == "meadow":
        for _ in range(int(rng.integers(5, 12))):
            x, y = rng.uniform(0, n), rng.uniform(horizon, n)
            draw.ellipse((x - 1.5, y - 1.5, x + 1.5, y + 1.5), fill=_jitter(rng, (230, 80, 160), 60))
    elif kind == "snowfield":
        for _ in range(int(rng.integers(0, 3))):
            x, h = rng.uniform(0, n), rng.uniform(0.15, 0.3) * n
            draw.polygon([(x, horizon - h), (x - h, horizon), (x + h, horizon)], fill=_jitter(rng, (170, 180, 200)))
    if kind in {"beach", "desert", "meadow"} and rng.random() < 0.5:
        x, y, r = rng.uniform(0.1, 0.9) * n, rng.uniform(0.05, 0.25) * n, rng.uniform(3, 6)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=(250, 230, 120))
    return _finish(rng, canvas, size, noise=14.0)


# ---------------------------------------------------------------- counting


COUNTS = ("one", "two", "three", "four", "five", "six")


def render_count(rng: np.random.Generator, label: int, size: int) -> Image.Image:
    n = size * SUPERSAMPLE
    fg, bg = _contrasting_pair(rng, min_gap=100.0)
    canvas = _background(rng, n, bg)
    draw = ImageDraw.Draw(canvas)
    r = rng.uniform(0.07, 0.09) * n
    centres: list[tuple[float, float]] = []
    spacing, attempts = 2.4 * r, 0
    while len(centres) < label + 1:
        x, y = rng.uniform(r + 1, n - r - 1), rng.uniform(r + 1, n - r - 1)
        if all((x - a) ** 2 + (y - b) ** 2 > spacing**2 for a, b in centres):
            centres.append((x, y))
        attempts += 1
        if attempts % 100 == 0:  # crowded: allow closer dots rather than loop forever
            spacing *= 0.9
    square = rng.random() < 0.3
    for x, y in centres:
        box = (x - r, y - r, x + r, y + r)
        draw.rectangle(box, fill=fg) if square else draw.ellipse(box, fill=fg)
    return _finish(rng, canvas, size)


# ---------------------------------------------------------------- the task list


MINI8_TASKS: tuple[ImageTask, ...] = (
    ImageTask(
        "digits",
        DIGITS,
        ('a photo of the number: "{}".', "a picture of the digit {}.", "the number {} written in a font."),
        "digits 0-9 in Pillow's font, random colours, size, position and tilt",
        render_digit,
    ),
    ImageTask(
        "letters",
        LETTERS,
        ('a photo of the letter "{}".', "the letter {} in a typeface.", "a picture of a {}, a letter."),
        "ten capital Latin letters, random colours, size, position and tilt",
        render_letter,
    ),
    ImageTask(
        "shapes",
        SHAPES,
        ("a drawing of a {}.", "a {} shape.", "a picture of a {}."),
        "eight filled shapes, random colour, size, position and rotation",
        render_shape,
    ),
    ImageTask(
        "colors",
        COLORS,
        ("something coloured {}.", "a {} object.", "the colour {}."),
        "the hue of one object of any shape on a grey, cluttered background",
        render_color,
    ),
    ImageTask(
        "textures",
        TEXTURES,
        ("a {} texture.", "a close-up of a {} pattern.", "a {} surface."),
        "eight periodic or random patterns, random colours, scale, phase and angle",
        render_texture,
    ),
    ImageTask(
        "arrows",
        ARROWS,
        ("an arrow pointing {}.", "a sign pointing {}.", "the direction {}."),
        "an arrow pointing in one of eight directions, random colours, size and position",
        render_arrow,
    ),
    ImageTask(
        "scenes",
        SCENES,
        ("a photo of a {}.", "a landscape: {}.", "a view of a {}."),
        "eight tiny landscapes with random horizon, colours and details",
        render_scene,
    ),
    ImageTask(
        "counting",
        COUNTS,
        ("a photo of {} dots.", "{} objects.", "there are {} things."),
        "one to six dots or squares, random colours, size and places",
        render_count,
    ),
)
