#!/usr/bin/env python
"""The steps of benchmarks/gpu_check.sh (issue 19): preflight, CPU-vs-device equality, the report.

    python benchmarks/gpu_check.py preflight --device cuda --backend nccl --out DIR/preflight.json
    python benchmarks/gpu_check.py equal --device cuda --backend nccl --out DIR/equal.json
    python benchmarks/gpu_check.py report --dir DIR

The speed step is benchmarks/calibration_speed.py itself (its family builder, floor and calibrate
measurements, `--device`, `--offload-blocks`, `--process-group`). Every step runs on the CPU too
(`--device cpu --backend gloo`), so the script can be run end to end without a GPU: gloo then
stands in for nccl, and the device path is the CPU path with the offload option (bit-identical).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

# equality: the largest |Δ| of a calibrated tensor, relative to the largest |value| of the CPU path's
# tensor. float32 sums accumulated in another order (GPU kernels) and a float64 solve on other hardware
# differ by round-off amplified by the solve; 1e-4 is ~1000 float32 ulps, far below what calibration
# changes (checked: `changed_by_calibration` must be far above it for the check to mean anything).
REL_BOUND = 1e-4

SIZES = {  # CLIPVisionConfig overrides of calibration_speed's `small` preset
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=32,
                 patch_size=8),
    "small": {},
}


def speed_module():
    """benchmarks/calibration_speed.py, imported by path (benchmarks/ is not a package)."""
    if "calibration_speed" in sys.modules:
        return sys.modules["calibration_speed"]
    spec = importlib.util.spec_from_file_location("calibration_speed", HERE / "calibration_speed.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["calibration_speed"] = module
    spec.loader.exec_module(module)
    return module


def _write(path: str | None, obj: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def fail(message: str, code: int = 2) -> None:
    print(f"gpu_check: FAILED: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


# ---- preflight -------------------------------------------------------------------------------------------


def _nccl_version() -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception as e:  # noqa: BLE001 - a version string is all that is asked
        return f"unknown ({e})"
    return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)


def check_device(device: str) -> dict:
    """What the device is, or a clear failure before any work when it is asked for and absent."""
    info = {"device": device, "torch": torch.__version__, "cuda_runtime": torch.version.cuda}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            fail(f"--device {device} asked for, but torch.cuda.is_available() is False (torch {torch.__version__}, "
                 f"built with CUDA {torch.version.cuda}); for a CPU dry run set GPU_CHECK_DEVICE=cpu")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            fail(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
        props = torch.cuda.get_device_properties(index)
        info.update(name=props.name, total_memory_mib=round(props.total_memory / 2**20),
                    capability=f"{props.major}.{props.minor}", nccl=_nccl_version())
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


def check_group(backend: str, device: str) -> dict:
    """A one-rank group of `backend` starts and its all-reduce / broadcast work on the rank's device."""
    import torch.distributed as dist

    from featcal.calibration.maths.distributed import RankGroup

    if not dist.is_available():
        fail("torch.distributed is not available in this torch build")
    if backend == "nccl" and not dist.is_nccl_available():
        fail("the nccl backend is not available in this torch build")
    with speed_module().one_process_group(backend, device) as got:
        where = RankGroup.comm_device()
        x = torch.arange(4, dtype=torch.float32, device=where)
        dist.all_reduce(x)
        dist.broadcast(x, src=0)
        if x.tolist() != [0.0, 1.0, 2.0, 3.0]:
            fail(f"{backend}: a one-rank all_reduce changed its input: {x.tolist()}")
    return {"backend": got, "comm_device": str(where)}


def preflight(args: argparse.Namespace) -> int:
    info = check_device(args.device)
    info["process_group"] = check_group(args.backend, args.device)
    if args.backend != "nccl":
        info["note"] = f"CPU dry run: {args.backend} stands in for nccl (the GPU run uses nccl)"
    _write(args.out, info)
    print("preflight: " + ", ".join(f"{k} {v}" for k, v in info.items() if k != "process_group")
          + f"; 1-process group: {info['process_group']['backend']} on {info['process_group']['comm_device']}")
    return 0


# ---- equality on a small model ---------------------------------------------------------------------------


def _family(root: Path, size: str, tasks: int, examples: int, batch_size: int, seed: int):
    cs = speed_module()
    argv = ["--preset", "small", "--tasks", str(tasks), "--examples", str(examples), "--batch-size", str(batch_size),
            "--seed", str(seed)]
    for key, value in SIZES[size].items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    args = cs.parse_args(argv)
    family = cs.build_family(root, args)
    return family, cs.task_batches(family, args)


def _calibrate(family: dict, data: dict, config: dict) -> dict[str, torch.Tensor]:
    from featcal import FeatCalConfig, calibrate
    from featcal.io.read.models import load_model

    model = calibrate(load_model(family["merged"]), base=family["base"], experts=dict(family["experts"]),
                       calibration=data, config=FeatCalConfig(**config), progress=False).model
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _max_rel(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, float, str]:
    """Largest |a - b| (absolute, and relative to max |b| of that tensor) over the floating tensors."""
    worst_abs, worst_rel, where = 0.0, 0.0, ""
    for k, ref in b.items():
        if not ref.is_floating_point():
            continue
        d = (a[k].double() - ref.double()).abs().max().item()
        rel = d / max(ref.double().abs().max().item(), 1e-30)
        worst_abs = max(worst_abs, d)
        if rel > worst_rel:
            worst_rel, where = rel, k
    return worst_abs, worst_rel, where


def equality(device: str, backend: str, size: str = "small", tasks: int = 4, examples: int = 32,
             batch_size: int = 16, seed: int = 0) -> dict:
    """calibrate() on the CPU path vs on `device` with offload_blocks in a one-rank `backend` group."""
    from featcal.io.read.models import load_model

    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on the GPU too
    torch.backends.cudnn.allow_tf32 = False  # (CLIP's patch embedding is a convolution)
    base_config = {"num_calibration_examples": examples, "calibration_batch_size": batch_size, "seed": seed}
    with tempfile.TemporaryDirectory(prefix="featcal-gpu-check-") as tmp:
        family, data = _family(Path(tmp), size, tasks, examples, batch_size, seed)
        merged = {k: v.clone() for k, v in load_model(family["merged"]).state_dict().items()}
        start = time.perf_counter()
        cpu = _calibrate(family, data, {**base_config, "device": "cpu"})
        cpu_seconds = time.perf_counter() - start
        with speed_module().one_process_group(backend, device) as got:
            start = time.perf_counter()
            dev = _calibrate(family, data, {**base_config, "device": device, "offload_blocks": True})
            dev_seconds = time.perf_counter() - start
    max_abs, max_rel, where = _max_rel(dev, cpu)
    _, changed, _ = _max_rel(cpu, merged)
    n_params = sum(v.numel() for v in cpu.values() if v.is_floating_point())
    return {
        "size": size, "parameters": n_params, "tasks": tasks, "examples_per_task": examples, "batch_size": batch_size,
        "device": device, "offload_blocks": True, "backend": got, "collectives_forced": True,
        "cpu_seconds": round(cpu_seconds, 3), "device_seconds": round(dev_seconds, 3),
        "max_abs_diff": max_abs, "max_rel_diff": max_rel, "worst_tensor": where, "rel_bound": REL_BOUND,
        "changed_by_calibration": changed,
        "equal": max_rel <= REL_BOUND and changed > 100 * REL_BOUND,
    }


def equal(args: argparse.Namespace) -> int:
    check_device(args.device)
    r = equality(args.device, args.backend, args.size, args.tasks, args.examples, args.batch_size, args.seed)
    _write(args.out, r)
    note = "" if args.backend == "nccl" else f" ({args.backend} stands in for nccl: CPU dry run)"
    print(f"equality ({r['size']} CLIP, {r['parameters'] / 1e6:.2f} M params, {r['tasks']} tasks x "
          f"{r['examples_per_task']}): CPU path vs {r['device']} --offload-blocks in a 1-process {r['backend']} "
          f"group{note}: max |Δ| {r['max_abs_diff']:.3g}, relative {r['max_rel_diff']:.3g} ({r['worst_tensor'] or '-'}), "
          f"bound {REL_BOUND:g}; calibration moved the weights by {r['changed_by_calibration']:.3g} relative")
    if not r["equal"]:
        fail("the device path's result differs from the CPU path beyond float32 round-off"
             if r["max_rel_diff"] > REL_BOUND else "calibration barely changed the weights: the check is vacuous", 1)
    return 0


# ---- report ------------------------------------------------------------------------------------------------


def _mib(x: float | None) -> str:
    return "n/a (cpu)" if x is None else f"{x:.0f}"


def report_table(speed: dict, equal_result: dict | None, preflight_info: dict | None) -> tuple[dict, str]:
    """The figures of one gpu_check run and their table; a ratio below 1 is an error, never a result."""
    f, c = speed["floor"], speed["calibrate"]
    ratio, error = speed_module().ratio_to_floor(c["seconds_median"], f["seconds_median"])
    figures = {
        "preflight": preflight_info, "equality": equal_result,
        "speed": {k: speed[k] for k in ("model", "tasks", "examples_per_task", "batch_size", "threads", "device",
                                        "offload_blocks", "process_group", "repeats") if k in speed},
        "floor": {"seconds": f["seconds_median"], "peak_device_mb": f.get("peak_device_mb_median"),
                  "peak_rss_mb": f["peak_rss_mb_median"]},
        "calibrate": {"seconds": c["seconds_median"], "peak_device_mb": c.get("peak_device_mb_median"),
                      "peak_rss_mb": c["peak_rss_mb_median"]},
        "ratio": None if error else ratio, "ratio_error": error,
    }
    m = speed["model"]
    lines = [
        f"model: {m['model_type']}, {m['parameters'] / 1e6:.1f} M parameters, {m['blocks']} blocks; "
        f"{speed['tasks']} experts x {speed['examples_per_task']} examples, batch {speed['batch_size']}; "
        f"device {speed['device']}, offload_blocks {speed.get('offload_blocks')}, 1-process group "
        f"{speed.get('process_group')}; {speed['repeats']} repeat(s), each in a fresh process",
        "",
        "| measurement | wall time (s) | peak device memory (MiB) | peak host RSS (MiB) |",
        "|---|---:|---:|---:|",
        f"| floor: merged fwd (all tasks) + each expert fwd (own task) | {f['seconds_median']:.2f} | "
        f"{_mib(f.get('peak_device_mb_median'))} | {f['peak_rss_mb_median']:.0f} |",
        f"| featcal calibrate() | {c['seconds_median']:.2f} | {_mib(c.get('peak_device_mb_median'))} | "
        f"{c['peak_rss_mb_median']:.0f} |",
        f"| calibrate / floor | {error.upper() if error else f'{ratio:.2f}x'} | "
        + (f"{c['peak_device_mb_median'] / f['peak_device_mb_median']:.2f}x"
           if c.get("peak_device_mb_median") and f.get("peak_device_mb_median") else "")
        + f" | {c['peak_rss_mb_median'] / f['peak_rss_mb_median']:.2f}x |",
    ]
    if equal_result:
        e = equal_result
        lines += ["", f"equality on a {e['size']} model ({e['device']}, offload, {e['backend']} group vs the CPU "
                      f"path): max relative |Δ| {e['max_rel_diff']:.3g} (bound {e['rel_bound']:g}): "
                      + ("EQUAL within float32 round-off" if e["equal"] else "NOT EQUAL")]
    if (preflight_info or {}).get("note"):
        lines += ["", preflight_info["note"]]
    return figures, "\n".join(lines)


def report(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    read = lambda name: json.loads((d / name).read_text()) if (d / name).exists() else None  # noqa: E731
    speed = read("speed.json")
    if speed is None:
        fail(f"no {d / 'speed.json'}: the speed step did not finish")
    figures, table = report_table(speed, read("equal.json"), read("preflight.json"))
    figures["elapsed_s"] = args.elapsed
    _write(str(d / "gpu_check.json"), figures)
    print(table)
    print(f"\nfigures: {d / 'gpu_check.json'}")
    return 1 if figures["ratio_error"] else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="step", required=True)
    for name in ("preflight", "equal"):
        s = sub.add_parser(name)
        s.add_argument("--device", default="cuda")
        s.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
        s.add_argument("--out")
    e = sub.choices["equal"]
    e.add_argument("--size", choices=sorted(SIZES), default="small")
    e.add_argument("--tasks", type=int, default=4)
    e.add_argument("--examples", type=int, default=32)
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("report")
    r.add_argument("--dir", required=True)
    r.add_argument("--elapsed", type=float, help="the script's wall time so far (s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step == "equal":
        torch.set_num_threads(max(1, min(torch.get_num_threads(), 8)))
    return {"preflight": preflight, "equal": equal, "report": report}[args.step](args)


if __name__ == "__main__":
    sys.exit(main())
