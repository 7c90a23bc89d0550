"""Checks that a base and its experts form one family that can be merged and calibrated.

Everything here runs BEFORE any merging or calibration work, and every failure names the expert and
the first offending tensor (in sorted name order), so that the user knows which file to fix. The cheap
checks (config identity, names, shapes, dtypes) use only headers (`reader.meta`); the finite scan
reads tensors one at a time, so it needs memory for a single tensor whatever the model size.

The functions accept any input as io/read/family.py opens it (a `TensorSource`: io/read/tensor_source.py).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from featcal.errors import CheckpointError, ConfigError
from featcal.io.read.tensor_source import TensorSource  # noqa: F401  (the interface checked here; re-exported)

# config.json fields that decide which class loads the weights; they must agree across the family.
IDENTITY_FIELDS = ("model_type", "architectures")
# config.json fields that may differ between a base and its fine-tunes: they do not change what the weights
# compute. Bookkeeping (names, versions, dtype: the tensors' own dtypes are checked), a task head's labels,
# runtime switches, and `vocab_size` (a grown vocabulary is checked on the tensors' rows, io/read/vocab.py). So are
# every field of transformers' GenerationConfig (token ids, sampling, use_cache: how text is generated, not
# what a forward computes), fields starting with "_" (transformers' private state) and fields naming
# `dropout` or `init` (training and initialisation only), or ending `_token_id(s)` (the tokenizer's, checked with
# the vocabulary). Every other field, nested ones (text_config) included,
# must agree: heads, KV heads, RoPE, norm eps, positions, sizes, layer types, activations, tying.
MAY_DIFFER = frozenset({
    "architectures", "model_type",  # compared as IDENTITY_FIELDS, with their own message
    "name_or_path", "transformers_version", "dtype", "torch_dtype", "id2label", "label2id", "num_labels",
    "problem_type", "finetuning_task", "task_specific_params", "return_dict", "torchscript", "auto_map",
    "tokenizer_class", "prefix", "vocab_size", "chunk_size_feed_forward",
})
_FLOAT_TOLERANCE = 1e-6  # GGUF headers store eps and RoPE bases as float32


MAX_NAME_LENGTH = 100


def validate_expert_names(names: Iterable[str]) -> list[str]:
    """At least one expert, each name a non-empty string without '=' or surrounding spaces, all unique.

    Names become task keys (calibration data, reports, CLI `NAME=PATH`) and parts of file names
    (calibration chains spilled to disk, resume checkpoints), hence the restrictions: no path separator,
    control character, '.' or '..', at most MAX_NAME_LENGTH characters, and no two names that differ
    only in case (one file on a case-insensitive file system).
    """
    out = list(names)
    if not out:
        raise ConfigError("at least one expert is needed")
    seen: dict[str, str] = {}
    for n in out:
        if not isinstance(n, str) or not n.strip():
            raise ConfigError(f"expert names must be non-empty strings, got {n!r}")
        if n != n.strip() or "=" in n:
            raise ConfigError(f"expert name {n!r} must not contain '=' or leading/trailing spaces")
        if "/" in n or "\\" in n or n in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in n):
            safe = "-".join(p for p in n.replace("\\", "/").split("/") if p.strip("."))
            hint = f"; use e.g. {safe!r}" if safe and safe != n and safe.isprintable() else ""
            raise ConfigError(
                f"expert name {n!r} must not contain '/', '\\' or control characters, nor be '.' or '..' "
                f"(task names become parts of file names){hint}"
            )
        if len(n) > MAX_NAME_LENGTH:
            raise ConfigError(f"expert name {n[:20]!r}... is {len(n)} characters long; at most {MAX_NAME_LENGTH}")
        if n in seen:
            raise ConfigError(f"expert name {n!r} is given twice; names must be unique")
        if n.casefold() in {k.casefold() for k in seen}:
            other = next(k for k in seen if k.casefold() == n.casefold())
            raise ConfigError(
                f"expert names {other!r} and {n!r} differ only in case; their files would collide on a "
                "case-insensitive file system"
            )
        seen[n] = n
    return out


def dtype_class(dtype: torch.dtype) -> str:
    """floating / complex / bool / integer: mixing classes is an error, mixing widths is not."""
    if dtype.is_floating_point:
        return "floating"
    if dtype.is_complex:
        return "complex"
    if dtype == torch.bool:
        return "bool"
    return "integer"


def _where(source: TensorSource) -> str:
    p = source.path
    return str(p) if isinstance(p, (str, os.PathLike)) else repr(p)


def check_same_config(
    base: TensorSource, name: str, expert: TensorSource, *, what: str | None = None, reference: str = "the base"
) -> None:
    """model_type and architectures of `expert` must equal the base's (when both declare them).

    model_type is what picks the config class in transformers, so it stands for the config class too.
    `what` / `reference` label the two sides in messages (default: "expert NAME" / "the base").
    """
    what = what or f"expert {name!r}"
    bcfg, ecfg = base.config, expert.config
    for field in IDENTITY_FIELDS:
        b, e = bcfg.get(field), ecfg.get(field)
        if b is None or e is None:
            continue  # an undeclared field cannot disagree; names and shapes still have to match
        if b != e:
            raise CheckpointError(
                f"{what} ({_where(expert)}): config {field} is {e!r} but {reference} has {b!r}; "
                "experts must be fine-tunes of the base architecture"
            )


def check_same_fields(
    base: TensorSource, name: str, expert: TensorSource, *, what: str | None = None, reference: str = "the base"
) -> None:
    """Every config field that defines the architecture (all but MAY_DIFFER's) must agree, naming those that
    differ with both values. Run after the tensor checks, whose messages name the tensor where shapes differ:
    this catches what shapes cannot show (heads at the same width, RoPE, norm eps, positions, activations)."""
    what = what or f"expert {name!r}"
    found = config_differences(base.config, expert.config)
    if found:
        raise CheckpointError(
            f"{what} ({_where(expert)}): config {describe_differences(found, reference)}; experts must share the "
            "base's architecture (docs/guarantees.md lists the fields that may differ)"
        )


def describe_differences(found: list[tuple[str, Any, Any]], reference: str = "the base") -> str:
    """'heads is 8 but the base has 4, head_dim ...' for at most three fields, and how many more differ."""
    parts = [f"{field} is {_short(e)} but {reference} has {_short(b)}" for field, b, e in found[:3]]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return ", ".join(parts) + more


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _ignored(field: str) -> bool:
    return (field in MAY_DIFFER or field in _generation_fields() or field.startswith("_")
            or field.endswith(("_token_id", "_token_ids")) or "dropout" in field or "init" in field)


def _generation_fields() -> frozenset[str]:
    global _GENERATION
    if _GENERATION is None:
        from transformers import GenerationConfig

        _GENERATION = frozenset(GenerationConfig().to_dict())
    return _GENERATION


_GENERATION: frozenset[str] | None = None


def normalised_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """`config` as its transformers config class reads it (defaults filled in, renamed fields under today's
    names: `rope_theta` and `rope_scaling` become `rope_parameters`), so that two files saved by different
    versions compare by meaning; None when no class reads it."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = dict(config)
    try:  # the lazy CONFIG_MAPPING has no working .get
        return _values(CONFIG_MAPPING[data["model_type"]].from_dict(data), data)
    except Exception:  # a config this transformers cannot build: None, and the files' own fields are compared
        return None


def _values(config: Any, data: Mapping[str, Any]) -> dict[str, Any]:
    """Every field of a config object, read as attributes (a field the file leaves out reads as its default;
    `to_dict` omits some of those), nested configs as dicts of theirs."""
    out = {}
    for key in set(config.to_dict()) | set(data):
        try:
            value = getattr(config, key)
        except Exception:
            value = data.get(key)
        if hasattr(value, "to_dict") and hasattr(value, "model_type"):
            value = _values(value, value.to_dict())
        out[key] = value
    return out


def config_differences(base: Mapping[str, Any], expert: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The architecture-defining fields (sorted, dotted for nested configs) whose values differ, each with the
    base's and the expert's value; empty when they agree. Absent fields read as their class's default."""
    if not base or not expert:
        return []  # a source without a config (an in-memory module): its tensors are still checked
    found: list[tuple[str, Any, Any]] = []
    b, e = normalised_config(base), normalised_config(expert)
    if b is None or e is None:  # compared alike, or defaults filled in on one side only would differ
        b, e = dict(base), dict(expert)
    _differences(b, e, "", found)
    return found


def _differences(b: Any, e: Any, where: str, found: list[tuple[str, Any, Any]]) -> None:
    if isinstance(b, Mapping) and isinstance(e, Mapping):
        for key in sorted(set(b) | set(e), key=str):
            if not _ignored(str(key)):
                _differences(b.get(key), e.get(key), f"{where}.{key}" if where else str(key), found)
    elif not _same(b, e):
        found.append((where, b, e))


def _same(b: Any, e: Any) -> bool:
    if isinstance(b, Mapping) and isinstance(e, Mapping):
        inner: list[tuple[str, Any, Any]] = []
        _differences(b, e, "", inner)
        return not inner
    if isinstance(b, (list, tuple)) and isinstance(e, (list, tuple)):
        return len(b) == len(e) and all(_same(x, y) for x, y in zip(b, e, strict=True))
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (b, e))
    if numbers and (isinstance(b, float) or isinstance(e, float)):
        return math.isclose(b, e, rel_tol=_FLOAT_TOLERANCE, abs_tol=0.0) or b == e
    return b == e


def _prefix_hint(missing: str, present: Iterable[str]) -> str:
    for other in present:
        if other.endswith("." + missing) or missing.endswith("." + other):
            return (
                f" (it has {other!r}: the names differ by a prefix, as between checkpoints saved by different "
                "transformers versions; re-save both with the same version)"
            )
    return ""


def check_same_tensors(
    base: TensorSource, name: str, expert: TensorSource, *, what: str | None = None, reference: str = "the base"
) -> None:
    """Same parameter names, shapes and dtype classes as the base, from headers only."""
    what = what or f"expert {name!r}"
    bkeys, ekeys = base.keys(), expert.keys()
    bset, eset = set(bkeys), set(ekeys)
    missing = sorted(bset - eset)
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{what} ({_where(expert)}) is missing tensor {missing[0]!r}{more} that {reference} has"
            + _prefix_hint(missing[0], sorted(eset - bset))
        )
    extra = sorted(eset - bset)
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise CheckpointError(
            f"{what} ({_where(expert)}) has tensor {extra[0]!r}{more} that {reference} does not have"
        )
    for key in sorted(bkeys):
        bshape, bdtype = base.meta(key)
        eshape, edtype = expert.meta(key)
        if tuple(bshape) != tuple(eshape):
            raise CheckpointError(
                f"{what}: tensor {key!r} has shape {tuple(eshape)} but {reference} has {tuple(bshape)}"
            )
        if dtype_class(bdtype) != dtype_class(edtype):
            raise CheckpointError(
                f"{what}: tensor {key!r} is {edtype} ({dtype_class(edtype)}) but {reference} has "
                f"{bdtype} ({dtype_class(bdtype)})"
            )


# a stack of numbered layers in a tensor name: model.layers.3., bert.encoder.layer.3., transformer.h.3., blocks.3.
_LAYER = re.compile(r"(?:^|\.)(layers|layer|h|blocks|block)\.(\d+)\.")


def _longest_stack(names: Iterable[str]) -> tuple[str, int] | None:
    """(stack, layers) of the longest stack of numbered layers among tensor names, None without one."""
    stacks: dict[str, int] = {}
    for key in names:
        m = _LAYER.search(key)
        if m:
            prefix = key[: m.end(1)]  # model.layers
            stacks[prefix] = max(stacks.get(prefix, 0), int(m.group(2)) + 1)
    return max(stacks.items(), key=lambda kv: kv[1]) if stacks else None


def _meta_parameters(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]] | None:
    """Parameter name -> shape of the model transformers builds from `config` (on the meta device: no memory);
    None where it cannot build one."""
    model = _meta_model(config)
    return None if model is None else {n: tuple(p.shape) for n, p in model.named_parameters()}


def _meta_model(config: Mapping[str, Any]) -> Any:
    """The model transformers builds from `config`, on the meta device; None where it cannot build one."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from featcal.io.read.models import model_class_for

    try:
        cfg = CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))
        cls = model_class_for(cfg)
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(cfg) if cls is transformers.AutoModel else cls(cfg)
    except Exception:  # an unknown or unbuildable config: nothing to compare with
        return None
    return model


def _built_layers(config: Mapping[str, Any]) -> int | None:
    """How many layers the longest stack of the model transformers builds from `config` has; None where it
    cannot build one."""
    params = _meta_parameters(config)
    stack = _longest_stack(params) if params else None
    return stack[1] if stack else None


def check_layer_count(label: str, source: TensorSource) -> None:
    """Refuse a config.json whose `num_hidden_layers` claims more layers than the weights hold: the merge would
    write it whole, and the model transformers builds from it fills the missing layers at random. Headers only;
    a count the names suggest is confirmed by the model transformers builds from the config (on the meta device),
    so a field that counts something else (sub-layers, repeats) is not taken for the blocks."""
    claimed = source.config.get("num_hidden_layers")
    if not isinstance(claimed, int) or isinstance(claimed, bool):
        return
    stack = _longest_stack(source.keys())
    if stack is None or claimed <= stack[1]:
        return
    prefix, found = stack
    built = _built_layers(source.config)
    if built is None or built <= found:
        return
    missing = f"layer {found}" if built - found == 1 else f"layers {found} to {built - 1}"
    raise CheckpointError(
        f"{label} ({_where(source)}): config.json num_hidden_layers is {claimed}, but the weights hold {found} "
        f"layer(s) ({prefix}.0 to {prefix}.{found - 1}); a model built from it would have {missing} random: set "
        f"num_hidden_layers to {found}, or add the missing layers' weights"
    )


# one expert's tensor in a checkpoint that stores a mixture of experts one tensor per expert:
# model.layers.0.block_sparse_moe.experts.3.w1.weight -> (model.layers.0.block_sparse_moe.experts, 3, w1.weight)
_EXPERT = re.compile(r"^(?P<module>.*\.experts)\.(?P<index>\d+)\.(?P<rest>.+)$")


def _per_expert(names: Iterable[str]) -> dict[str, dict[str, set[int]]]:
    """experts module -> tensor (`w1.weight`) -> the expert indices holding it, for per-expert tensor names."""
    found: dict[str, dict[str, set[int]]] = {}
    for key in names:
        m = _EXPERT.match(key)
        if m:
            found.setdefault(m["module"], {}).setdefault(m["rest"], set()).add(int(m["index"]))
    return found


def _built_expert_count(model: Any) -> int | None:
    """How many experts each mixture-of-experts layer of `model` (as transformers builds it from the config) has (a
    fused 3-D parameter's rows, or a list of expert modules); None where it has none, or layers of several counts."""
    per_module: dict[str, int] = {}
    for name, shape in ({} if model is None else {n: tuple(p.shape) for n, p in model.named_parameters()}).items():
        m = _EXPERT.match(name)
        module = name.rpartition(".")[0]
        if m:  # a list of expert modules: experts.3.w1.weight
            per_module[m["module"]] = max(per_module.get(m["module"], 0), int(m["index"]) + 1)
        elif module.endswith(".experts") and len(shape) == 3:  # fused: experts.gate_up_proj, E × 2I × H
            per_module[module] = shape[0]
    values = set(per_module.values())
    return values.pop() if len(values) == 1 else None


def check_expert_layout(label: str, source: TensorSource) -> None:
    """Refuse a checkpoint that stores a mixture of experts one tensor per expert (`...experts.3.w1.weight`) with
    an expert missing (a gap in the indices, or one of its tensors), an index past the experts the config makes,
    or experts of one layer whose same tensor has different shapes: transformers would stack the experts it finds
    in index order (expert 4 taken for expert 3) or fail to load the merge written from them, after the work.
    Headers only; the count is the one of the model transformers builds from the config (on the meta device)."""
    groups = _per_expert(source.keys())
    if not groups:
        return
    where = f"{label} ({_where(source)})"
    template = _meta_model(source.config)
    built = _built_expert_count(template)
    for module, tensors in sorted(groups.items()):
        held = set().union(*tensors.values())
        count = built if built is not None else max(held) + 1
        if max(held) >= count:
            raise CheckpointError(f"{where}: tensor {module}.{max(held)}.* is expert {max(held)}, past the {count} "
                                  f"experts its config.json makes (indices 0 to {count - 1}); remove it, or fix the "
                                  "config's expert count")
        for rest, indices in sorted(tensors.items()):
            gone = sorted(set(range(count)) - indices)
            if gone:
                raise CheckpointError(f"{where}: tensor {module}.{gone[0]}.{rest} is missing"
                                      f"{f' (and {len(gone) - 1} more experts)' if len(gone) > 1 else ''}: the "
                                      f"config makes {count} experts, indices 0 to {count - 1}, and a model would "
                                      "take the experts it holds for others")
            shapes = {i: tuple(source.meta(f"{module}.{i}.{rest}")[0]) for i in sorted(indices)}
            odd = next((i for i in shapes if shapes[i] != shapes[0]), None)
            if odd is not None:
                raise CheckpointError(f"{where}: tensor {module}.{odd}.{rest} has shape {shapes[odd]}, expert 0's "
                                      f"{module}.0.{rest} {shapes[0]}: the experts of one layer must agree")
    if template is not None:
        _check_fused_shapes(where, source, template)


def _check_fused_shapes(where: str, source: TensorSource, template: Any) -> None:
    """The fused expert parameters transformers would build from the per-expert tensors (its own converters, on
    meta tensors: nothing read) have the shapes its config makes; else loading the merge would fail, after the
    work."""
    from featcal.io.read.conversions import Conversion
    from featcal.io.read.param_sources import checkpoint_key_map

    conversions: dict[str, Conversion] = {}
    try:
        checkpoint_key_map(template, source.keys(), conversions)
    except Exception:  # names transformers does not convert: the tensor checks name them
        return
    params = {n: tuple(p.shape) for n, p in template.named_parameters()}
    for conv in conversions.values():
        first = sorted(conv.keys())[0]
        try:
            built = conv.shapes(source.meta, template)
        except Exception as exc:
            raise CheckpointError(f"{where}: the per-expert tensors of {conv.layer} ({first}, ...) cannot be "
                                  f"combined as transformers combines them: {' '.join(str(exc).split())[:200]}") from None
        for name, (shape, _) in sorted(built.items()):
            if name in params and tuple(shape) != params[name]:
                raise CheckpointError(f"{where}: the per-expert tensors {first}, ... make {name} of shape "
                                      f"{tuple(shape)}, but its config.json makes {params[name]}; fix the config, "
                                      "or the weights")


def all_finite(t: torch.Tensor) -> bool:
    """Whether floating tensor `t` holds no NaN or Inf, in one reduction pass where it can.

    Why: the finite scans read every weight of every expert before any work; `isfinite(t).all()` writes a
    bool tensor as large as `t` and reduces it (four times the time of a plain sum on the CPU). A finite
    sum proves every element finite (NaN propagates, Inf stays Inf or turns NaN), so the exact test runs
    only when the sum is not finite: a non-finite value, or finite values whose sum overflowed.
    Half-precision sums accumulate in float32 so that they overflow no sooner than their values do.
    """
    if t.element_size() == 1:  # float8 kernels are sparse on CPU; check in float32
        t = t.float()
    acc = torch.float32 if t.element_size() == 2 else None
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def non_finite_count(t: torch.Tensor) -> int:
    """How many NaN / Inf values `t` holds (read only after `all_finite` said some)."""
    t = t.float() if t.element_size() == 1 else t
    return int((~torch.isfinite(t)).sum())


def scan_finite(label: str, source: TensorSource, *, progress: bool = False) -> None:
    """Stream every floating tensor of `source` and fail on the first one holding NaN or Inf."""
    keys = [k for k in sorted(source.keys()) if source.meta(k)[1].is_floating_point]
    for key in tqdm(keys, desc=f"scanning {label}", unit="tensor", disable=not progress, leave=False):
        t = source.get(key)
        if not all_finite(t):
            t = t.float() if t.element_size() == 1 else t
            n_nan = int(torch.isnan(t).sum())
            n_inf = int(torch.isinf(t).sum())
            raise CheckpointError(
                f"{label} ({_where(source)}): tensor {key!r} contains {n_nan} NaN and {n_inf} Inf values"
            )
        del t


def validate_family(
    base: TensorSource,
    experts: Mapping[str, TensorSource],
    *,
    check_finite: bool = True,
    progress: bool = False,
) -> None:
    """Raise CheckpointError (or ConfigError for bad names) unless base + experts can be merged.

    Order: names, the base's layer count against its weights, then per expert config identity, tensor names,
    shapes and dtype classes, the other architecture-defining config fields (headers only, cheap), then the
    finite scan of the base and of each expert (one tensor in memory at a time).
    A bf16 expert of an fp32 base is accepted: merging computes in float32 and casts back.
    """
    validate_expert_names(experts.keys())
    check_layer_count("base", base)  # the experts' configs and tensor names must then be the base's
    check_expert_layout("base", base)  # a mixture of experts saved one tensor per expert: every expert, once
    for name, expert in experts.items():
        check_same_config(base, name, expert)
        check_same_tensors(base, name, expert)
        check_same_fields(base, name, expert)
    if check_finite:
        scan_finite("base", base, progress=progress)
        for name, expert in experts.items():
            scan_finite(f"expert {name!r}", expert, progress=progress)


def check_finite_state(label: str, state: Mapping[str, torch.Tensor]) -> None:
    """Refuse an in-memory result (merged or calibrated weights) holding NaN/Inf, naming the first tensor.

    The last guard before anything is written: finite inputs can still overflow (a large scaling of an
    fp16 checkpoint), and a checkpoint with NaN in it would only fail later, in someone's evaluation.
    """
    bad = first_non_finite((key, state[key]) for key in sorted(state))
    if bad is not None:
        raise CheckpointError(
            f"{label}: tensor {bad[0]!r} has {bad[1]} non-finite value(s) (NaN or Inf); nothing was written"
        )


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, int] | None:
    """The first (name, count of NaN/Inf values) among floating tensors, or None; reads lazily, in order."""
    for key, t in tensors:
        if not t.is_floating_point():
            continue
        if not all_finite(t):
            return key, non_finite_count(t)
    return None
