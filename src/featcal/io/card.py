"""The model card (README.md) of every merge and calibration output, written from its featcal.json report.

Why: a checkpoint shared on the hub without a card says nothing of where it came from; one that carries an
input's card (the base's, or mergekit's README describing a plain TIES merge) says something false. So the
card is always made anew, through huggingface_hub's ModelCard / ModelCardData (the hub's own metadata
schema: base_model, base_model_relation, library_name, tags), from what the report records: the recipe
(method, parameters, experts), and for a calibration its data, settings and per-block drift. The cards and
mergekit files an input carried are not copied (CARRIED_FILES); featcal.json keeps their sha256
(`replaced_input_files`), so the provenance is not lost.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from featcal.io.checkpoint import CARRIED_FILES
from featcal.io.report import file_sha256

CARD_NAME = "README.md"


def replaced_files(inputs: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    """`replaced_input_files` of featcal.json: each card or mergekit file found in an input folder
    (label -> folder), with its sha256 and, for a mergekit recipe, its text."""
    out: dict[str, dict[str, str]] = {}
    for label, folder in inputs.items():
        if not isinstance(folder, (str, Path)) or not Path(folder).is_dir():
            continue
        for name in CARRIED_FILES:
            f = Path(folder) / name
            if f.is_file():
                entry = {"from": label, "path": str(f), "sha256": file_sha256(f)}
                if name.startswith("mergekit_config") and f.stat().st_size <= 1 << 16:
                    entry["text"] = f.read_text(errors="replace")
                out[f"{label}/{name}"] = entry
    return out


def _name(entry: Any) -> str:
    if isinstance(entry, Mapping):
        return str(entry.get("hub_id") or entry.get("path") or entry.get("source") or "?")
    return str(entry)


def _hub_ids(report: Mapping[str, Any]) -> list[str]:
    """base_model metadata: the base, then the experts (what the hub links a merge's lineage by)."""
    inputs = report.get("inputs", {})
    names = [_name(inputs["base"])] if "base" in inputs else []
    names += [_name(e) for e in inputs.get("experts", {}).values()]
    return list(dict.fromkeys(names))


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _recipe(params: Mapping[str, Any], experts: Mapping[str, Any]) -> str:
    method = params.get("method", "?")
    shown = {k: v for k, v in params.items() if k != "method"}
    weights = shown.pop("weights", {}) or {}
    densities = shown.pop("densities", {}) or {}
    drops = shown.pop("drop_rates", {}) or {}
    rows = []
    for name, entry in experts.items():
        row = [f"`{name}`", f"`{_name(entry)}`", weights.get(name, 1.0)]
        if "density" in params:
            row.append(densities.get(name, params["density"]))
        if "drop_rate" in params:
            row.append(drops.get(name, params["drop_rate"]))
        rows.append(row)
    header = ["expert", "checkpoint", "weight"] + (["density"] if "density" in params else []) + (
        ["drop rate"] if "drop_rate" in params else [])
    settings = "\n".join(f"- `{k}`: `{json.dumps(v)}`" for k, v in shown.items()) or "- (none)"
    return f"Method: **{method}**\n\nParameters:\n{settings}\n\n{_table(header, rows)}\n"


def _drift(drift: list[Mapping[str, Any]] | None) -> str:
    if not drift:
        return "(no per-block drift recorded)\n"
    rows = []
    for r in drift:
        label = f"{r['stack']}.{r['layer']}" if "stack" in r and "layer" in r else str(r.get("block", "?"))
        before, after = float(r["before"]), float(r["after"])
        change = f"{100.0 * (after - before) / before:+.1f} %" if before else "n/a"
        rows.append([label, f"{before:.4g}", f"{after:.4g}", change])
    return _table(["block", "drift before", "drift after", "change"], rows) + "\n"


def _calibration(report: Mapping[str, Any]) -> str:
    inputs, params = report.get("inputs", {}), report.get("params", {})
    rows = [[f"`{t}`", f"`{d.get('source', '?')}`", d.get("kind", "?"), d.get("examples", "?")]
            for t, d in inputs.get("calibration", {}).items()]
    parts = ["## Calibration (FeatCal)\n",
             "The merged model was calibrated toward its experts block by block, in closed form, on the unlabeled "
             "data below (FeatCal, arXiv 2605.13030).\n",
             "### Data\n", _table(["task", "source", "format", "examples"], rows) + "\n"]
    tuning = report.get("tuning")
    keys = ("lambda_ratio", "anchor_blend_rho", "teacher_interp_alpha", "covariance_eps", "calibrate_bias",
            "calibrate_layernorm", "num_calibration_examples", "seed", "bias_solve", "block_statistics",
            "calibrate_final_norm", "calibrate_stem_norm")
    settings = "\n".join(f"- `{k}`: `{json.dumps(params[k])}`" for k in keys if k in params)
    parts += ["### Settings\n", settings + "\n"]
    if tuning:
        chosen = {k: v for k, v in tuning.get("chosen", {}).items()
                  if k in ("merge_scaling", "anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha")}
        parts.append("Tuned (`tune: true`): chose " + ", ".join(f"`{k}` = {v:g}" for k, v in chosen.items()
                                                               if v is not None) + " by held-out drift.\n")
    parts += ["### Per-block drift\n", "Distance of the merged model's block outputs from the experts' "
              "(before: the merge; after: calibrated).\n", _drift(report.get("drift"))]
    return "\n".join(parts)


def _merge_of_merged(replaced: Mapping[str, Mapping[str, str]], merged_report: Mapping[str, Any] | None) -> str:
    """How the calibrated merge was made: featcal's own report of it, or the mergekit recipe it carried."""
    if merged_report and merged_report.get("command") == "merge":
        return "## The merge\n\n" + _recipe(merged_report.get("params", {}),
                                            merged_report.get("inputs", {}).get("experts", {}))
    recipes = [e for e in replaced.values() if "text" in e]
    if recipes:
        return ("## The merge\n\nThe calibrated merge was made with mergekit from this configuration (its "
                f"README and configuration file are not carried over; sha256 in featcal.json):\n\n```yaml\n"
                f"{recipes[0]['text'].rstrip()}\n```\n")
    return ""


def build_card(report: Mapping[str, Any], merged_report: Mapping[str, Any] | None = None):
    """The huggingface_hub ModelCard of an output, from its report (and, for a calibration, the merged input's
    own featcal.json when it has one)."""
    from huggingface_hub import ModelCard, ModelCardData

    command = report.get("command")
    params = report.get("params", {})
    method = params.get("method") if command == "merge" else (merged_report or {}).get("params", {}).get("method")
    tags = ["merge", "featcal"] + ([str(method)] if method else []) + (["featcal-calibrated"] if command ==
                                                                       "calibrate" else [])
    data = ModelCardData(base_model=_hub_ids(report), base_model_relation="merge", library_name="transformers",
                         tags=list(dict.fromkeys(tags)))
    inputs = report.get("inputs", {})
    replaced = report.get("replaced_input_files", {})
    title = "Calibrated merge" if command == "calibrate" else "Merge"
    body = [f"# {title}\n",
            f"Made with [featcal](https://arxiv.org/abs/2605.13030) (`featcal {command}`); the full record, with "
            "every input's sha256 and the versions used, is in `featcal.json`.\n",
            f"Base model: `{_name(inputs.get('base', '?'))}`\n"]
    if command == "merge":
        body += ["## Recipe\n", _recipe(params, inputs.get("experts", {}))]
    else:
        body += [_merge_of_merged(replaced, merged_report),
                 "## Experts\n", "\n".join(f"- `{t}`: `{_name(e)}`" for t, e in inputs.get("experts", {}).items())
                 + "\n", _calibration(report)]
    out = report.get("output", {})
    extras = []
    if out.get("dtype"):
        extras.append(f"- weights stored as `{out['dtype']}`")
    tok = report.get("tokenizer")
    if tok:
        extras.append(f"- tokenizer from {tok.get('source', 'base')}" + (
            f", chat template from {tok['chat_template_from']}" if tok.get("chat_template_from") else ""))
    heads = report.get("task_heads")
    if heads:
        extras.append("- the experts' task heads differ (different label sets): each task's head is in `heads/` "
                      "with its label map; the merged model's own head is the method's merge of them "
                      "(docs/outputs.md)")
    if extras:
        body += ["## Output\n", "\n".join(extras) + "\n"]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body))


def write_card(directory: str | Path, report: Mapping[str, Any], merged_report: Mapping[str, Any] | None = None,
               ) -> Path:
    """README.md in `directory` (an output being written: the atomic temporary folder)."""
    path = Path(directory) / CARD_NAME
    path.write_text(str(build_card(report, merged_report)), encoding="utf-8")
    return path
