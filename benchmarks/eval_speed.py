#!/usr/bin/env python
"""Is `featcal eval` as fast as a plain forward loop over the same tokens? (issue #38: ≥ 0.8×)

Times, on one causal LM and one held-out text set, in this process and with the model already loaded:
- featcal: the causal-LM runner's `score` (tokenising, length-sorted batches, the loss, perplexity and
  next-token accuracy), as `featcal eval` runs it;
- plain, same batches: `model(**batch)` over exactly the length-sorted, right-padded batches featcal
  builds (the floor: the forwards featcal cannot avoid, nothing else);
- plain, file order: `model(**batch)` over batches of the same size in the file's order, each padded to
  its longest row (what a straightforward loop does; length sorting is what it gives away).
Each is repeated and the medians reported; the ratio floor / featcal is the figure the issue asks to keep
at or above 0.8. Nothing is asserted: a timing is not a test (the machine may be shared).

    python benchmarks/eval_speed.py --help
    python benchmarks/eval_speed.py --repeats 5 --out runs/eval-speed.json          # a random Llama of --preset
    python benchmarks/eval_speed.py --model DIR --data held_out.jsonl --threads 4   # a real model and data

By default it builds a random LlamaForCausalLM (sizes from --preset) with a word-level tokenizer and
random texts of 8 to --max-words words (the cost depends on the token counts, not on the words).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

PRESETS = {  # LlamaConfig sizes
    "small": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2),
    "smollm-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                        num_key_value_heads=3),
}


def build_model(root: Path, preset: str, vocab_words: int, seed: int) -> Path:
    """A random Llama of `preset`'s size with a word-level tokenizer over `vocab_words` words, saved in `root`."""
    import transformers as T
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(vocab_words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    T.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
                              ).save_pretrained(root)
    torch.manual_seed(seed)
    config = T.LlamaConfig(vocab_size=len(vocab), max_position_embeddings=4096, **PRESETS[preset])
    T.LlamaForCausalLM(config).eval().save_pretrained(root)
    return root


def write_texts(path: Path, n: int, max_words: int, vocab_words: int, seed: int) -> Path:
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            words = " ".join(f"w{rng.randrange(vocab_words)}" for _ in range(rng.randint(8, max_words)))
            f.write(json.dumps({"text": words}) + "\n")
    return path


def median_seconds(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a causal LM folder with its tokenizer (default: a random Llama of --preset)")
    p.add_argument("--data", help="held-out texts (.jsonl with a text column; default: random texts)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--examples", type=int, default=128)
    p.add_argument("--max-words", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the figures here as JSON")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from featcal.evaluation.data import read_eval_set
    from featcal.evaluation.kinds import model_kind
    from featcal.evaluation.options import EvalOptions
    from featcal.evaluation.runners.base import ModelEntry, length_sorted_batches
    from featcal.evaluation.runners.causal_lm import CausalLMRunner, _padded
    from featcal.io.read.models import load_config

    with tempfile.TemporaryDirectory(prefix="featcal-eval-speed-") as tmp:
        model_dir = Path(args.model) if args.model else build_model(Path(tmp) / "model", args.preset, 4000, args.seed)
        data_path = Path(args.data) if args.data else write_texts(Path(tmp) / "held_out.jsonl", args.examples,
                                                                 args.max_words, 4000, args.seed)
        config = load_config(model_dir)
        entry = ModelEntry("model", "model", model_dir, config, model_kind(config, name="model"), str(model_dir))
        options = EvalOptions(batch_size=args.batch_size, max_length=args.max_length)
        runner = CausalLMRunner(entry, options)
        data = read_eval_set("held_out", data_path)
        runner.check(data)
        model = runner.load_model()
        encoded = runner.encode(data)
        pad = runner.tokenizer.pad_token_id
        sorted_batches = [_padded([encoded[i] for i in b], pad)[:2]
                          for b in length_sorted_batches([len(ids) for ids, _ in encoded], args.batch_size)]
        file_batches = [_padded(encoded[i : i + args.batch_size], pad)[:2] for i in range(0, len(encoded), args.batch_size)]

        @torch.no_grad()
        def plain(batches):
            for ids, mask in batches:
                model(input_ids=ids, attention_mask=mask)

        plain(sorted_batches[:1])  # warm-up
        featcal_s = median_seconds(lambda: runner.score(model, data, progress=False), args.repeats)
        floor_s = median_seconds(lambda: plain(sorted_batches), args.repeats)
        file_order_s = median_seconds(lambda: plain(file_batches), args.repeats)
        tokens = sum(len(ids) for ids, _ in encoded)
        padded_sorted = sum(ids.numel() for ids, _ in sorted_batches)
        padded_file = sum(ids.numel() for ids, _ in file_batches)
    figures = {
        "model": str(args.model or f"random Llama ({args.preset})"), "examples": len(encoded), "tokens": tokens,
        "padded_tokens": {"length_sorted": padded_sorted, "file_order": padded_file},
        "threads": torch.get_num_threads(), "batch_size": args.batch_size, "repeats": args.repeats,
        "seconds": {"featcal": featcal_s, "plain_same_batches": floor_s, "plain_file_order": file_order_s},
        "ratio_floor_over_featcal": floor_s / featcal_s,
        "ratio_file_order_over_featcal": file_order_s / featcal_s,
    }
    print(json.dumps(figures, indent=2))
    print(f"featcal eval runs at {figures['ratio_floor_over_featcal']:.2f}x a plain forward loop over the same batches "
          f"(goal >= 0.8x) and {figures['ratio_file_order_over_featcal']:.2f}x a plain loop in file order")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
