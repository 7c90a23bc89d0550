"""Tiny Llama and Gemma3 models written as float32 GGUF files with the gguf package's own writer.

llama.cpp's conventions, which transformers' GGUF loader undoes: q/k rows permuted (Llama), norms stored as
1 + w (Gemma). Holds no tests itself; callers skip when the gguf package is absent.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest


def permute_qk(a: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py)."""
    return a.reshape(n_head, 2, a.shape[0] // n_head // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)


def _add_shape(w, cfg, *, hidden=None, blocks=None, heads=None, kv=None) -> None:
    """The header keys every architecture has; a keyword forges the one it names."""
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(hidden or cfg.hidden_size)
    w.add_block_count(blocks or cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads or cfg.num_attention_heads)
    w.add_head_count_kv(kv or cfg.num_key_value_heads)


def _add_vocabulary(w, tokens: list[str], types: list[int], special: dict[str, int]) -> None:
    """An SPM ("llama") vocabulary with zero scores and the named special token ids."""
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    for name, token_id in special.items():
        getattr(w, f"add_{name}_token_id")(token_id)


def _add_tensors_and_close(w, gguf, arch, model, transform: Callable[[str, np.ndarray], np.ndarray | None]) -> None:
    """Every tensor of `model` under its GGUF name, after `transform` (None leaves the tensor out)."""
    names = gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    for key, value in model.state_dict().items():
        a = transform(key, value.detach().float().numpy())
        if a is None:
            continue
        module, suffix = key.rsplit(".", 1)
        w.add_tensor(f"{names.get_name(module)}.{suffix}", np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_llama_gguf(model, path: Path, *, heads=None, kv=None, hidden=None, blocks=None, short_tensor=None) -> Path:
    """`model` (a LlamaForCausalLM) with a llama-style tokenizer of its vocabulary; the keyword arguments forge
    its header (and the q/k permutation with it) or cut one row off the tensor `short_tensor`."""
    gguf = pytest.importorskip("gguf")
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    _add_shape(w, cfg, hidden=hidden, blocks=blocks, heads=heads, kv=kv)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(cfg.vocab_size - 3)]
    _add_vocabulary(w, tokens, [2, 3, 3] + [1] * (len(tokens) - 3), {"unk": 0, "bos": 1, "eos": 2})

    def transform(key: str, a: np.ndarray) -> np.ndarray:
        if key.endswith("q_proj.weight"):
            a = permute_qk(a, heads or cfg.num_attention_heads)
        elif key.endswith("k_proj.weight"):
            a = permute_qk(a, kv or cfg.num_key_value_heads)
        return a[:-1] if key == short_tensor else a

    _add_tensors_and_close(w, gguf, gguf.MODEL_ARCH.LLAMA, model, transform)
    return path


def write_gemma3_gguf(model, path: Path) -> Path:
    """`model` (a Gemma3ForCausalLM, tied head) with an SPM vocabulary ▁w0...; GGUF holds one rope_theta, the
    global layers'."""
    gguf = pytest.importorskip("gguf")
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny-gemma3")
    _add_shape(w, cfg)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"\u2581w{i}" for i in range(cfg.vocab_size - 4)]
    _add_vocabulary(w, tokens, [3, 3, 3, 2] + [1] * (len(tokens) - 4), {"pad": 0, "eos": 1, "bos": 2, "unk": 3})

    def transform(key: str, a: np.ndarray) -> np.ndarray | None:
        if key == "lm_head.weight":
            return None  # tied to the embedding
        return a + 1.0 if key.endswith("norm.weight") else a

    _add_tensors_and_close(w, gguf, gguf.MODEL_ARCH.GEMMA3, model, transform)
    return path
