"""Each domain's documents split four ways, and cut into windows of tokens the way every stage reads them.

Split (per seed, by a hash of the seed, the domain and the document's key, so no document, and for Python
no module, straddles two parts): 10 % test (the held-out text every row is scored on), 5 % select (the
held-out calibration windows the label-free choice of the best merge is scored on), 25 % calib (what
`featcal calibrate --calib` and RegMean read), 60 % train (the experts' fine-tuning text). Each part is
shuffled with the seed, so the seed changes which documents are held out, which training windows each
expert sees and in what order, and which calibration windows each size takes.

Windows: the documents of a part, in that order, tokenised without special tokens and closed with the
eos token, are concatenated and cut into pieces of `length - len(start)` tokens, where `start` is what the
tokenizer puts before any text it encodes (Gemma's <bos>; nothing for SmolLM2). A training window is
`start + piece`; the other parts are written as the decoded piece, which featcal re-tokenises and so
prefixes with the same `start`: every model, in training, calibration and evaluation, reads windows that
begin the way its tokenizer begins a text. (The earlier bench trained Gemma on windows with no <bos>: see
docs/bench-decoder.md, "Gemma-3-270M".)
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path

PARTS = ("train", "select", "calib", "test")
BOUNDS = (("test", 10), ("select", 15), ("calib", 40))  # cumulative percentages; the rest is train
DATA_VERSION = 2  # recorded in bench.json; keys hash the windows themselves (their content), so no bump is needed


def split_docs(docs: list[tuple[str, str]], seed: int, name: str) -> dict[str, list[str]]:
    """train / select / calib / test parts of (key, document) pairs, by a hash of (seed, domain, key)."""
    import numpy as np

    parts: dict[str, list[str]] = {p: [] for p in PARTS}
    for key, doc in docs:
        h = zlib.crc32(f"{seed}:{name}:{key}".encode()) % 100
        parts[next((p for p, bound in BOUNDS if h < bound), "train")].append(doc)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    for k in parts:
        order = rng.permutation(len(parts[k]))
        parts[k] = [parts[k][i] for i in order]
    return parts


def start_tokens(tokenizer) -> list[int]:
    """The ids the tokenizer puts before any text it encodes (its BOS, where it adds one)."""
    probe = "a b"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe)["input_ids"]
    for i in range(len(full) - len(plain) + 1):
        if full[i:i + len(plain)] == plain:
            return list(full[:i])
    return []


def separator(tokenizer) -> int:
    sep = tokenizer.eos_token_id
    return int(sep if sep is not None else 0)


def pieces(tokenizer, docs: list[str], n: int, size: int, *, cycle: bool = False,
           what: str = "") -> tuple[list[list[int]], int]:
    """(n pieces of `size` stream tokens, passes over the documents). Without `cycle`, too little text is an
    error naming the part; with it (training), the documents are read again from the start."""
    if n <= 0:
        return [], 0
    sep, need, stream, passes = separator(tokenizer), n * size, [], 0
    while len(stream) < need:
        if not docs or (passes and not cycle):
            raise SystemExit(f"not enough text in {what or 'the documents'}: {len(stream)} tokens, {need} needed "
                             f"({n} windows of {size}); lower the window count (--calib-sizes, --eval-windows, "
                             "--select-windows) or --seq-len")
        passes += 1
        for doc in docs:
            stream.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
            stream.append(sep)
            if len(stream) >= need:
                break
    return [stream[i * size:(i + 1) * size] for i in range(n)], passes


def train_windows(tokenizer, docs: list[str], n: int, length: int):
    """(a LongTensor n x length of training windows, each starting with start_tokens, passes over the text)."""
    import torch

    start = start_tokens(tokenizer)
    got, passes = pieces(tokenizer, docs, n, length - len(start), cycle=True, what="the training part")
    return torch.tensor([start + p for p in got], dtype=torch.long), passes


def write_windows(tokenizer, docs: list[str], n: int, length: int, folder: Path, label: str) -> Path:
    """n windows of the part as JSONL texts ({"text": ...}), at a path named by their content's sha256, so a
    stage that reads it is keyed by what it reads."""
    start = start_tokens(tokenizer)
    got, _ = pieces(tokenizer, docs, n, length - len(start), what=f"{label}")
    body = "".join(json.dumps({"text": tokenizer.decode(p)}) + "\n" for p in got)
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    path = folder / f"{label.replace(' ', '-')}-{n}x{length}-{digest}.jsonl"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_text(body)
        tmp.rename(path)
    return path
