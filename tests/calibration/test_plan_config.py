"""Planning from a config alone (`featcal plan --config`), the per-block counts and what fits on which target."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from featcal.calibration.planning import cost, fit, planner
from featcal.calibration.planning.planner import (
    BlockShape,
    ModelShape,
    StackShape,
    estimate,
    model_shape,
    shape_of,
)
from featcal.cli.main import main
from featcal.config import FeatCalConfig
from featcal.experiments.bench.cost import block_macs
from featcal.io.read.models import load_config
from tests.builders.pipeline_family import bert_family
from tests.builders.tiny import perturbed, tiny_model

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "benchmarks" / "configs"
GiB = 2**30


def _config_only(tmp_path: Path, name: str) -> Path:
    """A folder holding the published config.json and nothing else: no weights to read."""
    folder = tmp_path / name
    folder.mkdir()
    shutil.copy(CONFIGS / f"{name}.json", folder / "config.json")
    return folder


def test_8b_plan_from_its_config_alone(tmp_path, capsys):
    folder = _config_only(tmp_path, "llama-3.1-8b")
    argv = ["plan", "--config", str(folder), "--tasks", "5", "--num-calibration-examples", "256", "--max-length", "512"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    # Llama-3.1-8B's published 8,030,261,248 parameters, plus its 128 rotary frequencies (buffers)
    assert "8,030,261,376 parameters and buffers (2 B each in its files)" in out
    assert re.search(r"merged model\s+29\.92 GiB", out)
    assert "655,360 token positions per side" in out  # 5 tasks x 256 examples x 512 tokens
    # 16 batches of 16 per task; as merged, also one reference batch per task and the one-batch context check
    assert "80 expert + 86 merged as merged + 80 calibrated" in out
    assert "7 Linear solves (largest 14336×14336, 4096 right-hand sides) + 2 norms" in out
    targets = {line.split()[0]: line for line in out.splitlines() if line.startswith("  gpu-") or line.startswith("  cpu")}
    assert set(targets) == {"gpu-24gb", "gpu-80gb", "cpu"}
    assert "fits with --offload-blocks" in targets["gpu-24gb"]  # two float32 8B models do not fit on 24 GB
    assert all("≈" in line for line in targets.values())
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


def test_1b_config_counts_its_tied_embedding_once(tmp_path):
    shape = model_shape(load_config(_config_only(tmp_path, "llama-3.2-1b")), 256)
    assert shape.param_count == 1_235_814_400 + 64  # published count + rotary frequencies; the LM head is the embedding
    blocks = shape.stacks[0].blocks
    assert len(blocks) == 16 and blocks[0].param_count == 60_821_504


@pytest.mark.parametrize("kind", ["llama", "clip", "t5", "bert"])
def test_plan_from_config_alone_matches_plan_from_the_loaded_model(tmp_path, kind):
    model = tiny_model(kind)
    model.save_pretrained(tmp_path / "m")
    from_config = model_shape(load_config(tmp_path / "m" / "config.json"), 16)
    loaded = shape_of(model, model.config, 16)
    assert from_config == loaded
    cfg = FeatCalConfig(num_calibration_examples=8, calibration_batch_size=4)
    for c in (cfg, cfg.model_copy(update={"offload_blocks": True, "device": "cuda"})):
        a = estimate(from_config, tasks=3, config=c, baseline_bytes=123)
        b = estimate(loaded, tasks=3, config=c, baseline_bytes=123)
        assert (a.components, a.device_components, a.total) == (b.components, b.device_components, b.total)
    held = {id(t): t.numel() for t in (*model.parameters(), *model.buffers())}  # tied tensors once
    assert loaded.param_count == sum(held.values())


def test_cli_plan_from_config_prints_the_checkpoint_plans_numbers(tmp_path, capsys, monkeypatch):
    fam = bert_family(tmp_path / "fam")
    monkeypatch.setattr(planner, "current_rss", lambda: 400 * 2**20)  # the same measured baseline for both
    monkeypatch.setattr(fit, "current_rss", lambda: 400 * 2**20)
    common = ["--num-calibration-examples", "4", "--calibration-batch-size", "2", "--max-length", "16"]
    argv = ["plan", "--base", str(fam["base"]), "--merged", str(fam["merged"]), "--out", str(tmp_path / "out"), *common]
    for t, d in fam["experts"].items():
        argv += ["--expert", f"{t}={d}"]
    for t, d in fam["data"].items():
        argv += ["--calib", f"{t}={d}"]
    assert main([*argv, "--time-from", "stated"]) == 0  # a run on this machine is timed by a probe by default
    printed = capsys.readouterr().out.splitlines()
    data = [line for line in printed if line.startswith("calibration data ")]  # what the data gives: no config has it
    assert len(data) == len(fam["experts"])
    from_checkpoints = [line for line in printed if line not in data]
    assert main(["plan", "--config", str(fam["merged"]), "--tasks", str(len(fam["experts"])), *common]) == 0
    from_config = capsys.readouterr().out.splitlines()
    assert from_config[1:1 + len(from_checkpoints)] == from_checkpoints
    assert main([*argv, "--target", "cpu"]) == 0
    assert "cpu (128.00 GiB host): fits with (none)" in capsys.readouterr().out


def test_plan_inputs_one_or_the_other(tmp_path, capsys):
    cfg = str(CONFIGS / "llama-3.2-1b.json")
    assert main(["plan", "--config", cfg]) == 2
    assert "--config needs --tasks N" in capsys.readouterr().err
    assert main(["plan", "--config", cfg, "--tasks", "2", "--merged", "x"]) == 2
    assert "--merged name a run's checkpoints and data: give one or the other" in capsys.readouterr().err
    assert main(["plan", "--tasks", "2"]) == 2
    assert "featcal plan needs --base, --merged, --expert, --calib, --out" in capsys.readouterr().err
    assert main(["plan", "--config", cfg, "--tasks", "2", "--target", "tpu"]) == 2
    assert "--target 'tpu' is not one of gpu-24gb, gpu-80gb, cpu" in capsys.readouterr().err
    assert main(["plan", "--config", cfg, "--tasks", "2", "--flops", "-1"]) == 2
    assert "--flops must be a positive number" in capsys.readouterr().err
    assert main(["plan", "--config", str(tmp_path / "absent"), "--tasks", "2"]) == 2
    assert "cannot load the config" in capsys.readouterr().err


def _shape(blocks: int = 4, hidden: int = 64, inter: int = 256, tokens: int = 32) -> ModelShape:
    linears = (("attn.q_proj", hidden, hidden), ("attn.k_proj", hidden, hidden), ("attn.v_proj", hidden, hidden),
               ("attn.out_proj", hidden, hidden), ("mlp.fc1", hidden, inter), ("mlp.fc2", inter, hidden))
    params = sum(i * o for _, i, o in linears)
    block = BlockShape(linears, (hidden, hidden), params)
    return ModelShape(10 * blocks * params, (StackShape("s", (block,) * blocks, hidden, 4, tokens, 0),), tokens * 16,
                      stem_count=params)


def test_token_macs_agree_with_the_bench_count():
    """calibration/planning/cost.py counts any block from its Linears; for a CLIP-style block it is the bench's count."""
    for hidden, inter, tokens in ((768, 3072, 50), (64, 256, 32), (1024, 4096, 257)):
        block = _shape(1, hidden, inter, tokens).stacks[0].blocks[0]
        forward, stats = cost.token_macs(block, tokens, hidden)
        ref = block_macs(hidden, inter, tokens)
        assert (forward, stats) == (ref.forward, ref.statistics)


def test_resident_device_plan_puts_models_and_chains_on_the_device():
    cfg = FeatCalConfig(num_calibration_examples=64, calibration_batch_size=16, device="cuda")
    plan = estimate(_shape(), tasks=4, config=cfg, baseline_bytes=0)
    host = {c.name: c.bytes for c in plan.components}
    device = {c.name: c.bytes for c in plan.device_components}
    cpu = {c.name: c.bytes for c in estimate(_shape(), tasks=4, config=cfg.model_copy(update={"device": "cpu"}),
                                            baseline_bytes=0).components}
    assert set(host) == {"process baseline", "merged model", "expert template", "calibration inputs",
                         planner.READ_AHEAD}  # the reader's blocks stay on the host, copied in tensor by tensor
    assert {c.phase for c in plan.device_components} == {"run"}
    assert device["chains"] == cpu["chains"] and device["statistics"] == cpu["statistics"]
    assert device["merged model"] == cpu["merged model"] and device["expert template"] == cpu["expert template"]
    assert device["expert template"] < device["merged model"]  # stems and one block (calibration/engine/template.py)
    assert planner.READ_AHEAD not in device and host[planner.READ_AHEAD] == cpu[planner.READ_AHEAD]
    assert plan.device_total == sum(device.values())
    options = dict(planner.alternatives(_shape(), tasks=4, config=cfg, baseline_bytes=0))
    assert options["--offload-blocks"].device_total < plan.device_total  # offered where the models sit on a device
    assert "--offload-blocks" not in dict(planner.alternatives(_shape(), tasks=4, config=cfg.model_copy(
        update={"device": "cpu"}), baseline_bytes=0))


def test_fit_takes_the_fastest_option_that_fits():
    shape, cfg = _shape(), FeatCalConfig(num_calibration_examples=64, calibration_batch_size=16)
    resident = estimate(shape, tasks=4, config=cfg.model_copy(update={"device": "cuda"}), baseline_bytes=0)
    offloaded = estimate(shape, tasks=4, config=cfg.model_copy(update={"device": "cuda", "offload_blocks": True}),
                         baseline_bytes=0)
    assert offloaded.device_total < resident.device_total

    def target(device_bytes, host_bytes):
        return fit.Target("t", "cuda", device_bytes, host_bytes, cost.THROUGHPUTS["gpu-80gb"])

    big = fit.fit(shape, target(resident.device_total, 10 * GiB), tasks=4, config=cfg, baseline_bytes=0)
    assert big.fits and big.options == "(none)" and not big.config.offload_blocks
    small = fit.fit(shape, target(offloaded.device_total, 10 * GiB), tasks=4, config=cfg, baseline_bytes=0)
    assert small.fits and small.options.startswith("--offload-blocks") and small.config.offload_blocks
    assert small.plan.device_total <= offloaded.device_total
    none = fit.fit(shape, target(10 * GiB, 1024), tasks=4, config=cfg, baseline_bytes=0)
    assert not none.fits and none.short_of.startswith("host needs")
    assert none.config.spill_dir is not None and none.config.calibration_batch_size == 1  # the most frugal tried
    on_cpu = fit.fit(shape, fit.target("cpu", host_bytes=10 * GiB), tasks=4, config=cfg, baseline_bytes=0)
    assert on_cpu.fits and on_cpu.plan.device_components == [] and on_cpu.config.device == "cpu"


def test_time_is_the_counts_over_the_stated_rates():
    shape = _shape()
    cfg = FeatCalConfig(num_calibration_examples=64, calibration_batch_size=16)
    blocks = cost.run_counts(shape, tasks=4, config=cfg)
    tp = cost.with_rates(cost.THROUGHPUTS["cpu"], f32=1e9, f64=5e8)
    est = cost.estimate_time(blocks, tp)
    assert est.f32_s == pytest.approx(sum(b.f32_flops for b in blocks) / 1e9)
    assert est.f64_s == pytest.approx(sum(b.f64_flops for b in blocks) / 5e8)
    assert est.moved_s == 0  # nothing offloaded
    b = blocks[0]
    assert b.tokens == 4 * 64 * 32 and b.batches == 4 * 4
    assert (b.expert_forwards, b.merged_forwards, b.calibrated_forwards) == (16, 16 + 4 + 1, 16)
    offloaded = cost.run_counts(shape, tasks=4, config=cfg.model_copy(update={"offload_blocks": True}))
    assert offloaded[0].moved_bytes > 0


def test_block_forward_counts_are_what_the_engine_runs():
    """The counts `featcal plan` prints per block are the block forwards a calibration runs (hooks count them)."""
    import featcal

    model = tiny_model("llama")
    base = tiny_model("llama")  # hooks on `model` only
    experts = {"a": perturbed(model, 1), "b": perturbed(model, 2)}
    calls: dict[tuple[str, int], int] = {}
    merged_blocks = {id(b): i for i, b in enumerate(model.model.layers)}

    def count(module, _args, _out):
        side = "merged" if id(module) in merged_blocks else "template"
        index = merged_blocks.get(id(module), module.self_attn.layer_idx)
        calls[(side, index)] = calls.get((side, index), 0) + 1

    handles = [b.register_forward_hook(count) for b in model.model.layers]
    g = torch.Generator().manual_seed(0)
    data = {t: [{"input_ids": torch.randint(0, 100, (2, 8), generator=g),
                 "attention_mask": torch.ones(2, 8, dtype=torch.long)} for _ in range(3)] for t in experts}
    cfg = FeatCalConfig(num_calibration_examples=6, calibration_batch_size=2)
    featcal.calibrate(model, base=base, experts=experts, calibration=data, config=cfg, progress=False, inplace=True)
    for h in handles:
        h.remove()
    config = model.config
    config.architectures = ["LlamaForCausalLM"]
    counts = cost.run_counts(model_shape(config, 8), tasks=2, config=cfg)
    for layer, b in enumerate(counts):
        template = calls.get(("template", layer), 0)
        merged = calls[("merged", layer)]
        assert (template, merged) == (b.expert_forwards, b.merged_forwards + b.calibrated_forwards), layer
