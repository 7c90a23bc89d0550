"""Helpers for the guarantee tests (docs/guarantees.md): CLI calls, checkpoint surgery, tree snapshots.

Holds no tests itself.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from featcal.cli.main import main
from tests.builders.tiny import without_log_lines

CALIB_FLAGS = ("--num-calibration-examples", "4", "--calibration-batch-size", "2")


def merge_argv(base: Path, experts: dict[str, Path], out: Path, *extra: str) -> list[str]:
    argv = ["merge", "--base", str(base), "--out", str(out), "--no-progress"]
    for name, path in experts.items():
        argv += ["--expert", f"{name}={path}"]
    return argv + list(extra)


def calibrate_argv(fam: dict, out: Path, *extra: str, calib_flags: tuple[str, ...] = CALIB_FLAGS,
                   command: str = "calibrate") -> list[str]:
    """`featcal calibrate` (or `plan`, which takes the same inputs) of an on-disk family with data."""
    argv = [command, "--base", str(fam["base"]), "--merged", str(fam["merged"]), "--out", str(out), "--no-progress"]
    for t, d in fam["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in fam["data"].items():
        argv += ["--calib", f"{t}={d}"]
    return argv + list(calib_flags) + list(extra)



def cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """Run `featcal ARGV` in-process; (exit code, stdout, stderr) of this call only."""
    capsys.readouterr()  # drop what the test's own setup printed
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_line_error(err: str) -> str:
    """The CLI's error contract: exactly one line, `featcal: error: ...`, no traceback."""
    text = without_log_lines(err)
    assert "Traceback" not in text, text
    assert text.count("\n") == 0, text
    assert text.startswith("featcal: error: "), text
    return text


def copy_family(fam: dict, root: Path) -> dict:
    """A private copy of an on-disk family (base, experts, merged, data), safe to damage."""
    root.mkdir(parents=True, exist_ok=True)

    def cp(p: Path) -> Path:
        dst = root / p.name
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, dst)
        return dst

    out = {"base": cp(fam["base"]), "experts": {t: cp(p) for t, p in fam["experts"].items()}}
    if "merged" in fam:
        out["merged"] = cp(fam["merged"])
    if "data" in fam:
        out["data"] = {t: cp(p) for t, p in fam["data"].items()}
    return out


def rewrite(directory: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Apply `fn` to a saved checkpoint's tensors and write them back as safetensors."""
    f = directory / "model.safetensors"
    state = load_file(f)
    fn(state)
    save_file(state, f, metadata={"format": "pt"})


def edit_config(directory: Path, **fields) -> None:
    cfg = directory / "config.json"
    data = json.loads(cfg.read_text())
    data.update(fields)
    cfg.write_text(json.dumps(data))


def first_key(directory: Path, contains: str) -> str:
    return next(k for k in sorted(load_file(directory / "model.safetensors")) if contains in k)


def snapshot(root: Path) -> dict[str, str]:
    """Every file under `root` (hidden ones included) -> sha256: proves a tree was left untouched."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*")) if p.is_file()
    }


def leftovers(root: Path) -> list[str]:
    """Temporary directories featcal may create beside an output (must be gone after any failure)."""
    return sorted(p.name for p in root.rglob(".featcal-*"))


def weights_sha(directory: Path) -> str:
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def save_as_pickle(src: Path, dst: Path) -> Path:
    """A copy of a safetensors checkpoint whose weights are a pytorch_model.bin (a plain state dict)."""
    dst.mkdir(parents=True)
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            shutil.copy2(p, dst / p.name)
    torch.save(load_file(src / "model.safetensors"), dst / "pytorch_model.bin")
    return dst


class Exploit:
    """Unpickling this runs code: it writes `marker`. weights_only=True must refuse it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))


def save_malicious_pickle(src: Path, dst: Path, marker: Path) -> Path:
    """Like save_as_pickle, but the state dict also holds an Exploit object."""
    save_as_pickle(src, dst)
    state = torch.load(dst / "pytorch_model.bin", weights_only=True)
    state["payload"] = Exploit(marker)
    torch.save(state, dst / "pytorch_model.bin")
    return dst


def report(out: Path) -> dict:
    """The featcal.json an output folder holds."""
    return json.loads((out / "featcal.json").read_text())


def plan_argv(fam: dict, out: Path, *extra: str, calib_flags: tuple[str, ...] = CALIB_FLAGS) -> list[str]:
    """`featcal plan` of the same inputs as `calibrate_argv`."""
    return calibrate_argv(fam, out, *extra, calib_flags=calib_flags, command="plan")
