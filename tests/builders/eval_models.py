"""Builders for the `featcal eval` tests: tiny models of each kind saved with their processors.

Holds no tests itself.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as T

from tests.builders.data_fixtures import save_tokenizer
from tests.builders.tiny import tiny_config

# role: content . -- every piece a separate word, so a whitespace tokenizer splits a rendering at turn bounds
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def save_llama(directory: Path, seed: int = 0, chat: bool = True) -> Path:
    """A tiny LlamaForCausalLM with a word-level tokenizer (pad 0, eos 1 appended, unk 2)."""
    torch.manual_seed(seed)
    T.LlamaForCausalLM(tiny_config("llama")).eval().save_pretrained(directory)
    save_tokenizer(directory, "t5")
    if chat:
        tok = T.AutoTokenizer.from_pretrained(directory)
        tok.chat_template = CHAT_TEMPLATE
        tok.save_pretrained(directory)
    return directory


def save_bert_classifier(directory: Path, labels: tuple[str, ...] = ("neg", "neu", "pos"), seed: int = 0) -> Path:
    """A tiny BertForSequenceClassification whose config names its classes `labels`."""
    config = tiny_config("bert")
    config.num_labels = len(labels)
    config.id2label = dict(enumerate(labels))
    config.label2id = {n: i for i, n in enumerate(labels)}
    torch.manual_seed(seed)
    T.BertForSequenceClassification(config).eval().save_pretrained(directory)
    save_tokenizer(directory, "bert")
    return directory


def save_t5(directory: Path, seed: int = 0) -> Path:
    """A tiny T5ForConditionalGeneration that answers in one word: every id but pad ends generation, so a
    greedy answer is the first word the model picks for the input (weights drawn 5x wider than T5's init,
    so that word depends on the input)."""
    save_tokenizer(directory, "t5")
    vocab = len(T.AutoTokenizer.from_pretrained(directory))
    config = T.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                        num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=5.0)
    torch.manual_seed(seed)
    model = T.T5ForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = list(range(1, vocab))
    model.save_pretrained(directory)
    return directory


def save_clip(directory: Path, seed: int = 0) -> T.CLIPModel:
    """A tiny CLIPModel with its processor (a byte-level BPE tokenizer and a 16-pixel image processor)."""
    from tests.builders.hub import clip_tokenizer, save_clip_model

    return save_clip_model(directory, clip_tokenizer(directory.parent / f"{directory.name}-tokenizer"), num_layers=1,
                           seed=seed)
