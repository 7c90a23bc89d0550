#!/usr/bin/env python
"""Micro-benchmark: symmetric (block-upper) vs plain Gram accumulation, to tune featcal.blocks.grams' SYM_MIN_D
and SYM_CHUNK. Run it on an idle machine; figures from a busy one say nothing.

For each width d: sxx += xᵀx of N tokens (float32), the plain addmm_ against featcal's add_gram_ at several
chunk widths (and at gram_chunks(d), what featcal uses now), medians over repeats after a warm-up. Every
variant is first checked against the plain product. The speed-up each chunk count could give at best is
2k/(k+1) (its share of multiply-adds).

    python benchmarks/gram_micro.py                               # d 384 768 1536 3072, N 4096, 1 thread
    python benchmarks/gram_micro.py --threads 8 --out runs/gram-micro.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from featcal.blocks.grams import add_gram_, gram_chunks, symmetrised


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def measure(d: int, tokens: int, widths: list[int], repeats: int, batches: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, d, generator=g) for _ in range(batches)]
    sxx = torch.zeros(d, d)
    plain_ref = sum(x.T.double() @ x.double() for x in xs)

    def run(k: int):
        def go():
            sxx.zero_()
            for x in xs:
                add_gram_(sxx, x, x, k)
        return go

    chunk_counts = sorted({1, gram_chunks(d), *(max(2, round(d / w)) for w in widths if w < d)})
    rows = []
    for k in chunk_counts:
        run(k)()
        err = ((symmetrised(sxx, k).double() - plain_ref).abs().max() / plain_ref.abs().max()).item()
        if err > 1e-5:
            raise SystemExit(f"d {d}, {k} chunks: relative error {err:.2e} against the plain product")
        seconds = _time(run(k), repeats) / batches
        rows.append({"chunks": k, "chunk_width": -(-d // k), "seconds_per_batch": seconds, "rel_error": err,
                     "featcal_default": k == gram_chunks(d), "flop_share": 1.0 if k == 1 else (k + 1) / (2 * k)})
    plain = next(r["seconds_per_batch"] for r in rows if r["chunks"] == 1)
    for r in rows:
        r["speedup_vs_plain"] = plain / r["seconds_per_batch"]
    return {"d": d, "tokens": tokens, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d", type=int, nargs="+", default=[384, 768, 1536, 3072])
    p.add_argument("--tokens", type=int, default=4096, help="tokens per batch (N)")
    p.add_argument("--widths", type=int, nargs="+", default=[128, 192, 256, 384, 512], help="chunk widths tried")
    p.add_argument("--batches", type=int, default=4, help="batches accumulated per measurement")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = [measure(d, args.tokens, args.widths, args.repeats, args.batches) for d in args.d]
    print(f"sxx += x^T x, float32, N = {args.tokens}, {args.threads} thread(s), medians of {args.repeats}")
    print("| d | chunks | chunk width | ms / batch | speed-up vs plain | multiply-add share | featcal now |")
    print("|---|---|---|---|---|---|---|")
    for res in results:
        for r in res["rows"]:
            print(f"| {res['d']} | {r['chunks']} | {r['chunk_width']} | {1e3 * r['seconds_per_batch']:.2f} | "
                  f"{r['speedup_vs_plain']:.2f} | {r['flop_share']:.2f} | {'yes' if r['featcal_default'] else ''} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"threads": args.threads, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
