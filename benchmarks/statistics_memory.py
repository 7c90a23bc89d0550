#!/usr/bin/env python
"""Would spilling per-task statistics (TaskSums) to disk save memory? The planner's own accounting says.

For the paper's model shapes (transformers configs built here, models on the meta device: no weights,
no hub), prints what `featcal plan` counts for the block with the largest statistics: one task's raw
sums (float32, the only per-task statistics ever alive: the engine folds each finished task into the
float64 cross-task sums and drops it), the cross-task sums, the fold/solve temporaries, and for scale
the chains and the two model copies at --tasks × --examples.

    python benchmarks/statistics_memory.py                  # 8 tasks × 256 examples, float32 chains
"""

from __future__ import annotations

import argparse
import shlex
import sys

import transformers as T

from featcal.calibration.planning.planner import estimate, fmt, model_shape, statistics_parts
from featcal.config import FeatCalConfig


def configs() -> dict[str, tuple[object, int]]:
    """Name -> (config, tokens per example for text models)."""
    def arch(cfg, name):
        cfg.architectures = [name]
        return cfg

    return {
        "CLIP ViT-B/32 (vision)": (arch(T.CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                                           num_attention_heads=12, image_size=224, patch_size=32),
                                        "CLIPVisionModel"), 0),
        "CLIP ViT-L/14 (vision)": (arch(T.CLIPVisionConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                                                           num_attention_heads=16, image_size=224, patch_size=14),
                                        "CLIPVisionModel"), 0),
        "FLAN-T5-base": (arch(T.T5Config(d_model=768, d_ff=2048, d_kv=64, num_layers=12, num_heads=12,
                                         feed_forward_proj="gated-gelu", vocab_size=32128), "T5ForConditionalGeneration"), 128),
        "Llama-3.2-3B": (arch(T.LlamaConfig(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                            num_attention_heads=24, num_key_value_heads=8, vocab_size=128256),
                              "LlamaForCausalLM"), 512),
        "Llama-3.1-8B": (arch(T.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
                              "LlamaForCausalLM"), 512),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=8)
    ap.add_argument("--examples", type=int, default=256)
    args = ap.parse_args(argv)
    cfg = FeatCalConfig(num_calibration_examples=args.examples)
    print(f"command: python benchmarks/statistics_memory.py {shlex.join(sys.argv[1:] if argv is None else argv)}".rstrip())
    print(f"{args.tasks} tasks × {args.examples} examples, float32 chains, text at the tokens shown\n")
    print("| model | tokens | one task's sums (f32) | cross-task sums (f64) | fold/solve | all statistics "
          "| chains | two models | one task's sums / (chains + models) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, (config, tokens) in configs().items():
        shape = model_shape(config, tokens or 128)
        block = max((b for s in shape.stacks for b in s.blocks), key=lambda b: sum(statistics_parts(b)))
        task, across, fold = statistics_parts(block)
        parts = {c.name: c.bytes for c in estimate(shape, tasks=args.tasks, config=cfg, baseline_bytes=0).components}
        models = parts["merged model"] + parts["expert template"]
        share = task / (parts["chains"] + models)  # the most that spilling TaskSums could take off the peak
        print(f"| {name} | {shape.stacks[0].tokens} | {fmt(task)} | {fmt(across)} | {fmt(fold)} | "
              f"{fmt(task + across + fold)} | {fmt(parts['chains'])} | {fmt(models)} | {share:.1%} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
