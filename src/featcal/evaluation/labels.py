"""A task's labels as the class ids of a classifier, with the label maps checked against its config.

A classifier's config names its classes (`id2label`). Labels given as names are looked up there; ids
that the data names (a ClassLabel feature, class sub-folders) are checked name by name against it, and
when the two maps hold the same names in another order, the data's ids are translated through the
names. Maps that do not fit are refused, both shown: scoring a model through the wrong label map gives a
wrong number and no error.

Bare class ids (no names in the data) mean, to each model, what its own id2label says. Where the models
scored on a task name one id differently, or where a model names its classes with other numbers (class
'1' at id 0), an id would be a different class to each reading, so the same model could score 67 % with
ids and 33 % with the same labels written as names: refused (check_same_numbering), naming the fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from featcal.errors import ConfigError, EvaluationDataError

log = logging.getLogger(__name__)


def model_classes(config) -> dict[int, str] | None:
    """The config's id -> class name, or None when it names none (transformers' LABEL_0, LABEL_1, ...)."""
    id2label = {int(k): str(v) for k, v in (getattr(config, "id2label", None) or {}).items()}
    if not id2label or all(v == f"LABEL_{k}" for k, v in id2label.items()):
        return None
    return id2label


def _shown(names: dict[int, str] | Sequence[str]) -> str:
    items = names.items() if isinstance(names, dict) else enumerate(names)
    return ", ".join(f"{i}={n}" for i, n in sorted(items))


def class_ids(labels: Sequence, label_names: Sequence[str] | None, config, *, task: str, model: str) -> list[int]:
    """Each label as the model's class id (see the module docstring); a refusal names both maps."""
    n_classes = int(getattr(config, "num_labels", 0) or len(getattr(config, "id2label", {}) or {}))
    named = model_classes(config)
    if named is not None and (all(isinstance(v, str) for v in labels) or label_names is not None):
        _refuse_repeated_names(named, task=task, model=model)  # names cannot then say which class is meant
    if all(isinstance(v, str) for v in labels):
        return _ids_of_names(labels, named, task=task, model=model)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        kinds = sorted({type(v).__name__ for v in labels})
        raise EvaluationDataError(f"task {task!r}: labels must be all class ids or all class names, found {', '.join(kinds)}")
    bad = sorted({v for v in labels if not 0 <= v < n_classes})
    if bad:
        raise EvaluationDataError(
            f"task {task!r}: label ids {bad[:5]} are outside model {model!r}'s {n_classes} classes (0..{n_classes - 1})"
        )
    if label_names is None or named is None:
        return list(labels)
    return _translated(list(labels), list(label_names), named, task=task, model=model)


def _refuse_repeated_names(named: dict[int, str], *, task: str, model: str) -> None:
    by_name: dict[str, list[int]] = {}
    for i, name in sorted(named.items()):
        by_name.setdefault(name.casefold(), []).append(i)
    repeated = {n: ids for n, ids in by_name.items() if len(ids) > 1}
    if repeated:
        name, ids = next(iter(repeated.items()))
        raise EvaluationDataError(
            f"task {task!r}: model {model!r}'s id2label names the class {name!r} {len(ids)} times (ids "
            f"{', '.join(map(str, ids))}), so labels read by name cannot say which is meant: fix id2label in its "
            "config.json, or give the labels as class ids"
        )


def _ids_of_names(labels: Sequence[str], named: dict[int, str] | None, *, task: str, model: str) -> list[int]:
    if named is None:
        raise EvaluationDataError(
            f"task {task!r}: the labels are class names ({', '.join(sorted(set(labels))[:5])}), but model {model!r}'s "
            "config names no classes (id2label is LABEL_0, LABEL_1, ...): set id2label in its config.json, or give "
            "the labels as class ids"
        )
    lookup = {name.casefold(): i for i, name in named.items()}
    unknown = sorted({v for v in labels if v.casefold() not in lookup})
    if unknown:
        raise EvaluationDataError(
            f"task {task!r}: labels {', '.join(map(repr, unknown[:5]))} are not classes of model {model!r} "
            f"(id2label: {_shown(named)})"
        )
    return [lookup[v.casefold()] for v in labels]


def _translated(labels: list[int], names: list[str], named: dict[int, str], *, task: str, model: str) -> list[int]:
    data_names = [n.casefold() for n in names]
    model_names = {i: n.casefold() for i, n in named.items()}
    if all(model_names.get(i) == n for i, n in enumerate(data_names)):
        return labels
    if sorted(data_names) != sorted(model_names.values()):
        raise EvaluationDataError(
            f"task {task!r}: the data's classes ({_shown(names)}) are not those of model {model!r} "
            f"(id2label: {_shown(named)}): the label maps differ, and scoring through either would be wrong"
        )
    to_model = {i: next(k for k, v in model_names.items() if v == n) for i, n in enumerate(data_names)}
    log.warning("task %r: the data numbers its classes %s, model %r %s; labels are translated by class name",
                task, _shown(names), model, _shown(named))
    return [to_model[v] for v in labels]


def check_same_numbering(labels: Sequence, label_names: Sequence[str] | None, configs: Mapping[str, Any], *,
                         task: str) -> None:
    """Refuse bare class ids that would not name the same class to every model scored on `task`.

    `configs`: model -> what reads its labels (a config with id2label). Labels given as names, or as ids the
    data names (a ClassLabel), are looked up by name in each model's map and need no check.
    """
    if label_names is not None or not all(isinstance(v, int) and not isinstance(v, bool) for v in labels):
        return
    used = sorted(set(labels))
    named = {m: classes for m, c in configs.items() if (classes := model_classes(c)) is not None}
    for model, classes in named.items():
        by_name = {n.strip(): k for k, n in classes.items()}
        bad = next((i for i in used if by_name.get(str(i), i) != i), None)
        if bad is not None:
            raise ConfigError(
                f"task {task!r}: the labels are class ids, and model {model!r} names its classes with other numbers "
                f"(id2label: {_shown(classes)}), so the label {bad} could mean id {bad} or the class named '{bad}' (id "
                f"{by_name[str(bad)]}): give the labels as strings (class names), or rename the classes in its "
                "config.json"
            )
    for i in used:
        meaning = {m: classes[i].casefold() for m, classes in named.items() if i in classes}
        first = next(iter(meaning), None)
        other = next((m for m in meaning if meaning[m] != meaning[first]), None)
        if other is not None:
            raise ConfigError(
                f"task {task!r}: the labels are class ids, but the models number their classes differently "
                f"({first}: {_shown(named[first])}; {other}: {_shown(named[other])}), so id {i} is a different class "
                "to each and their scores would not be comparable: give the labels as class names (or a ClassLabel "
                "feature naming the ids), which each model looks up in its own id2label, or correct the id2label "
                "that is wrong"
            )
