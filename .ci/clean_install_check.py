"""Run by .ci/clean_install.sh inside a fresh venv where `pip install .` put featcal with no extra.

Checks that no extra's package came in, that `featcal --version` prints the installed version, that a merge
and a calibration of a tiny BERT family run end to end, and that the features needing an extra refuse in one
line naming it. Usage: python clean_install_check.py TESTS_DIR WORK_DIR (TESTS_DIR: the repository's tests/,
for the tiny-model builders, which need nothing beyond torch, transformers and numpy).
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path


def run_featcal(*argv: str) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).parent / "featcal"  # the console script pip installed
    return subprocess.run([str(exe), *argv], capture_output=True, text=True, timeout=600)


def check(ok: bool, what: str, run: subprocess.CompletedProcess | None = None) -> None:
    if not ok:
        detail = f"\nstdout: {run.stdout[-2000:]}\nstderr: {run.stderr[-2000:]}" if run is not None else ""
        sys.exit(f"clean install: FAILED: {what}{detail}")
    print(f"clean install: ok: {what}")


def refused(run: subprocess.CompletedProcess, extra: str) -> bool:
    """A one-line error (exit 2) naming `pip install 'featcal[extra]'`."""
    lines = run.stderr.strip().splitlines()
    return run.returncode == 2 and len(lines) == 1 and f"'featcal[{extra}]'" in lines[0]


def main(tests: Path, work: Path) -> None:
    import featcal
    from featcal.io.process.extras import EXTRAS, installed

    check(Path(featcal.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()),
          f"featcal imported from the venv ({featcal.__file__})")
    present = sorted({m for modules in EXTRAS.values() for m in modules if installed(m)})
    check(not present, f"no extra's package installed (found: {present or 'none'})")

    run = run_featcal("--version")
    version = importlib.metadata.version("featcal")
    check(run.returncode == 0 and run.stdout.strip() == f"featcal {version}" == f"featcal {featcal.__version__}",
          f"featcal --version prints {run.stdout.strip()!r}", run)

    sys.path.insert(0, str(tests.parent))  # the repository root, so `tests.builders` imports as the suite imports it
    from tests.builders.data_fixtures import save_tokenizer
    from tests.builders.pipeline_family import bert_family

    fam = bert_family(work / "family")
    save_tokenizer(fam["base"], "bert")  # the merge carries the base's tokenizer, which calibration needs
    experts = [a for t, d in fam["experts"].items() for a in ("--expert", f"{t}={d}")]
    calib = [a for t, d in fam["data"].items() for a in ("--calib", f"{t}={d}")]
    merged = work / "merged"
    run = run_featcal("merge", "--base", str(fam["base"]), *experts, "--out", str(merged), "--method", "task_arithmetic",
                  "--no-progress")
    check(run.returncode == 0 and (merged / "model.safetensors").is_file(), "featcal merge (task_arithmetic)", run)

    calibrate = ["calibrate", "--base", str(fam["base"]), "--merged", str(merged), *experts, *calib,
                 "--num-calibration-examples", "4", "--calibration-batch-size", "2", "--no-progress"]
    run = run_featcal(*calibrate, "--out", str(work / "calibrated"))
    check(run.returncode == 0 and (work / "calibrated" / "model.safetensors").is_file()
          and "calibrated checkpoint" in run.stdout, "featcal calibrate", run)

    run = run_featcal(*calibrate, "--out", str(work / "plotted"), "--plot")
    check(refused(run, "plot") and not (work / "plotted").exists(),
          "calibrate --plot without matplotlib: one line naming featcal[plot], nothing written", run)
    run = run_featcal(*calibrate, "--out", str(work / "one-pass"), "--block-statistics", "sequential_one_pass")
    check(refused(run, "one-pass"), "block_statistics sequential_one_pass without greenlet names featcal[one-pass]",
          run)
    run = run_featcal("bench", "--preset", "tiny", "--out", str(work / "bench"))
    check(refused(run, "bench"), "featcal bench without its packages names featcal[bench]", run)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
