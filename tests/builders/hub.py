"""Local stand-ins for the hub: tiny models and datasets saved in the hub's own formats and layout.

`featcal reproduce --model-dir M --data-dir D` reads M/<hub id>/ (save_pretrained) and
D/<dataset id>[/<config>]/ (DatasetDict.save_to_disk), with the hub's column names, so these
fixtures exercise the same loading code as real hub ids:
- CLIP: a tiny CLIPModel with a CLIPProcessor (a byte-level BPE CLIPTokenizer written from a
  hand-made vocab.json / merges.txt, and a CLIPImageProcessor); experts are perturbed copies of its
  vision tower saved as CLIPVisionModel checkpoints, the first in the transformers-4 key layout
  (`vision_model.` prefix) as tanganke's experts are, the others in the 5.x layout, so both load
  paths run; image datasets with image/label columns.
- FLAN-T5 GLUE: a tiny T5ForConditionalGeneration with a word-level tokenizer, perturbed experts,
  GLUE configs with the hub's columns (sentence, sentence1/2, question, premise/hypothesis, label, idx).
- MergeBench: a tiny LlamaForCausalLM and `_val` sets with MergeBench's columns.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from tests.builders.tiny import perturbed

WORDS = ("the a cat dog runs sits on mat red blue big small house tree car sees likes fast slow green old new "
         "man woman child book river road city sun rain").split()


# ------------------------------------------------------------------ tokenizers
def clip_tokenizer(directory: Path) -> T.CLIPTokenizer:
    """A CLIP byte-level BPE tokenizer from a hand-written vocab.json / merges.txt (no hub)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    directory.mkdir(parents=True, exist_ok=True)
    chars = list(bytes_to_unicode().values())
    vocab: dict[str, int] = {}
    for c in chars:
        vocab[c] = len(vocab)
    for c in chars:
        vocab[c + "</w>"] = len(vocab)
    merges = ["p h", "ph o", "pho t", "phot o</w>", "o f</w>", "t h", "th e</w>"]
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    (directory / "vocab.json").write_text(json.dumps(vocab))
    (directory / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    return T.CLIPTokenizer(vocab=str(directory / "vocab.json"), merges=str(directory / "merges.txt"),
                           model_max_length=77)


def word_tokenizer(texts: list[str], *, eos: bool = True) -> T.PreTrainedTokenizerFast:
    """A lower-casing word-level tokenizer over the words of `texts` (T5-style ids: pad 0, eos 1, unk 2)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    pre = pre_tokenizers.Whitespace()
    words = sorted({w for t in texts for w, _ in pre.pre_tokenize_str(t.lower())})
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for w in words:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre
    if eos:
        tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


# ------------------------------------------------------------------ helpers
def _save_dataset(splits: dict, features, path: Path) -> Path:
    import datasets

    dd = datasets.DatasetDict({name: datasets.Dataset.from_dict(cols, features=features) for name, cols in splits.items()})
    path.mkdir(parents=True, exist_ok=True)
    dd.save_to_disk(str(path))
    return path


def _sentence(rng: random.Random, n: int = 5) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _save_v4_vision(model: T.CLIPVisionModel, directory: Path) -> None:
    """Save as transformers 4 did: every key under `vision_model.` (the hub experts' layout)."""
    model.save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    state = {k if k.startswith("vision_model.") else f"vision_model.{k}": v for k, v in state.items()}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


# ------------------------------------------------------------------ CLIP
def save_clip_model(directory: Path, tok: T.CLIPTokenizer, num_layers: int, seed: int = 0) -> T.CLIPModel:
    """A tiny random CLIPModel (32 wide, 16-pixel images) saved with its processor around `tok`."""
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    bos = tok.convert_tokens_to_ids("<|startoftext|>")
    config = T.CLIPConfig(
        text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=4, max_position_embeddings=77, eos_token_id=eos, bos_token_id=bos,
                         pad_token_id=eos),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
                           image_size=16, patch_size=4),
        projection_dim=16,
    )
    torch.manual_seed(seed)
    model = T.CLIPModel(config).eval()
    model.save_pretrained(directory)
    image_processor = T.CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    T.CLIPProcessor(image_processor=image_processor, tokenizer=tok).save_pretrained(directory)
    return model


CLIP_DATA = {"eurosat": ("tanganke/eurosat", None, "RGB"), "mnist": ("ylecun/mnist", None, "L"),
             "svhn": ("svhn", "cropped_digits", "RGB"), "dtd": ("tanganke/dtd", None, "RGB")}


def build_clip_hub(root: Path, tasks: tuple[str, ...] = ("eurosat", "mnist"), *, arch: str = "clip-vit-base-patch32",
                   n_train: int = 24, n_test: int = 20, seed: int = 0) -> tuple[Path, Path]:
    """(model_dir, data_dir) for a `clip-vit-*-ta8` setting restricted to `tasks`."""
    import datasets
    from PIL import Image

    from featcal.experiments.task_data.templates import clip_prompts

    models, data = root / "models", root / "data"
    base_dir = models / "openai" / arch
    base = save_clip_model(base_dir, clip_tokenizer(root / "tokenizer-src"), num_layers=2, seed=seed)
    for i, task in enumerate(tasks):
        expert = perturbed(base.vision_model, seed + 100 + i, scale=0.05)
        expert_dir = models / "tanganke" / f"{arch}_{task}"
        _save_v4_vision(expert, expert_dir) if i == 0 else expert.save_pretrained(expert_dir)
        hub_id, cfg, mode = CLIP_DATA[task]
        classes, _ = clip_prompts(task)
        rng = np.random.default_rng(seed + i)
        channels = 3 if mode == "RGB" else 1

        def images(n: int, rng=rng, channels=channels, mode=mode):
            arrays = rng.integers(0, 256, size=(n, 20, 20, channels), dtype=np.uint8)
            return [Image.fromarray(a if channels == 3 else a[..., 0], mode=mode) for a in arrays]

        features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=list(classes))})
        splits = {
            "train": {"image": images(n_train), "label": [int(v) for v in rng.integers(0, len(classes), n_train)]},
            "test": {"image": images(n_test), "label": [int(v) for v in rng.integers(0, len(classes), n_test)]},
        }
        _save_dataset(splits, features, data / hub_id / cfg if cfg else data / hub_id)
    return models, data


# ------------------------------------------------------------------ FLAN-T5 GLUE
GLUE_COLUMNS = {
    "cola": ("sentence",), "sst2": ("sentence",), "mrpc": ("sentence1", "sentence2"),
    "qqp": ("question1", "question2"), "stsb": ("sentence1", "sentence2"), "mnli": ("premise", "hypothesis"),
    "qnli": ("question", "sentence"), "rte": ("sentence1", "sentence2"),
}
GLUE_CLASSES = {"cola": 2, "sst2": 2, "mrpc": 2, "qqp": 2, "mnli": 3, "qnli": 2, "rte": 2}


def _glue_split(task: str, n: int, rng: random.Random) -> dict:
    cols: dict = {c: [_sentence(rng) for _ in range(n)] for c in GLUE_COLUMNS[task]}
    if task == "stsb":
        cols["label"] = [round(rng.uniform(0, 5), 2) for _ in range(n)]
    else:
        cols["label"] = [rng.randrange(GLUE_CLASSES[task]) for _ in range(n)]
    cols["idx"] = list(range(n))
    return cols


def build_glue_hub(root: Path, tasks: tuple[str, ...] = ("rte", "stsb"), *, n_train: int = 24, n_val: int = 16,
                   seed: int = 0) -> tuple[Path, Path]:
    """(model_dir, data_dir) for `flan-t5-base-glue-ta8` restricted to `tasks`."""
    import datasets

    from featcal.experiments.task_data.templates import GLUE_PROMPTS, glue_eval_split

    models, data = root / "models", root / "data"
    texts = [p.template for p in GLUE_PROMPTS.values()] + list(WORDS)
    texts += [w for p in GLUE_PROMPTS.values() if p.labels for w in p.labels.values()]
    texts += [f"{x / 10:.1f}" for x in range(51)]
    tok = word_tokenizer(texts)
    config = T.T5Config(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    base = T.T5ForConditionalGeneration(config).eval()
    base_dir = models / "google" / "flan-t5-base"
    base.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    rng = random.Random(seed)
    for i, task in enumerate(tasks):
        expert_dir = models / "tanganke" / f"flan-t5-base_glue-{task}"
        perturbed(base, seed + 200 + i, scale=0.05).save_pretrained(expert_dir)
        tok.save_pretrained(expert_dir)
        label = datasets.Value("float32") if task == "stsb" else datasets.ClassLabel(num_classes=GLUE_CLASSES[task])
        features = datasets.Features({**{c: datasets.Value("string") for c in GLUE_COLUMNS[task]},
                                      "label": label, "idx": datasets.Value("int32")})
        splits = {"train": _glue_split(task, n_train, rng), glue_eval_split(task): _glue_split(task, n_val, rng)}
        _save_dataset(splits, features, data / "nyu-mll" / "glue" / task)
    return models, data


# ------------------------------------------------------------------ MergeBench (Llama)
def build_mergebench_hub(root: Path, tasks: tuple[str, ...] = ("math", "coding"), *, base: str = "Llama-3.2-3B",
                         n_rows: int = 12, seed: int = 0) -> tuple[Path, Path]:
    import datasets

    from featcal.experiments.reproduce.mergebench import MERGEBENCH_COLUMNS, sft_text

    models, data = root / "models", root / "data"
    tok = word_tokenizer([sft_text("x", "y", "z")] + list(WORDS), eos=False)
    config = T.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           pad_token_id=0, eos_token_id=1, bos_token_id=1)
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(config).eval()
    base_dir = models / "meta-llama" / base
    model.save_pretrained(base_dir)
    tok.save_pretrained(base_dir)
    rng = random.Random(seed)
    for i, task in enumerate(tasks):
        perturbed(model, seed + 300 + i, scale=0.05).save_pretrained(models / "MergeBench" / f"{base}_{task}")
        instruction, context, response = MERGEBENCH_COLUMNS[task]
        cols = {instruction: [_sentence(rng, 8) for _ in range(n_rows)],
                response: [_sentence(rng, 6) for _ in range(n_rows)]}
        if context:
            cols[context] = [_sentence(rng, 3) if j % 2 else "" for j in range(n_rows)]
        features = datasets.Features({c: datasets.Value("string") for c in cols})
        _save_dataset({"train": cols}, features, data / "MergeBench" / f"{task}_val")
    return models, data
