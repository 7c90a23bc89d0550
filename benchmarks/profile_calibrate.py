#!/usr/bin/env python
"""Where calibrate()'s time goes: repeated timed runs in one warm process, then torch.profiler and cProfile.

calibration_speed.py says how long calibrate() takes against its floor; this says why. On one family
(built as calibration_speed.py builds it, or given) it times calibrate() `--repeats` times in one
process after a warm-up run (each run on a fresh copy of the merged model), then runs it once under
torch.profiler (the operators by host and by device time, and how busy the device was over the run) and
once under cProfile (the Python functions that hold the wall time, sync points included; --skip-cprofile
leaves it out).
Reports are text files under --out; a one-line summary is printed.

    python benchmarks/profile_calibrate.py --preset small --tasks 4 --examples 32 --out runs/profile-small
    python benchmarks/profile_calibrate.py --preset vit-b32 --tasks 8 --examples 256 --batch-size 32 \\
        --device cuda --expert-source memory --out runs/profile-vitb32-cuda
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
import calibration_speed as speed  # noqa: E402  (the family, its data and the device sync, as that benchmark makes them)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(speed.PRESETS), default="small")
    p.add_argument("--tasks", type=int, default=4)
    p.add_argument("--examples", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="timed runs after the warm-up (default: 2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--offload-blocks", action="store_true")
    p.add_argument("--expert-source", choices=("path", "memory"), default="memory")
    p.add_argument("--skip-cprofile", action="store_true", help="only the timed runs and torch.profiler")
    p.add_argument("--host-allocator", choices=("tuned", "default"), default="tuned",
                   help="glibc malloc settings of this process (featcal.io.process.host_allocator; default: tuned, as "
                        "calibration_speed.py times)")
    p.add_argument("--block-statistics", default="as_merged", choices=("as_merged", "sequential", "sequential_one_pass"))
    p.add_argument("--top", type=int, default=40, help="rows in each report (default: 40)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="folder for the reports")
    args = p.parse_args(argv)
    from featcal.io.process import host_allocator

    host_allocator.apply(args.host_allocator)  # before the family is built: every run sees the same malloc
    # the family exactly as calibration_speed.py builds it from these settings (its defaults for the rest)
    family_args = speed.parse_args(["--preset", args.preset, "--tasks", str(args.tasks), "--examples", str(args.examples),
                                    "--batch-size", str(args.batch_size), "--seed", str(args.seed)])
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from featcal import FeatCalConfig, calibrate
    from featcal.io.read.models import load_model

    with tempfile.TemporaryDirectory(prefix="featcal-profile-") as tmp:
        family = speed.build_family(Path(tmp), family_args)
        data = speed.task_batches(family, family_args)
        base: object = family["base"]
        experts: dict = dict(family["experts"])
        if args.expert_source == "memory":
            base = load_model(family["base"])
            experts = {t: load_model(p) for t, p in experts.items()}
        config = FeatCalConfig(num_calibration_examples=args.examples, calibration_batch_size=args.batch_size,
                               seed=args.seed, device=args.device, offload_blocks=args.offload_blocks,
                               block_statistics=args.block_statistics)

        host: list[dict] = []  # per run: page faults and system seconds (first touches of fresh memory)

        def once() -> float:
            merged = load_model(family["merged"])
            speed._sync(args.device)
            before = resource.getrusage(resource.RUSAGE_SELF)
            start = time.perf_counter()
            calibrate(merged, base=base, experts=experts, calibration=data, config=config, progress=False)
            speed._sync(args.device)
            seconds = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            host.append({"page_faults": after.ru_minflt - before.ru_minflt,
                         "system_s": round(after.ru_stime - before.ru_stime, 3)})
            return seconds

        warm = once()
        timed = [once() for _ in range(args.repeats)]
        print(f"warm-up {warm:.3f} s; timed {', '.join(f'{s:.3f}' for s in timed)} s; page faults / system s per run: "
              + ", ".join(f"{h['page_faults']} / {h['system_s']}" for h in host), flush=True)

        # torch.profiler first: on a device it is the report that says where the time goes, and twice a
        # time limit ended the run before it (2026-12-04); cProfile after it, unless --skip-cprofile
        activities = [torch.profiler.ProfilerActivity.CPU]
        if args.device.startswith("cuda"):
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            traced = once()
        events = prof.key_averages()
        sorts = ["self_cpu_time_total"] + (["self_device_time_total"] if len(activities) > 1 else [])
        for key in sorts:
            (out / f"torch-{key}.txt").write_text(events.table(sort_by=key, row_limit=args.top))
        device_busy_s = (sum(e.self_device_time_total for e in events) / 1e6) if len(activities) > 1 else None
        (out / "torch-trace-cpu-ops.txt").write_text(events.table(sort_by="cpu_time_total", row_limit=args.top))

        profiled = None
        if not args.skip_cprofile:
            profiler = cProfile.Profile()
            profiler.enable()
            profiled = once()
            profiler.disable()
            for key in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(args.top)
                (out / f"cprofile-{key}.txt").write_text(text.getvalue())

    summary = {"preset": args.preset, "tasks": args.tasks, "examples": args.examples, "batch_size": args.batch_size,
               "device": args.device, "threads": args.threads, "offload_blocks": args.offload_blocks,
               "expert_source": args.expert_source, "block_statistics": args.block_statistics, "warm_up_s": warm, "timed_s": timed,
               "cprofile_run_s": profiled, "torch_profiler_run_s": traced,
               "host_allocator": args.host_allocator, "host_per_run": host,
               "device_busy_s_in_profiled_run": device_busy_s}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    busy = f"; device busy {device_busy_s:.3f} s of the profiled run's {traced:.3f} s" if device_busy_s else ""
    print(f"median of timed runs {sorted(timed)[len(timed) // 2]:.3f} s{busy}; reports in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
