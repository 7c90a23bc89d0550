"""The --tiny base: a random LlamaForCausalLM (or, with --model gemma3, a Gemma3ForCausalLM) with a
vocabulary trained on the bench's own domains, written as a GGUF file with the gguf package's writer, so
the tiny mode reads its base through featcal.io.read.gguf exactly as the real run does."""

from __future__ import annotations

import json
from pathlib import Path

TINY_CLASS = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}


def _byte_level_vocab(texts: list[str]) -> tuple[list[str], list[str]]:
    """(tokens, merges) of a 512-token byte-level BPE trained on `texts`, token 0 the separator."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    spec = json.loads(tok.to_str())["model"]
    tokens = [""] * len(spec["vocab"])
    for t, i in spec["vocab"].items():
        tokens[i] = t
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in spec["merges"]]


GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's own ids 0-3 (Gemma3TextConfig's defaults)


def _char_sentencepiece_vocab(texts: list[str]) -> list[str]:
    """A character-level sentencepiece vocabulary (Gemma's specials, 256 byte-fallback tokens, "▁" for space).

    Why not the byte-level BPE: transformers saves a GGUF gemma3 tokenizer as GemmaTokenizer, which
    rebuilds Gemma's sentencepiece pipeline when reloaded, so only a sentencepiece vocabulary reads the same
    from the GGUF (the bench) and from the merged checkpoint (featcal calibrate)."""
    chars = sorted({c for t in texts for c in t.replace(" ", "\u2581") if c.isprintable()})
    return GEMMA_SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + chars


def write_tiny_gguf(path: Path, texts: list[str], seed: int, arch: str = "llama") -> Path:
    """A random tiny LlamaForCausalLM with a byte-level BPE trained on `texts` (arch "gemma3": a Gemma3ForCausalLM
    with a character-level sentencepiece vocabulary), written as a GGUF file."""
    import gguf
    import numpy as np
    import torch
    import transformers as T

    if arch == "gemma3":
        tokens, merges = _char_sentencepiece_vocab(texts), None
        ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    else:
        tokens, merges = _byte_level_vocab(texts)
        ids = {"bos_token_id": 0, "eos_token_id": 0}
    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokens), hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, **ids,
                  initializer_range=0.2)  # frozen embeddings wide enough for the blocks to move the logits
    if arch == "gemma3":  # GGUF holds no layer pattern: 6 blocks give transformers' default 5 sliding + 1 global
        cfg = T.Gemma3TextConfig(num_hidden_layers=6, head_dim=16, sliding_window=16, **common)  # window < --seq-len
        model = T.Gemma3ForCausalLM(cfg)
    else:
        cfg = T.LlamaConfig(num_hidden_layers=4, **common)
        model = T.LlamaForCausalLM(cfg)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_token_list(tokens)
    if arch == "gemma3":
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
        w.add_tokenizer_model("llama")
        w.add_token_scores([0.0] * len(tokens))
        w.add_token_types([3, 3, 3, 2] + [6] * 256 + [1] * (len(tokens) - 260))  # control, unknown, byte, normal
        w.add_pad_token_id(0)
        w.add_eos_token_id(1)
        w.add_bos_token_id(2)
        w.add_unk_token_id(3)
    else:
        w.add_rope_freq_base(10000.0)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_types([3] + [1] * (len(tokens) - 1))
        w.add_token_merges(merges)
        w.add_bos_token_id(0)
        w.add_eos_token_id(0)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3 if arch == "gemma3" else gguf.MODEL_ARCH.LLAMA,
                                     cfg.num_hidden_layers)

    def permute(a, n_head):  # llama.cpp's q/k row order, which transformers' GGUF loader undoes
        return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    for key, value in model.state_dict().items():
        if key == "lm_head.weight":
            continue  # tied to the embedding
        a = value.detach().float().numpy()
        module, suffix = key.rsplit(".", 1)
        if arch == "gemma3":
            if key.endswith("norm.weight"):
                a = a + 1.0  # llama.cpp stores Gemma's norms as 1 + w; transformers' loader subtracts the 1
        elif key.endswith("q_proj.weight"):
            a = permute(a, cfg.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            a = permute(a, cfg.num_key_value_heads)
        w.add_tensor(f"{names.get_name(module)}.{suffix}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
