"""Load one task's calibration set as ready-to-run batches: open, check, sample, preprocess.

Every check that can fail (missing path, empty set, too few examples, wrong modality, missing
tokenizer) runs before any example is read, and the examples are drawn with a seeded permutation,
so the same source, size and seed always give the same batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from featcal.data.batch import Batch, BatchLike, batch_size
from featcal.data.fingerprint import example_sha256
from featcal.data.preprocess import make_preprocessor, model_modality
from featcal.data.sources import open_source
from featcal.errors import CalibrationDataError, ConfigError
from featcal.io.models import load_config
from featcal.io.validate import validate_expert_names

log = logging.getLogger(__name__)

_NOUN = {"image": "images", "text": "texts"}


def sample_indices(count: int, num: int, seed: int) -> list[int]:
    """`num` distinct indices out of `count`, drawn by a seeded permutation (prefix-stable in `num`)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(count, generator=generator)[:num].tolist()


def check_calibration_source(
    source: str | Path, *, model_dir: str | Path, num_examples: int, allow_fewer: bool = False, config=None,
    text_column: str | None = None, allow_test_split: bool = False,
):
    """Open `source` and check it can feed the model in `model_dir`, reading no example.

    Refuses an empty set, the wrong modality, an ambiguous or missing text column, a test split (unless
    `allow_test_split`), and fewer examples than asked (unless `allow_fewer`).
    Returns (source, modality the model takes, number of examples that will be drawn). `config` is
    the model's transformers config when the caller already has it.
    """
    config = config if config is not None else load_config(model_dir, error=CalibrationDataError)
    wanted = model_modality(config)
    if text_column is not None and wanted != "text":  # an option that cannot apply is a mistake, not a no-op
        raise CalibrationDataError(
            f"text_column {text_column!r} is set, but the model in {model_dir} ({config.model_type}) takes images"
        )
    src = open_source(source, text_column=text_column, allow_test_split=allow_test_split)
    if len(src) == 0:
        raise CalibrationDataError(f"calibration data {src.path} ({src.kind}) holds no examples")
    if wanted not in src.modalities:
        held = " and ".join(_NOUN[m] for m in src.modalities) or "no image or text column"
        strings = src.string_columns() if wanted == "text" and hasattr(src, "string_columns") else []
        hint = f" (string columns: {', '.join(map(repr, strings))}; name the text one with --text-column)" if strings else ""
        raise CalibrationDataError(
            f"calibration data {src.path} ({src.kind}) holds {held}, but the model in {model_dir} "
            f"({config.model_type}) takes {_NOUN[wanted]}{hint}"
        )
    if wanted == "text":
        src.text_column  # noqa: B018 - refuses an ambiguous or unusable text column before any example is read
    available = len(src)
    if available < num_examples:
        message = f"calibration data {src.path} holds {available} examples, fewer than the {num_examples} asked for"
        if not allow_fewer:
            raise CalibrationDataError(message + " (pass --allow-fewer, allow_fewer=True, to use them all)")
        log.warning("%s; using all %d", message, available)
    return src, wanted, min(num_examples, available)


def source_record(src, modality: str) -> dict:
    """What featcal.json records about how a source was read: its kind, split and the column(s) used."""
    out: dict = {"kind": src.kind}
    if getattr(src, "split", None) is not None:
        out["split"] = src.split
    if modality == "text" and getattr(src, "text_column", None) is not None:
        out["text_column"] = src.text_column
        if getattr(src, "target_column", None) is not None:
            out["target_column"] = src.target_column
    elif modality == "image" and getattr(src, "image_column", None) is not None:
        out["image_column"] = src.image_column
    return out


def load_calibration_batches(
    source: str | Path,
    *,
    model_dir: str | Path,
    num_examples: int,
    batch_size: int,
    seed: int = 0,
    max_length: int = 128,
    allow_fewer: bool = False,
    progress: bool = False,
    text_column: str | None = None,
    allow_test_split: bool = False,
    record: dict | None = None,
    config=None,
) -> list[Batch]:
    """Draw `num_examples` examples from `source` and preprocess them for the model in `model_dir`.

    Returns batches of at most `batch_size` examples, each a dict of keyword inputs
    (pixel_values; or input_ids, attention_mask[, decoder_input_ids, ...]). `record`, when given, is
    filled with what a report should say about the source (its kind; the text column read; each drawn
    example's fingerprint, `example_sha256`), so a featcal.json shows which column the model was calibrated
    on, and `featcal eval` can refuse to score it on those very examples. `config`: the model's transformers
    config when the caller already has it (a run reads it once, not once per task).
    """
    if num_examples < 1 or batch_size < 1 or max_length < 1:
        raise ConfigError(
            f"num_examples, batch_size and max_length must be >= 1 (got {num_examples}, {batch_size}, {max_length})"
        )
    config = config if config is not None else load_config(model_dir, error=CalibrationDataError)
    src, wanted, count = check_calibration_source(
        source, model_dir=model_dir, num_examples=num_examples, allow_fewer=allow_fewer, config=config,
        text_column=text_column, allow_test_split=allow_test_split,
    )
    if record is not None:
        record.update(source_record(src, wanted))
    preprocess = make_preprocessor(model_dir, config, max_length)
    indices = sample_indices(len(src), count, seed)
    chunks = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    batches, fingerprints = [], []
    for chunk in tqdm(chunks, desc=f"data {Path(source).name}", unit="batch", disable=not progress):
        examples = src.fetch(chunk, wanted)
        fingerprints.extend(example_sha256(e) for e in examples)  # what `featcal eval`'s leakage guard reads
        batches.append(preprocess(examples))
    if record is not None:
        record["example_sha256"] = fingerprints
    return batches


def check_task_names(experts: Mapping[str, Any], calibration_sources: Mapping[str, Any]) -> list[str]:
    """The task names, in the experts' order; refuse any task that lacks its expert or its data."""
    if not experts:
        raise ConfigError("at least one expert is needed (--expert NAME=PATH)")
    validate_expert_names(experts)  # e.g. 'glue/sst2' would crash calibration after the first block
    no_data = [t for t in experts if t not in calibration_sources]
    no_expert = [t for t in calibration_sources if t not in experts]
    problems = []
    if no_data:
        problems.append(f"task(s) {', '.join(map(repr, no_data))} have an expert but no calibration data (--calib NAME=DATA)")
    if no_expert:
        problems.append(f"task(s) {', '.join(map(repr, no_expert))} have calibration data but no expert (--expert NAME=PATH)")
    if problems:
        raise ConfigError("; ".join(problems))
    return list(experts)


def batches_sha256(batches: list[BatchLike]) -> str:
    """A fingerprint of exactly the tensors calibration saw (cheaper and more exact than hashing the source).

    Also takes what the merges' in-memory calibration may hold: tensor batches, non-tensor keyword
    values, tensors of any dtype or device.
    """
    h = hashlib.sha256()
    for batch in batches:
        items = batch if isinstance(batch, Mapping) else {"input": batch}
        for key in sorted(items):
            t = items[key]
            if not isinstance(t, torch.Tensor):
                h.update(f"{key}={t!r}".encode())
                continue
            t = t.detach().cpu().contiguous()
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@contextlib.contextmanager
def naming_task(task: str) -> Iterator[None]:
    """A CalibrationDataError raised inside names `task` (which of several sources failed)."""
    try:
        yield
    except CalibrationDataError as exc:
        raise CalibrationDataError(f"task {task!r}: {exc}") from None


def batches_record(batches: list[BatchLike]) -> dict[str, Any]:
    """What featcal.json says about one task's batches: examples, batches and the tensors' fingerprint."""
    return {"examples": sum(batch_size(b) for b in batches), "batches": len(batches),
            "tensors_sha256": batches_sha256(batches)}
