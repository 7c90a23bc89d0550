"""--offload-blocks: bit-identical to keeping the models whole, and never more than one block per model
on the device. There is no accelerator here, so the device is the CPU and what is "on the device" is
tracked by a spy on the one move function (Placement._place), parameter by parameter."""

from __future__ import annotations

import pytest
import torch

from featcal import FeatCalConfig, calibrate
from featcal.blocks.adapters import adapter_for
from featcal.calibration.engine.chains import ChainStore
from featcal.calibration.engine.driver import FeatCalEngine
from featcal.calibration.engine.param_names import stem_param_names
from featcal.calibration.engine.placement import Placement, stem_parts
from featcal.cli.main import main
from featcal.errors import ConfigError
from tests.builders.pipeline_family import clip_family
from tests.builders.reference_featcal import family_data, max_abs_diff, noisy_family


class DeviceSpy:
    """Which parameters Placement has put on the device, checked at every move and every forward."""

    def __init__(self) -> None:
        self.on: dict[int, bool] = {}
        self.models: dict[str, tuple] = {}
        self.problems: list[str] = []
        self.peak: dict[str, int] = {}
        self.forwards: dict[str, int] = {}
        self.moves = 0

    def wrap(self, original):
        def place(placement, module, on_device, recurse=True):
            original(placement, module, on_device, recurse)
            self.moves += 1
            for p in module.parameters(recurse=recurse):
                self.on[id(p)] = on_device
            self._check_counts()
        return place

    def _resident(self, module) -> bool:
        return any(self.on.get(id(p), False) for p in module.parameters())

    def _check_counts(self) -> None:
        for label, (model, stacks) in self.models.items():
            n = sum(self._resident(b) for s in stacks for b in s.blocks(model))
            self.peak[label] = max(self.peak.get(label, 0), n)
            if n > 1:
                self.problems.append(f"{label}: {n} blocks on the device")

    def watch(self, label: str, model, stacks) -> list:
        """Hooks: a block, or a stack entry (the capture), runs only with its parameters on the device."""
        self.models[label] = (model, stacks)
        params = dict(model.named_parameters(remove_duplicate=False))
        stem = [params[n] for n in stem_param_names(model, stacks)]
        handles = []

        def needs(name, tensors):
            def hook(_mod, _args, *_rest):
                self.forwards[name] = self.forwards.get(name, 0) + 1
                off = sum(not self.on.get(id(p), False) for p in tensors)
                if off:
                    self.problems.append(f"{name} ran with {off} parameter(s) off the device")
            return hook

        for s in stacks:
            for i, b in enumerate(s.blocks(model)):  # after the forward: a capture stops block 0 before it runs
                handles.append(b.register_forward_hook(needs(f"{label} {s.name}.{i}", list(b.parameters()))))
            entry = model.get_submodule(s.entry_path) if s.entry_path else model
            handles.append(entry.register_forward_pre_hook(needs(f"{label} {s.name} stem", stem), with_kwargs=True))
        return handles


@pytest.mark.parametrize(("kind", "chain_dtype", "spill"), [
    ("clip", "float32", False), ("t5", "bfloat16", False), ("llama", "float32", False),
    ("bert", "float16", True),  # chains spilled to disk: read straight to the device
])
def test_offload_is_bit_identical_and_holds_one_block_per_model(kind, chain_dtype, spill, monkeypatch, tmp_path):
    base, experts, merged = noisy_family(kind)
    data = family_data(kind, experts)
    cfg = FeatCalConfig(chain_dtype=chain_dtype, spill_dir=tmp_path / "spill" if spill else None)
    whole = calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)

    spy = DeviceSpy()
    monkeypatch.setattr(Placement, "_place", spy.wrap(Placement._place))
    original_run = FeatCalEngine.run

    def run(engine):
        handles = spy.watch("merged", engine.merged, engine.stacks) + spy.watch("template", engine.template,
                                                                               engine.stacks)
        try:
            return original_run(engine)
        finally:
            for h in handles:
                h.remove()
    monkeypatch.setattr(FeatCalEngine, "run", run)
    offloaded = calibrate(merged, base=base, experts=experts, calibration=data,
                          config=cfg.model_copy(update={"offload_blocks": True}), progress=False)

    assert max_abs_diff(offloaded.model, whole.model)[0] == 0.0
    assert offloaded.drift == whole.drift
    assert spy.problems == [], spy.problems
    assert spy.peak == {"merged": 1, "template": 1}
    n_blocks = len(whole.drift)
    ran = {k for k in spy.forwards if not k.endswith("stem")}
    assert len([k for k in ran if k.startswith("merged")]) == n_blocks  # every block ran, each on the device
    assert any(k.endswith("stem") for k in spy.forwards)
    assert not any(spy.on.values())  # everything is back on the host at the end


def test_stem_parts_cover_the_stem_and_no_block():
    for kind in ("clip", "vit", "bert", "t5", "llama"):
        model = noisy_family(kind, n_experts=1)[2]
        stacks = adapter_for(model).stacks(model)
        moved = {id(p) for mod, recurse in stem_parts(model, stacks) for p in mod.parameters(recurse=recurse)}
        params = dict(model.named_parameters(remove_duplicate=False))
        assert moved == {id(params[n]) for n in stem_param_names(model, stacks)}, kind
        blocks = {id(p) for s in stacks for p in s.blocks(model).parameters()}
        assert not moved & blocks, kind


def test_offloaded_chains_are_held_on_the_host_and_handed_out_on_the_device():
    """Routing only: 'meta' stands in for the accelerator (tensors can go there, not come back)."""
    store = ChainStore("bfloat16", device="meta", home="cpu")
    h = torch.randn(2, 3, 4)
    store.put_hidden(("m", "a", 0), h)
    store.put_context(("m", "a", 0), {"mask": torch.ones(2, 3), "pos": (torch.arange(3), None), "flag": True})
    assert store.raw_hidden(("m", "a", 0)).device.type == "cpu"
    assert torch.equal(store.raw_hidden(("m", "a", 0)), h.to(torch.bfloat16))
    out = store.hidden(("m", "a", 0))
    assert out.device.type == "meta" and out.dtype == torch.float32
    ctx = store.context(("m", "a", 0))
    assert ctx["mask"].device.type == "meta" and ctx["pos"][0].device.type == "meta" and ctx["pos"][1] is None
    assert store.raw_context(("m", "a", 0))["mask"].device.type == "cpu" and ctx["flag"] is True


def test_offload_to_a_missing_device_is_refused_before_work(monkeypatch, tmp_path, capsys):
    base, experts, merged = noisy_family("clip", n_experts=1)
    data = family_data("clip", experts)
    monkeypatch.setattr(FeatCalEngine, "run", lambda self: pytest.fail("calibration work started"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = FeatCalConfig(offload_blocks=True, device="cuda")
    with pytest.raises(ConfigError, match=r"device 'cuda' requested \(offload_blocks puts each block there\) but "
                                          "CUDA is not available"):
        calibrate(merged, base=base, experts=experts, calibration=data, config=cfg, progress=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=r"device 'cuda:1' requested .* but this machine has 1 CUDA device"):
        calibrate(merged, base=base, experts=experts, calibration=data,
                  config=cfg.model_copy(update={"device": "cuda:1"}), progress=False)

    fam = clip_family(tmp_path / "fam")
    argv = ["calibrate", "--base", str(fam["base"]), "--merged", str(fam["merged"]), "--out", str(tmp_path / "out"),
            "--no-progress", "--num-calibration-examples", "4", "--offload-blocks", "--device", "cuda:3"]
    for t, d in fam["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in fam["data"].items():
        argv += ["--calib", f"{t}={d}"]
    assert main(argv) == 2
    assert "device 'cuda:3' requested (offload_blocks puts each block there)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_offloaded_chain_entries_are_rewritten_in_their_host_buffer():
    """Routing only, the roles swapped: 'meta' stands for the host and the CPU for the accelerator. A rewritten
    entry of the same shape and dtype goes into the buffer it holds (no fresh host tensor per block); another
    shape or dtype gets a new one."""
    store = ChainStore("float32", device="cpu", home="meta")
    key = ("m", "a", 0)
    store.put_hidden(key, torch.randn(2, 3, 4))
    first = store.raw_hidden(key)
    assert first.device.type == "meta"
    store.put_hidden(key, torch.randn(2, 3, 4))
    assert store.raw_hidden(key) is first
    store.put_hidden(key, torch.randn(2, 5, 4))  # T5's decoder chains, say: another shape
    assert store.raw_hidden(key) is not first and store.raw_hidden(key).shape == (2, 5, 4)
    kept = ChainStore("float32", device="cpu", home="cpu")  # already at home: stored as given, as before
    h = torch.randn(2, 3, 4)
    kept.put_hidden(key, h)
    kept.put_hidden(key, h2 := torch.randn(2, 3, 4))
    assert kept.raw_hidden(key).data_ptr() == h2.data_ptr() != h.data_ptr()
