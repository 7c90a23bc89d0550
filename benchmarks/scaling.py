#!/usr/bin/env python
"""How FeatCal's time and peak RSS grow with the number of experts and of calibration examples.

Builds one random CLIPVisionModel family (base, up to max(--experts) perturbed experts, their Task
Arithmetic merge at 0.3) in a temporary directory, then runs `featcal.calibrate` on every
(experts, examples per task) pair in a fresh subprocess (single-threaded torch), experts read block
by block from their checkpoints, inputs random pixel tensors (the cost does not depend on their
values). Prints a markdown table and the command that made it.

    python benchmarks/scaling.py                              # 2,4,8 experts x 16,64,256 examples
    python benchmarks/scaling.py --experts 2 4 --examples 16 64 --chain-dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, time
import torch
torch.set_num_threads(1)
from featcal import FeatCalConfig, calibrate
spec = json.loads(sys.argv[1])
g = torch.Generator().manual_seed(0)
size, bs, n = spec["image_size"], spec["batch_size"], spec["examples"]
data = {t: [torch.randn(min(bs, n - i), 3, size, size, generator=g) for i in range(0, n, bs)] for t in spec["experts"]}
cfg = FeatCalConfig(num_calibration_examples=n, calibration_batch_size=bs, chain_dtype=spec["chain_dtype"])
start = time.perf_counter()
calibrate(spec["merged"], base=spec["base"], experts=spec["experts"], calibration=data, config=cfg, progress=False)
seconds = time.perf_counter() - start
from featcal.io.write.report import peak_rss_mb  # own peak: ru_maxrss would carry the parent's across fork + exec
print(json.dumps({"seconds": seconds, "peak_rss_mb": peak_rss_mb()}))
"""


def build_family(root: Path, n_experts: int, sizes: dict) -> dict:
    import torch
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(0)
    base = CLIPVisionModel(CLIPVisionConfig(**sizes)).eval()
    base.save_pretrained(root / "base")
    g = torch.Generator().manual_seed(1)
    state = base.state_dict()
    deltas = []
    experts = {}
    for i in range(n_experts):
        delta = {k: torch.randn(v.shape, generator=g) * 0.05 * (v.std() if v.numel() > 1 else 1.0)
                 for k, v in state.items() if v.is_floating_point()}
        expert = CLIPVisionModel(base.config)
        expert.load_state_dict({k: v + delta.get(k, 0) for k, v in state.items()})
        expert.save_pretrained(root / f"expert{i}")
        experts[f"task{i}"] = str(root / f"expert{i}")
        deltas.append(delta)
    return {"base": str(root / "base"), "experts": experts, "deltas": deltas, "state": state, "model": base}


def merged_for(root: Path, fam: dict, k: int) -> str:
    """Task Arithmetic (s = 0.3) of the first k experts, saved once per k."""
    out = root / f"merged{k}"
    if not out.exists():
        merged = {n: v + 0.3 * sum(d[n] for d in fam["deltas"][:k]) if n in fam["deltas"][0] else v
                  for n, v in fam["state"].items()}
        model = fam["model"]
        model.load_state_dict(merged)
        model.save_pretrained(out)
        model.load_state_dict(fam["state"])
    return str(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--examples", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--chain-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--patch-size", type=int, default=4)
    args = parser.parse_args()
    sizes = dict(hidden_size=args.hidden_size, intermediate_size=4 * args.hidden_size, num_hidden_layers=args.layers,
                 num_attention_heads=4, image_size=args.image_size, patch_size=args.patch_size)
    tokens = (args.image_size // args.patch_size) ** 2 + 1
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    rows = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="featcal-scaling-") as tmp:
        root = Path(tmp)
        fam = build_family(root, max(args.experts), sizes)
        for k in args.experts:
            merged = merged_for(root, fam, k)
            for n in args.examples:
                spec = {"base": fam["base"], "merged": merged, "experts": dict(list(fam["experts"].items())[:k]),
                        "examples": n, "batch_size": args.batch_size, "image_size": args.image_size,
                        "chain_dtype": args.chain_dtype}
                proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True,
                                      text=True, check=False)
                if proc.returncode != 0:
                    print(proc.stderr[-3000:], file=sys.stderr)
                    return 1
                result = json.loads(proc.stdout.strip().splitlines()[-1])
                chains = 2 * k * n * tokens * args.hidden_size * {"float32": 4}.get(args.chain_dtype, 2) / 2**20
                rows.append((k, n, result["seconds"], result["peak_rss_mb"], chains))
                print(f"experts={k} examples={n}: {result['seconds']:.2f} s, {result['peak_rss_mb']:.0f} MiB", file=sys.stderr)
    print(f"command: `{shlex.join(['python', 'benchmarks/scaling.py', *sys.argv[1:]])}` ({time.perf_counter() - t0:.0f} s in all)")
    print(f"model: CLIPVisionModel hidden {args.hidden_size}, {args.layers} blocks, {tokens} tokens; batch "
          f"{args.batch_size}; chains {args.chain_dtype}; torch single-threaded\n")
    print("| experts | examples/task | calibrate (s) | peak RSS (MiB) | chains (MiB) |")
    print("|---:|---:|---:|---:|---:|")
    for k, n, s, rss, ch in rows:
        print(f"| {k} | {n} | {s:.2f} | {rss:.0f} | {ch:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
