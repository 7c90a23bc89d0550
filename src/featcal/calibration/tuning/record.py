"""The search's record (featcal.json's "tuning") and its one line for the command line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

CRITERION = (
    "mean over tasks of ||h - h_expert||^2 / ||h_expert||^2 at the last block's output (class token only where "
    "the output is read from it; padding excluded) on each task's held-out calibration examples; with task "
    "heads, first the mean over tasks of the fraction of held-out examples whose prediction differs from the "
    "expert's, the drift (tune_tiebreak soft: the mean KL from the expert's head softmax to the candidate's) "
    "breaking ties; lower is better"
)
CRITERION_NEXT_TOKEN = (
    "first the mean over tasks of the fraction of the held-out calibration windows' valid (non-padding) positions "
    "whose next-token prediction (the argmax of the model's own LM head) differs from the expert's (a task with a "
    "head of its own: the fraction of its held-out examples whose prediction differs); ties broken by the mean over "
    "tasks of ||h - h_expert||^2 / ||h_expert||^2 at the last block's output on the same examples, padding "
    "excluded (tune_tiebreak soft: the mean over those positions of the KL from the expert's softmax to the "
    "candidate's); lower is better"
)


def criterion(next_token: bool) -> str:
    """What the candidates were scored by (featcal.json's tuning.criterion)."""
    return CRITERION_NEXT_TOKEN if next_token else CRITERION


def next_token_record(used: bool, why: str, tasks: list[str] | None = None,
                      tokens: Mapping[str, int] | None = None) -> dict[str, Any]:
    """featcal.json's tuning.next_token: whether the LM head's next-token agreement scored the candidates, why,
    and (used) for which tasks, on how many held-out positions each."""
    if not used:
        return {"used": False, "why": why}
    return {"used": True, "why": why, "tasks": list(tasks or []), "held_out_positions": dict(tokens or {})}


def summary_line(record: Mapping[str, Any]) -> str:
    """One line for the command line: how many candidates, the choice, its held-out score against the start's."""
    if record.get("scope") == "block":
        return block_summary_line(record)
    chosen = record["chosen"]
    # the configured setting's score at the chosen one's size (with a screen: where it was confirmed)
    first = next((c for c in record["candidates"] if c.get("stage", "full") == "full"), record["candidates"][0])
    values = ", ".join(f"{k}={chosen[k]:g}" for k in ("merge_scaling", "anchor_blend_rho", "lambda_ratio",
                                                       "teacher_interp_alpha") if chosen.get(k) is not None)
    screen = record.get("screen") or {}
    if screen.get("confirmed"):
        counted = (f"{screen['screened']} candidate(s) screened on {screen['examples_per_task']} examples per task, "
                   f"{len(screen['confirmed'])} confirmed on the whole fit part; all")
    elif screen.get("screened"):
        counted = (f"{screen['screened']} candidate(s) screened on {screen['examples_per_task']} examples per task, "
                   "none confirmed (the screen's best is the choice);")
    else:
        counted = f"{len(record['candidates'])} candidate(s)"
    line = (f"tune: {counted} scored on held-out calibration examples; chose "
            f"{values}: held-out drift {chosen['drift']:.4g} (starting setting {first['drift']:.4g})")
    if chosen.get("disagreement") is not None:
        what = "next-token disagreement" if (record.get("next_token") or {}).get("used") else "disagreement"
        line += f", {what} with the experts {chosen['disagreement']:.3f} (start {first['disagreement']:.3f})"
    unbacked = sum(1 for c in record.get("comparisons", ()) if c["scored_better"] and not c["accepted"])
    if unbacked:
        line += (f"; {unbacked} step(s) that scored better were not taken (under {record['min_evidence']:g} standard "
                 "errors)")
    return line + f"; search {record['seconds']['search']:.1f} s, refit on all data {record['seconds']['refit']:.1f} s"


def block_summary_line(record: Mapping[str, Any]) -> str:
    """tune_scope "block": how many settings the blocks scored, the choices' spread, the held-out drift of the last
    block against the configured setting's there."""
    blocks = record["blocks"]
    if not blocks:
        return "tune (per block): no block was calibrated"
    spread = ", ".join(f"{k} {min(b['chosen'][k] for b in blocks):g}..{max(b['chosen'][k] for b in blocks):g}"
                       for k in record["searched"])
    last = blocks[-1]
    kept = sum(1 for b in blocks if b["chosen"] == record["start"])
    return (f"tune (per block): {sum(len(b['candidates']) for b in blocks)} setting(s) scored on held-out calibration "
            f"examples over {len(blocks)} block(s); chose {spread or 'the configured setting'} ({kept} block(s) kept "
            f"the configured one); last block's held-out drift {last['held_out_drift']:.4g} (configured setting "
            f"{last['start_drift']:.4g}); calibration {record['seconds']['calibration']:.1f} s")
