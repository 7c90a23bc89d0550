"""The experts' next blocks read on a background thread (calibration/engine/prefetch.py, issue #40): the same model bit
for bit as reading each block when it is needed, NaN found as a block is read (before that block is solved) with
the pre-scan's message, a reader failure raised in the main thread as the same one-line error, resume intact."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from featcal import FeatCalConfig
from featcal.blocks.adapters import adapter_for
from featcal.calibration.core.setting import calibrate_setting
from featcal.calibration.engine import driver as engine
from featcal.calibration.engine import prefetch
from featcal.errors import CheckpointError
from featcal.io.read.sources import UnmappedReader
from tests.builders.reference_featcal import Crash, family_data, killed_after, noisy_family

KINDS = ("clip", "bert", "t5", "llama")


def _family(kind: str, root: Path | None):
    """(merged, base, experts, data): experts in memory, or saved to folders under `root`."""
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    if root is not None:
        for t, e in experts.items():
            e.save_pretrained(root / t)
        base.save_pretrained(root / "base")
        experts, base = {t: str(root / t) for t in experts}, str(root / "base")
    return merged, base, experts, data


def _run(fam, prefetch_on: bool, resident: bool = True, **options):
    merged, base, experts, data = fam
    cfg = FeatCalConfig(**options)
    return calibrate_setting(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False,
                             prefetch=prefetch_on, resident=resident)


def _taken(monkeypatch) -> list[int]:
    """Counts the loads the reader served (so that a test fails if every read fell back to the main thread)."""
    served = [0]
    original = prefetch.BlockReader.take

    def take(self, task, names):
        values = original(self, task, names)
        served[0] += values is not None
        return values

    monkeypatch.setattr(prefetch.BlockReader, "take", take)
    return served


def _assert_same(a, b) -> None:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    assert a.drift == b.drift
    assert a.end_to_end == b.end_to_end


def _no_reader_left() -> bool:
    return not any(t.name == "featcal-block-reader" for t in threading.enumerate())


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("offload", [False, True])
def test_prefetch_equals_reading_when_needed_from_folders(kind, offload, tmp_path, monkeypatch):
    fam = _family(kind, tmp_path)
    served = _taken(monkeypatch)
    ahead = _run(fam, True, offload_blocks=offload)
    n_blocks = sum(len(s.blocks(ahead.model)) for s in adapter_for(ahead.model).stacks(ahead.model))
    assert served[0] == n_blocks * len(fam[2])  # every block of every expert came from the reader
    _assert_same(ahead, _run(fam, False, offload_blocks=offload))
    assert _no_reader_left()


@pytest.mark.parametrize("kind", ["clip", "t5", "llama"])
def test_in_memory_experts_resident_streamed_and_read_when_needed_agree(kind, monkeypatch):
    fam = _family(kind, None)
    before = {t: {k: v.clone() for k, v in e.state_dict().items()} for t, e in fam[2].items()}
    served = _taken(monkeypatch)
    resident = _run(fam, True)
    assert served[0] == 0 and resident.placement["experts"] == "resident"  # nothing to read ahead
    streamed = _run(fam, True, resident=False)
    assert served[0] > 0 and streamed.placement["experts"] == "streamed"
    assert "switched off" in streamed.placement["why"]
    _assert_same(resident, streamed)
    _assert_same(resident, _run(fam, False, resident=False))
    for t, e in fam[2].items():  # the template pointed at the experts' tensors never wrote into them
        assert all(torch.equal(v, before[t][k]) for k, v in e.state_dict().items()), t


def test_placement_says_why_the_experts_are_streamed(tmp_path):
    files = _run(_family("bert", tmp_path), True)
    assert files.placement == {"experts": "streamed", "why": "expert(s) task0, task1 read from files, the next "
                                                             "block read ahead on a background thread"}
    memory = _family("bert", None)
    assert "offload_blocks" in _run(memory, True, offload_blocks=True).placement["why"]
    half = (memory[0], memory[1], {t: e.to(torch.bfloat16) for t, e in memory[2].items()}, memory[3])
    assert _run(half, True).placement["why"] == ("expert 'task0' holds torch.bfloat16, the model being calibrated "
                                                 "torch.float32")


@pytest.mark.parametrize("statistics", ["sequential", "sequential_one_pass"])
def test_prefetch_equals_with_other_gatherers(statistics, tmp_path):
    """"sequential" reads its expert again for each stage (those reads fall back to the main thread)."""
    fam = _family("llama", tmp_path)
    options = dict(block_statistics=statistics, calibrate_final_norm=True)
    _assert_same(_run(fam, True, **options), _run(fam, False, **options))


def _plant_nan(folder: Path, layer: int) -> str:
    """A NaN in the first floating tensor of block `layer` of the checkpoint in `folder`; its name."""
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = next(k for k in sorted(tensors) if f"layers.{layer}." in k and tensors[k].is_floating_point())
    tensors[name].view(-1)[0] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})
    return name


def _solved_blocks(monkeypatch) -> list[int]:
    solved: list[int] = []
    original = engine.FeatCalEngine._calibrate_block

    def spy(self, stack, layer, n_blocks):
        original(self, stack, layer, n_blocks)
        solved.append(layer)

    monkeypatch.setattr(engine.FeatCalEngine, "_calibrate_block", spy)
    return solved


def test_nan_in_block_1_is_refused_as_read_with_the_pre_scan_message(tmp_path, monkeypatch):
    fam = _family("llama", tmp_path)
    name = _plant_nan(Path(fam[2]["task1"]), 1)
    with pytest.raises(CheckpointError) as before:
        _run(fam, False)  # the scan of every input before any work
    solved = _solved_blocks(monkeypatch)
    with pytest.raises(CheckpointError) as ahead:
        _run(fam, True)
    assert str(ahead.value) == str(before.value)
    assert f"expert 'task1' ({fam[2]['task1']}): parameter {name!r} contains NaN or Inf (1 value(s))" == str(ahead.value)
    assert solved == [0]  # found while block 0 computed; block 1 never solved
    assert _no_reader_left()


def test_a_reader_failure_surfaces_in_the_main_thread(tmp_path, monkeypatch):
    fam = _family("bert", tmp_path)
    original = UnmappedReader.get
    where: list[str] = []

    def failing(self, name):
        if ".layer.1." in name and Path(self.path).name == "task1":
            where.append(threading.current_thread().name)
            raise CheckpointError(f"{self.path}: tensor {name!r} is truncated (0 of 8 bytes)")
        return original(self, name)

    monkeypatch.setattr(UnmappedReader, "get", failing)
    with pytest.raises(CheckpointError, match="is truncated"):
        _run(fam, True)
    assert where == ["featcal-block-reader"]  # raised in the reader, once, and re-raised here
    assert _no_reader_left()


def test_interrupted_and_resumed_with_the_reader(tmp_path, monkeypatch):
    fam = _family("t5", tmp_path / "family")
    straight = _run(fam, False)
    options = dict(resume=True, resume_dir=str(tmp_path / "state"))
    with killed_after(monkeypatch, 1), pytest.raises(Crash):
        _run(fam, True, **options)
    assert _no_reader_left()
    _assert_same(_run(fam, True, **options), straight)  # the reader's schedule starts at the resumed block


def test_featcal_json_records_the_placement(tmp_path):
    import json

    from featcal.cli.main import main
    from tests.builders.guarantees import calibrate_argv
    from tests.builders.pipeline_family import clip_family

    fam = clip_family(tmp_path / "fam")
    assert main(calibrate_argv(fam, tmp_path / "out")) == 0
    report = json.loads((tmp_path / "out" / "featcal.json").read_text())
    assert report["placement"]["experts"] == "streamed" and "read from files" in report["placement"]["why"]
