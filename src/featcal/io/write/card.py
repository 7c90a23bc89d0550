"""The model card (README.md) of every merge and calibration output, written from its featcal.json report.

Why: a checkpoint shared on the hub without a card says nothing of where it came from; one that carries an
input's card (the base's, or mergekit's README describing a plain TIES merge) says something false. So the
card is always made anew, through huggingface_hub's ModelCard / ModelCardData (the hub's own metadata
schema: base_model, base_model_relation, library_name, tags), from what the report records: the recipe
(method, parameters, experts), and for a calibration its data, settings and per-block drift. The cards and
mergekit files an input carried are not copied (CARRIED_FILES); featcal.json keeps their sha256
(`replaced_input_files`), so the provenance is not lost.

Inputs are named by hub id, never by a machine's path: a card pushed to the hub would leak it, and `base_model`
metadata that is no hub id breaks the hub's merge lineage. An input's hub id (`find_hub_ids`): the one given
(`--hub-id ROLE=ID`, a run file's `hub_id:`, `hub_id=`), else the input's own record: a hub cache path
(`.../models--org--name/snapshots/...`, what a hub id given as the input resolves to), else its config.json's
`_name_or_path` where that is a hub id `org/name` (an expert's naming the base's id, or another expert's, names
what it was fine-tuned from, not itself, and is not taken). featcal.json records each id and where it came from.
`base_model` lists the ids found; an input without one is named in the card's text by its path relative to the
folder holding the output, or by its folder's name where it lies elsewhere, and the card says so.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from featcal.errors import ConfigError
from featcal.io.read.checkpoint import CARRIED_FILES
from featcal.io.read.hashes import file_sha256

CARD_NAME = "README.md"
BASE_ROLE = "base"  # the --hub-id role of the base; an expert's role is its name
# a hub snapshot in the cache: HF_HOME/hub/models--ORG--NAME/snapshots/REVISION/...
_HUB_CACHE = re.compile(r"(?:^|/)models--(?P<id>[^/]+)/snapshots(?:/|$)")
# an absolute path in a carried mergekit recipe's text: a file:// URL; a POSIX root that starts no URL's //host and
# follows no name or path (`org/name` is a hub id); ~/ or ~user/; a Windows drive (C:\ or C:/) or a UNC \\server\
_ABSOLUTE = re.compile(r"file://[^\s'\",\])}]*"
                       r"|(?<![\w.~/\\-])/(?!/)[^\s'\",\])};:]*"
                       r"|(?<![\w.~/\\-])~[\w.-]*/[^\s'\",\])};]*"
                       r"|(?<![\w.])[A-Za-z]:[\\/][^\s'\",\])};]*"
                       r"|(?<![\w.\\/])\\\\[^\s'\",\])};]*")


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


def is_hub_id(text: Any) -> bool:
    """Whether `text` is a valid hub repository id (`name` or `org/name`)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(text, str) or not text or text.startswith((".", "~")):
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def check_hub_ids(given: Mapping[str, str] | None, experts: Iterable[str]) -> dict[str, str]:
    """The `--hub-id ROLE=ID` pairs, refused (ConfigError, before any work) for a role that is neither the base
    nor an expert, an id that is no hub id, or the role `base` where an expert has that name."""
    given = dict(given or {})
    experts = list(experts)
    roles = [BASE_ROLE, *experts]
    for role, hub_id in given.items():
        if role not in roles:
            raise ConfigError(f"--hub-id {role}={hub_id}: {role!r} is neither {BASE_ROLE!r} nor an expert's name "
                              f"(roles: {', '.join(roles)})")
        if role == BASE_ROLE and BASE_ROLE in experts:
            raise ConfigError(f"--hub-id {role}={hub_id}: an expert is named {BASE_ROLE!r} too; rename that task")
        if not is_hub_id(hub_id):
            raise ConfigError(f"--hub-id {role}={hub_id}: {hub_id!r} is not a hub id (org/name)")
    return given


def _path_of(entry: Any) -> str | None:
    path = entry.get("path") if isinstance(entry, Mapping) else entry
    return None if path is None else str(path)


def _cached_hub_id(path: str | None) -> str | None:
    """ORG/NAME of a path inside the hub cache's models--ORG--NAME/snapshots/ (what a hub id resolves to)."""
    found = _HUB_CACHE.search(Path(path).as_posix()) if path else None
    hub_id = found.group("id").replace("--", "/", 1) if found else None
    return hub_id if is_hub_id(hub_id) else None


def _config_hub_id(path: str | None) -> str | None:
    """config.json's `_name_or_path` where it is a hub id ORG/NAME and no local folder (transformers 4 saved it,
    e.g. after `from_pretrained("org/name")`; transformers 5 writes none)."""
    config = Path(path) / "config.json" if path else None
    if config is None or not config.is_file():
        return None
    try:
        named = json.loads(config.read_text(encoding="utf-8")).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(named, str) or named.count("/") != 1 or not is_hub_id(named) or Path(named).exists():
        return None
    return named


def _inputs_by_role(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The base and the experts of a report's inputs, by --hub-id role."""
    return {**({BASE_ROLE: inputs[BASE_ROLE]} if BASE_ROLE in inputs else {}), **(inputs.get("experts") or {})}


def find_hub_ids(inputs: Mapping[str, Any], given: Mapping[str, str] | None = None) -> dict[str, tuple[str, str]]:
    """role -> (hub id, where it came from) for the base and each expert of a report's `inputs`, where one is known
    (the module docstring says how)."""
    given = given or {}
    by_role = _inputs_by_role(inputs)
    found: dict[str, tuple[str, str]] = {}
    for role, entry in by_role.items():
        recorded = entry.get("hub_id") if isinstance(entry, Mapping) else None
        recorded = recorded if is_hub_id(recorded) else None  # a record read from an input's featcal.json
        cached = _cached_hub_id(_path_of(entry))
        if role in given:
            found[role] = (given[role], "given")
        elif recorded:
            found[role] = (recorded, entry.get("hub_id_from", "recorded"))
        elif cached:
            found[role] = (cached, "hub cache path")
    named = {r: _config_hub_id(_path_of(e)) for r, e in by_role.items() if r not in found}
    if named.get(BASE_ROLE):  # the base's own first: an expert whose config names it names its own base
        found[BASE_ROLE] = (named[BASE_ROLE], "config _name_or_path")
    taken = {hub_id for hub_id, _ in found.values()}
    by_experts = [n for r, n in named.items() if r != BASE_ROLE and n]
    for role, hub_id in named.items():
        if role != BASE_ROLE and hub_id and hub_id not in taken and by_experts.count(hub_id) == 1:
            found[role] = (hub_id, "config _name_or_path")
    return found


def add_hub_ids(report: dict[str, Any], given: Mapping[str, str] | None = None) -> list[str]:
    """Record in the report's inputs (featcal.json) each input's hub id and where it came from; returns the ids,
    the base's first (the card's `base_model`)."""
    entries = _inputs_by_role(report.get("inputs", {}))
    found = find_hub_ids(report.get("inputs", {}), given)
    for role, (hub_id, source) in found.items():
        if isinstance(entries[role], dict):
            entries[role].update(hub_id=hub_id, hub_id_from=source)
    return list(dict.fromkeys(found[role][0] for role in entries if role in found))


class _Names:
    """How the card names inputs and data: by hub id, else by a path relative to the folder holding the output,
    else by the folder's name alone; never by a machine's absolute path. `local` says whether a path was shown."""

    def __init__(self, output: Any) -> None:
        self.home = Path(output).expanduser().absolute().parent if output else None
        self.local = False

    def path(self, path: Any) -> str:
        text = str(path)
        p = Path(text).expanduser()
        if not p.is_absolute() and not p.exists():
            return text  # no local path: a hub (dataset) id as given, or a path relative to another run
        self.local = True
        if self.home is not None and p.absolute().is_relative_to(self.home):
            return Path(os.path.relpath(p.absolute(), self.home)).as_posix()
        return p.name if p.is_absolute() else Path(os.path.normpath(text)).as_posix()

    def __call__(self, entry: Any) -> str:
        if isinstance(entry, Mapping):
            if is_hub_id(entry.get("hub_id")):  # an input's featcal.json may say anything
                return str(entry["hub_id"])
            where = entry.get("path") or entry.get("source")
            return "?" if where is None else self.path(where)
        return self.path(entry)

    def redact(self, text: str) -> str:
        """`text` (a carried recipe) with each absolute path named as `path` names it: a POSIX one found here,
        else by its last component (a Windows or UNC path, ~user/, a file:// URL; issue 49)."""
        return _ABSOLUTE.sub(lambda m: self._redacted(m.group(0)), text)

    def _redacted(self, found: str) -> str:
        text = found.removeprefix("file://")
        if text.startswith("/") and not text.startswith("//") and not text.startswith("~"):
            return self.path(text)
        self.local = True
        return PureWindowsPath(text).name if "\\" in text or re.match(r"[A-Za-z]:", text) else PurePosixPath(text).name


def _code(text: Any) -> str:
    """`text` as inline code inside a Markdown table cell or list: on one line, fenced by more backticks than any
    run of them in it, `|` escaped (GitHub's tables split on it even inside code)."""
    text = " ".join(str(text).split())
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def _cell(value: Any) -> str:
    """A plain table cell: on one line, `|` escaped."""
    return " ".join(str(value).split()).replace("|", "\\|")


def _table(header: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table; the cells are written with `_code` or `_cell`, or are numbers."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _mapping(value: Any) -> Mapping[str, Any]:
    """`value` where it is a mapping, else an empty one: a merged input's featcal.json is read as it comes."""
    return value if isinstance(value, Mapping) else {}


def _recipe(params: Mapping[str, Any], experts: Mapping[str, Any], names: _Names) -> str:
    params, experts = _mapping(params), _mapping(experts)
    method = params.get("method", "?")
    shown = {k: v for k, v in params.items() if k != "method"}
    weights = _mapping(shown.pop("weights", {}))
    densities = _mapping(shown.pop("densities", {}))
    drops = _mapping(shown.pop("drop_rates", {}))
    rows = []
    for name, entry in experts.items():
        row = [_code(name), _code(names(entry)), _cell(weights.get(name, 1.0))]
        if "density" in params:
            row.append(_cell(densities.get(name, params["density"])))
        if "drop_rate" in params:
            row.append(_cell(drops.get(name, params["drop_rate"])))
        rows.append(row)
    header = ["expert", "checkpoint", "weight"] + (["density"] if "density" in params else []) + (
        ["drop rate"] if "drop_rate" in params else [])
    settings = "\n".join(f"- {_code(k)}: {_code(names.redact(json.dumps(v, default=str)))}"
                         for k, v in shown.items()) or "- (none)"
    return f"Method: **{_cell(method)}**\n\nParameters:\n{settings}\n\n{_table(header, rows)}\n"


def _drift(drift: list[Mapping[str, Any]] | None) -> str:
    if not drift:
        return "(no per-block drift recorded)\n"
    rows = []
    for r in drift:
        label = f"{r['stack']}.{r['layer']}" if "stack" in r and "layer" in r else str(r.get("block", "?"))
        before, after = float(r["before"]), float(r["after"])
        change = f"{100.0 * (after - before) / before:+.1f} %" if before else "n/a"
        rows.append([_cell(label), f"{before:.4g}", f"{after:.4g}", change])
    return _table(["block", "drift before", "drift after", "change"], rows) + "\n"


def _calibration(report: Mapping[str, Any], names: _Names) -> str:
    inputs, params = report.get("inputs", {}), report.get("params", {})
    # the data's record (data/): "format" (text, jsonl, csv, ...), "examples"
    rows = [[_code(t), _code(names.path(d.get("source", "?"))), _cell(d.get("format", "?")),
             _cell(d.get("examples", "?"))] for t, d in inputs.get("calibration", {}).items()]
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


def _merge_of_merged(replaced: Mapping[str, Mapping[str, str]], merged_report: Mapping[str, Any] | None,
                     names: _Names) -> str:
    """How the calibrated merge was made: featcal's own report of it, or the mergekit recipe it carried."""
    if isinstance(merged_report, Mapping) and merged_report.get("command") == "merge":
        return "## The merge\n\n" + _recipe(merged_report.get("params", {}),
                                            _mapping(merged_report.get("inputs")).get("experts", {}), names)
    recipes = [e for e in replaced.values() if "text" in e]
    if recipes:
        text = names.redact(recipes[0]["text"].rstrip())
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))  # stays shut
        return ("## The merge\n\nThe calibrated merge was made with mergekit from this configuration (its "
                f"README and configuration file are not carried over; sha256 in featcal.json):\n\n{fence}yaml\n"
                f"{text}\n{fence}\n")
    return ""


_LOCAL_NOTE = ("Inputs without a hub id are named by their local path, relative to the folder holding this model's "
               "folder, or by their folder's name where they lie elsewhere: not hub ids, and not in `base_model`. "
               "`--hub-id ROLE=ID` (a run file's `hub_id:`) names them by hub id.\n")


def _output_notes(report: Mapping[str, Any]) -> list[str]:
    """The card's "Output" section: the dtype, the tokenizer's source, the per-task heads."""
    out = report.get("output", {})
    extras = []
    if out.get("dtype"):
        extras.append(f"- weights stored as `{out['dtype']}`")
    tok = report.get("tokenizer")
    if tok:
        extras.append(f"- tokenizer from {tok.get('source', 'base')}" + (
            f", chat template from {tok['chat_template_from']}" if tok.get("chat_template_from") else ""))
    if report.get("task_heads"):
        extras.append("- the experts' task heads differ (different label sets): each task's head is in `heads/` "
                      "with its label map; the merged model's own head is the method's merge of them "
                      "(docs/outputs.md)")
    return ["## Output\n", "\n".join(extras) + "\n"] if extras else []


def build_card(report: Mapping[str, Any], merged_report: Mapping[str, Any] | None = None,
               hub_ids: list[str] | None = None):
    """The huggingface_hub ModelCard of an output, from its report (and, for a calibration, the merged input's
    own featcal.json when it has one). `hub_ids`: the `base_model` metadata (default: those the report records)."""
    from huggingface_hub import ModelCard, ModelCardData

    command = report.get("command")
    params = report.get("params", {})
    method = params.get("method") if command == "merge" else _mapping(_mapping(merged_report).get("params")).get(
        "method")
    method = method if isinstance(method, str) and re.fullmatch(r"[\w.+-]{1,64}", method) else None  # a tag, no text
    tags = ["merge", "featcal"] + ([method] if method else []) + (["featcal-calibrated"] if command ==
                                                                       "calibrate" else [])
    inputs = report.get("inputs", {})
    hub_ids = hub_ids if hub_ids is not None else [hub_id for hub_id, _ in find_hub_ids(inputs).values()]
    data = ModelCardData(base_model=list(dict.fromkeys(hub_ids)) or None,
                         base_model_relation="merge" if hub_ids else None, library_name="transformers",
                         tags=list(dict.fromkeys(tags)))
    names = _Names(report.get("output", {}).get("path"))
    title = "Calibrated merge" if command == "calibrate" else "Merge"
    body = [f"Base model: {_code(names(inputs.get('base', '?')))}\n"]
    if command == "merge":
        body += ["## Recipe\n", _recipe(params, inputs.get("experts", {}), names)]
    else:
        body += [_merge_of_merged(report.get("replaced_input_files", {}), merged_report, names), "## Experts\n",
                 "\n".join(f"- {_code(t)}: {_code(names(e))}" for t, e in inputs.get("experts", {}).items()) + "\n",
                 _calibration(report, names)]
    intro = [f"# {title}\n",
             f"Made with [featcal](https://arxiv.org/abs/2605.13030) (`featcal {command}`); the full record, with "
             "every input's sha256 and the versions used, is in `featcal.json`.\n"] + (
                 [_LOCAL_NOTE] if names.local else [])
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(intro + body + _output_notes(report)))


def write_card(directory: str | Path, report: dict[str, Any], merged_report: Mapping[str, Any] | None = None,
               hub_ids: Mapping[str, str] | None = None) -> Path:
    """README.md in `directory` (an output being written: the atomic temporary folder). Records each input's hub
    id in `report` first (`add_hub_ids`; `hub_ids`: role -> id given), so write the report after the card."""
    path = Path(directory) / CARD_NAME
    ids = add_hub_ids(report, hub_ids)
    path.write_text(str(build_card(report, merged_report, ids)), encoding="utf-8")
    return path
