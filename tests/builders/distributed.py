"""Running featcal as 2 gloo ranks with torchrun, and comparing what the ranks wrote with one process.

Holds no tests itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def ranked_argv(fam: dict, out: Path, n_examples: int) -> list[str]:
    """`featcal calibrate` of `fam` with `n_examples` per task in batches of 2 (how the ranks split them)."""
    argv = ["calibrate", "--base", str(fam["base"]), "--merged", str(fam["merged"]), "--out", str(out), "--no-progress",
            "--num-calibration-examples", str(n_examples), "--calibration-batch-size", "2"]
    for t, d in fam["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in fam["data"].items():
        argv += ["--calib", f"{t}={d}"]
    return argv


def torchrun(argv: list[str], **env: str) -> subprocess.CompletedProcess:
    """`featcal ARGV` as 2 gloo ranks on this machine."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src"), **env}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "featcal", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


def max_param_diff(cls, a: Path, b: Path) -> float:
    """The largest difference between the floating parameters of two saved checkpoints."""
    sa, sb = cls.from_pretrained(a).state_dict(), cls.from_pretrained(b).state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa if sa[k].is_floating_point())
