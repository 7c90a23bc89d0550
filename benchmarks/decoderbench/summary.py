"""The bench's figures, as pure functions of the eval.json rows: per seed, over seeds, by calibration size.

Every share is of the TA -> experts gap on the mean over domains, (TA - row) / (TA - experts) for the loss
(lower is better) and (row - TA) / (experts - TA) for next-token accuracy, through featcal's own
`gap_closed` (None, printed n/a, where the experts are no better than TA: no gap to close). Nothing here
rounds: bench.md rounds when it prints.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

REFERENCE, EXPERTS, BASE = "task_arithmetic", "experts", "base"
MERGES = ("task_arithmetic", "ties", "regmean", "wudi")
BEST = "best"
METRICS = ("loss", "acc")


def row_id(merge: str, variant: str | None = None, size: int | None = None) -> str:
    """"ties" (the merge alone), "ties+featcal@32" (paper defaults), "best+featcal_tuned@32" (--tune)."""
    return merge if variant is None else f"{merge}+{variant}@{size}"


def parse_row(row: str) -> tuple[str, str | None, int | None]:
    if "+" not in row:
        return row, None, None
    merge, rest = row.split("+", 1)
    variant, size = rest.split("@")
    return merge, variant, int(size)


TITLES = {"base": "base", "experts": "experts (each on its own domain)", "task_arithmetic": "Task Arithmetic",
          "ties": "TIES", "regmean": "RegMean", "wudi": "WUDI", "best": "best merge"}
VARIANTS = {"featcal": "FeatCal (paper defaults)", "featcal_tuned": "FeatCal --tune"}


def row_label(row: str, chosen: str | None = None) -> str:
    merge, variant, size = parse_row(row)
    title = TITLES.get(merge, merge) + (f" ({TITLES.get(chosen, chosen)})" if merge == BEST and chosen else "")
    return title if variant is None else f"{title} + {VARIANTS.get(variant, variant)}, {size}/domain"


def share(row: float, reference: float, experts: float, metric: str) -> float | None:
    """The row's share (in %) of the reference -> experts gap on `metric`; None where there is no gap."""
    from featcal.evaluation.metrics import gap_closed

    g = gap_closed(row, reference, experts, higher_is_better=metric != "loss")
    return None if g is None else 100.0 * g


def means(results: Mapping[str, Mapping[str, Mapping[str, float]]], domains: Sequence[str]) -> dict:
    """row -> {loss, acc: means over the domains; ppl: exp of the mean loss (the geometric mean perplexity)}."""
    out = {}
    for row, by_domain in results.items():
        m = {k: sum(by_domain[d][k] for d in domains) / len(domains) for k in METRICS}
        m["ppl"] = math.exp(m["loss"])
        out[row] = m
    return out


def regime(results: Mapping, domains: Sequence[str]) -> dict:
    """Per domain: base < TA < experts in quality (loss: base > TA > experts); and whether it holds on all."""
    per = {}
    for d in domains:
        b, t, e = (results[r][d]["loss"] for r in (BASE, REFERENCE, EXPERTS))
        per[d] = {"base": b, "task_arithmetic": t, "experts": e, "holds": b > t > e,
                  "ta_above_base": b > t, "experts_above_ta": t > e}
    return {"per_domain": per, "holds": all(v["holds"] for v in per.values())}


def regime_line(seed: int, reg: Mapping) -> str:
    cells = [f"{d} {v['base']:.3f} > {v['task_arithmetic']:.3f} > {v['experts']:.3f}"
             + ("" if v["holds"] else (" FAILS (TA not below base)" if not v["ta_above_base"]
                                       else " FAILS (expert not below TA)"))
             for d, v in reg["per_domain"].items()]
    verdict = "holds on every domain" if reg["holds"] else "DOES NOT HOLD on every domain: this seed's shares mean little"
    return f"seed {seed} regime (loss: base > TA > experts): " + "; ".join(cells) + f": {verdict}"


def seed_summary(results: Mapping, domains: Sequence[str]) -> dict:
    """One seed's means, shares (mean over domains; and per domain for the loss) and regime."""
    mean = means(results, domains)
    shares = {row: {k: share(mean[row][k], mean[REFERENCE][k], mean[EXPERTS][k], k) for k in METRICS}
              for row in results if row != EXPERTS}
    per_domain = {row: {d: share(results[row][d]["loss"], results[REFERENCE][d]["loss"], results[EXPERTS][d]["loss"],
                                 "loss") for d in domains}
                  for row in results if row != EXPERTS}
    return {"mean": mean, "share_pct": shares, "share_loss_pct_per_domain": per_domain,
            "regime": regime(results, domains)}


def spread(values: Sequence[float | None]) -> dict:
    """mean, sample sd (n >= 2), min and max of the values that exist (n/a shares left out, and counted)."""
    got = [v for v in values if v is not None]
    return {"n": len(got), "missing": len(values) - len(got),
            "mean": statistics.fmean(got) if got else None,
            "sd": statistics.stdev(got) if len(got) >= 2 else None,
            "min": min(got) if got else None, "max": max(got) if got else None}


def over_seeds(per_seed: Sequence[Mapping]) -> dict:
    """row -> metric -> spread of its share over the seeds (rows present in every seed)."""
    rows = [r for r in per_seed[0]["share_pct"] if all(r in s["share_pct"] for s in per_seed)]
    return {row: {k: dict(spread([s["share_pct"][row][k] for s in per_seed]),
                          per_seed=[s["share_pct"][row][k] for s in per_seed]) for k in METRICS}
            for row in rows}


def gain_ratios(mean: Mapping, variant_rows: Mapping[int, str]) -> dict[int, float | None]:
    """size -> (TA loss - row loss at size) / (the same at the largest size): the share of the largest size's gain."""
    top = variant_rows[max(variant_rows)]
    top_gain = mean[REFERENCE]["loss"] - mean[top]["loss"]
    if not top_gain > 1e-12:
        return dict.fromkeys(variant_rows)
    return {n: (mean[REFERENCE]["loss"] - mean[row]["loss"]) / top_gain for n, row in variant_rows.items()}


def curve(per_seed: Sequence[Mapping], merge: str, variants: Sequence[str], sizes: Sequence[int]) -> dict:
    """variant -> size -> {share of the loss / accuracy gap over seeds, share of the largest size's gain}."""
    out = {}
    for variant in variants:
        rows = {n: row_id(merge, variant, n) for n in sizes}
        if not all(r in s["mean"] for s in per_seed for r in rows.values()):
            continue
        ratios = [gain_ratios(s["mean"], rows) for s in per_seed]
        out[variant] = {n: {"row": rows[n], "loss": spread([s["share_pct"][rows[n]]["loss"] for s in per_seed]),
                            "acc": spread([s["share_pct"][rows[n]]["acc"] for s in per_seed]),
                            "gain_ratio": dict(spread([r[n] for r in ratios]), per_seed=[r[n] for r in ratios])}
                        for n in sizes}
    return out


def goals(per_seed: Sequence[Mapping], best_row: str, main_size: int, curves: Mapping, sizes: Sequence[int]) -> dict:
    """The issue's three goals, checked per seed (reported, never used to choose anything)."""
    others = [m for m in MERGES] + [row_id(m, "featcal", main_size) for m in MERGES]
    best = []
    for s in per_seed:
        loss_share = s["share_pct"].get(best_row, {}).get("loss")
        beaten = [r for r in others if r in s["mean"] and best_row in s["mean"]
                  and not s["mean"][best_row]["loss"] < s["mean"][r]["loss"]]
        best.append({"seed": s["seed"], "loss_share_pct": loss_share,
                     "at_least_80": loss_share is not None and loss_share >= 80.0, "not_above": beaten})
    mid = [n for n in sizes if n < max(sizes)]
    efficiency = {v: {n: {"per_seed": c[n]["gain_ratio"]["per_seed"],
                          "at_least_0.8": all(r is not None and r >= 0.8 for r in c[n]["gain_ratio"]["per_seed"])}
                      for n in mid} for v, c in curves.items()}
    return {"best_label_free": {"row": best_row, "per_seed": best,
                                "met": all(b["at_least_80"] and not b["not_above"] for b in best)},
            "regime": {"per_seed": {s["seed"]: s["regime"]["holds"] for s in per_seed},
                       "met": all(s["regime"]["holds"] for s in per_seed)},
            "sample_efficiency": efficiency}
