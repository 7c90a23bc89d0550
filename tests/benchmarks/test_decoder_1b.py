"""benchmarks/decoder_1b.py (issue 40): its tiny mode end to end, its streamed checkpoints and its accounting.

The 1B run is a benchmark, not a test (docs/scaling.md has its commands); the tiny mode runs the same script on a
few-MB Llama of the same architecture (tied embeddings, grouped KV heads).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "decoder_1b.py"


def _bench():
    spec = importlib.util.spec_from_file_location("decoder_1b", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_streamed_writer_is_a_safetensors_file(tmp_path):
    bench = _bench()
    tensors = {"a.weight": torch.randn(5, 3), "b": torch.randn(7), "c.weight": torch.randn(4, 2, 3)}
    writer = bench.SafetensorsWriter(tmp_path / "m.safetensors", [(k, tuple(v.shape)) for k, v in tensors.items()])
    for v in tensors.values():  # in row chunks, as the generator writes them
        for lo in range(0, v.shape[0], 2):
            writer.write(v[lo:lo + 2])
    assert not (tmp_path / "m.safetensors").exists()  # only the finished file gets its name
    writer.close()
    back = load_file(tmp_path / "m.safetensors")
    assert set(back) == set(tensors)
    for k, v in tensors.items():
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k], v.to(torch.bfloat16))


def test_generation_is_seeded_and_task_vectors_are_the_stated_size(tmp_path):
    bench = _bench()
    config = bench.model_config(tiny=True, layers=None)
    a = bench.generate(tmp_path / "a", config, ["x", "y"], seed=3)
    bench.generate(tmp_path / "b", config, ["x", "y"], seed=3)
    digest = {r: hashlib.sha256((tmp_path / r / "experts" / "y" / "model.safetensors").read_bytes()).hexdigest()
              for r in ("a", "b")}
    assert digest["a"] == digest["b"]
    base = load_file(tmp_path / "a" / "base" / "model.safetensors")
    expert = load_file(tmp_path / "a" / "experts" / "x" / "model.safetensors")
    assert "lm_head.weight" not in base  # tied: written once, as transformers saves it
    d2 = sum(float((expert[k].float() - base[k].float()).pow(2).sum()) for k in base)
    w2 = sum(float(base[k].float().pow(2).sum()) for k in base)
    assert math.isclose(math.sqrt(d2 / w2), a["relative_norm_whole_model"][0], rel_tol=1e-3)
    assert 0.003 < a["relative_norm_whole_model"][0] < 0.008  # ~0.5 % (bf16 rounding adds a little)


def test_tiny_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--chains", "float32", "--compare", "--repeats", "1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    res = json.loads((out / "bench.json").read_text())
    # the script's accounting against the model's real parameters (the written file, read back here)
    base = load_file(out / "work" / "base" / "model.safetensors")
    acc = res["accounting"]
    assert acc["file_block_bytes"] == 4 * sum(t.numel() for k, t in base.items() if k.startswith("model.layers.0."))
    assert acc["planned_block_bytes"] == acc["file_block_bytes"]
    assert acc["file_model_bytes"] == 4 * sum(t.numel() for t in base.values())
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(out / "work" / "merged")
    assert acc["planned_model_bytes"] == 4 * sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    (run,) = res["calibrate"]
    assert run["blocks_calibrated"] == 2 and run["peak_rss_mib"] > 0
    assert abs(run["rss_over_plan"] - 1) < 0.15, run  # the plan's estimate of the same command
    assert run["macs"]["forwards"] > run["macs"]["floor"] > 0
    assert res["compare"]["identical_weights"] is True  # experts in memory or streamed: the same checkpoint
    placements = {m: {r["placement"]["experts"] for r in v} for m, v in res["compare"]["runs"].items()}
    assert placements == {"files": {"streamed"}, "memory": {"streamed"}, "resident": {"resident"}}
    assert "| float32 |" in (out / "bench.md").read_text()
