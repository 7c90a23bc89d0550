"""Layer 2 of the data seam: one task's calibration set as ready-to-run batches: open, check, sample, preprocess.

Every check that can fail (missing path, empty set, too few examples, wrong modality, missing
tokenizer or chat template) runs before any model is loaded, and the examples are drawn with a seeded
permutation, so the same source, size and seed always give the same batches. A task's data is any
source `featcal.data.read_examples` reads (a path, a hub id, a `datasets.Dataset`, a list of texts or
conversations); texts are tokenised as `tokenizer(texts)` does, conversations as
`tokenizer.apply_chat_template(conversations)` does, and with packing (decoders reading plain-text files,
by default) documents are concatenated and cut into windows of `max_length` tokens (data/packing.py).

Example counts: `num_calibration_examples` is a ceiling when it is the default (`num_examples_explicit` False: a
task holding fewer uses them all, with one warning), and a requirement when the user asked for it (fewer are
refused unless `allow_fewer`). How a source is read is one value, `CalibrationOptions` (config/data.py); what
reads it for the model is a `DataReader`. Several tasks' data go through the door in calibration_set.py.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from featcal.config import DEFAULT_MAX_LENGTH, CalibrationOptions, parse
from featcal.data.batch import Batch, BatchLike, batch_size
from featcal.data.fingerprint import FINGERPRINT_SCHEME, example_sha256
from featcal.data.packing import documents_in_order, pack
from featcal.data.preprocess import TextPreprocessor, is_causal_lm, make_preprocessor, model_modality
from featcal.data.sources import TextSource, open_source
from featcal.data.types import Example, ExampleSource, Modality
from featcal.errors import CalibrationDataError, ConfigError
from featcal.io.read.models import load_config
from featcal.io.read.validate import validate_expert_names

log = logging.getLogger(__name__)

_NOUN = {"image": "images", "text": "texts", "chat": "chat conversations"}


def sample_indices(count: int, num: int, seed: int) -> list[int]:
    """`num` distinct indices out of `count`, drawn by a seeded permutation (prefix-stable in `num`)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(count, generator=generator)[:num].tolist()


@dataclass(frozen=True)
class DataReader:
    """What reads calibration data for the model: its transformers `config` (read from `model_dir` where not given),
    the tokenizer or image processor saved in `model_dir` (or `tokenizer`, an object: the Python API's), and the
    `experts` (task -> folder) where a chat template is looked for when the tokenizer has none (`template_dirs`)."""

    model_dir: str | Path | None = None
    config: Any = None
    tokenizer: Any = None
    experts: Mapping[str, Any] = field(default_factory=dict)

    def with_config(self) -> DataReader:
        """This reader, with the model's config read from `model_dir` where it was not given (read once)."""
        if self.config is not None:
            return self
        if self.model_dir is None:
            raise ConfigError("the model's config is needed to read calibration data (pass config= or model_dir=)")
        return replace(self, config=load_config(self.model_dir, error=CalibrationDataError))

    def template_dirs(self, task: str) -> dict[str, Path]:
        """Where task `task`'s chat template is looked for when the tokenizer has none (`template_dirs`)."""
        return template_dirs(self.experts, task)


@dataclass
class SourcePlan:
    """What checking a source established: the source, what the model reads from it and how; what the check
    drew and preprocessed (text), kept for the load (`read_plan`), which then opens and parses nothing again."""

    source: ExampleSource
    modality: Modality
    count: int  # examples (or packed windows) that will be used
    requested: int
    explicit: bool  # whether the count was asked for (else it is the default ceiling)
    reader: DataReader  # with the model's config read
    options: CalibrationOptions
    preprocessor: Any = None  # a TextPreprocessor, built when checking needed it (text models)
    windows: list[list[int]] | None = None  # packed windows of token ids, when packing
    packed_sha256: list[str] | None = None  # fingerprints of the documents the packed windows hold
    shortfall: str | None = None  # the warning to give when the source holds fewer than requested
    record: dict[str, Any] = field(default_factory=dict)
    drawn: tuple[int, list[Batch], list[str]] | None = None  # (batch size, batches, fingerprints) the check made


def _model_label(model_dir: str | Path | None, config) -> str:
    return f"the model in {model_dir} ({config.model_type})" if model_dir is not None else f"the model ({config.model_type})"


def plan_source(source: Any, options: CalibrationOptions, reader: DataReader,
                template_dirs: Mapping[str, Path] | None = None) -> SourcePlan:
    """Open `source` and check it can feed the reader's model, loading no model.

    Refuses an empty set, the wrong modality, an ambiguous or missing text column, a test split (unless
    `allow_test_split`), chat data without a chat template (looked for in `template_dirs` when the tokenizer has
    none), and fewer examples than asked when the count was asked for (`num_examples_explicit`) unless
    `allow_fewer`. Packs the documents into windows where the options say so.
    """
    reader = reader.with_config()
    wanted = model_modality(reader.config)
    label = _model_label(reader.model_dir, reader.config)
    _refuse_text_options(wanted, label, text_column=options.text_column, text_unit=options.text_unit,
                         pack_texts=options.pack_texts)
    src = open_source(source, text_column=options.text_column, allow_test_split=options.allow_test_split,
                      text_unit=options.text_unit, data_format=options.data_format, modality=wanted)
    _refuse_content(src, wanted, label)
    num = options.num_calibration_examples
    plan = SourcePlan(src, wanted, 0, num, options.num_examples_explicit, reader, options)
    plan.record = {"source": str(src.path), **src.describe(wanted)}  # refuses an ambiguous text column
    available, unit = len(src), "example"
    if wanted == "text":
        plan.preprocessor = make_preprocessor(reader.model_dir, reader.config, options.max_length,
                                              tokenizer=reader.tokenizer)
        if src.content("text") == "chat":
            plan.record["chat_template"] = plan.preprocessor.use_chat_template(template_dirs).record()
        if _packs(options.pack_texts, src, reader.config):
            plan.windows, plan.packed_sha256 = _pack(src, plan.preprocessor, num, options.seed)
            available, unit = len(plan.windows), "window"
            plan.record["packed"] = {"window": plan.preprocessor.max_length, "documents": len(src)}
    plan.count = min(num, available)
    plan.record["requested"] = num
    if available < num:
        _shortfall(plan, available, unit)
    return plan


def _refuse_content(src: ExampleSource, wanted: Modality, label: str) -> None:
    """An empty source, or one holding no `wanted` examples (the model's modality), is refused."""
    if len(src) == 0:
        hint = src.empty_hint() if hasattr(src, "empty_hint") else ""
        raise CalibrationDataError(f"calibration data {src.path} ({src.kind}) holds no examples{hint}")
    if wanted not in src.modalities:
        held = " and ".join(_NOUN[src.content(m)] for m in src.modalities) or "no image or text column"
        strings = src.string_columns() if wanted == "text" and hasattr(src, "string_columns") else []
        hint = f" (string columns: {', '.join(map(repr, strings))}; name the text one with --text-column)" if strings else ""
        raise CalibrationDataError(
            f"calibration data {src.path} ({src.kind}) holds {held}, but {label} takes {_NOUN[wanted]}{hint}"
        )


def _shortfall(plan: SourcePlan, available: int, unit: str) -> None:
    """A source holding fewer examples than requested: refused when the count was asked for (unless allow_fewer),
    else the warning the load gives."""
    num, src = plan.requested, plan.source
    asked = "asked for" if plan.explicit else "used by default (num_calibration_examples)"
    held = f"{available} {unit}{'' if available == 1 else 's'}"
    if plan.windows is not None:
        held += f" of {plan.preprocessor.max_length} tokens"
    message = f"calibration data {src.path} holds {held}, fewer than the {num} {asked}"
    if plan.explicit and not plan.options.allow_fewer:
        raise CalibrationDataError(message + " (pass --allow-fewer, allow_fewer=True, to use them all)")
    plan.shortfall = f"{message}; using all {available}{_unit_hint(src, plan.windows is not None)}"


def _refuse_text_options(wanted: Modality, label: str, **options: Any) -> None:
    """Options that only text models read are a mistake, not a no-op, for an image model."""
    if wanted == "text":
        return
    for name, value in options.items():
        if value is not None and value is not False:
            raise CalibrationDataError(f"{name} {value!r} is set, but {label} takes images")


def _packs(pack_texts: bool | None, src: ExampleSource, config) -> bool:
    """Whether this source's documents are packed into windows: as `pack_texts` says, else (unset) plain-text
    files read by a decoder (is_causal_lm)."""
    if pack_texts is False:
        return False
    if getattr(config, "is_encoder_decoder", False):
        if pack_texts:
            raise CalibrationDataError(
                f"pack_texts is set, but the model ({config.model_type}) is an encoder-decoder: its decoder reads "
                "each example's target, which packed windows do not have"
            )
        return False
    return bool(pack_texts) or (isinstance(src, TextSource) and is_causal_lm(config))


def _pack(src: ExampleSource, preprocessor: TextPreprocessor, count: int,
          seed: int) -> tuple[list[list[int]], list[str]]:
    """The packed windows, and the fingerprints of the documents they hold (tokenised lazily: exactly the
    documents the windows consumed are fingerprinted, for `featcal eval`'s leakage guard)."""
    order = sample_indices(len(src), len(src), seed)
    fingerprints: list[str] = []

    def token_ids(example: Example) -> list[int]:
        fingerprints.append(example_sha256(example))
        return preprocessor.token_ids(example, limit=count * preprocessor.max_length)  # never more is read of one

    docs = documents_in_order(lambda idx: src.examples(idx, "text"), order, token_ids)
    return pack(docs, preprocessor.max_length, count), fingerprints


def _unit_hint(src: ExampleSource, packed: bool) -> str:
    """How to get more examples out of a short text source."""
    if packed:
        return (f" ({len(src)} documents packed into windows; a smaller --max-length makes more of them, "
                "--no-pack-texts makes one example per document)")
    if isinstance(src, TextSource) and src.unit != "line":
        return f" (one example per {src.unit}; --text-unit line makes one per line)"
    return ""


def template_dirs(experts: Mapping[str, Any], task: str) -> dict[str, Path]:
    """Where chat templates are looked for when the model's tokenizer has none: the task's own expert first
    (the model fine-tuned on this task's conversations), then the other experts; folders only."""
    order = [task, *(t for t in experts if t != task)] if task in experts else list(experts)
    out = {}
    for t in order:
        path = experts[t]
        if isinstance(path, (str, Path)) and Path(path).expanduser().is_dir():
            out[f"expert {t!r}"] = Path(path).expanduser()
    return out


def preprocess_drawn(plan: SourcePlan, batch_size: int) -> None:
    """The check's last step: the texts or conversations the run will draw, preprocessed now, in the batches the
    run reads (kept on the plan for `read_plan`): a chat template that raises on one of them ("roles must
    alternate"), a text the tokenizer turns into no tokens, a token id past the vocabulary are refused by the
    check (featcal plan, calibrate and run before any work), not once the run reaches them (issue 49). Images are
    left to the load."""
    if plan.preprocessor is None or (plan.drawn is not None and plan.drawn[0] == batch_size):
        return
    plan.drawn = (batch_size, *_draw(plan, plan.preprocessor, batch_size, progress=False))


def read_plan(plan: SourcePlan, batch_size: int, progress: bool = False) -> tuple[list[Batch], dict[str, Any]]:
    """The checked source's batches of at most `batch_size` examples, and what featcal.json says of the source
    (`load_calibration_batches`' `record`): what the check drew and preprocessed is used as it is, nothing is
    opened or parsed again."""
    if plan.shortfall is not None:
        log.warning("%s", plan.shortfall)
        plan.record["warning"] = plan.shortfall
    if plan.drawn is not None and plan.drawn[0] == batch_size:
        _, batches, fingerprints = plan.drawn
    else:
        preprocess = plan.preprocessor or make_preprocessor(plan.reader.model_dir, plan.reader.config,
                                                            plan.options.max_length)
        batches, fingerprints = _draw(plan, preprocess, batch_size, progress)
    # each drawn example's fingerprint (packed: the documents the windows hold), what `featcal eval`'s leakage
    # guard reads, and how they were made (older featcal.json: scheme 1)
    record = {**plan.record, "example_sha256": fingerprints, "example_fingerprint": FINGERPRINT_SCHEME}
    return batches, record


def _draw(plan: SourcePlan, preprocess: Any, batch_size: int, progress: bool) -> tuple[list[Batch], list[str]]:
    """The plan's examples (or packed windows), drawn with the seeded permutation and preprocessed in batches of
    `batch_size`; and their fingerprints."""
    name = Path(str(plan.source.path)).name
    if plan.windows is not None:
        chunks = [plan.windows[i : i + batch_size] for i in range(0, len(plan.windows), batch_size)]
        batches = [preprocess.windows(c) for c in tqdm(chunks, desc=f"data {name}", unit="batch", disable=not progress)]
        return batches, list(plan.packed_sha256 or [])
    indices = sample_indices(len(plan.source), plan.count, plan.options.seed)
    chunks = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    batches, fingerprints = [], []
    for chunk in tqdm(chunks, desc=f"data {name}", unit="batch", disable=not progress):
        examples = plan.source.examples(chunk, plan.modality)
        fingerprints.extend(example_sha256(e) for e in examples)
        batches.append(preprocess(examples))
    return batches, fingerprints


_READER_KEYS = ("config", "tokenizer", "template_dirs")


def load_calibration_batches(
    source: Any,
    *,
    model_dir: str | Path | None,
    num_examples: int,
    batch_size: int,
    seed: int = 0,
    max_length: int = DEFAULT_MAX_LENGTH,
    allow_fewer: bool = False,
    progress: bool = False,
    record: dict | None = None,
    **options: Any,
) -> list[Batch]:
    """Draw `num_examples` examples from one `source` and preprocess them for the model in `model_dir`.

    Returns batches of at most `batch_size` examples, each a dict of keyword inputs
    (pixel_values; or input_ids, attention_mask[, decoder_input_ids, ...]). `record`, when given, is
    filled with what featcal.json says about the source (its format, content and unit, the column or chat
    layout read, the chat template and where it came from, packing, the count requested, the warning
    when the source held fewer, and each drawn example's fingerprint, `example_sha256`, so that `featcal
    eval` can refuse to score the model on those very examples). Other options: CalibrationOptions' fields
    (text_column, allow_test_split, text_unit, data_format, pack_texts, num_examples_explicit: True unless
    given) and the reader's (`config`: the model's transformers config when the caller already has it,
    `tokenizer`, `template_dirs`). Several tasks: `featcal.data.open_calibration`.
    """
    if num_examples < 1 or batch_size < 1 or max_length < 1:
        raise ConfigError(
            f"num_examples, batch_size and max_length must be >= 1 (got {num_examples}, {batch_size}, {max_length})"
        )
    reading = {k: options.pop(k) for k in _READER_KEYS if k in options}
    values = {"num_calibration_examples": num_examples, "calibration_batch_size": batch_size, "seed": seed,
              "max_length": max_length, "allow_fewer": allow_fewer, "num_examples_explicit": True, **options}
    reader = DataReader(model_dir, reading.get("config"), reading.get("tokenizer"))
    plan = plan_source(source, parse(CalibrationOptions, values), reader, reading.get("template_dirs"))
    batches, got = read_plan(plan, batch_size, progress)
    if record is not None:
        record.update(got)
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
    """What featcal.json says about one task's batches: examples, batches, the tokens they hold (text; the
    attention mask's ones, padding excluded) and the tensors' fingerprint."""
    out: dict[str, Any] = {"examples": sum(batch_size(b) for b in batches), "batches": len(batches)}
    tokens = _tokens(batches)
    if tokens is not None:
        out["tokens"] = tokens
    out["tensors_sha256"] = batches_sha256(batches)
    return out


def _tokens(batches: list[BatchLike]) -> int | None:
    total = None
    for b in batches:
        if not isinstance(b, Mapping) or not isinstance(b.get("input_ids"), torch.Tensor):
            continue
        mask = b.get("attention_mask")
        count = int(mask.sum()) if isinstance(mask, torch.Tensor) else int(b["input_ids"].numel())
        total = (total or 0) + count
    return total
