"""Everything `featcal eval` checks before it runs a model: names, roles, kinds, data, pairs.

The models come by role (--base, --merged, --calibrated, --expert TASK=PATH, each expert scored on its
own task only) or by name (--model NAME=PATH); every model is scored on every task. Each model's kind is
read from its config, each task's data opened and its columns resolved, and every (model, task) pair
checked by its runner, so a missing column, a label map that does not fit or a model with no task
head is refused before the first forward; so are bare class ids that the models scored on one task number
differently (evaluation/labels.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from featcal.errors import ConfigError
from featcal.evaluation.data import EvalSet, read_eval_set
from featcal.evaluation.kinds import model_kind
from featcal.evaluation.options import EvalOptions
from featcal.evaluation.runners.base import ModelEntry, Runner

ROLES = ("base", "merged", "calibrated", "experts")
EXPERTS = "experts"


@dataclass
class EvalPlan:
    """The checked models, tasks, and which model is scored on which task."""

    entries: list[ModelEntry]
    sets: dict[str, EvalSet]
    runners: dict[str, Runner]  # entry name -> its runner
    pairs: list[tuple[ModelEntry, str]] = field(default_factory=list)

    def row_name(self, entry: ModelEntry) -> str:
        """The name a model has in the table and eval.json (every expert shares the `experts` row)."""
        return EXPERTS if entry.role == "expert" else entry.name

    def role_of(self, row: str) -> str | None:
        for e in self.entries:
            if self.row_name(e) == row:
                return "experts" if e.role == "expert" else e.role
        return None


def model_sources(models: Mapping[str, str | Path] | None, *, base, merged, calibrated,
                  experts: Mapping[str, str | Path] | None) -> list[tuple[str, str, str | Path, str | None]]:
    """(name, role, path or hub id, expert task) of every model, roles first; names checked."""
    out: list[tuple[str, str, str | Path, str | None]] = []
    for role, source in (("base", base), ("merged", merged), ("calibrated", calibrated)):
        if source is not None:
            out.append((role, role, source, None))
    for task, source in (experts or {}).items():
        out.append((f"{EXPERTS}[{task}]", "expert", source, task))
    for name, source in (models or {}).items():
        if name in ROLES or name.startswith(f"{EXPERTS}["):
            raise ConfigError(f"--model {name!r}: {name!r} is a role's name; pass that model as --{name} instead, or "
                              "give it another name")
        if not name or any(c in name for c in "|\n\r\t"):
            raise ConfigError(f"--model {name!r}: a model's name must be non-empty and hold no '|' or control "
                              "characters (it names a table row)")
        out.append((name, "model", source, None))
    if not out:
        raise ConfigError("no model to evaluate: give --model NAME=PATH, or the roles --base / --merged / "
                          "--calibrated / --expert TASK=PATH")
    return out


def _check_task_names(tasks: Mapping[str, str | Path], experts: Mapping[str, str | Path] | None) -> None:
    for name in tasks:
        if not name or any(c in name for c in "|\n\r\t/"):
            raise ConfigError(f"--task {name!r}: a task's name must be non-empty and hold no '|', '/' or control "
                              "characters")
    if tasks:
        orphans = [t for t in (experts or {}) if t not in tasks]
        if orphans:
            raise ConfigError(f"expert(s) for {', '.join(map(repr, orphans))} have no evaluation data: add "
                              f"--task {orphans[0]}=DATA (each expert is scored on its own task)")


def build_plan(tasks: Mapping[str, str | Path], models: Mapping[str, str | Path] | None, *, base, merged,
               calibrated, experts: Mapping[str, str | Path] | None, options: EvalOptions) -> EvalPlan:
    """Resolve and check everything (no model weight is read); see the module docstring."""
    from featcal.evaluation.runners import runner_for
    from featcal.io.read.checkpoint import resolve_checkpoint
    from featcal.io.read.models import load_config

    _check_task_names(tasks, experts)
    sources = model_sources(models, base=base, merged=merged, calibrated=calibrated, experts=experts)
    configs = {}
    for name, _, source, _ in sources:
        path = resolve_checkpoint(source, allow_pickle=options.allow_pickle)
        configs[name] = (path, load_config(path))
    base_entry = None
    if base is not None:
        base_kind = model_kind(configs["base"][1], name="base")
        base_entry = ModelEntry("base", "base", configs["base"][0], configs["base"][1], base_kind, str(base))
    zero_shot_base = base_entry is not None and base_entry.kind.name == "zero_shot"
    entries = []
    for name, role, source, task in sources:
        path, config = configs[name]
        kind = base_entry.kind if name == "base" and base_entry else model_kind(config, name=name,
                                                                                  zero_shot_base=zero_shot_base)
        entries.append(ModelEntry(name, role, path, config, kind, str(source), task))
    sets = {t: read_eval_set(t, d, text_column=options.text_column, label_column=options.label_column,
                             target_column=options.target_column, split=options.split,
                             max_examples=options.max_examples, seed=options.seed, text_unit=options.text_unit,
                             data_format=options.data_format) for t, d in tasks.items()}
    runners = {e.name: runner_for(e, options, text_model=base_entry) for e in entries}
    pairs = [(e, t) for e in entries for t in sets if e.role != "expert" or e.task == t]
    for entry, task in pairs:
        runners[entry.name].check(sets[task])
    _check_label_numbering(sets, runners, pairs)
    return EvalPlan(entries, sets, runners, pairs)


def _check_label_numbering(sets: Mapping[str, EvalSet], runners: Mapping[str, Runner],
                           pairs: list[tuple[ModelEntry, str]]) -> None:
    """Bare class ids must name one class to every model scored on a task (evaluation/labels.py)."""
    from featcal.evaluation.labels import check_same_numbering

    for task, data in sets.items():
        configs = {e.name: c for e, t in pairs if t == task and (c := runners[e.name].label_config(task)) is not None}
        if configs:
            check_same_numbering(data.labels(), data.label_names, configs, task=task)
