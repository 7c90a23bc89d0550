"""The host allocator's settings (io/process/host_allocator.py): under `tuned` a freed block is reused instead of
faulted in afresh; the command line applies it when asked, and refuses an unknown setting."""

from __future__ import annotations

import subprocess
import sys

import pytest

from featcal.cli.main import main
from featcal.io.process import host_allocator

# 20 rounds of what a forward does: 40 activations of 0.9 MB each, written, then all freed together
FAULTS = """
import resource, sys, torch
from featcal.io.process import host_allocator
print(host_allocator.apply(sys.argv[1]))
def forward():
    return [torch.empty(225_000).fill_(1.0) for _ in range(40)]
for _ in range(3):
    forward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    forward()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(setting: str, env: dict[str, str] | None = None) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", FAULTS, setting], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(host_allocator._glibc() is None, reason="the settings are glibc's; elsewhere nothing changes")
def test_tuned_reuses_freed_blocks_where_the_default_faults_them_in_again():
    applied, tuned = _faults("tuned")
    kept, default = _faults("default")
    assert applied and not kept
    assert default > 20 * 1000  # the default gives the freed 36 MB back to the system and faults it in again
    assert tuned < 50  # tuned: the first round's pages serve every later one


@pytest.mark.skipif(host_allocator._glibc() is None, reason="the settings are glibc's; elsewhere nothing changes")
def test_the_environment_gives_a_child_the_same_setting_from_its_start():
    import os

    _, inherited = _faults("default", env={**os.environ, **host_allocator.environment("tuned")})
    assert inherited < 50
    assert host_allocator.environment("default") == {}


def test_the_requested_setting_comes_from_the_environment():
    assert host_allocator.requested({}) == "default"  # opt-in: it costs peak RSS over a whole bench
    assert host_allocator.requested({host_allocator.ENV: " Tuned "}) == "tuned"
    assert host_allocator.requested({host_allocator.ENV: "default"}) == "default"
    with pytest.raises(ValueError, match="host allocator setting 'fast': choose from tuned, default"):
        host_allocator.requested({host_allocator.ENV: "fast"})


def test_the_cli_refuses_an_unknown_setting_before_any_work(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(host_allocator.ENV, "fast")
    out = tmp_path / "merged"
    assert main(["merge", "--method", "average", "--base", str(tmp_path / "b"), "--expert", f"a={tmp_path}",
                 "--out", str(out)]) == 2
    assert "FEATCAL_HOST_ALLOCATOR: host allocator setting 'fast'" in capsys.readouterr().err
    assert not out.exists()


# 160 MB in 1,600 heap chunks of 100 kB (below the mmap threshold), nine in ten freed: fragmented free pages the
# heap's top cannot give back, which release_free_pages returns (RSS in MB before and after; what it returned)
FRAGMENTED = """
import sys
from featcal.io.process import host_allocator
host_allocator.apply(sys.argv[1])
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
chunks = [bytearray(b"x" * 100_000) for _ in range(1_600)]
kept = chunks[::10]
del chunks
before = rss()
released = host_allocator.release_free_pages()
print(before, rss(), released, len(kept))
"""


@pytest.mark.skipif(host_allocator._glibc() is None, reason="malloc_trim is glibc's; elsewhere nothing changes")
def test_free_pages_inside_the_heap_go_back_unless_tuned_keeps_them():
    def run(setting: str) -> tuple[int, int, bool]:
        out = subprocess.run([sys.executable, "-c", FRAGMENTED, setting], capture_output=True, text=True,
                             check=True).stdout.split()
        return int(out[0]), int(out[1]), out[2] == "True"

    before, after, released = run("default")
    assert released and before - after > 100  # ~144 MB of the 160 were free, between kept chunks
    before, after, released = run("tuned")
    assert not released and abs(before - after) < 5
