"""Pretraining of the zoo's base encoder on data distinct from every downstream task.

The base plays CLIP's role: a broadly useful encoder trained on other data. One classifier is
trained over three families of categories, none of which is a downstream class:
- `K` procedural "object categories", each a fixed random composite (an irregular polygon, an inner
  stroke, a colour scheme) drawn under random pose, scale and background (ImageNet-like objects);
- Greek and Cyrillic letters in random fonts, colours and poses (text seen in the wild; the
  downstream glyph tasks use Latin digits and sign symbols);
- plaids: two superposed gratings at random orientations, labelled by their pair of spatial
  frequency bands (frequency, not orientation: the downstream stripes task asks for orientation).
The pretraining head is thrown away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import ImageDraw
from tqdm import tqdm

import featcal.experiments.zoo.draw as D
from featcal.experiments.zoo.train import optimizer, pixel_values, schedule


@dataclass(frozen=True)
class Category:
    outline: tuple[tuple[float, float], ...]  # polygon in unit coordinates
    stroke: tuple[tuple[float, float], ...]  # polyline drawn over it
    hue: float
    hue2: float


def categories(k: int, seed: int) -> list[Category]:
    """`k` random object categories, fixed by `seed`."""
    rng = np.random.default_rng([seed, 1234])
    out = []
    for _ in range(k):
        n = int(rng.integers(5, 11))
        angles = np.sort(rng.uniform(0, 2 * math.pi, n))
        radii = rng.uniform(0.45, 1.0, n)
        outline = tuple((float(r * math.cos(a)), float(r * math.sin(a))) for r, a in zip(radii, angles, strict=True))
        stroke = tuple((float(x), float(y)) for x, y in rng.uniform(-0.6, 0.6, (int(rng.integers(2, 4)), 2)))
        out.append(Category(outline, stroke, float(rng.random()), float(rng.random())))
    return out


def render(rng: np.random.Generator, cat: Category) -> np.ndarray:
    c = D.CANVAS
    img = D.background(rng, D.random_colour(rng), rng.uniform(0.1, 0.5))
    d = ImageDraw.Draw(img)
    scale = rng.uniform(0.22, 0.42) * c
    cx, cy = rng.uniform(0.35 * c, 0.65 * c, 2)
    angle = rng.uniform(-0.5, 0.5)
    v = rng.uniform(0.45, 1.0)
    d.polygon(D.transform(list(cat.outline), cx, cy, scale, angle), fill=D.hsv(cat.hue + rng.uniform(-0.04, 0.04), 0.75, v))
    d.line(D.transform(list(cat.stroke), cx, cy, scale, angle), fill=D.hsv(cat.hue2, 0.6, 1.1 - v), width=int(scale * 0.18))
    return D.finish(img, rng, 0.03)


LETTERS = "αβγδεζηθλξπσφψωΓΔΘΛΞΠΣΦΨΩбгджзийлфцчшщыэюяБГДЖЗИЛФЦШЭЮЯ"
BANDS = (1.5, 2.5, 3.5, 5.0, 7.0)  # cycles per image, centres of the plaid frequency bands


def render_letter(rng: np.random.Generator, index: int) -> np.ndarray:
    fg, bg = D.contrasting_pair(rng)
    img = D.background(rng, bg, 0.3)
    c = D.CANVAS
    D.draw_glyph(img, LETTERS[index], c / 2 + rng.uniform(-6, 6), c / 2 + rng.uniform(-6, 6),
                 rng.uniform(0.5, 0.8) * c, fg, int(rng.integers(0, len(D.FONT_FILES))), rng.uniform(-20, 20))
    return D.finish(img, rng, 0.03)


def render_plaid(rng: np.random.Generator, index: int) -> np.ndarray:
    c = D.CANVAS
    f1, f2 = BANDS[index // len(BANDS)], BANDS[index % len(BANDS)]
    yy, xx = np.mgrid[0:c, 0:c].astype(np.float32) / c
    wave = np.zeros((c, c), np.float32)
    for f in (f1, f2):
        a = rng.uniform(0, np.pi)
        f = f * rng.uniform(0.9, 1.1)
        wave += np.sin(2 * np.pi * f * (xx * np.cos(a) + yy * np.sin(a)) + rng.uniform(0, 2 * np.pi))
    t = (wave[..., None] / 4 + 0.5).clip(0, 1)
    a_col, b_col = D.contrasting_pair(rng)
    img = t * np.asarray(a_col, np.float32) + (1 - t) * np.asarray(b_col, np.float32)
    from PIL import Image

    return D.finish(Image.fromarray(img.astype(np.uint8), "RGB"), rng, 0.03)


def n_classes(k: int) -> int:
    """Pretraining classes: k objects, the letters, and the plaid frequency-band pairs."""
    return k + len(LETTERS) + len(BANDS) ** 2


def pretraining_set(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` labelled pretraining images over `n_classes(k)` categories (balanced)."""
    cats = categories(k, seed)
    rng = np.random.default_rng([seed, 4321])
    labels = rng.permutation(np.arange(n) % n_classes(k)).astype(np.int64)
    images = []
    for y in labels.tolist():
        if y < k:
            images.append(render(rng, cats[y]))
        elif y < k + len(LETTERS):
            images.append(render_letter(rng, y - k))
        else:
            images.append(render_plaid(rng, y - k - len(LETTERS)))
    return np.stack(images), labels


@dataclass(frozen=True)
class PretrainSettings:
    images: int
    categories: int
    steps: int
    batch_size: int
    lr: float
    weight_decay: float = 0.05
    warmup: int = 50


def pretrain(model, settings: PretrainSettings, seed: int, progress: bool = True) -> dict[str, float]:
    """Train `model` (a CLIPVisionModel) in place on the pretraining categories; return its metrics."""
    images, labels = pretraining_set(settings.images, settings.categories, seed)
    x, y = pixel_values(images), torch.from_numpy(labels)
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(model.config.hidden_size, n_classes(settings.categories))
    params = list(model.parameters()) + list(head.parameters())
    opt = optimizer(params, settings.lr, settings.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule(settings.warmup, settings.steps))
    model.train()
    correct = seen = 0
    bar = tqdm(range(settings.steps), desc="pretrain base", disable=not progress, leave=False)
    for step in bar:
        idx = torch.randint(0, len(x), (settings.batch_size,), generator=g)
        logits = head(model(pixel_values=x[idx]).pooler_output)
        loss = torch.nn.functional.cross_entropy(logits, y[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step >= settings.steps - 50:  # training accuracy over the last steps
            correct += int((logits.argmax(-1) == y[idx]).sum())
            seen += len(idx)
        bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    return {"final_loss": float(loss.item()), "final_train_accuracy": correct / max(seen, 1)}
