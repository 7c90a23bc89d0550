"""The hand-off to EleutherAI's lm-evaluation-harness, for the benchmarks featcal does not embed.

A featcal checkpoint is a plain transformers folder, so lm-eval's `hf` model loads it as it is:
`featcal eval --lm-eval TASKS` runs `python -m lm_eval` on every model when the harness is installed
(`pip install featcal[lm-eval]`), reads back its results file, and otherwise prints the exact command
for each model, so the user can run it where the harness is.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from featcal.errors import ConfigError, FeatCalError

log = logging.getLogger(__name__)


def parse_tasks(tasks: str | Sequence[str]) -> tuple[str, ...]:
    """lm-eval task names from "a,b" or a sequence; refuses an empty list and odd characters."""
    items = tasks.split(",") if isinstance(tasks, str) else list(tasks)
    names = tuple(dict.fromkeys(t.strip() for t in items if t.strip()))
    if not names:
        raise ConfigError("--lm-eval needs at least one lm-eval task name (e.g. --lm-eval hellaswag,arc_easy)")
    bad = [t for t in names if not all(c.isalnum() or c in "_-.:*" for c in t)]
    if bad:
        raise ConfigError(f"--lm-eval: {', '.join(map(repr, bad))} is not an lm-eval task name")
    return names


# lm-eval reads `--model_args` as "k=v,k=v" with no quoting: a ',' in a path starts a new argument and an
# '=' in one misreads it, so a folder named `ck,trust_remote_code=...` would pass that option on. Such paths are refused.
MODEL_ARGS_SEPARATORS = ",="


def check_checkpoint_path(checkpoint: str | Path, name: str = "") -> None:
    """Refuse a checkpoint whose path lm-eval's `--model_args` would split into more arguments."""
    text = str(checkpoint)
    found = sorted({c for c in text if c in MODEL_ARGS_SEPARATORS})
    if found:
        label = f"model {name!r} at " if name else ""
        raise ConfigError(
            f"--lm-eval: {label}{text!r} holds {', '.join(map(repr, found))}, which lm-eval's --model_args splits "
            "on (a path like 'ck,OPTION=VALUE' would pass options to the harness); rename the folder or "
            "link it under a name without ',' or '=' (ln -s), then give that path")


def lm_eval_argv(checkpoint: Path, tasks: Sequence[str], output: Path, *, batch_size: int = 8,
                 dtype: str | None = None, device: str | None = None) -> list[str]:
    """The lm_eval command line scoring `checkpoint` (a transformers folder) on `tasks`, results under `output`."""
    check_checkpoint_path(checkpoint)
    model_args = f"pretrained={checkpoint}" + (f",dtype={dtype}" if dtype else "")
    argv = ["lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", ",".join(tasks),
            "--batch_size", str(batch_size)]
    if device:
        argv += ["--device", device]
    return argv + ["--output_path", str(output)]


def lm_eval_command(checkpoint: Path, tasks: Sequence[str], output: Path, batch_size: int = 8,
                    dtype: str | None = "bfloat16", device: str | None = None) -> str:
    """`lm_eval_argv` as one shell line, quoted where needed (what is printed, and what the MergeBench
    reproduction writes into its metrics.json)."""
    return shlex.join(lm_eval_argv(checkpoint, tasks, output, batch_size=batch_size, dtype=dtype, device=device))


def installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None


LOG_NAME = "lm_eval.log"  # the harness's stdout and stderr, beside its results


def run(checkpoint: Path, tasks: Sequence[str], output: Path, *, batch_size: int, device: str | None,
        shown: Path | None = None) -> dict[str, Any]:
    """Run the harness on one checkpoint (in a child process) and return its `results` mapping.

    Its stdout and stderr go to `output`/lm_eval.log, not the terminal: a failure is one line naming that log
    (where it will be: under `shown`, when `output` is a temporary folder renamed there later), not the harness's
    traceback in the middle of featcal's output."""
    argv = lm_eval_argv(checkpoint, tasks, output, batch_size=batch_size, device=device)
    argv = [sys.executable, "-m", "lm_eval", *argv[1:]]
    output.mkdir(parents=True, exist_ok=True)
    log.info("running %s", shlex.join(argv))
    with open(output / LOG_NAME, "wb") as harness_log:
        harness_log.write(f"$ {shlex.join(argv)}\n".encode())
        harness_log.flush()
        done = subprocess.run(argv, check=False, stdin=subprocess.DEVNULL, stdout=harness_log,
                              stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise FeatCalError(f"lm-eval failed on {checkpoint} (exit status {done.returncode}); its output is in "
                           f"{(shown or output) / LOG_NAME}")
    return read_results(output)


def read_results(output: Path) -> dict[str, Any]:
    """The `results` of the newest results*.json the harness wrote under `output`."""
    files = sorted(output.rglob("results*.json"), key=lambda p: (p.stat().st_mtime, str(p)))
    if not files:
        raise FeatCalError(f"lm-eval wrote no results*.json under {output}")
    results = json.loads(files[-1].read_text(encoding="utf-8")).get("results")
    if not isinstance(results, Mapping):
        raise FeatCalError(f"{files[-1]} holds no `results` mapping")
    return dict(results)


def result_rows(model: str, results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """eval.json rows {model, task, metric, value} of the harness's numbers (standard errors left out)."""
    rows = []
    for task, metrics in results.items():
        if not isinstance(metrics, Mapping):
            continue
        for key, value in metrics.items():
            name = str(key).split(",")[0]  # "acc,none": the metric, then lm-eval's filter
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith("_stderr"):
                rows.append({"model": model, "task": str(task), "metric": str(key), "value": float(value)})
    return rows
