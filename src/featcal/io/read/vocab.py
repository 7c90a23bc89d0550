"""Experts whose vocabulary grew: more embedding / LM-head rows than the base (or than each other).

Why: fine-tunes often add tokens (chat templates, padding to a multiple of 64); the MergeBench Llama
experts carry 128320 rows against their base's 128256. Such experts cannot be merged row for row, yet
every row the base has is an ordinary fine-tune of it. So:

- the vocabulary tensors are the parameters of the model's input and output embeddings (the LM head and
  its bias), as its class names them, with the base config's `vocab_size` rows; an expert may hold more rows in all of them (the
  same number in each, the other dimensions equal to the base's). Fewer rows than the base, another
  hidden size, or rows that disagree between the tensors of one expert are refused before any work;
- the method merges the base's rows: each grown expert is read through `RowsView`, which shows its
  first `base` rows only (a view like io/read/layouts.py's, so validation, the streaming merge, TIES'
  global selection and the whole-model merges see one shape);
- each extra row is the mean of the experts that have it (a new token has no base value to take a
  task vector from, and an expert without that row knows nothing about it);
- the output's config says `vocab_size` = the most rows of any expert, and its tokenizer files are
  those of the first expert (in the order given) with that many rows whose tokenizer holds every token
  any expert adds; the report (`vocabulary` in featcal.json) says all of this;
- the tokenizers are compared, id by id (`check_tokenizers`): the base's and every expert's that ships
  one must give each id the same token, so an expert that adds other tokens at the ids another one
  adds, or orders the base's tokens differently, is refused (its rows would be averaged with rows of
  other tokens); when no tokenizer of the most rows holds every added token, the merge is refused
  rather than dropping some.

Calibration reads the grown merge as its reference: `pad_rows_view` shows a base or an expert with
fewer rows than the merged model at the merged model's size (headers), and `PaddedRows` gives the
engine an expert's embedding with the rows it lacks taken from the merged model.
"""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from featcal.errors import CheckpointError
from featcal.io.read.layouts import RenamedSource
from featcal.io.read.tensor_source import TensorSource

log = logging.getLogger(__name__)

EXTRA_ROWS_RULE = "mean of the experts that have the row"
# files that make up a tokenizer (featcal.io.read.checkpoint.TOKENIZER_FILES plus the side files tokenizers write)
TOKENIZER_SIDE_FILES = ("special_tokens_map.json", "added_tokens.json", "merges.txt", "chat_template.jinja")


def config_vocab_size(config: Mapping[str, Any]) -> int | None:
    """`vocab_size` of a config.json dict (or of its `text_config`), None when it declares none."""
    value = config.get("vocab_size")
    if value is None and isinstance(config.get("text_config"), Mapping):
        value = config["text_config"].get("vocab_size")
    return value if isinstance(value, int) and value > 0 else None


def _set_vocab_size(config: dict, rows: int) -> dict:
    out = dict(config)
    if "vocab_size" in out or not isinstance(out.get("text_config"), Mapping):
        out["vocab_size"] = rows
    else:
        out["text_config"] = {**out["text_config"], "vocab_size": rows}
    return out


def vocab_tensors(source: Any) -> list[str]:
    """The floating tensors of `source` with one row per token of its config's vocabulary: those of the model's
    input and output embeddings (as its transformers class names them), or, for a class that cannot be built,
    every floating tensor with `vocab_size` rows. The shape alone is not enough: where `vocab_size` equals a
    hidden size, square projections and norms would count as vocabulary tensors."""
    vocab = config_vocab_size(source.config)
    if vocab is None:
        return []
    embeddings = embedding_names(source.config)
    names = []
    for name in sorted(source.keys()):
        shape, dtype = source.meta(name)
        if dtype.is_floating_point and len(shape) >= 1 and shape[0] == vocab:
            if embeddings is None or any(_same_name(name, e) for e in embeddings):
                names.append(name)
    return names


def _same_name(key: str, name: str) -> bool:
    """A checkpoint key and a model parameter name for one tensor (saved with or without the head's prefix)."""
    return key == name or key.endswith("." + name) or name.endswith("." + key)


_EMBEDDINGS: dict[str, frozenset[str] | None] = {}


def embedding_names(config: Mapping[str, Any]) -> frozenset[str] | None:
    """Every name (tied aliases included) of the parameters of the model's input and output embeddings, from
    a model of the config's class on the meta device; None when the class cannot be built or says nothing."""
    key = json.dumps(config, sort_keys=True, default=str)
    if key not in _EMBEDDINGS:
        if len(_EMBEDDINGS) >= 32:
            _EMBEDDINGS.clear()
        _EMBEDDINGS[key] = _embedding_names(_one_block_model(config))
    return _EMBEDDINGS[key]


def _one_block_model(config: Mapping[str, Any]) -> torch.nn.Module | None:
    """A model of the config's class on the meta device with one block per stack: the embeddings' names do not
    depend on the depth, and a crafted config claiming 100,000 layers must not take minutes to build."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from featcal.io.read.models import model_class_for

    try:
        cfg = CONFIG_MAPPING[config["model_type"]].from_dict(dict(config))
        for sub in {id(c): c for c in (cfg, cfg.get_text_config())}.values():
            for name in ("num_hidden_layers", "num_decoder_layers"):
                if isinstance(getattr(sub, name, None), int) and getattr(sub, name) > 1:
                    setattr(sub, name, 1)
            if isinstance(getattr(sub, "layer_types", None), list):
                sub.layer_types = sub.layer_types[:1]
        cls = model_class_for(cfg)
        if cls is transformers.AutoModel:  # no architectures: the head (and its LM head) unknown, the shape decides
            return None
        with torch.device("meta"):
            return cls(cfg)
    except Exception as exc:  # a config this transformers cannot build: the shape rule decides
        log.debug("no one-block model for %s: %s", config.get("model_type"), exc)
        return None


def _embedding_names(model: torch.nn.Module | None) -> frozenset[str] | None:
    if model is None:
        return None
    modules = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            found = getattr(model, get)()
        except Exception:  # not implemented by this class
            found = None
        if isinstance(found, torch.nn.Module):
            modules.append(found)
    names = {f"{prefix}.{p}" if prefix else p
             for prefix, module in model.named_modules(remove_duplicate=False) if any(module is m for m in modules)
             for p, _ in module.named_parameters(recurse=False)}
    return frozenset(names) or None


def _where(source: Any) -> str:
    return str(source.path)


class RowsView(RenamedSource):
    """A checkpoint with its vocabulary tensors shown with `rows[name]` rows (cut, or padded in headers).

    Cut (`rows` below the checkpoint's): what the merge method sees of a grown expert. Padded (headers
    only, for the calibration checks): `get` then returns the rows the checkpoint has.
    """

    def __init__(self, source: Any, rows: Mapping[str, int], config: dict, view: str) -> None:
        super().__init__(source, {k: k for k in source.keys()}, config, view)
        self.rows = dict(rows)

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self.source.meta(name)
        if name in self.rows:
            shape = (self.rows[name], *tuple(shape)[1:])
        return tuple(shape), dtype

    def get(self, name: str) -> torch.Tensor:
        t = super().get(name)
        if name in self.rows and t.shape[0] > self.rows[name]:
            return t[: self.rows[name]]
        return t


def _expert_rows(base: Any, label: str, expert: Any, names: list[str]) -> int | None:
    """The rows of `expert`'s vocabulary tensors when they exceed the base's; None when equal.

    Refuses fewer rows, another trailing shape, and tensors of one expert that disagree.
    """
    found: dict[str, int] = {}
    keys = set(expert.keys())
    for name in names:
        if name not in keys:
            continue  # validation names a missing tensor
        bshape, eshape = tuple(base.meta(name)[0]), tuple(expert.meta(name)[0])
        if eshape == bshape or len(eshape) != len(bshape) or eshape[1:] != bshape[1:]:
            continue  # equal, or another hidden size: validation refuses the latter with both shapes
        if eshape[0] < bshape[0]:
            raise CheckpointError(
                f"{label} ({_where(expert)}): tensor {name!r} has {eshape[0]} rows, fewer than the base's "
                f"{bshape[0]}; featcal merges experts whose vocabulary grew, not shrank"
            )
        found[name] = eshape[0]
    if not found:
        return None
    if len(set(found.values())) > 1 or len(found) != len([n for n in names if n in keys]):
        described = ", ".join(f"{n!r}: {expert.meta(n)[0][0]}" for n in names if n in keys)
        raise CheckpointError(
            f"{label} ({_where(expert)}): its vocabulary tensors disagree on the number of rows ({described}); "
            "resize the embeddings and the LM head together"
        )
    rows = next(iter(found.values()))
    declared = config_vocab_size(expert.config)
    if declared is not None and declared != rows:
        raise CheckpointError(
            f"{label} ({_where(expert)}): its tensors have {rows} vocabulary rows but its config says "
            f"vocab_size {declared}; the checkpoint is inconsistent"
        )
    return rows


@dataclass
class VocabPlan:
    """What a merge does with grown vocabularies (None is returned when no expert grew)."""

    base_rows: int
    rows: int
    tensors: list[str]
    expert_rows: dict[str, int]
    originals: dict[str, Any] = field(repr=False)  # expert name -> its source with all its rows
    tokenizer_from: str | None = None

    def grow(self, merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`merged` with each vocabulary tensor extended by the extra rows (mean of the experts having them).

        Reads one expert tensor at a time; holds the extra rows of one tensor.
        """
        for name in self.tensors:
            value = merged[name]
            extra = self.rows - self.base_rows
            total = torch.zeros((extra, *value.shape[1:]), dtype=torch.float64)
            count = torch.zeros(extra, dtype=torch.float64)
            for expert, rows in self.expert_rows.items():
                if rows <= self.base_rows:
                    continue
                t = self.originals[expert].get(name)[self.base_rows : rows]
                total[: rows - self.base_rows] += t.to(torch.float64)
                count[: rows - self.base_rows] += 1
                del t
            mean = total / count.view(-1, *([1] * (total.dim() - 1)))
            merged[name] = torch.cat([value, mean.to(value.dtype)]).contiguous()
        return merged

    def report(self) -> dict[str, Any]:
        return {
            "base_rows": self.base_rows, "rows": self.rows, "tensors": self.tensors,
            "expert_rows": self.expert_rows,
            "shared_rows": f"rows 0..{self.base_rows - 1} merged by the method",
            "extra_rows": f"rows {self.base_rows}..{self.rows - 1}: {EXTRA_ROWS_RULE}",
            "config_vocab_size": self.rows,
            "tokenizer_from": f"expert {self.tokenizer_from!r}" if self.tokenizer_from else "base",
        }

    def write(self, directory: Path) -> None:
        """Make the written checkpoint's config and tokenizer agree with its rows."""
        config_file = directory / "config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
            config_file.write_text(json.dumps(_set_vocab_size(config, self.rows), indent=2, sort_keys=True) + "\n")
        if self.tokenizer_from is None:
            return
        src = Path(self.originals[self.tokenizer_from].path)
        for name in _tokenizer_files():  # the base's tokenizer covers fewer tokens: none of its files stay
            (directory / name).unlink(missing_ok=True)
        for name in _tokenizer_files():
            if (src / name).is_file():
                shutil.copy2(src / name, directory / name)


def _tokenizer_files() -> tuple[str, ...]:
    from featcal.io.read.checkpoint import TOKENIZER_FILES

    return TOKENIZER_FILES + TOKENIZER_SIDE_FILES


def _has_tokenizer(source: Any) -> bool:
    path = getattr(source, "path", None)
    if not isinstance(path, (str, Path)) or not Path(path).is_dir():
        return False
    return any((Path(path) / name).is_file() for name in _tokenizer_files())


def grown_vocabulary(base: Any, experts: Mapping[str, Any]) -> tuple[dict[str, Any], VocabPlan | None]:
    """The experts as the merge method must see them (grown ones cut to the base's rows), and the plan.

    Headers (and tokenizer files) only; refusals name the expert and the tensor or token. Untouched (plan
    None) when no expert grew.
    """
    names = vocab_tensors(base)
    base_rows = config_vocab_size(base.config)
    if not names or base_rows is None:
        return dict(experts), None
    rows = {n: _expert_rows(base, f"expert {n!r}", e, names) for n, e in experts.items()}
    tokens = check_tokenizers(base, experts)
    if all(r is None for r in rows.values()):
        _warn_dropped_tokens(tokens, base_rows)
        return dict(experts), None
    expert_rows = {n: (r if r is not None else base_rows) for n, r in rows.items()}
    out = {n: (_cut(e, names, base_rows, rows[n]) if rows[n] is not None else e) for n, e in experts.items()}
    top = max(expert_rows.values())
    tokenizer_from = _tokenizer_from(tokens, expert_rows, top, experts)
    if tokenizer_from is None:
        log.warning("no expert with %d vocabulary rows ships tokenizer files: the merge keeps the base's tokenizer "
                    "(it produces ids below %d only)", top, base_rows)
    plan = VocabPlan(base_rows, top, names, expert_rows, dict(experts), tokenizer_from)
    log.info("grown vocabulary: %d rows (base %d) in %s; extra rows are the %s", top, base_rows,
             ", ".join(names), EXTRA_ROWS_RULE)
    return out, plan


_TOKENIZERS: dict[tuple[str, int], dict[int, str] | None] = {}


def token_ids(source: Any) -> dict[int, str] | None:
    """id -> token of the tokenizer a checkpoint folder ships (added tokens included), read by transformers
    (no shipped code); None without tokenizer files or when transformers cannot read them (logged)."""
    if not _has_tokenizer(source):
        return None
    path = Path(source.path).resolve()
    key = (str(path), max((path / n).stat().st_mtime_ns for n in _tokenizer_files() if (path / n).is_file()))
    if key not in _TOKENIZERS:
        import transformers

        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
            _TOKENIZERS[key] = {i: t for t, i in tokenizer.get_vocab().items()}
        except Exception as exc:
            log.warning("%s: its tokenizer cannot be read (%s); its tokens are not compared", path,
                        " ".join(str(exc).split())[:200])
            _TOKENIZERS[key] = None
    return _TOKENIZERS[key]


def check_tokenizers(base: Any, experts: Mapping[str, Any]) -> dict[str, dict[int, str]]:
    """Refuse tokenizers that give one id different tokens: an expert ordering the base's tokens otherwise,
    or two experts adding different tokens at the same id (their rows would be merged as one token's).
    Returns each tokenizer read ("base" and the expert names) as id -> token."""
    tokens = {"base": token_ids(base)} if token_ids(base) is not None else {}
    for name, expert in experts.items():
        found = token_ids(expert)
        if found is not None:
            tokens[name] = found
    owner: dict[int, tuple[str, str]] = {}  # id -> (the first tokenizer defining it, its token)
    for who, ids in tokens.items():
        for i in sorted(ids):
            token = ids[i]
            if i not in owner:
                owner[i] = (who, token)
            elif owner[i][1] != token:
                first, other = owner[i]
                side = "the base" if first == "base" else f"expert {first!r}"
                why = ("it orders the base's tokens differently" if first == "base"
                       else "they add different tokens at the same ids")
                raise CheckpointError(
                    f"expert {who!r} ({_where(experts[who])}): its tokenizer has {token!r} at id {i} but {side} has "
                    f"{other!r}; {why}, so their rows cannot be merged as one token's: give the experts one tokenizer"
                )
    return tokens


def _tokenizer_from(tokens: Mapping[str, dict[int, str]], expert_rows: Mapping[str, int], top: int,
                    experts: Mapping[str, Any]) -> str | None:
    """The first expert with `top` rows whose tokenizer holds every token any tokenizer defines (below `top`);
    refused when the experts' tokenizers each lack some (one of them would be dropped)."""
    defined = {i for ids in tokens.values() for i in ids if i < top}
    candidates = [n for n, r in expert_rows.items() if r == top and _has_tokenizer(experts[n])]
    for name in candidates:
        if name not in tokens or defined <= set(tokens[name]):
            return name
    if candidates:
        name = candidates[0]
        missing = min(defined - set(tokens[name]))
        who = next(w for w, ids in tokens.items() if missing in ids)
        raise CheckpointError(
            f"expert {name!r} ({_where(experts[name])}): its tokenizer lacks id {missing} ({tokens[who][missing]!r}, "
            f"{'the base' if who == 'base' else f'expert {who!r}'}'s), and no tokenizer of the {top} rows holds every "
            "token the experts add; the merge would drop some: give the experts one tokenizer"
        )
    return None


def _warn_dropped_tokens(tokens: Mapping[str, dict[int, str]], rows: int) -> None:
    """No expert grew: the output keeps the base's tokenizer; say so when an expert's defines tokens it lacks."""
    if "base" not in tokens:
        return
    for name, ids in tokens.items():
        extra = sorted(i for i in ids if i < rows and i not in tokens["base"])
        if name != "base" and extra:
            log.warning("expert %r: its tokenizer adds %d token(s) at ids the base's leaves free (e.g. %d, %r); the "
                        "merge keeps the base's tokenizer, which lacks them", name, len(extra), extra[0], ids[extra[0]])


def _cut(source: Any, names: list[str], base_rows: int, rows: int) -> RowsView:
    config = _set_vocab_size(source.config, base_rows) if source.config else {}
    return RowsView(source, {t: base_rows for t in names}, config, view=f"its first {base_rows} of {rows} vocabulary rows")


def cut_rows_view(base: Any, label: str, source: Any) -> Any:
    """`source` as the merge sees it next to `base`: cut to the base's rows when its vocabulary grew."""
    names = vocab_tensors(base)
    base_rows = config_vocab_size(base.config)
    if not names or base_rows is None:
        return source
    rows = _expert_rows(base, label, source, names)
    return source if rows is None else _cut(source, names, base_rows, rows)


def pad_rows_view(reference: Any, label: str, source: Any) -> Any:
    """`source` seen at the reference's vocabulary size when it has fewer rows (headers; for the checks).

    For calibration, whose reference is the (grown) merged model: a base, or an expert with fewer rows,
    fits it. A source with more rows than the reference is returned as is (validation refuses it).
    """
    names = vocab_tensors(reference)
    ref_rows = config_vocab_size(reference.config)
    if not names or ref_rows is None:
        return source
    keys = set(source.keys())
    short = {}
    for name in names:
        if name not in keys:
            continue
        rshape, sshape = tuple(reference.meta(name)[0]), tuple(source.meta(name)[0])
        if len(sshape) == len(rshape) and sshape[1:] == rshape[1:] and sshape[0] < rshape[0]:
            short[name] = rshape[0]
    if not short:
        return source
    return RowsView(source, short, source.config, view=f"padded to the {ref_rows} vocabulary rows of {label}")


class PaddedRows(TensorSource):
    """A calibration ParamSource whose vocabulary parameters with fewer rows than the merged model's
    are completed with the merged model's rows (tokens the expert never had are embedded as merged)."""

    def __init__(self, source: Any, model: torch.nn.Module) -> None:
        self.source = source
        self.label, self.path = source.label, source.path
        self._params = dict(model.named_parameters(remove_duplicate=False))
        self.padded: list[str] = []
        embeddings = _embedding_names(model)  # not a square projection where vocab_size is a hidden size
        for name, p in self._params.items():
            if embeddings is not None and name not in embeddings:
                continue
            got = source.shape(name)
            if got is not None and p.dim() >= 1 and len(got) == p.dim() and got[0] < p.shape[0] \
                    and tuple(got[1:]) == tuple(p.shape[1:]):  # scalars (CLIP logit_scale) have no rows
                vocab = getattr(getattr(model, "config", None), "vocab_size", None)
                if vocab == p.shape[0]:
                    self.padded.append(name)

    @property
    def config(self) -> dict:
        return self.source.config

    def keys(self) -> list[str]:
        return self.source.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.source

    def meta(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        shape, dtype = self.source.meta(name)
        return (tuple(self._params[name].shape) if name in self.padded else tuple(shape)), dtype

    def shape(self, name: str) -> tuple[int, ...] | None:
        if name in self.padded:
            return tuple(self._params[name].shape)
        return self.source.shape(name)

    def get(self, name: str) -> torch.Tensor:
        t = self.source.get(name)
        if name not in self.padded:
            return t
        own = self._params[name].detach()
        return torch.cat([t.to(own.dtype), own[t.shape[0]:].cpu()])


def pad_param_sources(sources: Mapping[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """Each calibration source wrapped in PaddedRows where it has fewer vocabulary rows than `model`."""
    out = {}
    for t, src in sources.items():
        padded = PaddedRows(src, model)
        out[t] = padded if padded.padded else src
    return out


def vocab_rows_view(reference: Any, reference_label: str, label: str, source: Any) -> Any:
    """The calibration checks' view of `source` next to their reference (the base, or the merged model).

    Next to the base (`featcal run` checks before it merges), a grown expert is cut to the base's rows;
    next to a grown merged model, a base or expert with fewer rows is padded to its size.
    """
    if reference_label == "base":
        return cut_rows_view(reference, label, source)
    return pad_rows_view(reference, f"the {reference_label} model", source)


def plan_for_checkpoints(base_dir: Any, expert_dirs: Mapping[str, Any]) -> VocabPlan | None:
    """The plan `featcal.merge` follows for these checkpoints (headers only): for callers that write a
    merged state dict themselves (featcal reproduce) and must make its config and tokenizer agree."""
    from featcal.io.read.checkpoint import CheckpointReader

    return grown_vocabulary(CheckpointReader(base_dir), {t: CheckpointReader(d) for t, d in expert_dirs.items()})[1]
