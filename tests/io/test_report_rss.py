"""featcal.json's peak RSS is the process's own, not its parent's.

ru_maxrss survives execve: a featcal started by fork/vfork + exec from a larger process reported
that process's peak (the planner test measured 1589 MiB against its 1147 MiB estimate only when
the test runner had grown past 1.5 GiB). peak_rss_mb reads the memory map's own high-water mark.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

PARENT = """
import json, subprocess, sys
big = bytearray(600 * 2**20)
for i in range(0, len(big), 4096):
    big[i] = 1  # resident
child = "import json; from featcal.io.write.report import peak_rss_mb; print(json.dumps(peak_rss_mb()))"
out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, check=True).stdout
from featcal.io.write.report import peak_rss_mb
print(json.dumps({"child": json.loads(out), "parent": peak_rss_mb()}))
"""


def test_a_child_of_a_large_process_reports_its_own_peak():
    env_path = str(SRC)
    done = subprocess.run([sys.executable, "-c", PARENT], capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    rss = json.loads(done.stdout)
    assert rss["parent"] > 600  # the parent did hold its 600 MiB
    assert rss["child"] < 200, rss  # ru_maxrss would say > 600 here
