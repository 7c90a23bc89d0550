"""The memory planner: its estimate against a measured run, its options, and the CLI entry points."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T

from featcal.calibration.planning.planner import BlockShape, ModelShape, StackShape, estimate, parse_size
from featcal.cli.main import main
from featcal.config import FeatCalConfig
from featcal.errors import ConfigError
from tests.builders.data_fixtures import save_image_processor, write_png_folder
from tests.builders.guarantees import calibrate_argv, plan_argv
from tests.builders.pipeline_family import bert_family, clip_family
from tests.builders.tiny import perturbed

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20


def _deep_clip_family(root: Path) -> dict:
    """~85M parameters in 96 narrow blocks: the two model copies clearly outweigh the interpreter
    (its baseline is 390–460 MiB depending on the install), and solves stay cheap."""
    cfg = T.CLIPVisionConfig(hidden_size=384, intermediate_size=384, num_hidden_layers=96, num_attention_heads=8,
                             image_size=8, patch_size=4)
    torch.manual_seed(0)
    base = T.CLIPVisionModel(cfg).eval()
    base.save_pretrained(root / "base")
    save_image_processor(root / "base", size=8)
    perturbed(base, 100).save_pretrained(root / "expert")
    base.save_pretrained(root / "merged")  # the merge's values do not matter for memory
    return {"base": root / "base", "merged": root / "merged", "experts": {"t": root / "expert"},
            "data": {"t": write_png_folder(root / "data", n_per_class=2)}}


def _featcal(*argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "featcal", *argv], env=env, capture_output=True, text=True, timeout=120)


def _mib(text: str) -> float:
    value, unit = re.search(r"estimated peak memory per process: ([0-9.]+) (GiB|MiB)", text).groups()
    return float(value) * (1024 if unit == "GiB" else 1)


def test_estimate_within_25_percent_of_measured_peak_rss(tmp_path):
    fam = _deep_clip_family(tmp_path / "fam")
    plan = _featcal(*plan_argv(fam, tmp_path / "out"))
    assert plan.returncode == 0, plan.stderr[-2000:]
    estimated = _mib(plan.stdout)
    models = [float(m) for m in re.findall(r"(?:merged model|expert template)\s+([0-9.]+) MiB", plan.stdout)]
    baseline = float(re.search(r"process baseline\s+([0-9.]+) MiB", plan.stdout).group(1))
    # the test measures the model, not the interpreter: the merged model is most of what is planned beyond the
    # baseline (the template holds its stems and one block, so a planned second copy would be off by > 25 %)
    assert models[0] > 0.5 * baseline and models[1] < 0.1 * models[0]
    run = _featcal(*calibrate_argv(fam, tmp_path / "out", "--no-resume"))  # resume adds no memory, only time
    assert run.returncode == 0, run.stderr[-2000:]
    measured = json.loads((tmp_path / "out" / "featcal.json").read_text())["peak_rss_mb"]
    assert abs(estimated - measured) / measured < 0.25, (estimated, measured, plan.stdout)


def _shape(tokens=65, hidden=32, blocks=2) -> ModelShape:
    block = BlockShape((("q", hidden, hidden), ("k", hidden, hidden), ("fc1", hidden, 4 * hidden)), (hidden,), 10_000)
    return ModelShape(100_000, (StackShape("vision", (block,) * blocks, hidden, 4, tokens, 0),), 3 * 16 * 16 * 4)


def test_options_shrink_what_they_should():
    cfg = FeatCalConfig(num_calibration_examples=256, calibration_batch_size=16)
    parts = {c.name: c.bytes for c in estimate(_shape(), tasks=8, config=cfg, baseline_bytes=0).components}
    assert parts["chains"] == 2 * 8 * 256 * 65 * 32 * 4
    bf16 = {c.name: c.bytes for c in estimate(_shape(), tasks=8, config=cfg.model_copy(
        update={"chain_dtype": "bfloat16"}), baseline_bytes=0).components}
    assert bf16["chains"] * 2 == parts["chains"] and bf16["merged model"] == parts["merged model"]
    spilled = estimate(_shape(), tasks=8, config=cfg.model_copy(update={"spill_dir": Path("x")}), baseline_bytes=0)
    assert {c.name: c.bytes for c in spilled.components}["chains"] == 16 * 65 * 32 * 4
    assert spilled.chain_bytes_total == parts["chains"]
    two = {c.name: c.bytes for c in estimate(_shape(), tasks=8, config=cfg, baseline_bytes=0, world=2).components}
    assert two["chains"] * 2 == parts["chains"] and two["merged model"] == parts["merged model"]


def test_parse_size():
    assert parse_size("8GiB") == 8 * 2**30 and parse_size("500MB") == 500 * 10**6 and parse_size("1.5g") == int(1.5 * 2**30)
    with pytest.raises(ConfigError, match="--max-memory expects a size"):
        parse_size("lots")


def test_dry_run_and_max_memory_act_before_any_work(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    assert main(calibrate_argv(fam, tmp_path / "out", "--dry-run", "--max-memory", "1MiB")) == 0
    printed = capsys.readouterr().out
    assert "estimated peak memory per process" in printed and "does NOT fit" in printed
    assert "chains" in printed and not (tmp_path / "out").exists()
    assert main(calibrate_argv(fam, tmp_path / "out", "--max-memory", "1MiB")) == 2
    assert "exceeds --max-memory 1.00 MiB" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert main(plan_argv(fam, tmp_path / "out", "--chain-dtype", "bfloat16")) == 0
    assert "2 B (bfloat16)" in capsys.readouterr().out


def test_text_plan_counts_masks_at_max_length(tmp_path, capsys):
    fam = bert_family(tmp_path / "fam")
    assert main(plan_argv(fam, tmp_path / "out", "--max-length", "16")) == 0
    out = capsys.readouterr().out
    assert "16 tokens × 32 hidden" in out
    ctx = re.search(r"chain contexts\s+([0-9.]+) (KiB|B)", out)
    assert ctx is not None and float(ctx.group(1)) > 0


def test_offload_plan_moves_the_block_transients_to_the_device():
    cfg = FeatCalConfig(num_calibration_examples=256, calibration_batch_size=16)
    shape = ModelShape(100_000, _shape().stacks, 3 * 16 * 16 * 4, stem_count=5_000)
    whole = estimate(shape, tasks=8, config=cfg, baseline_bytes=0)
    off = estimate(shape, tasks=8, config=cfg.model_copy(update={"offload_blocks": True, "device": "cuda"}),
                   baseline_bytes=0)
    host, dev = {c.name: c.bytes for c in off.components}, off.device_components
    parts = {c.name: c.bytes for c in whole.components}
    assert whole.device_components == [] and whole.device_total == 0
    assert not {"statistics", "activations", "base anchors"} & set(host)
    assert host["expert blocks read ahead"] == parts["expert blocks read ahead"]  # on the host either way
    assert host["chains"] == parts["chains"] and host["merged model"] == parts["merged model"]  # chains stay on the host
    assert host["tensor in transit"] == 32 * 128 * 4  # the widest Linear (fc1), not a whole block
    block = {c.name: c.bytes for c in dev if c.phase == "block"}
    capture = {c.name: c.bytes for c in dev if c.phase == "capture"}
    assert block["merged block"] == block["expert block"] == 10_000 * 4
    assert block["statistics"] == parts["statistics"] and block["activations"] == parts["activations"]
    assert block["batch chains"] == 2 * 16 * 65 * 32 * 4  # one batch, both sides, float32; not all chains
    assert capture["stems"] == 2 * 5_000 * 4
    assert off.device_total == max(sum(block.values()), sum(capture.values()))
    saved = parts["statistics"] + parts["activations"] + parts["base anchors"]
    assert parts["expert template"] == (100_000 - 2 * 10_000 + 10_000) * 4  # all but the blocks, and one block
    # offloading, the template's current block is on the device ("expert block"), not in the host's template
    assert host["expert template"] == parts["expert template"] - block["expert block"]
    assert whole.total - off.total == saved + block["expert block"] - host["tensor in transit"]


def test_stem_count_is_what_offloading_moves():
    from featcal.blocks.adapters import adapter_for
    from featcal.calibration.engine.param_names import stem_param_names
    from featcal.calibration.planning.planner import model_shape
    from tests.builders.tiny import tiny_config, tiny_model

    for kind in ("clip", "t5", "llama"):
        model = tiny_model(kind)
        stacks = adapter_for(model).stacks(model)
        params = dict(model.named_parameters(remove_duplicate=False))
        stem = {id(params[n]): params[n].numel() for n in stem_param_names(model, stacks)}
        for name, b in model.named_buffers(remove_duplicate=False):  # position ids, rotary frequencies
            under = any(st.entry_path == "" or name.startswith(st.entry_path + ".") for st in stacks)
            if under and not any(name.startswith(st.blocks_path + ".") for st in stacks):
                stem[id(b)] = b.numel()
        config = tiny_config(kind)
        config.architectures = [type(model).__name__]
        assert model_shape(config, 16).stem_count == sum(stem.values()), kind


def test_plan_cli_reports_device_memory_when_offloading(tmp_path, capsys):
    fam = clip_family(tmp_path / "fam")
    assert main(plan_argv(fam, tmp_path / "out", "--offload-blocks", "--device", "cuda")) == 0
    out = capsys.readouterr().out
    assert "estimated peak memory per process (host)" in out
    assert "estimated peak device memory per process (--offload-blocks on cuda)" in out
    assert re.search(r"block phase: [0-9.]+ (KiB|MiB)", out) and re.search(r"capture phase: [0-9.]+ (KiB|MiB)", out)
    assert main(plan_argv(fam, tmp_path / "out")) == 0
    assert "device memory" not in capsys.readouterr().out


def test_one_pass_plan_holds_every_batch_paused():
    """block_statistics sequential_one_pass holds every batch's two paused block forwards and an expert block per
    task (calibration/engine/one_pass.py); the planner counts them, on the device when offloading."""
    cfg = FeatCalConfig(num_calibration_examples=256, calibration_batch_size=16)
    one = cfg.model_copy(update={"block_statistics": "sequential_one_pass"})
    plain = {c.name: c.bytes for c in estimate(_shape(), tasks=8, config=cfg, baseline_bytes=0).components}
    parts = {c.name: c.bytes for c in estimate(_shape(), tasks=8, config=one, baseline_bytes=0).components}
    assert "paused forwards" not in plain
    assert parts["paused forwards"] == plain["activations"] * 8 * 16  # 8 tasks x 16 batches of 16
    assert parts["expert block copies"] == 8 * 10_000 * 4
    assert {k: v for k, v in parts.items() if k in plain} == plain
    off = estimate(_shape(), tasks=8, config=one.model_copy(update={"offload_blocks": True, "device": "cuda"}),
                   baseline_bytes=0)
    device = {c.name: c for c in off.device_components if c.phase == "block"}
    assert device["paused forwards"].bytes == parts["paused forwards"]
    assert "paused forwards" not in {c.name for c in off.components}


def test_the_reader_holds_one_block_of_every_expert():
    """calibration/engine/prefetch.py reads the next block of every expert while a block computes: the plan counts one
    block per task, on the host also when offloading."""
    from featcal.calibration.planning.planner import READ_AHEAD

    cfg = FeatCalConfig(num_calibration_examples=16, calibration_batch_size=16)
    block = max(b.param_count for s in _shape().stacks for b in s.blocks)
    for tasks in (1, 8):
        for offload in (False, True):
            plan = estimate(_shape(), tasks=tasks, config=cfg.model_copy(update={"offload_blocks": offload}),
                            baseline_bytes=0)
            assert {c.name: c.bytes for c in plan.components}[READ_AHEAD] == tasks * block * 4
            assert READ_AHEAD not in {c.name for c in plan.device_components}
