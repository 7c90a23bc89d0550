"""A merge method from an installed package (issue 52): found through the entry-point group featcal.merge_methods,
selectable in `featcal merge --method`, its own parameters flags of their own, validated by its own model; a
broken plugin is said and left out."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from featcal.config import ENTRY_POINT_GROUP
from tests.builders.tiny import make_family

PLUGIN = '''
from pydantic import BaseModel, ConfigDict, Field

from featcal.merging import register
from featcal.merging.method import Merger


class ShrinkParams(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, gt=0.0, le=10.0, description="divides the mean task vector")
    scaling: float = 1.0  # MergeConfig's field: takes its value


@register("plugin_shrink", params=ShrinkParams)
class Shrink(Merger):
    """theta0 + scaling * mean(theta_t - theta0) / temperature."""

    def prepare(self, family, *, progress=False):
        self.n = len(list(family.experts))

    def merge_tensor(self, name, base, experts):
        p = self.method_params
        mean = sum(t.to(base.dtype) - base for _, t in experts) / self.n
        return base + p.scaling * mean / p.temperature
'''


def _install(site: Path, module: str, code: str, entry: str) -> None:
    """A package in `site` as pip would leave it: the module and a dist-info naming its entry point."""
    (site / f"{module}.py").write_text(textwrap.dedent(code))
    info = site / f"{module}-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry} = {module}\n")


def _featcal(site: Path | None, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*([str(site)] if site else []), str(Path.cwd())])}
    return subprocess.run([sys.executable, "-m", "featcal.cli.main", *argv], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return make_family("bert", tmp_path_factory.mktemp("bert"), n_experts=2)


def test_an_installed_plugin_method_has_its_flags_and_merges(bert, tmp_path):
    base, experts = bert
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "featcal_shrink_plugin", PLUGIN, "shrink")
    shown = _featcal(site, "merge", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "plugin_shrink" in shown.stdout and "--temperature" in shown.stdout
    assert "method plugin_shrink: its own parameters" in shown.stdout
    pairs = [a for n, p in experts.items() for a in ("--expert", f"{n}={p}")]
    done = _featcal(site, "merge", "--base", str(base), *pairs, "--method", "plugin_shrink", "--temperature", "2",
                    "--scaling", "0.5", "--no-progress", "--out", str(tmp_path / "m"))
    assert done.returncode == 0, done.stderr
    merged = load_file(tmp_path / "m" / "model.safetensors")
    b = load_file(base / "model.safetensors")
    es = [load_file(d / "model.safetensors") for d in experts.values()]
    for k in b:
        expected = b[k] + 0.5 * ((es[0][k] - b[k]) + (es[1][k] - b[k])) / 2 / 2.0
        assert torch.allclose(merged[k].float(), expected.float(), atol=1e-6), k
    # its own model validates its own flag; another method refuses it, in one line, before any work
    bad = _featcal(site, "merge", "--base", str(base), *pairs, "--method", "plugin_shrink", "--temperature", "0",
                   "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr
    other = _featcal(site, "merge", "--base", str(base), *pairs, "--method", "ties", "--temperature", "2",
                     "--out", str(tmp_path / "other"))
    assert other.returncode == 2 and "temperature" in other.stderr and "Traceback" not in other.stderr
    assert not (tmp_path / "bad").exists() and not (tmp_path / "other").exists()


def test_without_the_plugin_there_is_no_such_method_or_flag(tmp_path):
    shown = _featcal(None, "merge", "--help")
    assert shown.returncode == 0 and "plugin_shrink" not in shown.stdout and "--temperature" not in shown.stdout


def test_a_broken_plugin_is_said_and_left_out(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "featcal_broken_plugin", "raise RuntimeError('no luck')\n", "broken")
    shown = _featcal(site, "merge", "--help")
    assert shown.returncode == 0 and "usage" in shown.stdout
    assert "plugin 'broken'" in shown.stderr and "RuntimeError: no luck" in shown.stderr
