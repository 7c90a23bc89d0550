#!/usr/bin/env python
"""How close FeatCal's cost comes to its floor, and how it compares with a straightforward implementation.

The floor (docs/method.md §8) is what any method that reads the merged model's and the experts' features on
the calibration data must pay: one forward of the merged model over every task's data plus one
forward of each expert over its own task's data. This command measures that floor, a full
`featcal.calibrate()` and the independent straightforward FeatCal of benchmarks/straightforward_featcal.py
(the authors' demo's way; CLIPVisionModel families only) on the same family and data, each in a fresh
subprocess (so each peak RSS belongs to one measurement), and reports medians over repeats and the ratios
calibrate / floor, straightforward / floor and calibrate / straightforward. A ratio below 1 against the
floor is impossible: it is printed as a measurement error, not a result. With --quick the calibrated
parameters of featcal and of the straightforward implementation are compared (exit 1 if they differ).

    python benchmarks/calibration_speed.py --help
    python benchmarks/calibration_speed.py --tasks 4 --examples 64 --repeats 3 --out runs/bench-calib.json
    python benchmarks/calibration_speed.py --preset vit-b32 --quick   # do the three paths run and agree? (not a timing)

By default it builds a random CLIPVisionModel family (base + perturbed experts, Task Arithmetic
merge at 0.3) of the size given; --base/--merged/--expert take an existing family instead.
Calibration inputs are random tensors of the model's input shape unless --calib gives real data:
the cost does not depend on the pixel values.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

PRESETS = {  # CLIPVisionConfig sizes
    "small": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  image_size=64, patch_size=8),
    "vit-b32": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                    image_size=224, patch_size=32),
}


# ---- building the family and the data (parent process) --------------------------------------------------


def build_family(root: Path, args: argparse.Namespace) -> dict:
    """A random CLIPVisionModel base, `tasks` perturbed experts and their Task Arithmetic merge."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    sizes = dict(PRESETS[args.preset])
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                "patch_size"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    torch.manual_seed(args.seed)
    base = CLIPVisionModel(CLIPVisionConfig(**sizes)).eval()
    base.save_pretrained(root / "base")
    theta0 = {k: v.clone() for k, v in base.state_dict().items()}
    merged = {k: v.clone() for k, v in theta0.items()}
    experts = {}
    g = torch.Generator().manual_seed(args.seed + 1)
    for t in range(args.tasks):
        state = {}
        for k, v in theta0.items():
            if v.is_floating_point():
                scale = args.perturbation * (v.std() if v.numel() > 1 and v.std() > 0 else 0.02)
                state[k] = v + torch.randn(v.shape, generator=g) * scale
                merged[k] += args.merge_scale * (state[k] - v)
            else:
                state[k] = v
        base.load_state_dict(state)
        name = f"task{t}"
        base.save_pretrained(root / name)
        experts[name] = str(root / name)
    base.load_state_dict(merged)
    base.save_pretrained(root / "merged")
    return {"base": str(root / "base"), "merged": str(root / "merged"), "experts": experts}


def random_batches(model_dir: str, examples: int, batch_size: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """Inputs of the model's shape: pixels for vision models, token ids (no padding) for text models."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(seed)
    sizes = [min(batch_size, examples - i) for i in range(0, examples, batch_size)]
    vision = cfg if hasattr(cfg, "image_size") else getattr(cfg, "vision_config", None)
    if vision is not None:
        s, c = vision.image_size, getattr(vision, "num_channels", 3)
        return [{"pixel_values": torch.randn(n, c, s, s, generator=g)} for n in sizes]
    out = []
    for n in sizes:
        ids = torch.randint(4, cfg.vocab_size, (n, 64), generator=g)
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if getattr(cfg, "is_encoder_decoder", False):
            batch["decoder_input_ids"] = ids[:, :16]
            batch["decoder_attention_mask"] = torch.ones_like(ids[:, :16])
        out.append(batch)
    return out


def task_batches(family: dict, args: argparse.Namespace) -> dict[str, list[dict[str, torch.Tensor]]]:
    sources = dict(p.split("=", 1) for p in args.calib or [])
    out = {}
    for i, t in enumerate(family["experts"]):
        if t in sources:
            from featcal.data import load_calibration_batches

            out[t] = load_calibration_batches(
                sources[t], model_dir=family["merged"], num_examples=args.examples, batch_size=args.batch_size,
                seed=args.seed,
            )
        else:
            out[t] = random_batches(family["merged"], args.examples, args.batch_size, args.seed + i)
    return out


# ---- the measurements (worker subprocesses) ------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_rss_mb() -> float:
    # this process's own peak (VmHWM): ru_maxrss would carry the parent's peak across fork + exec
    from featcal.io.write.report import peak_rss_mb

    return peak_rss_mb()


def _peak_device_mb(device: str) -> float | None:
    """Peak memory torch allocated on a CUDA device in this process (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    return torch.cuda.max_memory_allocated(torch.device(device)) / 2**20


def _measured(seconds: float, rss_loaded: float, device: str) -> dict:
    return {"seconds": seconds, "peak_rss_mb": _peak_rss_mb(), "rss_after_load_mb": rss_loaded,
            "peak_device_mb": _peak_device_mb(device)}


@contextmanager
def one_process_group(backend: str, device: str = "cpu"):
    """A default process group of one rank (`backend`: gloo or nccl) in which featcal runs its collectives.

    featcal skips its collectives in a world of one (`RankGroup.active` is False), so a bare one-rank
    group would test only its start; here `active` is forced on, so every all-reduce, all-gather and
    broadcast of a calibration goes through the backend (sums over one rank: the result is unchanged).
    Restored, and the group destroyed, on exit.
    """
    import torch.distributed as dist

    from featcal.calibration.maths import distributed

    if backend == "nccl":
        torch.cuda.set_device(torch.device(device).index or 0)
    saved = distributed.RankGroup.active
    with tempfile.TemporaryDirectory(prefix="featcal-pg-") as tmp:
        dist.init_process_group(backend, init_method=f"file://{tmp}/store", rank=0, world_size=1)
        distributed.RankGroup.active = property(lambda self: dist.is_initialized())
        try:
            yield dist.get_backend()
        finally:
            distributed.RankGroup.active = saved
            dist.destroy_process_group()


def _to(batch: dict, device: str) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def warm_up(model, data: dict, device: str) -> None:
    """One small forward and the lazy imports calibrate() triggers, so neither is timed."""
    import importlib

    for name in ("featcal.calibration.front.api", "featcal.calibration.engine.driver", "featcal.io.read.param_sources",
                 "transformers.conversion_mapping", "transformers.core_model_loading"):
        importlib.import_module(name)
    first = next(iter(data.values()))[0]
    with torch.no_grad():
        model(**_to({k: v[:1] for k, v in first.items()}, device))


def warm_device(device: str) -> None:
    """Start the device's math libraries (cuBLAS, cuDNN, attention kernels) before a timer, touching none of
    the models: the floor and the straightforward implementation start them in their own `warm_up`, on models
    already on the device; calibrate() moves its models itself, so without this its timer would pay the
    libraries' start-up alone. Nothing on the CPU."""
    if device.startswith("cuda"):
        start_libraries(device)


def start_libraries(device: str) -> None:
    """One small call of each kind calibrate() makes on `device` (runs on any device; tested on the CPU)."""
    x = torch.ones(2, 3, 32, 32, device=device)
    w = torch.ones(8, 3, 16, 16, device=device)
    q = torch.ones(1, 2, 8, 16, device=device)
    with torch.no_grad():
        torch.nn.functional.conv2d(x, w, stride=16)
        torch.ones(64, 64, device=device) @ torch.ones(64, 64, device=device)
        torch.nn.functional.layer_norm(x, (32,))
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
        torch.linalg.cholesky(torch.eye(4, dtype=torch.float64, device=device))
    _sync(device)


def measure_floor(spec: dict, data: dict) -> dict:
    """One forward of the merged model over all tasks' data + one of each expert over its own data."""
    from featcal.io.read.models import load_model

    device = spec["device"]
    merged = load_model(spec["merged"]).to(device)
    experts = {t: load_model(p).to(device) for t, p in spec["experts"].items()}
    warm_up(merged, data, device)
    rss_loaded = _peak_rss_mb()
    _sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        for t, batches in data.items():
            for b in batches:
                merged(**_to(b, device))
                experts[t](**_to(b, device))
    _sync(device)
    return _measured(time.perf_counter() - start, rss_loaded, device)


def measure_calibrate(spec: dict, data: dict) -> dict:
    """A full calibrate(): merged model in memory; base and experts as paths (streamed) or loaded."""
    from featcal import FeatCalConfig, calibrate
    from featcal.io.read.models import load_model

    merged = load_model(spec["merged"])
    base: object = spec["base"]
    experts: dict = dict(spec["experts"])
    if spec["expert_source"] in ("memory", "device"):
        base = load_model(spec["base"])
        experts = {t: load_model(p) for t, p in experts.items()}
    if spec["expert_source"] == "device":  # on the calibration device, float32: the resident path (expert_placement.py)
        experts = {t: e.to(spec["device"]) for t, e in experts.items()}
    config = FeatCalConfig(**spec["config"])
    warm_up(merged, data, "cpu")  # calibrate() moves the model to config.device itself
    warm_device(spec["device"])
    rss_loaded = _peak_rss_mb()
    group = one_process_group(spec["process_group"], spec["device"]) if spec.get("process_group") else nullcontext()
    with group:
        _sync(spec["device"])
        start = time.perf_counter()
        out = calibrate(merged, base=base, experts=experts, calibration=data, config=config, progress=False).model
        _sync(spec["device"])
        seconds = time.perf_counter() - start
    result = _measured(seconds, rss_loaded, spec["device"])
    _save_parameters(spec, "calibrate", out)
    return result


def measure_calibrate_plain_grams(spec: dict, data: dict) -> dict:
    """calibrate() with the symmetric Gram switched off (every Gram a full addmm): the A/B of issue 19's change."""
    from featcal.blocks import grams

    grams.SYM_MIN_D = 1 << 62  # gram_chunks() reads it per call: 1 chunk, the plain product, everywhere
    return measure_calibrate(spec, data)


def _straightforward_module():
    """benchmarks/straightforward_featcal.py, imported by path (benchmarks/ is not a package)."""
    import importlib.util

    name = "straightforward_featcal"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def measure_straightforward(spec: dict, data: dict) -> dict:
    """The straightforward FeatCal on the same family and data: every model in memory on the device, as the demo."""
    from featcal import FeatCalConfig
    from featcal.io.read.models import load_model

    sf = _straightforward_module()
    device = spec["device"]
    cfg = FeatCalConfig(**spec["config"])  # the same hyperparameters as calibrate()
    settings = sf.Settings(alpha=cfg.teacher_interp_alpha, rho=cfg.anchor_blend_rho, lam=cfg.lambda_ratio,
                           eps=cfg.covariance_eps, cls_weight=cfg.cls_token_weight,
                           calibrate_bias=cfg.calibrate_bias, calibrate_layernorm=cfg.calibrate_layernorm)
    warm_device(device)
    _sync(device)
    loading = time.perf_counter()  # the demo's way has every model on the device before it starts: timed apart
    merged = load_model(spec["merged"]).to(device)
    base = load_model(spec["base"]).to(device)
    experts = {t: load_model(p).to(device) for t, p in spec["experts"].items()}
    _sync(device)
    load_seconds = time.perf_counter() - loading
    warm_up(merged, data, device)
    rss_loaded = _peak_rss_mb()
    _sync(device)
    start = time.perf_counter()
    out = sf.calibrate(merged, base, experts, data, settings, device=device)
    _sync(device)
    result = _measured(time.perf_counter() - start, rss_loaded, device)
    # calibrate()'s timer holds its own loading (experts streamed from their files, models moved to the device)
    result["load_seconds"] = load_seconds
    _save_parameters(spec, "straightforward", out)
    return result


def _save_parameters(spec: dict, mode: str, model) -> None:
    """With --quick: keep the calibrated parameters (after the timed region) for the parent to compare."""
    if spec.get("save_dir"):
        torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, Path(spec["save_dir"]) / f"{mode}.pt")


MEASURE = {"floor": measure_floor, "calibrate": measure_calibrate, "calibrate_plain_grams": measure_calibrate_plain_grams,
           "straightforward": measure_straightforward}


def worker(mode: str, spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec["threads"])
    data = torch.load(spec["data"], weights_only=True)
    result = MEASURE[mode](spec, data)
    print("RESULT " + json.dumps(result), flush=True)


def run_worker(mode: str, spec_path: Path, allocator: str = "tuned") -> dict:
    """One measurement in a fresh process; every mode gets the same host allocator setting (the floor too)."""
    from featcal.io.process import host_allocator

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", mode, "--spec", str(spec_path)],
        capture_output=True, text=True, env={**env, **host_allocator.environment(allocator), "TQDM_DISABLE": "1"},
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"the {mode} measurement failed (exit {proc.returncode})")
    return json.loads(lines[-1][len("RESULT "):])


# ---- reporting ---------------------------------------------------------------------------------------


def summarise(runs: list[dict]) -> dict:
    device = [r["peak_device_mb"] for r in runs if r.get("peak_device_mb") is not None]
    return {
        "seconds_median": statistics.median(r["seconds"] for r in runs),
        "seconds_all": [round(r["seconds"], 4) for r in runs],
        "peak_rss_mb_median": statistics.median(r["peak_rss_mb"] for r in runs),
        "rss_after_load_mb_median": statistics.median(r["rss_after_load_mb"] for r in runs),
        "peak_device_mb_median": statistics.median(device) if device else None,
        **({"with_loading_seconds_median": statistics.median(r["seconds"] + r["load_seconds"] for r in runs)}
           if runs and all("load_seconds" in r for r in runs) else {}),
    }


def ratio_to_floor(calibrate_seconds: float, floor_seconds: float, what: str = "calibrate") -> tuple[float, str | None]:
    """`what` / floor, and an error when it is below 1: nothing can do the floor's work in less time."""
    ratio = calibrate_seconds / floor_seconds
    if ratio < 1:
        return ratio, (f"measurement error: {what} ({calibrate_seconds:.3f} s) took less than its floor "
                       f"({floor_seconds:.3f} s), ratio {ratio:.2f} < 1 is impossible; not a result")
    return ratio, None


def compare_parameters(root: Path) -> dict:
    """--quick: featcal's and the straightforward implementation's calibrated parameters, and how far
    calibration moved them from the merge (the comparison is meaningful only when the move is much larger)."""
    from featcal.io.read.models import load_model

    ours = torch.load(root / "calibrate.pt", weights_only=True)
    theirs = torch.load(root / "straightforward.pt", weights_only=True)
    merged = load_model(json.loads((root / "spec.json").read_text())["merged"]).state_dict()
    diff = change = 0.0
    where = ""
    for k, v in ours.items():
        if not v.is_floating_point():
            continue
        d = (v.double() - theirs[k].double()).abs().max().item()
        if d >= diff:
            diff, where = d, k
        change = max(change, (v.double() - merged[k].double()).abs().max().item())
    return {"max_abs_diff": diff, "where": where, "max_abs_change": change,
            "equal": diff <= EQUAL_FRACTION * change and change > 0}


EQUAL_FRACTION = 1e-3  # --quick: agreement this much finer than calibration's own move counts as equal


def _ratio_cell(result: dict, key: str) -> str:
    error = result.get(f"{key}_error")
    return f"MEASUREMENT ERROR: {error.removeprefix('measurement error: ')}" if error else format(result[key], ".2f")


def _row(label: str, r: dict | None) -> list[str]:
    if r is None:
        return []
    return [f"| {label} | {r['seconds_median']:.3f} | {r['peak_rss_mb_median']:.0f} | {r['rss_after_load_mb_median']:.0f} |"]


def markdown(result: dict) -> str:
    f, c, s = result["floor"], result["calibrate"], result.get("straightforward")
    m = result["model"]
    quick = ["**quick check (--quick): a few examples, one repeat; the timings are not results**", ""] \
        if result.get("quick") else []
    eq = result.get("equality")
    return "\n".join([
        *quick,
        f"`{result['command']}`",
        "",
        f"model: {m['model_type']}, {m['parameters'] / 1e6:.2f} M parameters, {m['blocks']} blocks; "
        f"{result['tasks']} tasks x {result['examples_per_task']} examples, batch {result['batch_size']}; "
        f"{result['threads']} thread(s), device {result['device']}; experts as {result['expert_source']}; "
        f"host allocator {result.get('host_allocator', 'default')}; "
        + (f"featcal block_statistics {result['block_statistics']}; "
           if result.get("block_statistics", "as_merged") != "as_merged" else "") +
        f"medians of {result['repeats']}",
        "",
        "| measurement | wall time (s) | peak RSS (MiB) | RSS after loading (MiB) |",
        "|---|---|---|---|",
        *_row("floor: merged fwd (all tasks) + each expert fwd (own task)", f),
        *_row("featcal calibrate()", c),
        *_row("featcal calibrate(), full Gram products (--compare-plain-grams)", result.get("calibrate_plain_grams")),
        *_row("straightforward FeatCal (benchmarks/straightforward_featcal.py)", s),
        f"| ratio calibrate / floor | {_ratio_cell(result, 'ratio')} | | |",
        *([f"| ratio calibrate / calibrate with full Grams | {result['ratio_symmetric_to_plain_grams']:.2f} | | |"]
          if result.get("calibrate_plain_grams") else []),
        *([f"| ratio straightforward / floor | {_ratio_cell(result, 'straightforward_ratio')} | | |",
           f"| ratio calibrate / straightforward | {result['ratio_to_straightforward']:.2f} | | |"] if s else []),
        *([f"| straightforward with its loading (models read and moved to the device, as calibrate()'s timer "
           f"includes) | {s['with_loading_seconds_median']:.3f} | | |",
           f"| ratio calibrate / straightforward with its loading | "
           f"{c['seconds_median'] / s['with_loading_seconds_median']:.2f} | | |"]
          if s and s.get("with_loading_seconds_median") else []),
        *([f"\nparameters, featcal vs straightforward: max |diff| {eq['max_abs_diff']:.3g} ({eq['where']}), "
           f"max |calibrated - merged| {eq['max_abs_change']:.3g}: "
           f"{'EQUAL' if eq['equal'] else 'NOT EQUAL'} (diff <= {EQUAL_FRACTION:g} x change)"] if eq else []),
        *([f"\npeak device memory (torch.cuda.max_memory_allocated): floor {f['peak_device_mb_median']:.0f} MiB, "
           f"calibrate {c['peak_device_mb_median']:.0f} MiB"
           + (f", straightforward {s['peak_device_mb_median']:.0f} MiB" if s and s.get("peak_device_mb_median")
              is not None else "")] if c.get("peak_device_mb_median") is not None
          and f.get("peak_device_mb_median") is not None else []),
    ])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    fam = p.add_argument_group("built family (default)")
    fam.add_argument("--preset", choices=sorted(PRESETS), default="small", help="CLIPVisionModel size (default: small)")
    for flag in ("hidden-size", "intermediate-size", "num-hidden-layers", "num-attention-heads", "image-size",
                 "patch-size"):
        fam.add_argument(f"--{flag}", type=int, help="override the preset's value")
    fam.add_argument("--tasks", type=int, default=4, help="number of experts / tasks (default: 4)")
    fam.add_argument("--perturbation", type=float, default=0.05, help="expert noise relative to each tensor's std")
    fam.add_argument("--merge-scale", type=float, default=0.3, help="Task Arithmetic scaling of the merge")
    given = p.add_argument_group("existing family (instead of building one)")
    given.add_argument("--base")
    given.add_argument("--merged")
    given.add_argument("--expert", action="append", metavar="NAME=PATH")
    given.add_argument("--calib", action="append", metavar="NAME=DATA", help="real data for a task (else random)")
    p.add_argument("--examples", type=int, help="calibration examples per task (default: 64; --quick: 8)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, help="measurements per mode; medians are reported (default: 3; --quick: 1)")
    p.add_argument("--compare-plain-grams", action="store_true",
                   help="also time calibrate() with full (not symmetric) Gram products, interleaved with the rest")
    p.add_argument("--skip-straightforward", action="store_true",
                   help="measure only the floor and calibrate() (the straightforward implementation is measured by "
                        "default on CLIPVisionModel families, skipped on others)")
    p.add_argument("--quick", action="store_true",
                   help="a quick check, not a timing: 8 examples per task and 1 repeat unless given, and featcal's "
                        "calibrated parameters compared with the straightforward implementation's")
    p.add_argument("--threads", type=int, default=1, help="torch threads in each measurement (default: 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--host-allocator", choices=("tuned", "default"), default="tuned",
                   help="glibc malloc settings of every measured process, the floor's too (featcal.io.process.host_allocator; "
                        "default: tuned: the floor at its fastest, so the ratios are not flattered)")
    p.add_argument("--offload-blocks", action="store_true", help="calibrate with FeatCalConfig(offload_blocks=True)")
    p.add_argument("--process-group", choices=("gloo", "nccl"),
                   help="calibrate inside a one-rank default process group of this backend, collectives forced on")
    p.add_argument("--chain-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--block-statistics", default="as_merged", choices=("as_merged", "sequential", "sequential_one_pass"),
                   help="featcal's variant (FeatCalConfig.block_statistics); the straightforward implementation runs "
                        "the paper's method only, so it is skipped for the others")
    p.add_argument("--expert-source", choices=("path", "memory", "device"), default="path",
                   help="give calibrate() the experts as paths (streamed, as the CLI does), loaded models, or loaded "
                        "models on --device (the resident path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", help="where the family and data are written (default: a temporary directory)")
    p.add_argument("--out", help="write the result JSON here")
    p.add_argument("--worker", choices=sorted(MEASURE), help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.examples is None:
        args.examples = 8 if args.quick else 64
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.spec)
        return 0
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="featcal-bench-calib-") as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        if args.base or args.merged or args.expert:
            if not (args.base and args.merged and args.expert):
                raise SystemExit("an existing family needs --base, --merged and at least one --expert NAME=PATH")
            family = {"base": args.base, "merged": args.merged, "experts": dict(e.split("=", 1) for e in args.expert)}
        else:
            family = build_family(root, args)
        data = task_batches(family, args)
        torch.save(data, root / "batches.pt")
        config = {"num_calibration_examples": args.examples, "calibration_batch_size": args.batch_size,
                  "seed": args.seed, "device": args.device, "chain_dtype": args.chain_dtype,
                  "offload_blocks": args.offload_blocks, "block_statistics": args.block_statistics}
        from transformers import AutoConfig, AutoModel

        cfg = AutoConfig.from_pretrained(family["merged"])
        straightforward = (not args.skip_straightforward and cfg.model_type == "clip_vision_model"
                           and args.block_statistics == "as_merged")
        if not args.skip_straightforward and args.block_statistics != "as_merged":
            print(f"the straightforward implementation is the paper's method, not block_statistics "
                  f"{args.block_statistics}: skipped", file=sys.stderr)
        elif not args.skip_straightforward and not straightforward:
            print(f"the straightforward implementation reads CLIPVisionModel only, not {cfg.model_type}: skipped",
                  file=sys.stderr)
        compare = args.quick and straightforward
        spec = {**family, "data": str(root / "batches.pt"), "threads": args.threads, "device": args.device,
                "expert_source": args.expert_source, "config": config, "process_group": args.process_group,
                "save_dir": str(root) if compare else None}
        spec_path = root / "spec.json"
        spec_path.write_text(json.dumps(spec))
        runs: dict[str, list[dict]] = {"floor": [], "calibrate": [],
                                       **({"calibrate_plain_grams": []} if args.compare_plain_grams else {}),
                                       **({"straightforward": []} if straightforward else {})}
        for r in range(args.repeats):  # interleaved, so slow drifts of the machine hit all alike
            for mode in runs:
                runs[mode].append(run_worker(mode, spec_path, args.host_allocator))
                print(f"repeat {r + 1}/{args.repeats} {mode}: {runs[mode][-1]['seconds']:.3f} s", file=sys.stderr)
        equality = compare_parameters(root) if compare else None
        with torch.device("meta"):
            n_params = sum(p.numel() for p in AutoModel.from_config(cfg).parameters())
    floor, calib = summarise(runs["floor"]), summarise(runs["calibrate"])
    ratio, ratio_error = ratio_to_floor(calib["seconds_median"], floor["seconds_median"])
    sf = summarise(runs["straightforward"]) if straightforward else None
    sf_ratio, sf_error = (ratio_to_floor(sf["seconds_median"], floor["seconds_median"], "the straightforward FeatCal")
                          if sf else (None, None))
    result = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "model": {"model_type": cfg.model_type, "parameters": n_params,
                  "blocks": getattr(cfg, "num_hidden_layers", None) or getattr(cfg, "num_layers", None)},
        "tasks": len(family["experts"]), "examples_per_task": args.examples, "batch_size": args.batch_size,
        "threads": args.threads, "device": args.device, "expert_source": args.expert_source,
        "chain_dtype": args.chain_dtype, "repeats": args.repeats, "offload_blocks": args.offload_blocks,
        "block_statistics": args.block_statistics, "host_allocator": args.host_allocator,
        "process_group": args.process_group,
        "quick": args.quick,
        "floor": floor, "calibrate": calib, "ratio": ratio, "ratio_error": ratio_error,
        "straightforward": sf, "straightforward_ratio": sf_ratio, "straightforward_ratio_error": sf_error,
        "ratio_to_straightforward": calib["seconds_median"] / sf["seconds_median"] if sf else None,
        "ratio_to_straightforward_with_loading": (calib["seconds_median"] / sf["with_loading_seconds_median"]
                                                  if sf and sf.get("with_loading_seconds_median") else None),
        "equality": equality,
        "calibrate_plain_grams": summarise(runs["calibrate_plain_grams"]) if args.compare_plain_grams else None,
    }
    if args.compare_plain_grams:
        result["ratio_symmetric_to_plain_grams"] = (calib["seconds_median"]
                                                    / result["calibrate_plain_grams"]["seconds_median"])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    failed = 0
    for error in (ratio_error, sf_error):  # printed, in the table and here; the exit status stays 0 (gpu_check's
        if error:                          # report step reads the JSON and fails on it)
            print(error.upper(), file=sys.stderr)
    if equality is not None and not equality["equal"]:
        print(f"featcal and the straightforward implementation disagree: max |diff| {equality['max_abs_diff']:.3g} "
              f"at {equality['where']}", file=sys.stderr)
        failed = 1
    return failed


if __name__ == "__main__":
    sys.exit(main())
