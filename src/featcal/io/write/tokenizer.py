"""Which tokenizer (and chat template) an output carries.

Why: a merge used to carry the base's tokenizer files only, so merging instruct experts over a base without
a chat template dropped the template, and chat use (`lm_eval --apply_chat_template`) broke. The rule:

- the output carries the base's tokenizer;
- where the base lacks something every expert has and they all agree on, it is taken from them: the whole
  tokenizer when the base ships none, the chat template when the base has none;
- experts that disagree there (different templates, or some with one and some without) stop the run before
  any work, unless `tokenizer_source` (--tokenizer-source) picks one: 'base' (its files as they are) or an
  expert's name (that expert's tokenizer files, chat template included);
- featcal.json's `tokenizer` records what was used and where it came from.

Templates are read where transformers writes them: chat_template.jinja, the `chat_template` key of
tokenizer_config.json, or chat_template.json (processors).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from featcal.errors import ConfigError
from featcal.io.read.checkpoint import TOKENIZER_FILES

TEMPLATE_FILE = "chat_template.jinja"
# every file that is part of a tokenizer (io/read/vocab.py's list, plus the processors' template file)
TOKENIZER_PARTS = (*TOKENIZER_FILES, "special_tokens_map.json", "added_tokens.json", "merges.txt", TEMPLATE_FILE,
                   "chat_template.json")


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def chat_template(folder: Path | None) -> Any:
    """The chat template a checkpoint folder ships (a string, or transformers' named list / dict), None if none."""
    if folder is None:
        return None
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text()
    for name in ("tokenizer_config.json", "chat_template.json"):
        value = _json(folder / name).get("chat_template") if (folder / name).is_file() else None
        if value:
            return value
    return None


def tokenizer_fingerprint(folder: Path | None) -> str | None:
    """sha256 of a folder's tokenizer files without their chat template (None: it ships no tokenizer)."""
    if folder is None or not any((folder / n).is_file() for n in TOKENIZER_FILES):
        return None
    h = hashlib.sha256()
    for name in TOKENIZER_PARTS:
        f = folder / name
        if not f.is_file() or name in (TEMPLATE_FILE, "chat_template.json"):
            continue
        data = f.read_bytes()
        if name == "tokenizer_config.json":
            config = _json(f)
            config.pop("chat_template", None)
            data = json.dumps(config, sort_keys=True).encode()
        h.update(name.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def _label(name: str) -> str:
    return "base" if name == "base" else f"expert {name!r}"


def _agreed(values: Mapping[str, Any], what: str, flag_hint: str) -> tuple[Any, list[str]]:
    """The one value every expert has (None where none has one), or a ConfigError naming who disagrees."""
    having = {n: v for n, v in values.items() if v is not None}
    if not having:
        return None, []
    distinct = {json.dumps(v, sort_keys=True) for v in having.values()}
    if len(distinct) == 1 and len(having) == len(values):
        return next(iter(having.values())), list(having)
    lacking = [n for n in values if n not in having]
    detail = (f"{len(distinct)} different ones among {', '.join(having)}" if len(distinct) > 1
              else f"{', '.join(having)} ship one, {', '.join(lacking)} none")
    raise ConfigError(f"the base has no {what} and the experts disagree ({detail}); pick whose tokenizer the output "
                      f"carries with {flag_hint}")


@dataclass
class TokenizerPlan:
    """Whose tokenizer files the output carries, and a chat template added from the experts."""

    source: str = "base"  # 'base' or an expert's name
    folders: dict[str, Path | None] = field(default_factory=dict, repr=False)
    template: Any = None  # added to the base's tokenizer: every expert's (agreed) chat template
    template_from: list[str] = field(default_factory=list)
    chosen_by: str = "default"  # or 'tokenizer_source', 'experts agree'

    def write(self, directory: Path) -> None:
        """Make `directory`'s tokenizer files this plan's (the base's side files are already there)."""
        if self.source != "base":
            src = self.folders[self.source]
            for name in TOKENIZER_PARTS:  # the base's tokenizer files go: the expert's is a whole tokenizer
                (directory / name).unlink(missing_ok=True)
            for name in TOKENIZER_PARTS:
                if src is not None and (src / name).is_file():
                    shutil.copy2(src / name, directory / name)
        if self.template is None:
            return
        if isinstance(self.template, str):
            (directory / TEMPLATE_FILE).write_text(self.template)
        else:  # transformers' named templates live in tokenizer_config.json
            config_file = directory / "tokenizer_config.json"
            config = _json(config_file) if config_file.is_file() else {}
            config["chat_template"] = self.template
            config_file.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    def report(self, directory: Path | None = None) -> dict[str, Any]:
        """featcal.json's `tokenizer`: where the files and the template came from, and how it was decided."""
        out: dict[str, Any] = {"source": _label(self.source), "chosen_by": self.chosen_by}
        if self.template_from:
            out["chat_template_from"] = ", ".join(_label(n) for n in self.template_from)
        if directory is not None:
            tpl = chat_template(directory)
            out["chat_template"] = tpl is not None
            if tpl is not None:
                out["chat_template_sha256"] = hashlib.sha256(json.dumps(tpl, sort_keys=True).encode()).hexdigest()
        return out


def plan_tokenizer(base: Path | None, experts: Mapping[str, Path | None], source: str | None = None,
                   flag_hint: str = "--tokenizer-source base|NAME") -> TokenizerPlan:
    """The tokenizer rule of the module docstring; `base` / `experts`: their checkpoint folders (None for an
    input without one: an in-memory model). Refusals come before any work."""
    folders = {"base": base, **experts}
    if source is not None:
        if source != "base" and source not in experts:
            raise ConfigError(f"tokenizer_source {source!r} is neither base nor an expert (experts: "
                              f"{', '.join(experts)})")
        if tokenizer_fingerprint(folders[source]) is None:
            raise ConfigError(f"tokenizer_source {source!r}: {_label(source)} ships no tokenizer files")
        return TokenizerPlan(source, folders, chosen_by="tokenizer_source")
    plan = TokenizerPlan("base", folders)
    experts = {n: d for n, d in experts.items() if d is not None}  # an in-memory expert ships no files to compare
    if tokenizer_fingerprint(base) is None:
        prints = {n: tokenizer_fingerprint(d) for n, d in experts.items()}
        if any(p is not None for p in prints.values()):
            _, agreeing = _agreed(prints, "tokenizer", flag_hint)
            _, plan.template_from = _agreed({n: chat_template(d) for n, d in experts.items()}, "chat template",
                                            flag_hint)
            plan.source, plan.chosen_by = agreeing[0], "experts agree"
            return plan  # the expert's files carry its template, which the others share
    if chat_template(base) is None:
        template, agreeing = _agreed({n: chat_template(d) for n, d in experts.items()}, "chat template", flag_hint)
        if template is not None:
            plan.template, plan.template_from, plan.chosen_by = template, agreeing, "experts agree"
    return plan


def input_folder(item: Any, source: Any = None) -> Path | None:
    """The folder an input was read from (the item itself, else its opened source's path), None if none."""
    for candidate in (item, getattr(source, "path", None)):
        if isinstance(candidate, (str, Path)) and Path(candidate).expanduser().is_dir():
            return Path(candidate).expanduser()
    return None
