"""The eight downstream tasks of the zoo: image classification problems that differ in kind.

They play the roles of the paper's CLIP tasks: objects (shapes), orientation (stripes), texture
(DTD), dominant colour (RESISC-like scenes), land cover seen from above (EuroSAT), printed digits
(SVHN), handwritten digits (MNIST; real scikit-learn images) and traffic-sign-like symbols (GTSRB). Each generator maps (rng, labels) to
uint8 images (N, 32, 32, 3); labels are drawn balanced by `make_split`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

import featcal.experiments.zoo.draw as D

Generator = Callable[[np.random.Generator, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Task:
    name: str
    classes: tuple[str, ...]
    generate: Generator | None = None  # renderer of procedural tasks
    pool: Callable[[], tuple[np.ndarray, np.ndarray]] | None = None  # all images of a real dataset

    @property
    def real(self) -> bool:
        return self.pool is not None


def _each(render: Callable[[np.random.Generator, int], np.ndarray]) -> Generator:
    def gen(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
        return np.stack([render(rng, int(y)) for y in labels])

    return gen


# ---- shapes: which object is drawn -------------------------------------------------------------
SHAPES = ("circle", "square", "triangle", "cross", "star", "ring")


def _shape(rng: np.random.Generator, y: int) -> np.ndarray:
    fg, bg = D.contrasting_pair(rng)
    img = D.background(rng, bg)
    d = ImageDraw.Draw(img)
    c = D.CANVAS
    r = rng.uniform(0.28, 0.42) * c
    cx, cy = c / 2 + rng.uniform(-0.08, 0.08, 2) * c
    a = -math.pi / 2 + rng.uniform(-0.15, 0.15)  # upright, like photographed objects
    name = SHAPES[y]
    if name == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fg)
    elif name == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], outline=fg, width=max(3, int(r * 0.3)))
    elif name == "square":
        d.polygon(D.regular_polygon(cx, cy, r * 1.1, 4, a + math.pi / 4), fill=fg)
    elif name == "triangle":
        d.polygon(D.regular_polygon(cx, cy, r * 1.15, 3, a), fill=fg)
    elif name == "star":
        d.polygon(D.star(cx, cy, r * 1.15, 5, a), fill=fg)
    else:  # cross
        arm = [(-1, -0.3), (1, -0.3), (1, 0.3), (-1, 0.3)]
        d.polygon(D.transform(arm, cx, cy, r, a), fill=fg)
        d.polygon(D.transform(arm, cx, cy, r, a + math.pi / 2), fill=fg)
    return D.finish(img, rng, 0.02)


# ---- stripes: orientation of a grating ---------------------------------------------------------
ANGLES = tuple(f"{int(22.5 * i)}deg" for i in range(8))


def _stripes(rng: np.random.Generator, y: int) -> np.ndarray:
    c = D.CANVAS
    theta = math.radians(22.5 * y + rng.uniform(-5, 5))
    freq = rng.uniform(2.5, 6.0) / c
    yy, xx = np.mgrid[0:c, 0:c].astype(np.float32)
    wave = np.sin(2 * math.pi * freq * (xx * math.cos(theta) + yy * math.sin(theta)) + rng.uniform(0, 2 * math.pi))
    if rng.random() < 0.5:
        wave = np.sign(wave)  # square-wave bars as well as sine gratings
    a, b = D.contrasting_pair(rng)
    t = (wave[..., None] + 1) / 2
    img = t * np.asarray(a, np.float32) + (1 - t) * np.asarray(b, np.float32)
    return D.finish(Image.fromarray(img.astype(np.uint8), "RGB"), rng, 0.04)


# ---- textures: which texture fills the image ---------------------------------------------------
TEXTURES = ("checker", "dots", "grid", "rings", "zigzag", "speckle", "blobs", "bricks")


def _texture(rng: np.random.Generator, y: int) -> np.ndarray:
    c = D.CANVAS
    yy, xx = np.mgrid[0:c, 0:c].astype(np.float32)
    a = rng.uniform(-0.2, 0.2)
    u = xx * math.cos(a) + yy * math.sin(a)
    v = -xx * math.sin(a) + yy * math.cos(a)
    p = rng.uniform(12, 20)  # period in canvas pixels
    name = TEXTURES[y]
    if name == "checker":
        m = ((np.floor(u / p) + np.floor(v / p)) % 2).astype(np.float32)
    elif name == "dots":
        m = ((((u % p) - p / 2) ** 2 + ((v % p) - p / 2) ** 2) < (p * 0.28) ** 2).astype(np.float32)
    elif name == "grid":
        m = (((u % p) < p * 0.22) | ((v % p) < p * 0.22)).astype(np.float32)
    elif name == "rings":
        cx, cy = rng.uniform(0, c, 2)
        m = ((np.sqrt((xx - cx) ** 2 + (yy - cy) ** 2) % p) < p / 2).astype(np.float32)
    elif name == "zigzag":
        m = (((v + np.abs((u % p) - p / 2) * 1.5) % p) < p / 2).astype(np.float32)
    elif name == "speckle":
        m = (rng.random((c // 2, c // 2)) < 0.5).astype(np.float32).repeat(2, 0).repeat(2, 1)
    elif name == "blobs":
        m = (D.smooth_noise(rng, int(rng.integers(5, 9))) > 0.5).astype(np.float32)
    else:  # bricks
        row = np.floor(v / p)
        m = (((v % p) < p * 0.2) | (((u + row * p) % (2 * p)) < p * 0.2)).astype(np.float32)
    fg, bg = D.contrasting_pair(rng)
    img = m[..., None] * np.asarray(fg, np.float32) + (1 - m[..., None]) * np.asarray(bg, np.float32)
    return D.finish(Image.fromarray(img.astype(np.uint8), "RGB"), rng, 0.03)


# ---- colours: dominant hue of a textured scene ------------------------------------------------
HUES = ("red", "orange", "yellow", "green", "cyan", "blue", "purple", "pink")
_HUE_CENTRES = (0.0, 0.08, 0.16, 0.33, 0.5, 0.63, 0.76, 0.88)


def _colour(rng: np.random.Generator, y: int) -> np.ndarray:
    c = D.CANVAS
    h = _HUE_CENTRES[y] + rng.uniform(-0.025, 0.025)
    s = 0.45 + 0.55 * D.smooth_noise(rng, int(rng.integers(3, 8)))
    v = 0.35 + 0.65 * D.smooth_noise(rng, int(rng.integers(3, 8)))
    hsv = np.stack([np.full((c, c), h % 1.0, np.float32), s, v], -1)
    img = Image.fromarray((hsv * 255).astype(np.uint8), "HSV").convert("RGB")
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(0, 4))):  # distractors covering a small area
        r = rng.uniform(3, 7)
        cx, cy = rng.uniform(0, c, 2)
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=D.random_colour(rng))
    return D.finish(img, rng, 0.02)


# ---- land cover: colour-and-texture scenes seen from above (EuroSAT-like) ----------------------
LANDCOVER = ("forest", "sea", "desert", "urban", "crops", "snow", "river", "residential")
_LAND = {  # pattern, (hue, saturation, value) of the two colours
    "forest": ("blobs", (0.30, 0.8, 0.35), (0.27, 0.6, 0.6)),
    "sea": ("waves", (0.60, 0.8, 0.45), (0.58, 0.6, 0.75)),
    "desert": ("dunes", (0.11, 0.6, 0.85), (0.09, 0.7, 0.6)),
    "urban": ("grid", (0.0, 0.0, 0.35), (0.0, 0.05, 0.7)),
    "crops": ("rows", (0.22, 0.7, 0.7), (0.14, 0.7, 0.8)),
    "snow": ("speckle", (0.6, 0.05, 0.95), (0.6, 0.1, 0.8)),
    "river": ("band", (0.28, 0.6, 0.5), (0.6, 0.7, 0.7)),
    "residential": ("bricks", (0.02, 0.6, 0.6), (0.0, 0.0, 0.75)),
}


def _jitter(rng: np.random.Generator, h: float, s: float, v: float) -> tuple[int, int, int]:
    return D.hsv(h + rng.uniform(-0.03, 0.03), s * rng.uniform(0.8, 1.1), v * rng.uniform(0.8, 1.15))


def _landcover(rng: np.random.Generator, y: int) -> np.ndarray:
    pattern, a, b = _LAND[LANDCOVER[y]]
    c = D.CANVAS
    yy, xx = np.mgrid[0:c, 0:c].astype(np.float32) - c / 2
    ang = rng.uniform(0, math.pi)
    u = xx * math.cos(ang) + yy * math.sin(ang)
    v = -xx * math.sin(ang) + yy * math.cos(ang)
    p = rng.uniform(8, 14)
    if pattern == "blobs":
        m = D.smooth_noise(rng, int(rng.integers(6, 10)))
    elif pattern == "waves":
        m = 0.5 + 0.5 * np.sin(2 * math.pi * u / p + 2 * np.sin(v / p))
    elif pattern == "dunes":
        m = D.smooth_noise(rng, 3) * 0.7 + 0.3 * (0.5 + 0.5 * np.sin(2 * math.pi * u / (2 * p)))
    elif pattern == "grid":
        m = (((u % p) < p * 0.3) | ((v % p) < p * 0.3)).astype(np.float32)
    elif pattern == "rows":
        m = ((u % p) < p / 2).astype(np.float32)
    elif pattern == "speckle":
        m = rng.random((c, c)).astype(np.float32)
    elif pattern == "band":
        m = (np.abs(v + rng.uniform(-8, 8) - 6 * np.sin(u / 9)) < rng.uniform(5, 10)).astype(np.float32)
    else:  # bricks (roofs)
        row = np.floor(v / p)
        m = (((v % p) < p * 0.25) | (((u + row * p / 2) % p) < p * 0.25)).astype(np.float32)
    ca, cb = np.asarray(_jitter(rng, *a), np.float32), np.asarray(_jitter(rng, *b), np.float32)
    img = m[..., None] * cb + (1 - m[..., None]) * ca
    return D.finish(Image.fromarray(img.clip(0, 255).astype(np.uint8), "RGB"), rng, 0.03)


# ---- printed digits in a street-number style (SVHN-like) --------------------------------------
DIGITS = tuple(str(i) for i in range(10))


def _printed_digit(rng: np.random.Generator, y: int) -> np.ndarray:
    fg, bg = D.contrasting_pair(rng)
    img = D.background(rng, bg, 0.3)
    c = D.CANVAS
    h = rng.uniform(0.7, 0.85) * c
    fi = int(rng.integers(0, 4))  # the sans, bold and serif faces
    cx, cy = c / 2 + rng.uniform(-3, 3), c / 2 + rng.uniform(-3, 3)
    for side in (-1, 1):  # neighbouring house-number digits, mostly cut off by the frame
        if rng.random() < 0.3:
            D.draw_glyph(img, str(rng.integers(0, 10)), cx + side * h * 0.95, cy, h, fg, fi)
    D.draw_glyph(img, DIGITS[y], cx, cy, h, fg, fi, rng.uniform(-8, 8))
    return D.finish(img, rng, 0.03)


# ---- handwritten digits: scikit-learn's real 8x8 digits, upsampled (MNIST-like) --------------
def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.images.astype(np.float32), data.target.astype(np.int64)


@functools.lru_cache(maxsize=1)
def handwritten_pool() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 real digits as 32×32 RGB uint8, ink and paper in random contrasting colours (as
    digits appear in photographs), with their labels. The colours are fixed per image by its index."""
    images, labels = _sklearn_digits()
    out = np.zeros((len(images), D.SIZE, D.SIZE, 3), np.uint8)
    rng = np.random.default_rng(1797)
    for i, im in enumerate(images):
        big = Image.fromarray((im / 16.0 * 255).astype(np.uint8), "L").resize((24, 24), Image.BILINEAR)
        ink = np.zeros((D.SIZE, D.SIZE, 1), np.float32)
        ink[4:28, 4:28, 0] = np.asarray(big, np.float32) / 255.0
        fg, bg = D.contrasting_pair(rng)
        out[i] = (ink * np.asarray(fg, np.float32) + (1 - ink) * np.asarray(bg, np.float32)).astype(np.uint8)
    return out, labels


# ---- signs: fine-grained symbol-on-shape categories (GTSRB-like) ------------------------------
SIGNS = ("limit30", "limit50", "limit80", "warning", "crossing", "ahead", "parking", "stop")
_SIGN_SPEC = {  # shape, colour scheme, symbol
    "limit30": ("ring", "red", "30"), "limit50": ("ring", "red", "50"), "limit80": ("ring", "red", "80"),
    "warning": ("triangle", "red", "!"), "crossing": ("triangle", "red", "X"),
    "ahead": ("disc", "blue", "↑"), "parking": ("square", "blue", "P"), "stop": ("octagon", "red", "S"),
}


def _sign(rng: np.random.Generator, y: int) -> np.ndarray:
    shape, scheme, symbol = _SIGN_SPEC[SIGNS[y]]
    img = D.background(rng, D.random_colour(rng), 0.4)
    d = ImageDraw.Draw(img)
    c = D.CANVAS
    r = rng.uniform(0.33, 0.45) * c
    cx, cy = c / 2 + rng.uniform(-5, 5), c / 2 + rng.uniform(-5, 5)
    bright = rng.uniform(0.55, 1.0)
    red, blue = D.hsv(0.0, 0.85, bright), D.hsv(0.62, 0.85, bright)
    white, black = D.hsv(0, 0, bright), D.hsv(0, 0, 0.12)
    if shape == "ring":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=white, outline=red, width=int(r * 0.22))
        ink = black
    elif shape == "triangle":
        pts = D.regular_polygon(cx, cy + r * 0.15, r * 1.1, 3, -math.pi / 2)
        d.polygon(pts, fill=red)
        d.polygon(D.regular_polygon(cx, cy + r * 0.15, r * 0.72, 3, -math.pi / 2), fill=white)
        ink = black
    elif shape == "disc":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=blue)
        ink = white
    elif shape == "square":
        d.rectangle([cx - r * 0.9, cy - r * 0.9, cx + r * 0.9, cy + r * 0.9], fill=blue)
        ink = white
    else:  # octagon
        d.polygon(D.regular_polygon(cx, cy, r, 8, math.pi / 8), fill=red)
        ink = white
    height = r * (0.8 if len(symbol) > 1 else 1.0) * (0.8 if shape == "triangle" else 1.0)
    D.draw_glyph(img, symbol, cx, cy + (r * 0.2 if shape == "triangle" else 0), height, ink, 0)
    img = img.rotate(rng.uniform(-10, 10), resample=Image.BICUBIC)
    return D.finish(img, rng, 0.03)


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("shapes", SHAPES, _each(_shape)),
        Task("stripes", ANGLES, _each(_stripes)),
        Task("textures", TEXTURES, _each(_texture)),
        Task("colours", HUES, _each(_colour)),
        Task("landcover", LANDCOVER, _each(_landcover)),
        Task("printed_digits", DIGITS, _each(_printed_digit)),
        Task("handwritten_digits", DIGITS, pool=handwritten_pool),
        Task("signs", SIGNS, _each(_sign)),
    )
}


def balanced_labels(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return rng.permutation(np.arange(n) % k).astype(np.int64)


def make_splits(task: Task, sizes: dict[str, int], seed: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Disjoint labelled splits {name: (images uint8 (N,32,32,3), labels int64)} for one task.

    Procedural splits use independent RNG streams per split; real data is shuffled once with the
    seed and cut into consecutive, non-overlapping pieces.
    """
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    if task.pool is not None:
        images, labels = task.pool()
        need = sum(sizes.values())
        if need > len(images):
            raise ValueError(f"task {task.name}: {need} images requested, only {len(images)} exist")
        order = np.random.default_rng([seed, 7]).permutation(len(images))
        start = 0
        for name, n in sizes.items():
            idx = order[start : start + n]
            out[name] = (images[idx], labels[idx])
            start += n
        return out
    for i, (name, n) in enumerate(sizes.items()):
        rng = np.random.default_rng([seed, sum(map(ord, task.name)), i])
        labels = balanced_labels(rng, n, len(task.classes))
        assert task.generate is not None
        out[name] = (task.generate(rng, labels), labels)
    return out
