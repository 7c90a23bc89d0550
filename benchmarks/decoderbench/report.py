"""bench.json's summary over seeds, bench.md (each figure beside the command that produced it) and the size plot."""

from __future__ import annotations

import os
from collections.abc import Mapping

from decoderbench import summary
from decoderbench.summary import BEST, REFERENCE, row_id, row_label


def aggregate(s, seeds: list[dict]) -> dict:
    """What bench.json holds over the seeds: each row's shares (mean, sd, min, max), the size curve, the goals."""
    per_seed = [x["summary"] for x in seeds]
    curves = summary.curve(per_seed, REFERENCE, s.curve, s.calib_sizes)
    best_row = row_id(BEST, "featcal_tuned", s.main_size)
    return {"over_seeds": summary.over_seeds(per_seed), "curve": curves,
            "goals": summary.goals(per_seed, best_row, s.main_size, curves, s.calib_sizes)}


def f1(v: float) -> str:
    """One decimal, never "-0.0"."""
    return f"{round(v, 1) + 0.0:.1f}"


def pct(v: float | None) -> str:
    return "n/a" if v is None else f"{f1(v)} %"


def spread_text(sp: Mapping) -> str:
    if sp["mean"] is None:
        return "n/a"
    text = f1(sp["mean"]) + (f" ± {f1(sp['sd'])}" if sp["sd"] is not None else "") + " %"
    if sp["n"] >= 2:
        text += f" ({f1(sp['min'])} – {f1(sp['max'])})"
    return text + (f", {sp['missing']} n/a" if sp["missing"] else "")


def _ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.2f}"


def ordered_rows(rows, s) -> list[str]:
    """base, experts, then each merge alone and + FeatCal, the tuned rows, the size curve."""
    first = ["base", "experts"]
    for m in s.merges:
        first += [m, row_id(m, "featcal", s.main_size)]
    first += [row_id(REFERENCE, "featcal_tuned", s.main_size), row_id(BEST, "featcal_tuned", s.main_size)]
    first += [row_id(m, "featcal_tuned", s.main_size) for m in s.merges]
    first = list(dict.fromkeys(first))
    return [r for r in first if r in rows] + sorted(r for r in rows if r not in first)


def _header(r: dict) -> list[str]:
    s, b = r["settings"], r["base"]
    model = s["model"]
    arch = "gemma3" if model == "gemma3" else "llama"
    from decoderbench.settings import MODEL_TITLES
    from decoderbench.tiny import TINY_CLASS

    title = f"tiny {TINY_CLASS[arch]}" if s["tiny"] else MODEL_TITLES[model]
    env = r["environment"]
    screen = (f", --tune-screen {s['tune_screen']}" if s.get("tune_screen") is not None else "") + (
        f", --tune-scope {s['tune_scope']}" if s.get("tune_scope") is not None else "") + (
        f", --tune-fixed {s['tune_fixed']}" if s.get("tune_fixed") is not None else "") + (
        f", --tune-confirm {s['tune_confirm']}" if s.get("tune_confirm") is not None else "")
    return [f"# Decoder benchmark ({title})", "", f"Produced by: `{r['command']}`", "",
            f"Base: {b['source']} ({b['layers']} blocks, width {b['hidden']}), read with featcal.io.read.gguf and saved "
            f"once as safetensors ({b['checkpoint_for_eval']}): `featcal eval` scores that copy, and "
            + ("merges and calibrations get the .gguf itself as --base (RegMean the copy). " if s.get("base_from_gguf")
               else "every merge and calibration gets it as --base. ") +
            f"Experts: {s['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens, last {s['train_layers']} "
            f"blocks trained, lr {s['lr']}. Windows of {s['seq_len']} tokens, each starting with the tokenizer's "
            f"start tokens {b['start_tokens']}: {s['eval_windows']} test and {s['select_windows']} selection windows "
            f"per domain; calibration at {', '.join(map(str, s['calib_sizes']))} windows per domain (every merge at "
            f"{s['main_size']}). Seeds {', '.join(map(str, s['seeds']))}. TA {s['ta_scaling']}, TIES density "
            f"{s['ties_density']} scaling {s['ties_scaling']}, RegMean on {s['main_size']} windows per domain, WUDI "
            f"{s.get('wudi_steps') or 300} Adam steps, FeatCal's own defaults (--tune budget "
            f"{s.get('tune_budget') or 'featcal default'}{screen}); featcal commit {_git(r.get('featcal_git'))}; "
            f"code digests {r.get('code')}. {s['threads']} threads, stages run {env['runner']}; load average "
            f"at start / end {env['load_average_start']} / {env['load_average_end']} ({env['cpus']} CPUs). "
            f"Total {r['total_seconds']} s.", ""]


def _git(g: dict | None) -> str:
    if not g or not g.get("commit"):
        return "unknown"
    return g["commit"][:10] + (" (work tree dirty)" if g.get("dirty") else "")


def timing(r: dict) -> dict:
    """The plan's estimate against the measured time of everything this run computed (cached results cost
    nothing and are left out): the base's load, each expert trained, each stage run; totals, and the run's
    whole wall time (which also holds reading the domains and writing the windows)."""
    rows = [{"what": "base GGUF load", "estimate_s": r["base"]["load_estimate_s"], "measured_s": r["base"]["load_seconds"]}]
    for x in r["seeds"]:
        for d, e in x["experts"].items():
            if not e.get("cached"):
                rows.append({"what": f"seed {x['seed']} expert:{d}", "estimate_s": e.get("estimate_s"),
                             "measured_s": e.get("wall_seconds", e.get("train_seconds"))})
        for st in x["stages"]:
            if not st["cached"]:
                rows.append({"what": f"seed {x['seed']} {st['name']}", "estimate_s": st["estimate_s"],
                             "measured_s": st["wall_seconds"]})
    est = sum(x["estimate_s"] or 0 for x in rows)
    got = sum(x["measured_s"] or 0 for x in rows)
    return {"rows": rows, "estimate_s": round(est), "measured_s": round(got, 1), "run_wall_s": r["total_seconds"],
            "ratio": round(got / est, 2) if est else None}


def timing_lines(r: dict) -> list[str]:
    t = r.get("timing")
    if not t:
        return []
    lines = ["## The plan's estimate against the measured time", "",
             f"What this run computed (cached results left out). Rates: {r.get('rates_source', 'see --plan')}.", "",
             "| what | estimate s | measured s | measured / estimate |", "|---|---|---|---|"]
    for x in t["rows"]:
        ratio = f"{x['measured_s'] / x['estimate_s']:.2f}" if x["estimate_s"] and x["measured_s"] is not None else "n/a"
        lines.append(f"| {x['what']} | {x['estimate_s']} | {x['measured_s']} | {ratio} |")
    lines += [f"| **total** | **{t['estimate_s']}** | **{t['measured_s']}** | **{t['ratio']}** |", "",
              f"The run's whole wall time: {t['run_wall_s']} s (also reading the domains, writing the windows and the "
              "bench's own bookkeeping).", ""]
    return lines


def markdown(r: dict) -> str:
    s = r["settings"]
    lines = _header(r) + timing_lines(r)
    lines += ["## Regime check (held-out loss per domain: base > TA > experts)", ""]
    lines += [f"- {x['regime_line']}" for x in r["seeds"]] + [""]
    if r.get("regime_only"):
        lines += ["--regime-only: stopped after the regime check.", ""] + _seed_sections(r)
        return "\n".join(lines)

    class S:  # the settings as attributes, for ordered_rows
        merges, main_size = s["merges"], s["main_size"]

    best_row = row_id(BEST, "featcal_tuned", s["main_size"])
    chosen = ", ".join(f"seed {x['seed']}: {x['selection']['best']}" for x in r["seeds"])
    lines += ["## Share of the TA → experts gap closed, over seeds", "",
              "On the mean over domains: (TA − row) / (TA − experts) in loss, (row − TA) / (experts − TA) in "
              "next-token accuracy; mean ± sd (min – max) over the seeds; n/a where the experts are not better "
              f"than TA. The best merge (chosen per seed by mean loss on the held-out calibration windows, never on "
              f"test data): {chosen}.", "",
              "| row | loss gap | accuracy gap | per seed (loss) |", "|---|---|---|---|"]
    for row in ordered_rows(r["over_seeds"], S):
        o = r["over_seeds"][row]
        lines.append(f"| {row_label(row)} | {spread_text(o['loss'])} | {spread_text(o['acc'])} | "
                     + ", ".join(pct(v) for v in o["loss"]["per_seed"]) + " |")
    lines += ["", "## Sample efficiency (TA + FeatCal by calibration windows per domain)", "",
              "| variant | windows / domain | loss gap | accuracy gap | share of the gain at the largest size, per seed |",
              "|---|---|---|---|---|"]
    for variant, by_size in r["curve"].items():
        for n, c in by_size.items():
            lines.append(f"| TA + {summary.VARIANTS[variant]} | {n} | {spread_text(c['loss'])} | "
                         f"{spread_text(c['acc'])} | " + ", ".join(_ratio(v) for v in c["gain_ratio"]["per_seed"]) + " |")
    g = r["goals"]
    lines += ["", "## The issue's goals (reported; nothing was chosen by them)", ""]
    lines.append(f"- Best label-free FeatCal ({row_label(best_row)}) ≥ 80 % of the loss gap on every seed and above "
                 f"every merge alone and every merge + default FeatCal: **{'met' if g['best_label_free']['met'] else 'not met'}** ("
                 + "; ".join(f"seed {b['seed']} {pct(b['loss_share_pct'])}"
                             + (f", not above {', '.join(b['not_above'])}" if b["not_above"] else "")
                             for b in g["best_label_free"]["per_seed"]) + ").")
    lines.append(f"- The regime on every domain, per seed: **{'met' if g['regime']['met'] else 'not met'}**.")
    for variant, by_size in g["sample_efficiency"].items():
        for n, e in by_size.items():
            lines.append(f"- TA + {summary.VARIANTS[variant]} at {n} windows per domain ≥ 0.8 of the gain at "
                         f"{max(s['calib_sizes'])}: **{'met' if e['at_least_0.8'] else 'not met'}** ("
                         + ", ".join(_ratio(v) for v in e["per_seed"]) + ").")
    lines += [""] + _seed_sections(r)
    return "\n".join(lines)


def _seed_sections(r: dict) -> list[str]:
    s = r["settings"]
    doms = list(s["domains"])

    class S:
        merges, main_size = s["merges"], s["main_size"]

    lines = []
    for x in r["seeds"]:
        summ = x.get("summary") or summary.seed_summary(x["results"], doms)
        chosen = x.get("selection", {}).get("best")
        lines += [f"## Seed {x['seed']}", ""]
        if x.get("selection"):
            lines += ["Mean loss on the held-out calibration windows (chooses the best merge): "
                      + ", ".join(f"{m} {v:.4f}" for m, v in x["selection"]["loss"].items()) + f"; best: **{chosen}**.", ""]
        lines += ["Held-out loss (nats) / next-token accuracy (%) per domain; the share of the TA → experts gap on the "
                  "means; the `featcal eval` stage whose eval.json holds the row (commands below).", "",
                  "| row | " + " | ".join(doms) + " | mean loss | mean ppl | mean acc | loss gap | acc gap | eval |",
                  "|---|" + "---|" * (len(doms) + 6)]
        for row in ordered_rows(x["results"], S):
            cells = [f"{x['results'][row][d]['loss']:.3f} / {x['results'][row][d]['acc']:.1f}" for d in doms]
            m, sh = summ["mean"][row], summ["share_pct"].get(row, {"loss": None, "acc": None})
            gaps = ["—", "—"] if row == "experts" else [pct(sh["loss"]), pct(sh["acc"])]
            lines.append(f"| {row_label(row, chosen)} | " + " | ".join(cells)
                         + f" | {m['loss']:.4f} | {m['ppl']:.2f} | {m['acc']:.2f} | {gaps[0]} | {gaps[1]} | "
                           f"`{x['rows'][row]}` |")
        lines += ["", "| stage | cached | wall s | featcal seconds | peak RSS MiB | estimate s | command |",
                  "|---|---|---|---|---|---|---|"]
        for st in x["stages"]:
            sec = st["seconds"]
            sec = ", ".join(f"{k} {v:.1f}" for k, v in sec.items()) if isinstance(sec, dict) else f"{sec}"
            lines.append(f"| `{st['name']}` | {st['cached']} | {st['wall_seconds']} | {sec} | {st['peak_rss_mb']} | "
                         f"{st['estimate_s']} | `{st['command']}` |")
        lines += ["", "| expert | cached | s/step | train loss first → last | passes over its text | documents "
                  "train / select / calib / test |", "|---|---|---|---|---|---|"]
        for d in doms:
            e, dc = x["experts"][d], x["data"][d]["documents"]
            lines.append(f"| {d} | {e['cached']} | {e.get('s_per_step')} | {e['losses'][0]} → {e['losses'][-1]} | "
                         f"{e.get('passes_over_text')} | {dc['train']} / {dc['select']} / {dc['calib']} / {dc['test']} |")
        lines.append("")
    return lines


def size_plot(r: dict, path: str | os.PathLike) -> None:
    """Share of the TA → experts gap (loss, accuracy) against calibration windows per domain: one line per
    curve variant, the mean over seeds with min-max bars; the other rows at the main size as points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    main = r["settings"]["main_size"]
    for ax, metric, title in zip(axes, ("loss", "acc"), ("mean loss", "mean next-token accuracy"), strict=True):
        for i, (variant, by_size) in enumerate(r["curve"].items()):
            ns = [n for n in by_size if by_size[n][metric]["mean"] is not None]
            mid = [by_size[n][metric]["mean"] for n in ns]
            err = [[m - by_size[n][metric]["min"] for n, m in zip(ns, mid, strict=True)],
                   [by_size[n][metric]["max"] - m for n, m in zip(ns, mid, strict=True)]]
            ax.errorbar(ns, mid, yerr=err, fmt="-o", color=f"C{i}", capsize=3, label=f"TA + {summary.VARIANTS[variant]}")
        j = len(r["curve"])
        for row, o in r["over_seeds"].items():
            merge, variant, size = summary.parse_row(row)
            if variant is None or size != main or merge == REFERENCE or o[metric]["mean"] is None:
                continue
            ax.plot([main], [o[metric]["mean"]], "s", color=f"C{j}", label=row_label(row))
            j += 1
        sizes = r["settings"]["calib_sizes"]
        ax.set_xlim(min(sizes) / 1.5, max(sizes) * 1.5)  # also where no share exists (n/a on every seed)
        ax.axhline(100, color="grey", linestyle=":", linewidth=1)
        ax.axhline(0, color="grey", linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("calibration windows per domain")
        ax.set_ylabel("share of the TA → experts gap (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    handles = {label: h for ax in axes for h, label in zip(*ax.get_legend_handles_labels(), strict=True)}
    axes[1].legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
