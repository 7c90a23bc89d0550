"""Rendering primitives for the procedural zoo: backgrounds, polygons, glyphs, all from a seeded RNG.

Images are drawn at twice the output size and box-downsampled, which anti-aliases edges so that a
small ViT sees shapes rather than jagged pixels. Fonts come from matplotlib's bundled DejaVu/STIX
files, so glyph tasks render identically wherever the pip package is installed.
"""

from __future__ import annotations

import colorsys
import functools
import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SIZE = 32  # output side in pixels
SCALE = 2  # supersampling factor
CANVAS = SIZE * SCALE

FONT_FILES = (
    "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf",
    "DejaVuSansMono.ttf", "DejaVuSans-Oblique.ttf", "STIXGeneral.ttf", "STIXGeneralBol.ttf",
)


def font_dir() -> Path:
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


@functools.lru_cache(maxsize=256)
def font(index: int, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.truetype(str(font_dir() / FONT_FILES[index % len(FONT_FILES)]), size)


def hsv(h: float, s: float, v: float) -> tuple[int, int, int]:
    r, g, b = colorsys.hsv_to_rgb(h % 1.0, min(max(s, 0.0), 1.0), min(max(v, 0.0), 1.0))
    return int(r * 255), int(g * 255), int(b * 255)


def random_colour(rng: np.random.Generator) -> tuple[int, int, int]:
    return hsv(rng.random(), rng.uniform(0.2, 1.0), rng.uniform(0.2, 1.0))


def contrasting_pair(rng: np.random.Generator) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """A foreground and a background colour whose brightness differs enough to see the shape."""
    v_bg = rng.uniform(0.05, 0.95)
    v_fg = (v_bg + rng.uniform(0.35, 0.65)) % 1.0
    if abs(v_fg - v_bg) < 0.3:
        v_fg = 1.0 - v_bg
    return hsv(rng.random(), rng.uniform(0, 1), v_fg), hsv(rng.random(), rng.uniform(0, 1), v_bg)


def smooth_noise(rng: np.random.Generator, cells: int, size: int = CANVAS) -> np.ndarray:
    """A smooth random field in [0, 1] of shape (size, size): low-res noise upsampled bicubically."""
    low = (rng.random((cells, cells)) * 255).astype(np.uint8)
    up = Image.fromarray(low, "L").resize((size, size), Image.BICUBIC)
    return np.asarray(up, dtype=np.float32) / 255.0


def background(rng: np.random.Generator, base: tuple[int, int, int], contrast: float = 0.25) -> Image.Image:
    """A plain colour modulated by a smooth random field (scenes are rarely flat)."""
    field = smooth_noise(rng, int(rng.integers(2, 6)))[..., None] - 0.5
    img = np.asarray(base, dtype=np.float32)[None, None, :] * (1.0 + contrast * 2 * field)
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


def regular_polygon(cx: float, cy: float, r: float, n: int, angle: float) -> list[tuple[float, float]]:
    return [(cx + r * math.cos(angle + 2 * math.pi * i / n), cy + r * math.sin(angle + 2 * math.pi * i / n)) for i in range(n)]


def star(cx: float, cy: float, r: float, points: int, angle: float, inner: float = 0.45) -> list[tuple[float, float]]:
    out = []
    for i in range(2 * points):
        rad = r if i % 2 == 0 else r * inner
        a = angle + math.pi * i / points
        out.append((cx + rad * math.cos(a), cy + rad * math.sin(a)))
    return out


def transform(points: list[tuple[float, float]], cx: float, cy: float, scale: float, angle: float) -> list[tuple[float, float]]:
    """Rotate, scale and place points given in unit coordinates around the origin."""
    c, s = math.cos(angle), math.sin(angle)
    return [(cx + scale * (x * c - y * s), cy + scale * (x * s + y * c)) for x, y in points]


def draw_glyph(
    img: Image.Image, text: str, cx: float, cy: float, height: float, colour, font_index: int, angle_deg: float = 0.0
) -> None:
    """Paste `text` centred at (cx, cy), about `height` pixels tall, rotated by angle_deg."""
    f = font(font_index, max(int(height), 6))
    left, top, right, bottom = f.getbbox(text)
    w, h = right - left, bottom - top
    layer = Image.new("L", (w + 8, h + 8), 0)
    ImageDraw.Draw(layer).text((4 - left, 4 - top), text, fill=255, font=f)
    if angle_deg:
        layer = layer.rotate(angle_deg, resample=Image.BICUBIC, expand=True)
    solid = Image.new("RGB", layer.size, colour)
    img.paste(solid, (int(cx - layer.width / 2), int(cy - layer.height / 2)), layer)


def finish(img: Image.Image, rng: np.random.Generator | None = None, noise: float = 0.0) -> np.ndarray:
    """Downsample to SIZE×SIZE, optionally add pixel noise, return uint8 (H, W, 3)."""
    out = np.asarray(img.resize((SIZE, SIZE), Image.BOX), dtype=np.float32)
    if noise and rng is not None:
        out = out + rng.normal(0.0, noise * 255, out.shape)
    return np.clip(out, 0, 255).astype(np.uint8)
