"""The one front door to the checkpoints of a merge or a calibration: `open_family(base, experts, merged)`.

Every input is opened by what it is, in one place (`open_input`): a checkpoint folder or hub id, a model in
memory, a LoRA / PEFT adapter applied to the base (io/read/lora.py), a GGUF file, dequantised (io/read/gguf.py), each
as a TensorSource (io/read/tensor_source.py). The family then gives each consumer the view it reads:

- the streaming merge, tensor by tensor (`merge_view`): base and experts under one naming (io/read/layouts.py),
  experts with a grown vocabulary cut to the base's rows, and the plan that grows the merge back (io/read/vocab.py);
- the checks before a calibration (`check_model_types`, `check_consistent`): every input against the merge
  (or the base), its config, tensor names, shapes and architecture-defining fields, from headers only;
- the calibration, block by block (`param_sources`): each expert's and the base's parameters by the merged
  model's names, shapes and (optionally) finite values checked before any forward;
- the merges computed on whole models (`load_source_model`);
- `scan_finite`: every tensor of every input read once, one at a time.

Before this module merge and calibrate each had their own dispatch over these kinds of inputs (three in all);
a rule about one kind of input (which folder is an adapter, when a GGUF header is enough) now lives here once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from featcal.errors import CheckpointError
from featcal.io.read.checkpoint import CheckpointReader, check_copied_links
from featcal.io.read.gguf import GGUFHeader, GGUFSource, gguf_file, open_gguf
from featcal.io.read.layouts import RenamedSource, harmonise, load_view
from featcal.io.read.lora import LoraSource, kind_record, open_adapter, reads_as_adapter
from featcal.io.read.models import check_loadable, load_model
from featcal.io.read.param_sources import CheckpointSource, ModelSource, validate_source
from featcal.io.read.sources import ModuleSource, UnmappedReader
from featcal.io.read.tensor_source import TensorSource
from featcal.io.read.validate import (
    check_expert_layout,
    check_same_config,
    check_same_fields,
    check_same_tensors,
    first_non_finite,
    scan_finite,
)
from featcal.io.read.vocab import VocabPlan, grown_vocabulary, pad_param_sources, vocab_rows_view

log = logging.getLogger(__name__)

Input = Union[str, os.PathLike, nn.Module, TensorSource]
BaseRef = Union[TensorSource, Callable[[], TensorSource], None]  # the base, opened now or when first needed
MERGED, BASE = "merged", "base"


def expert_label(task: str) -> str:
    """How an expert is named in messages and in a family's tables: "expert 'mnist'"."""
    return f"expert {task!r}"


def open_input(
    item: Input, *, label: str, allow_pickle: bool = False, base: BaseRef = None, kind: str | None = None,
    may_be_adapter: bool | None = None, header_only: bool = False,
) -> TensorSource:
    """One input opened by what it is; errors name it (`label`, e.g. "expert 'mnist'").

    A LoRA / PEFT adapter folder is an expert over `base` (io/read/lora.py); a folder holding an adapter and full
    weights is refused unless `kind` ("full" / "adapter") says which to read (`reads_as_adapter`).
    `may_be_adapter` (default: whether a base is given) is False for inputs that are models of their own (the
    base, a merge), which read such a folder as its full weights. A `.gguf` file (or a folder holding one) is
    dequantised, or with `header_only` only its names, shapes and config are read; its header is compared
    first with the base's, when the base is given opened (a callable `base` is opened only for an adapter). Anything else is a checkpoint folder or hub id, read one tensor at a time.
    """
    if isinstance(item, TensorSource):
        return item
    if isinstance(item, nn.Module):
        return ModuleSource(item, label=f"<in-memory {type(item).__name__} ({label})>")
    adapter = reads_as_adapter(item, label, kind, may_be_adapter=base is not None if may_be_adapter is None
                               else may_be_adapter)
    if adapter:
        if base is None:
            raise CheckpointError(
                f"{label}: {item} is a LoRA/PEFT adapter, not a model; give the model it was trained on as the base"
            )
        return open_adapter(item, _opened(base), label, allow_pickle=allow_pickle)
    try:
        gguf = gguf_file(item)
    except CheckpointError as exc:
        raise CheckpointError(f"{label}: {exc}") from None
    if gguf is not None:  # compared with a base opened already (not opened for it: a GGUF base is dequantised)
        return open_gguf(gguf, label, base if isinstance(base, TensorSource) else None, header_only=header_only)
    if isinstance(item, (str, os.PathLike)):
        try:
            return UnmappedReader(item, allow_pickle=allow_pickle)
        except CheckpointError as exc:
            raise CheckpointError(f"{label}: {exc}") from None
    raise CheckpointError(
        f"{label}: expected a checkpoint path, hub id or torch.nn.Module, got {type(item).__name__}"
    )


def _opened(base: BaseRef) -> TensorSource:
    return base if isinstance(base, TensorSource) else base()


def is_gguf(source: TensorSource) -> bool:
    return isinstance(source, (GGUFSource, GGUFHeader))


def describe_kind(source: TensorSource) -> dict[str, Any]:
    """What featcal.json says of an input that is no plain checkpoint: a LoRA adapter, a dequantised GGUF file,
    a folder holding adapter files read as its full weights ({} for any other)."""
    if isinstance(source, LoraSource):
        return {"lora_adapter": True}
    if is_gguf(source):
        return {"dequantised_from_gguf": True}
    if isinstance(source, CheckpointReader):
        return kind_record(source.path, False)
    return {}


def load_source_model(source: TensorSource, label: str, allow_pickle: bool = False) -> nn.Module:
    """An opened input as a whole model (the merges computed on whole models, RegMean and WUDI): an in-memory
    model as given, a view (another layout, a LoRA adapter over its base) built from its tensors, a checkpoint
    folder through featcal's safe loader."""
    if isinstance(source, ModuleSource):
        return source.module
    try:
        if isinstance(source, RenamedSource):  # read under other names (a CLIPModel base's vision tower, ...)
            return load_view(source)
        return load_model(source.path, allow_pickle=allow_pickle)
    except CheckpointError as exc:
        raise CheckpointError(f"{label}: {exc}") from None


class InputFamily:
    """A base, its experts and possibly a merge of them, each opened once (on first use) by `open_input`.

    Inputs are known by label: "merged", "base", "expert 'NAME'" (`expert_label`); `names` say how messages
    call them (the CLI's checks say "base model"). Experts that are adapters are applied to the family's base.
    """

    def __init__(self, items: Mapping[str, Input], tasks: Mapping[str, str], *, allow_pickle: bool = False,
                 expert_kind: Mapping[str, str] | None = None, header_only: bool = False,
                 names: Mapping[str, str] | None = None) -> None:
        self.items = dict(items)
        self.task_of = dict(tasks)  # expert label -> task name
        self.tasks = list(self.task_of.values())
        self.allow_pickle = allow_pickle
        self.expert_kind = dict(expert_kind or {})
        self.header_only = header_only
        self.names = {label: label for label in self.items} | dict(names or {})
        self._sources: dict[str, TensorSource] = {}
        self._full: dict[str, TensorSource] = {}

    # --- the opened inputs --------------------------------------------------------------------------
    def source(self, label: str) -> TensorSource:
        """Input `label`, opened the first time it is asked for."""
        if label not in self._sources:
            self._sources[label] = self._open(label, self.header_only, self.source)
        return self._sources[label]

    def _open(self, label: str, header_only: bool, opened: Callable[[str], TensorSource]) -> TensorSource:
        item, name = self.items[label], self.names[label]
        expert = label in self.task_of
        if label == MERGED:  # loaded whole by transformers, which reads only its standard files
            try:
                gguf = gguf_file(item)
            except CheckpointError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
            if gguf is not None:
                raise CheckpointError(f"{name}: {gguf} is a GGUF file; calibrate the safetensors checkpoint featcal "
                                      "merge wrote")
        base: BaseRef = None
        if expert and BASE in self.items:  # opened already: a GGUF expert's header is compared with it
            base = self._sources[BASE] if opened == self.source and BASE in self._sources else (lambda: opened(BASE))
        source = open_input(item, label=name, allow_pickle=self.allow_pickle, base=base,
                            kind=self.expert_kind.get(self.task_of[label]) if expert else None,
                            may_be_adapter=expert, header_only=header_only)
        if label == MERGED and isinstance(source, CheckpointReader):
            try:
                check_loadable(source.path, self.allow_pickle)
            except CheckpointError as exc:
                raise CheckpointError(f"{name}: {exc}") from None
        if isinstance(item, (str, os.PathLike)) and isinstance(getattr(source, "path", None), (str, os.PathLike)):
            check_copied_links(source.path, name)  # what outputs copy from it stays inside it
        return source

    def open_all(self) -> InputFamily:
        """Every input opened now, in order (so that a bad one is refused before any work)."""
        for label in self.items:
            self.source(label)
        return self

    @property
    def base(self) -> TensorSource:
        return self.source(BASE)

    @property
    def experts(self) -> dict[str, TensorSource]:
        return {t: self.source(expert_label(t)) for t in self.tasks}

    @property
    def merged(self) -> TensorSource | None:
        return self.source(MERGED) if MERGED in self.items else None

    def path(self, label: str) -> Path | None:
        """Where input `label` lives on disk (a resolved checkpoint folder; an adapter folder, a GGUF file or
        the folder holding it, as given); None for a model in memory."""
        item, source = self.items[label], self.source(label)
        if isinstance(source, CheckpointReader):
            return Path(source.path)
        return Path(item).expanduser() if isinstance(item, (str, os.PathLike)) else None

    def kind(self, label: str) -> dict[str, Any]:
        """featcal.json's record of how input `label` was read (`describe_kind`)."""
        return describe_kind(self.source(label))

    # --- the streaming merge --------------------------------------------------------------------------
    def merge_view(self) -> tuple[TensorSource, dict[str, TensorSource], VocabPlan | None]:
        """(base, experts, vocabulary plan) as the merge reads them: under the base's naming, experts with more
        vocabulary rows cut to the base's (the plan grows the merged tensors back)."""
        labels = [BASE, *(expert_label(t) for t in self.tasks)]
        viewed = harmonise({label: self.source(label) for label in labels}, BASE)
        experts, vocab = grown_vocabulary(viewed[BASE], {t: viewed[expert_label(t)] for t in self.tasks})
        return viewed[BASE], experts, vocab

    # --- the checks before a calibration ----------------------------------------------------------------
    def check_model_types(self, reference: str) -> None:
        """Every input is of the reference's model type (adapters have their base's); a CLIPModel base with
        vision-tower experts is one family (io/read/layouts.py reads it as vision towers)."""
        types = {label: self._model_type(label) for label in self.items
                 if not isinstance(self.source(label), LoraSource)}
        if set(types.values()) == {"clip", "clip_vision_model"}:
            return
        ref_type = types[reference]
        odd = [f"{label} ({t})" for label, t in types.items() if t != ref_type]
        if odd:
            raise CheckpointError(
                f"all checkpoints must share the {reference} model's type ({ref_type}); these differ: {', '.join(odd)}"
            )

    def _model_type(self, label: str) -> str | None:
        source = self.source(label)
        try:
            config = source.config
        except CheckpointError as exc:
            raise CheckpointError(f"{label}: {exc}") from None
        model_type = config.get("model_type")
        if model_type is not None and not isinstance(model_type, str):
            raise CheckpointError(f"{label}: {source.path} gives model_type {model_type!r} in its config, which is no "
                                  "model type name")
        return model_type

    def check_consistent(self, reference: str) -> None:
        """Headers only: every input has the reference's config class, tensor names, shapes, dtype classes and
        architecture fields, each compared under one naming and vocabulary size with the reference; a reference
        saved one tensor per expert holds every expert its config makes, once (check_expert_layout)."""
        ref = self.source(reference)
        check_expert_layout(f"the {reference} model", ref)  # the others must then hold the reference's tensors
        for label in self.items:
            if label == reference:
                continue
            pair = harmonise({reference: ref, label: self.source(label)}, reference)
            pair[label] = vocab_rows_view(pair[reference], reference, label, pair[label])  # grown vocabularies
            for check in (check_same_config, check_same_tensors, check_same_fields):
                check(pair[reference], label, pair[label], what=label, reference=f"the {reference} model")

    def scan_finite(self, progress: bool = False, skip: Iterable[str] = ()) -> None:
        """Refuse NaN / Inf in any tensor of any input (but those labelled in `skip`), reading one tensor at a
        time (GGUF inputs opened for their headers are dequantised for this, one at a time; the base once, if
        adapters need it)."""
        skip = set(skip)
        for label in self.items:
            if label in skip:
                continue
            scan_finite(self.names[label] if label in self.task_of else f"{label} model", self._values(label),
                        progress=progress)
            if label != BASE:
                self._full.pop(label, None)
        self._full.clear()

    def _values(self, label: str) -> TensorSource:
        """Input `label` with values to read: itself, or (a header-only GGUF, or an adapter over one) reopened."""
        source = self.source(label)
        needs = is_gguf(source) and self.header_only or (isinstance(source, LoraSource) and self.header_only
                                                         and is_gguf(self.source(BASE)))
        if not needs:
            return source
        if label not in self._full:
            self._full[label] = self._open(label, False, self._values)
        return self._full[label]

    # --- the calibration, block by block --------------------------------------------------------------
    def param_sources(self, template: nn.Module) -> tuple[dict[str, TensorSource], TensorSource | None]:
        """Each expert's and the base's parameters by `template`'s names (the merged model's): a model in
        memory read directly, any other input through its opened source, mapped by transformers' renaming
        rules (io/read/param_sources.py), read block by block into `template`."""
        experts = {t: self._params(expert_label(t), template) for t in self.tasks}
        base = self._params(BASE, template) if BASE in self.items else None
        return experts, base

    def _params(self, label: str, template: nn.Module) -> TensorSource:
        item = self.items[label]
        if isinstance(item, nn.Module):
            return ModelSource(item, self.names[label])
        return CheckpointSource(None, template, self.names[label], reader=self.source(label))

    def calibration_sources(
        self, model: nn.Module, template: nn.Module, expert_names: list[str], base_names: list[str],
        check_finite: bool = True, streamed_as_read: bool = False,
    ) -> tuple[dict[str, TensorSource], TensorSource | None]:
        """`param_sources`, completed to a grown vocabulary (experts with fewer rows than `model` read its rows
        for the rest), every parameter the calibration reads (`expert_names` of each expert, `base_names` of
        the base) checked against `model`'s shape and, with `check_finite`, for NaN / Inf (the merged model's
        own parameters too), before any forward. `streamed_as_read`: the experts read from files are not scanned
        here; the calibration checks each of their tensors as it reads it (`refuse_non_finite_tensor`)."""
        experts, base = self.param_sources(template)
        experts = pad_param_sources(experts, model)
        for src in experts.values():
            validate_source(src, model, expert_names)
        if base is not None:
            validate_source(base, model, base_names)
        if check_finite:
            scanned = {t: s for t, s in experts.items() if not (streamed_as_read and self.streamed(t))}
            refuse_non_finite(model, scanned, base, expert_names, base_names)
        return experts, base

    def streamed(self, task: str) -> bool:
        """Whether expert `task` is read from its files (not a model in memory)."""
        return not isinstance(self.items[expert_label(task)], nn.Module)


def refuse_non_finite(model: nn.Module, experts: Mapping[str, TensorSource], base: TensorSource | None,
                      expert_names: list[str], base_names: list[str]) -> None:
    """Refuse NaN / Inf in any parameter a calibration reads, naming its owner, before any forward runs."""
    def read(src: TensorSource, names: Iterable[str]):  # lazily: one tensor in memory at a time
        return ((n, src.get(n)) for n in names)

    owners: list[tuple[str, Any, Iterable]] = [("merged model", None, model.named_parameters())]
    owners += [(src.label, src, read(src, expert_names)) for src in experts.values()]
    if base is not None:
        owners.append((base.label, base, read(base, base_names)))
    for label, src, tensors in owners:
        bad = first_non_finite(tensors)
        if bad is not None:
            raise non_finite_error(label, src, *bad)


def refuse_non_finite_tensor(source: TensorSource, name: str, value: torch.Tensor) -> None:
    """The same refusal as `refuse_non_finite`, for one tensor of `source` as the calibration reads it."""
    bad = first_non_finite([(name, value)])
    if bad is not None:
        raise non_finite_error(source.label, source, *bad)


def non_finite_error(label: str, source: TensorSource | None, name: str, count: int) -> CheckpointError:
    """The one-line refusal of a parameter holding NaN / Inf, naming its owner and, read from files, their path."""
    path = getattr(source, "path", None)
    where = f" ({path})" if isinstance(path, (str, os.PathLike)) and str(path) != label else ""
    return CheckpointError(f"{label}{where}: parameter {name!r} contains NaN or Inf ({count} value(s))")


def open_family(
    base: Input | None, experts: Mapping[str, Input], merged: Input | None = None, *, allow_pickle: bool = False,
    expert_kind: Mapping[str, str] | None = None, header_only: bool = False, eager: bool = True,
    base_name: str = BASE, merged_name: str = "merged model",
) -> InputFamily:
    """The family of a merge (`base`, `experts`) or of a calibration (and `merged`), opened by `open_input`.

    `eager` opens every input now, merged model first, then the base, then the experts, so that a bad one is
    refused before any work; else each is opened when first used. `header_only`: GGUF inputs are read for
    their headers only (the checks; `scan_finite` dequantises them one at a time). `expert_kind`: task ->
    "full" / "adapter" for expert folders holding both. `base_name` / `merged_name`: how messages name them.
    """
    items: dict[str, Input] = {}
    if merged is not None:
        items[MERGED] = merged
    if base is not None:
        items[BASE] = base
    items.update({expert_label(t): e for t, e in experts.items()})
    family = InputFamily(items, {expert_label(t): t for t in experts}, allow_pickle=allow_pickle, expert_kind=expert_kind, header_only=header_only,
                         names={MERGED: merged_name, BASE: base_name})
    return family.open_all() if eager else family
