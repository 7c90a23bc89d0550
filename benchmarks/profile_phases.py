#!/usr/bin/env python
"""Where a `featcal calibrate` command's wall time goes, per phase of the engine: py-spy samples, grouped.

profile_calibrate.py profiles calibrate() in one warm process on a built family, by operator and by Python
function; this takes ANY featcal command as a user runs it (the 1B shape of decoder_1b.py, a zoo model),
samples its main thread with py-spy (`pip install py-spy`; sampling another process's stacks costs little, so
the command runs at close to its own speed) and adds the samples up by phase, the innermost rule that
matches a sample's stack naming it:

    python benchmarks/profile_phases.py --out runs/prof-l4 -- python -m featcal calibrate --base ... --merged ...
    python benchmarks/profile_phases.py --out runs/prof-l4 --raw runs/prof-l4/samples.txt   # regroup saved samples

Phases (PHASES below, matched on function names, innermost first): the statistics folded by the hooks during
the merged forward; the expert forward; the merged forward itself; the reference chain of the end-to-end
drift; the propagation through the calibrated block; the fold of each finished task into the float64 sums
(its float64 products and the element-wise work around them apart); the solves (Cholesky factor, triangular
solves, the rest); reading expert blocks on the main thread; the context check; the input checks and hashes;
the write. Output: phases.json and phases.md under --out (seconds = samples / rate), and the raw samples.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

# (phase, function names any of which in a sample's stack puts it there); the first rule whose names appear
# innermost (closest to the leaf) wins, so nested phases (the hooks inside the merged forward) are their own
PHASES: list[tuple[str, tuple[str, ...]]] = [
    ("statistics (hooks: Grams, cross moments, teacher products)", ("MergedFolder.", "TaskSums.add_", "add_gram_")),
    ("fold: float64 products", ("NormalisedSums._teacher_terms",)),
    ("fold: Gram means (widen, mirror, scale)", ("GramSums.means",)),
    ("fold: other element-wise", ("NormalisedSums.add_task",)),
    ("solve: Cholesky factor and triangular solves", ("solve_spd",)),
    ("solve: other", ("BlockContext.solve",)),
    ("expert forward", ("GatherPass._expert_forward",)),
    ("merged forward (as merged)", ("GatherPass._merged_forward",)),
    ("reference chain (end-to-end drift)", ("BlockContext.advance_reference",)),
    ("propagation (calibrated block)", ("BlockContext.propagate",)),
    ("expert blocks read (main thread)", ("RunContext.load_expert",)),
    ("context check (one whole forward)", ("check_context_replay",)),
    ("input checks and hashes", ("scan_finite", "file_sha256", "checkpoint_hashes")),
    ("write", ("_write_calibrated", "save_file")),
    ("engine, other", ("FeatCalEngine.",)),
]


def frame_name(frame: str) -> str:
    """'func (path:line)' -> 'func'."""
    return frame.split(" (", 1)[0]


def phase_of(frames: list[str]) -> str:
    """The phase of one sample's stack (root first): the rule matched closest to the leaf."""
    for frame in reversed(frames):
        name = frame_name(frame)
        for phase, names in PHASES:
            if any(name.startswith(n) for n in names):
                return phase
    return "outside the engine (start-up, loading, other)"


def group(raw: Path) -> tuple[Counter, int]:
    """Samples per phase of the main thread, from py-spy's raw output recorded with --threads."""
    per_thread: dict[str, Counter] = {}
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, n = line.rsplit(" ", 1)
        frames = stack.split(";")
        thread, frames = (frames[0], frames[1:]) if frames[0].startswith("thread (") else ("?", frames)
        per_thread.setdefault(thread, Counter())[phase_of(frames)] += int(n)
    # the main thread is the one that ran the engine longest (readers, tqdm's monitor and the like are not timed)
    main = max(per_thread.values(), key=lambda c: sum(v for k, v in c.items() if not k.startswith("outside")))
    return main, sum(main.values())


def table(counts: Counter, total: int, rate: int) -> str:
    lines = ["| phase | seconds | share |", "|---|---:|---:|"]
    for phase, n in counts.most_common():
        lines.append(f"| {phase} | {n / rate:.1f} | {100 * n / total:.1f} % |")
    lines.append(f"| all (main thread) | {total / rate:.1f} | 100 % |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rate", type=int, default=20, help="samples per second (default 20)")
    p.add_argument("--raw", type=Path, default=None, help="group these saved samples instead of running a command")
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    raw = args.raw
    if raw is None:
        if not cmd:
            p.error("give the command to profile after --, or --raw FILE")
        spy = shutil.which("py-spy")
        if spy is None:
            p.error("py-spy is not installed: pip install py-spy")
        raw = args.out / "samples.txt"
        subprocess.run([spy, "record", "--rate", str(args.rate), "--threads", "--format", "raw", "-o", str(raw),
                        "--", *cmd], check=True)
    counts, total = group(raw)
    md = table(counts, total, args.rate)
    (args.out / "phases.json").write_text(json.dumps({
        "command": shlex.join(cmd) if cmd else None, "rate": args.rate, "raw": str(raw),
        "seconds": {k: round(v / args.rate, 2) for k, v in counts.most_common()},
        "main_thread_seconds": round(total / args.rate, 2)}, indent=2))
    (args.out / "phases.md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
