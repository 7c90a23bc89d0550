#!/usr/bin/env python
"""How far featcal's merge of a mergekit YAML is from mergekit's own output, in bfloat16 (docs/mergekit.md).

Builds a tiny random Llama family (a base and three experts = base + noise of `--scale` times each tensor's
std), stores it in `--dtype`, writes one mergekit YAML per method (weights 0.6 / 1.3 / 0.9, densities 0.5 / 0.3 /
0.7, λ 0.9, `dtype: --dtype`), merges it with mergekit 0.1.x's own run_merge (offline, local folders: what
`mergekit-yaml` runs) and with `featcal run`, and prints per method the largest |featcal − mergekit| and the
share of entries more than one ulp of the dtype apart. `--float32` merges the same YAML with featcal's own
float32 arithmetic instead (mergekit_arithmetic unset: what featcal did before it followed mergekit's).

    python benchmarks/mergekit_parity.py --out runs/mergekit-parity
    python benchmarks/mergekit_parity.py --out runs/mergekit-parity-f32 --float32

DARE draws random masks (mergekit from torch's global generator, featcal from its seeded one), so its methods
differ by the draw and are not compared here; tests/merging/test_mergekit.py hands mergekit featcal's masks.
Needs mergekit (`pip install -e '.[dev]'`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import transformers as T
import yaml
from safetensors.torch import load_file, save_file

from featcal.cli.main import main as featcal_main
from featcal.merging.mergekit_config import translate

METHODS = ("ties", "task_arithmetic", "linear")
RECIPE = ((0.6, 0.5), (1.3, 0.3), (0.9, 0.7))  # (weight, density) of each expert


def family(root: Path, dtype: torch.dtype, scale: float) -> tuple[Path, list[Path]]:
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base = T.LlamaForCausalLM(config)
    folders = []
    for i in range(len(RECIPE) + 1):
        model = T.LlamaForCausalLM(config)
        model.load_state_dict(base.state_dict())
        if i:
            g = torch.Generator().manual_seed(100 + i)
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * scale * (p.std() if p.numel() > 1 else 1.0))
        folder = root / ("base" if i == 0 else f"expert{i}")
        model.save_pretrained(folder)
        state = load_file(folder / "model.safetensors")
        save_file({k: v.to(dtype) for k, v in state.items()}, folder / "model.safetensors", metadata={"format": "pt"})
        folders.append(folder)
    return folders[0], folders[1:]


def mergekit_yaml(method: str, base: Path, experts: list[Path], dtype: str) -> dict:
    models = [{"model": str(e), "parameters": {"weight": w} if method in ("linear", "task_arithmetic")
               else {"weight": w, "density": d}} for e, (w, d) in zip(experts, RECIPE, strict=True)]
    parameters = {"weight": 0.4} if method == "linear" else {"lambda": 0.9}
    return {"merge_method": method, "base_model": str(base), "models": models, "parameters": parameters,
            "dtype": dtype}


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Representable values between a and b, entry by entry (a and b of one 16-bit or 32-bit float dtype)."""
    view, mask = (torch.int16, 0x7FFF) if a.element_size() == 2 else (torch.int32, 0x7FFFFFFF)

    def ordered(x):
        bits = x.contiguous().view(view).to(torch.int64)
        return torch.where(bits < 0, -(bits & mask), bits)

    return (ordered(a) - ordered(b)).abs()


def run_featcal(config: dict, out: Path, float32: bool) -> None:
    run = translate(config)
    if float32:
        run["merge"]["params"].pop("mergekit_arithmetic")
    run["out"] = str(out)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(run, sort_keys=False))  # the order of the inputs is the order of the sums
    assert featcal_main(["run", str(path), "--no-progress"]) == 0


def compare(method: str, root: Path, base: Path, experts: list[Path], dtype: str, float32: bool) -> str:
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    config = mergekit_yaml(method, base, experts, dtype)
    run_merge(MergeConfiguration.model_validate(config), str(root / f"mergekit-{method}"),
              MergeOptions(quiet=True, copy_tokenizer=False, write_model_card=False))
    run_featcal(config, root / f"featcal-{method}", float32)
    theirs = load_file(root / f"mergekit-{method}" / "model.safetensors")
    ours = load_file(root / f"featcal-{method}" / "model.safetensors")
    worst, differ, over, total = 0.0, 0, 0, 0
    for name, expected in theirs.items():
        got, apart = ours[name], ulps(ours[name], theirs[name])
        worst = max(worst, float((got.float() - expected.float()).abs().max()))
        differ, over = differ + int((apart > 0).sum()), over + int((apart > 1).sum())
        total += expected.numel()
    return (f"{method:16s} max |featcal - mergekit| = {worst:.4g}; of {total} entries {differ} differ, {over} "
            f"({100 * over / total:.2f} %) by more than one {dtype} ulp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="scratch folder (replaced)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--scale", type=float, default=0.01, help="expert noise, times each tensor's std")
    parser.add_argument("--float32", action="store_true", help="featcal's own float32 arithmetic (before)")
    args = parser.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    base, experts = family(args.out, getattr(torch, args.dtype), args.scale)
    print(f"featcal arithmetic: {'float32 (mergekit_arithmetic unset)' if args.float32 else 'mergekit'}; "
          f"inputs and YAML dtype {args.dtype}, expert noise {args.scale} x std")
    for method in METHODS:
        print(compare(method, args.out, base, experts, args.dtype, args.float32))


if __name__ == "__main__":
    main()
