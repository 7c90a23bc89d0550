"""Turn examples into the keyword inputs a model takes, using the model's own processor.

Vision models get `pixel_values` from the image processor saved with the checkpoint (or, when none
was saved, a resize + CLIP normalisation, with a warning). Text models get `input_ids` and
`attention_mask` from the saved tokenizer: texts as `tokenizer(texts)` gives them, chat conversations
as `tokenizer.apply_chat_template(conversations)` gives them (the tokenizer's template, else one found
beside an expert: `ChatTemplate` says which); encoder-decoders also get teacher-forced
`decoder_input_ids`. Packed windows (data/packing.py) are padded as the tokenizer pads. Only inputs the
model's forward names are kept, so a BERT tokenizer's `token_type_ids` never reach a model that would
reject them.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from featcal.config import DEFAULT_MAX_LENGTH
from featcal.data.batch import Batch
from featcal.data.bounds import bounded_text, render_chat
from featcal.data.types import Example, Modality
from featcal.errors import CalibrationDataError
from featcal.io.read.checkpoint import TOKENIZER_FILES

log = logging.getLogger(__name__)

IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# CLIP's normalisation: the fallback for vision checkpoints saved without a processor.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

Preprocessor = Callable[[Sequence], Batch]


def _vision_config(config):
    return config if hasattr(config, "image_size") else getattr(config, "vision_config", None)


def model_modality(config) -> Modality:
    """"image" for vision models (CLIP, ViT: configs with an image size), "text" otherwise."""
    return "image" if _vision_config(config) is not None else "text"


def has_processor_files(model_dir: str | Path | None, modality: Modality) -> bool:
    """Whether `model_dir` holds the preprocessing files a model of this modality needs."""
    if model_dir is None:
        return False
    names = IMAGE_PROCESSOR_FILES if modality == "image" else TOKENIZER_FILES
    return any((Path(model_dir) / n).is_file() for n in names)


def accepted_inputs(config) -> set[str] | None:
    """Keyword inputs the model's forward names explicitly (None: unknown, keep everything)."""
    from featcal.io.read.models import model_class_for

    cls = model_class_for(config)
    if not hasattr(cls, "forward"):  # no architectures recorded: the base model class of this config
        from transformers import AutoModel

        try:
            cls = AutoModel._model_mapping[type(config)]
        except (KeyError, AttributeError):
            return None
    forward = cls.forward
    params = inspect.signature(forward).parameters
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"self"}
    return named or None


def to_8bit(image):
    """`image` with 16-bit (or wider integer) samples scaled into 8 bits, so that `convert("RGB")` keeps them.

    PIL's convert() clips integer modes to 255 instead of scaling: a 16-bit greyscale PNG (mode I;16)
    would turn almost white. I;16 modes span 0..65535; mode I (how older PIL opens those PNGs, and some
    TIFFs) is taken as 16-bit when any sample exceeds 255 and as 8-bit otherwise. Other modes pass through.
    """
    import numpy as np
    from PIL import Image

    if not (image.mode.startswith("I;16") or image.mode == "I"):
        return image
    samples = np.asarray(image).astype(np.float64)
    if image.mode.startswith("I;16") or samples.max(initial=0) > 255:
        samples = samples / 257.0  # 65535 -> 255, exactly
    return Image.fromarray(np.clip(np.rint(samples), 0, 255).astype(np.uint8))  # mode L


class ImagePreprocessor:
    """PIL images -> {"pixel_values"} at the size the model was configured for."""

    def __init__(self, model_dir: Path | None, config) -> None:
        vision = _vision_config(config)
        self.image_size = int(vision.image_size)
        self.channels = int(getattr(vision, "num_channels", 3))
        self.model_dir = model_dir
        self.processor = None
        if has_processor_files(model_dir, "image"):
            from transformers import AutoImageProcessor

            try:
                self.processor = AutoImageProcessor.from_pretrained(model_dir, trust_remote_code=False)
            except Exception as exc:
                raise CalibrationDataError(f"cannot load the image processor saved in {model_dir}: {exc}") from None
        else:
            log.warning(
                "%s has no image processor (preprocessor_config.json); resizing calibration images to %dx%d "
                "and normalising with CLIP's mean/std instead",
                model_dir or "the model", self.image_size, self.image_size,
            )

    def __call__(self, images: Sequence) -> Batch:
        images = [im.image if isinstance(im, Example) else im for im in images]  # PIL images, or image Examples
        if self.processor is None:
            pixels = torch.stack([self._fallback(im) for im in images])
        else:
            mode = "L" if self.channels == 1 else "RGB"
            pixels = self.processor(
                images=[to_8bit(im).convert(mode) for im in images], return_tensors="pt"
            )["pixel_values"]
        expected = (self.channels, self.image_size, self.image_size)
        if tuple(pixels.shape[1:]) != expected:
            raise CalibrationDataError(
                f"the image processor in {self.model_dir} produces images of shape {tuple(pixels.shape[1:])}, "
                f"but the model expects {expected} (config image_size / num_channels)"
            )
        return {"pixel_values": pixels.float()}

    def _fallback(self, image) -> torch.Tensor:
        import numpy as np
        from PIL import Image

        if self.channels not in (1, 3):
            raise CalibrationDataError(
                f"{self.model_dir}: no image processor saved and the model takes {self.channels} channels; "
                "save the model's image processor beside it"
            )
        mode = "L" if self.channels == 1 else "RGB"
        resized = to_8bit(image).convert(mode).resize((self.image_size, self.image_size), Image.BICUBIC)
        array = torch.from_numpy(np.asarray(resized, dtype=np.float32) / 255.0)
        array = array.unsqueeze(-1) if array.ndim == 2 else array
        mean = torch.tensor(CLIP_MEAN if self.channels == 3 else (sum(CLIP_MEAN) / 3,))
        std = torch.tensor(CLIP_STD if self.channels == 3 else (sum(CLIP_STD) / 3,))
        return ((array - mean) / std).permute(2, 0, 1).contiguous()


@dataclass(frozen=True)
class ChatTemplate:
    """The chat template conversations are rendered with, and where it came from (featcal.json records both)."""

    text: str
    origin: str  # "the tokenizer in DIR", or "expert 'code' (DIR)"

    def record(self) -> dict[str, str]:
        return {"from": self.origin, "sha256": hashlib.sha256(self.text.encode()).hexdigest()}


def load_tokenizer(directory: Path, what: str = "a text model"):
    """The tokenizer saved in `directory` (never custom code); one-line errors naming the folder."""
    if directory is None or not has_processor_files(directory, "text"):
        raise CalibrationDataError(
            f"{directory} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); {what} needs "
            "its tokenizer saved beside the checkpoint to tokenize calibration texts"
        )
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    except Exception as exc:
        raise CalibrationDataError(f"cannot load the tokenizer saved in {directory}: {exc}") from None


def is_causal_lm(config) -> bool:
    """Whether the model is a decoder that reads one token stream (transformers' causal-LM classes, or a
    config marked is_decoder): the models whose long documents are packed into windows by default."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if getattr(config, "is_encoder_decoder", False):
        return False
    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = getattr(config, "architectures", None) or []
    return any(a in causal for a in architectures) or bool(getattr(config, "is_decoder", False))


class TextPreprocessor:
    """Text or chat Examples -> padded, truncated token ids (+ teacher-forced decoder ids for encoder-decoders).

    `tokenizer`: a tokenizer object to use instead of the one saved in `model_dir` (the Python API's
    `tokenizer=`); it is copied before a pad token is set on it. `chat_template` renders conversations;
    unset, the tokenizer's own is used (`use_chat_template` finds one or refuses).
    """

    def __init__(self, model_dir: Path | None, config, max_length: int, *, tokenizer=None) -> None:
        if tokenizer is None:
            tokenizer = load_tokenizer(model_dir)
            where = f"the tokenizer in {model_dir}"
        else:
            import copy

            tokenizer = copy.deepcopy(tokenizer)  # the caller's object is not changed (pad token below)
            where = "the tokenizer given"
        self.tokenizer = tokenizer
        self.source = where
        if self.tokenizer.pad_token is None:
            if self.tokenizer.eos_token is None:
                raise CalibrationDataError(f"{where} has neither a pad nor an eos token")
            self.tokenizer.pad_token = self.tokenizer.eos_token  # padding is masked out anyway
        self.model_dir = model_dir
        self.chat_template: ChatTemplate | None = None
        self.vocab_size = getattr(config, "vocab_size", None)
        positions = getattr(config, "max_position_embeddings", None)
        self.max_length = min(max_length, positions) if positions else max_length
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        self.accepted = accepted_inputs(config)
        if self.encoder_decoder:
            start = getattr(config, "decoder_start_token_id", None)
            self.decoder_start = start if start is not None else getattr(config, "pad_token_id", None)
            if self.decoder_start is None:
                raise CalibrationDataError(
                    f"{model_dir}: an encoder-decoder config needs decoder_start_token_id (or pad_token_id)"
                )
            self.pad_id = self.tokenizer.pad_token_id

    def use_chat_template(self, fallbacks: Mapping[str, Path] | None = None) -> ChatTemplate:
        """The tokenizer's chat template, else the first of `fallbacks` (label -> a folder with a tokenizer,
        e.g. an expert's) that has one; refused when none has. Conversations are rendered with it."""
        own = getattr(self.tokenizer, "chat_template", None)
        if isinstance(own, str) and own:
            self.chat_template = ChatTemplate(own, self.source)
            return self.chat_template
        for label, directory in (fallbacks or {}).items():
            found = _saved_chat_template(directory)
            if found is not None:
                self.chat_template = ChatTemplate(found, f"{label} ({directory})")
                return self.chat_template
        looked = f" nor do {', '.join(fallbacks)}" if fallbacks else ""
        raise CalibrationDataError(
            f"chat data needs a chat template to render its conversations, and {self.source} has none{looked}; "
            "save a tokenizer with a chat_template beside the model, or read plain texts from a column "
            "with --text-column"
        )

    def __call__(self, examples: Sequence[Example]) -> Batch:
        """A padded batch, truncated at max_length: texts as `tokenizer(texts)` gives them, conversations as
        `apply_chat_template(conversations, tokenize=True)` does (rendered, then tokenised without special
        tokens), each rendering bounded (data/bounds.py) and a huge text tokenised only as far as it is kept."""
        if examples and examples[0].messages is not None:
            texts = [bounded_text(self.tokenizer, self.render(e.messages), self.max_length) for e in examples]
            enc = self.tokenizer(texts, add_special_tokens=False, padding=True, truncation=True,
                                 max_length=self.max_length, return_tensors="pt")
        else:
            enc = self.tokenizer(
                [bounded_text(self.tokenizer, e.text, self.max_length) for e in examples], padding=True,
                truncation=True, max_length=self.max_length, return_tensors="pt",
            )
        self._refuse_empty(enc, examples)
        return self._finish(dict(enc), examples)

    def _refuse_empty(self, enc: Mapping[str, Any], examples: Sequence[Example]) -> None:
        """An example the tokenizer turns into no tokens (a text of characters it drops, with no special tokens
        added) is refused, as an empty text is: the model would read nothing of it (a row of padding only)."""
        ids, mask = enc.get("input_ids"), enc.get("attention_mask")
        if ids is None or not len(examples):
            return
        lengths = mask.sum(dim=1) if mask is not None else torch.full((len(examples),), ids.shape[1])
        empty = next((i for i, n in enumerate(lengths.tolist()) if n == 0), None)
        if empty is not None:
            e = examples[empty]
            shown = repr(e.text if e.messages is None else list(e.messages))
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise CalibrationDataError(
                f"{self.source} turns a calibration example into no tokens at all: {shown}; the model would read "
                "nothing of it (drop it from the data, as empty texts must be)"
            )

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """A conversation rendered with the chat template in use (bounded in time and size; one-line errors)."""
        template = self.chat_template or self.use_chat_template()
        return render_chat(self.tokenizer, messages, template.text, origin=template.origin)

    def token_ids(self, example: Example, limit: int | None = None) -> list[int]:
        """One document's ids, untruncated, ending with eos (what packing concatenates): a text as
        `tokenizer(text)` gives it, a conversation as `apply_chat_template` does. `limit`: the most tokens the
        caller reads of it; a huge document is then tokenised only as far (data/bounds.py)."""
        if example.messages is not None:
            text = self.render(example.messages)
            ids = list(self.tokenizer(text if limit is None else bounded_text(self.tokenizer, text, limit),
                                      add_special_tokens=False)["input_ids"])
        else:
            text = example.text if limit is None else bounded_text(self.tokenizer, example.text, limit)
            ids = list(self.tokenizer(text)["input_ids"])
        eos = self.tokenizer.eos_token_id
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids

    def windows(self, rows: Sequence[Sequence[int]]) -> Batch:
        """Packed windows of token ids -> input_ids / attention_mask, padded on the tokenizer's padding side."""
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        left = getattr(self.tokenizer, "padding_side", "right") == "left"
        for i, row in enumerate(rows):
            cut = slice(width - len(row), width) if left else slice(0, len(row))
            ids[i, cut] = torch.tensor(list(row), dtype=torch.long)
            mask[i, cut] = 1
        return self._finish({"input_ids": ids, "attention_mask": mask}, [Example(text="") for _ in rows])

    def _finish(self, enc: dict, examples: Sequence[Example]) -> Batch:
        batch = {k: v for k, v in enc.items() if self.accepted is None or k in self.accepted}
        if self.encoder_decoder:
            batch.update(self._decoder_inputs(examples))
        self._check_vocab(batch)
        return batch

    def _decoder_inputs(self, examples: Sequence[Example]) -> Batch:
        targets = None if all(e.target is None for e in examples) else [e.target or "" for e in examples]
        ids, mask = teacher_forced_decoder_inputs(
            self.tokenizer, targets, len(examples), decoder_start_token_id=self.decoder_start, pad_token_id=self.pad_id,
            max_length=self.max_length,
        )
        out = {"decoder_input_ids": ids}
        if self.accepted is None or "decoder_attention_mask" in self.accepted:
            out["decoder_attention_mask"] = mask
        return out

    def _check_vocab(self, batch: Batch) -> None:
        if self.vocab_size is None:
            return
        for key in ("input_ids", "decoder_input_ids"):
            if key in batch and batch[key].numel() and int(batch[key].max()) >= self.vocab_size:
                raise CalibrationDataError(
                    f"{self.source} produced token id {int(batch[key].max())}, but the model's "
                    f"vocabulary has {self.vocab_size} entries: tokenizer and checkpoint do not match"
                )


def _saved_chat_template(directory: Path) -> str | None:
    """The chat template of the tokenizer saved in `directory`, None when there is none (or no tokenizer)."""
    if not Path(directory).is_dir() or not has_processor_files(directory, "text"):
        return None
    template = getattr(load_tokenizer(Path(directory)), "chat_template", None)
    return template if isinstance(template, str) and template else None


def teacher_forced_decoder_inputs(
    tokenizer, targets: Sequence[str] | None, n: int, *, decoder_start_token_id: int, pad_token_id: int,
    max_length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(decoder_input_ids, decoder_attention_mask) that teacher-force `targets` through an encoder-decoder.

    The decoder reads [start] + target shifted right by one. A row keeps exactly as many positions as its
    target has tokens: the ones that predict a real target token, i.e. those fine-tuning's loss counted
    (labels = target ids, padding ignored). The position that would read a target's last token (its eos)
    predicts nothing and is masked, its id set to pad, whatever the row's length. `targets=None` (no example
    has one): a single position reading the start token for each of the `n` rows. Calibration data
    (TextPreprocessor) and the GLUE reproduction (evaluation/glue.py) both build decoder inputs here.
    """
    start = torch.full((n, 1), decoder_start_token_id, dtype=torch.long)
    if targets is None:
        return start, torch.ones(n, 1, dtype=torch.long)
    lab = tokenizer(text_target=list(targets), padding=True, truncation=True, max_length=max_length,
                    return_tensors="pt")
    mask = lab["attention_mask"]
    ids = torch.cat([start, lab["input_ids"][:, :-1]], dim=1).masked_fill(mask == 0, pad_token_id)
    return ids, mask


def make_preprocessor(model_dir: str | Path | None, config, max_length: int = DEFAULT_MAX_LENGTH, *, tokenizer=None) -> Preprocessor:
    """The preprocessor for the model whose config (and processor files) live in `model_dir` (None: no folder,
    the API's in-memory model; then `tokenizer` tokenizes, and images get the fallback preprocessing)."""
    directory = None if model_dir is None else Path(model_dir)
    if model_modality(config) == "image":
        return ImagePreprocessor(directory, config)
    return TextPreprocessor(directory, config, max_length, tokenizer=tokenizer)
