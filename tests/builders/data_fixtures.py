"""Builders for calibration-data fixtures (no hub): PNG folders, tiny processors, tiny tokenizers.

Shared by the data, pipeline and CLI tests; holds no tests itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

WORDS = [f"w{i}" for i in range(40)]


def write_png_folder(
    root: Path, n_per_class: int = 3, classes: tuple[str, ...] = ("cat", "dog"), size: int = 20, seed: int = 0
) -> Path:
    """Class sub-folders of small random RGB PNGs; returns the root."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            arr = rng.integers(0, 256, (size, size + 4, 3), dtype=np.uint8)
            Image.fromarray(arr).save(root / c / f"{i:03d}.png")
    return root


def save_image_processor(model_dir: Path, size: int = 16) -> None:
    """A CLIP image processor producing `size`x`size` images, saved into `model_dir`."""
    from transformers import CLIPImageProcessor

    CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}).save_pretrained(
        model_dir
    )


def save_tokenizer(model_dir: Path, style: str = "bert") -> None:
    """A WordLevel tokenizer over WORDS ("bert": [CLS] x [SEP], pad 0; "t5": x </s>, pad 0, eos 1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"] if style == "bert" else ["<pad>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    unk = "[UNK]" if style == "bert" else "<unk>"
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if style == "bert":
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
        )
        wrapped = PreTrainedTokenizerFast(
            tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
        )
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
        wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    wrapped.save_pretrained(model_dir)


def sentences(n: int, seed: int = 0, lo: int = 2, hi: int = 9) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi)))) for _ in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def save_chat_tokenizer(model_dir: Path, *, template: str | None = CHAT_TEMPLATE) -> None:
    """A Llama-style WordLevel tokenizer over WORDS: <s> before each text, </s> as eos, <pad> 0; role markers
    as words; with `template` saved as its chat template (None: a tokenizer without one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", vocab["<s>"])])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>")
    if template is not None:
        wrapped.chat_template = template
    wrapped.save_pretrained(model_dir)


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """`n` two- or three-turn chats over WORDS (a system turn in every third)."""
    user, answer = sentences(n, seed=seed), sentences(n, seed=seed + 1)
    out = []
    for i in range(n):
        turns = [{"role": "user", "content": user[i]}, {"role": "assistant", "content": answer[i]}]
        out.append(([{"role": "system", "content": "w0 w1"}] if i % 3 == 0 else []) + turns)
    return out


def cache_as_hub_dataset(root: Path, name: str, config: str, splits: dict[str, list[dict]]) -> Path:
    """Lay out `splits` in a datasets cache as `load_dataset(name, config)` leaves a downloaded dataset."""
    build = root / "build"
    files = {}
    for split, rows in splits.items():
        files[split] = str(write_jsonl(root / f"{split}.jsonl", rows))
    import datasets

    datasets.load_dataset("json", data_files=files, cache_dir=str(build))
    (built,) = (build / "json").iterdir()
    (version,) = built.iterdir()
    (fingerprint,) = (p for p in version.iterdir() if p.is_dir())
    target = root / "cache" / name.replace("/", "___") / config / version.name / fingerprint.name
    target.mkdir(parents=True)
    info = json.loads((fingerprint / "dataset_info.json").read_text())
    info["config_name"] = config
    (target / "dataset_info.json").write_text(json.dumps(info))
    for arrow in fingerprint.glob("*.arrow"):
        arrow.rename(target / arrow.name.replace("json-", f"{name.split('/')[-1]}-"))
    return root / "cache"
