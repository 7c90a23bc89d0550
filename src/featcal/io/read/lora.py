"""LoRA / PEFT adapters as experts: W + scale·B·A, computed tensor by tensor, without `peft`.

Why: many fine-tunes are published as adapters (`adapter_config.json` + `adapter_model.safetensors`),
not as full checkpoints. An adapter is an expert once applied to the base it was trained on, and the
application is one matrix product per adapted weight, so featcal does it itself as each tensor is
read (`LoraSource.get`): merging and calibration stream exactly as for a full checkpoint, and no
full copy of the expert is ever written or held.

What is supported (PEFT's key layout, `base_model.model.<module>.lora_A.weight`, with or without the
adapter name before `.weight`): `peft_type: LORA`; `r`, `lora_alpha`, `use_rslora` (alpha/sqrt(r));
`rank_pattern` / `alpha_pattern` (PEFT's rule: a key matches a module whose name ends with it);
`fan_in_fan_out` (Conv1D-style weights, ΔW transposed); `target_modules` as a list or a regex; LoRA
on Linear and on Embedding (`lora_embedding_A/B`); `modules_to_save` and trained biases (stored as
full tensors: they replace the base's). Refused before any work, naming the adapter: DoRA
(`use_dora`), `lora_bias`, other PEFT types, LoRA on convolutions, keys that name no base weight, a
target module that matches nothing in the base, a rank or shape that does not fit. An adapter whose
`base_model_name_or_path` names another model than the base given is applied when its shapes fit, with
a warning kept in featcal.json (`base_name_warning`): names differ for renamed local copies of the
right base, so the name alone cannot decide.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import regex
import torch

from featcal.errors import CheckpointError, ConfigError
from featcal.io.read.layouts import RenamedSource

log = logging.getLogger(__name__)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_PICKLE = "adapter_model.bin"
PREFIX = "base_model.model."
# adapter_config.json options that change what the weights mean and that featcal does not implement
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) rescales each column by a learned magnitude",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
    "layer_replication": "layer_replication duplicates base layers",
    "trainable_token_indices": "trainable_token_indices trains selected embedding rows",
    "target_parameters": "target_parameters adapts raw parameters, not modules",
    "megatron_config": "Megatron-parallel LoRA layers",
}
MAX_CONFIG_BYTES = 16 << 20
PATTERN_SECONDS = 2.0  # all of one adapter's regular expressions together (see _Patterns)
MAX_PATTERN_LENGTH = 10_000
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|lora_embedding_B)(?:\.[^.]+)?\.weight$")
_LORA_EMBEDDING_KEY = re.compile(r"^(?P<module>.+)\.(?P<kind>lora_embedding_A|lora_embedding_B)(?:\.[^.]+)?$")


EXPERT_KINDS = ("full", "adapter")  # --expert-kind NAME=KIND: how a folder holding both is read
_FULL_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def is_adapter_dir(path: Any) -> bool:
    """A local folder holding a PEFT adapter (its config file is what marks it)."""
    if not isinstance(path, (str, Path)):
        return False
    p = Path(path).expanduser()
    return p.is_dir() and (p / ADAPTER_CONFIG).is_file()


def full_weight_files(path: Any) -> list[str]:
    """The files of a folder that hold a whole model's weights (not the adapter's, nor a Trainer's
    `training_args.bin` / `optimizer.pt`): what a checkpoint reader would read instead of the adapter."""
    if not isinstance(path, (str, Path)) or not Path(path).expanduser().is_dir():
        return []
    found = []
    for f in sorted(Path(path).expanduser().iterdir()):
        if not f.is_file() or f.name.startswith("adapter_model"):
            continue
        if f.name in _FULL_WEIGHTS or f.suffix.lower() in (".safetensors", ".gguf"):
            found.append(f.name)
    return found


def reads_as_adapter(path: Any, label: str, kind: str | None = None, *, may_be_adapter: bool = True) -> bool:
    """Whether input `path` is read as a LoRA adapter over the base (else as a checkpoint of its own).

    The one place merge and calibrate decide it. A folder holding an adapter AND full weights (PEFT's
    `merge_and_unload()` saved beside the adapter, a hub repo shipping both) is ambiguous: the two readings
    give different experts, so it is refused unless `kind` ("full" / "adapter", --expert-kind NAME=KIND)
    says which. `may_be_adapter=False` (the base, the merged model): such a folder is read as its full
    weights, the only reading a model that is no expert has; featcal.json says so (`kind_record`).
    """
    if kind is not None and kind not in EXPERT_KINDS:
        raise ConfigError(f"{label}: expert kind {kind!r} is not one of {', '.join(EXPERT_KINDS)}")
    adapter = is_adapter_dir(path)
    full = full_weight_files(path) if adapter else []
    if kind == "adapter" and not adapter:
        raise ConfigError(f"{label}: --expert-kind adapter, but {path} holds no {ADAPTER_CONFIG}")
    if kind == "full" and adapter and not full:
        raise ConfigError(f"{label}: --expert-kind full, but {path} holds only a LoRA/PEFT adapter, no full weights")
    if not adapter or kind == "adapter":
        return adapter
    if not full:
        return True  # an adapter only (where a model is needed, the caller refuses it)
    if kind == "full" or not may_be_adapter:
        return False
    name = label.removeprefix("expert ").strip("'")
    raise CheckpointError(
        f"{label}: {path} holds both full weights ({', '.join(full)}) and a LoRA/PEFT adapter ({ADAPTER_CONFIG}); "
        f"featcal cannot tell which is the expert: pass --expert-kind {name}=full or {name}=adapter "
        "(expert_kind in a run file, featcal.merge or featcal.calibrate)"
    )


def kind_record(path: Any, as_adapter: bool) -> dict[str, Any]:
    """What featcal.json says of how an input folder holding adapter files was read ({} for any other)."""
    if as_adapter or not is_adapter_dir(path):
        return {}
    return {"read_as_kind": "full", "not_applied": sorted(
        f.name for f in Path(path).expanduser().iterdir() if f.name == ADAPTER_CONFIG or f.name.startswith("adapter_model"))}


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def key_pattern(key: str) -> str:
    """A rank_pattern / alpha_pattern key as PEFT reads it: the module name, or its end after a '.'."""
    return rf"(?:^|.*\.)(?:{key})"


class _Patterns:
    """The regular expressions of one adapter config (target_modules, rank_pattern / alpha_pattern keys), run
    with a bound: a crafted pattern that backtracks catastrophically is refused, not waited on.

    Why the `regex` package: it runs Python's `re` syntax (PEFT's) and takes a `timeout`; `re` cannot be
    interrupted once in C. It is a dependency of transformers, so always there. Every pattern of one adapter
    shares PATTERN_SECONDS, and a pattern is at most MAX_PATTERN_LENGTH characters.
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self.deadline = time.monotonic() + PATTERN_SECONDS
        self._compiled: dict[str, Any] = {}

    def compile(self, pattern: str, what: str, shown: str | None = None):
        """`pattern` compiled; `shown`: the user's text it was built from, for messages."""
        shown = pattern if shown is None else shown
        if pattern not in self._compiled:
            if len(pattern) > MAX_PATTERN_LENGTH:
                raise CheckpointError(f"{self.where}: {what} is a pattern of {len(pattern)} characters; at most "
                                      f"{MAX_PATTERN_LENGTH}")
            try:
                self._compiled[pattern] = regex.compile(pattern)
            except (regex.error, RecursionError, OverflowError) as exc:
                raise CheckpointError(f"{self.where}: {what} {shown[:80]!r} is not a valid regular expression "
                                      f"({exc})") from None
        return self._compiled[pattern]

    def fullmatch(self, pattern: str, text: str, what: str, shown: str | None = None) -> bool:
        compiled = self.compile(pattern, what, shown)
        left = self.deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            return compiled.fullmatch(text, timeout=left) is not None
        except TimeoutError:
            raise CheckpointError(
                f"{self.where}: matching {what} {(shown or pattern)[:80]!r} against the module names took over "
                f"{PATTERN_SECONDS:g} s (a pattern that backtracks catastrophically); simplify it or list the modules"
            ) from None

    def pattern_key(self, patterns: Mapping[str, Any], module: str, what: str) -> str | None:
        """PEFT's rule for rank_pattern / alpha_pattern: the first key that is `module` or ends it after a '.'."""
        for key in patterns:
            if module == key or self.fullmatch(key_pattern(key), module, f"{what} key", key):
                return key
        return None

    def targets(self, target_modules: Any, module: str) -> bool:
        """Whether `module` is targeted (PEFT: a regex must match the whole name; a list, the last parts)."""
        if target_modules is None:
            return True
        if isinstance(target_modules, str):
            return target_modules == "all-linear" or self.fullmatch(target_modules, module, "target_modules")
        return any(module == t or module.endswith("." + t) for t in target_modules)


class LoraSource(RenamedSource):
    """An expert = base + a LoRA adapter, read under the base's names, one adapted tensor at a time.

    A RenamedSource (io/read/layouts.py) over the base, so that validation, the streaming merge, the
    whole-model merges (`load_view`) and reports treat it like any other view of a checkpoint.
    """

    def __init__(self, adapter_dir: str | Path, base: Any, label: str, *, allow_pickle: bool = False) -> None:
        self.adapter_dir = Path(adapter_dir).expanduser()
        self.label = label
        config_file = self.adapter_dir / ADAPTER_CONFIG
        try:
            if config_file.stat().st_size > MAX_CONFIG_BYTES:
                raise ValueError(f"it is over {MAX_CONFIG_BYTES >> 20} MiB, no adapter config is")
            self.adapter_config = json.loads(config_file.read_text())
        except (OSError, ValueError, RecursionError) as exc:
            raise CheckpointError(f"{label}: cannot read {config_file}: {exc}") from None
        if not isinstance(self.adapter_config, dict):
            raise CheckpointError(f"{label}: {config_file} holds a JSON {type(self.adapter_config).__name__}, not the "
                                  "object of an adapter config")
        super().__init__(base, {k: k for k in base.keys()}, base.config, view=f"LoRA adapter {self.adapter_dir}")
        self.path = self.adapter_dir
        self._patterns = _Patterns(self._where())
        self._check_config()
        self._tensors = self._load_adapter_tensors(allow_pickle)
        self._lora: dict[str, tuple[str, str, float, bool]] = {}  # base weight -> (A key, B key, scale, embedding)
        self._replace: dict[str, str] = {}  # base tensor -> adapter key holding its full value
        self._plan(base)

    # --- reading the adapter -----------------------------------------------------------------------
    def _where(self) -> str:
        return f"{self.label} (adapter {self.adapter_dir})"

    def _check_config(self) -> None:
        cfg = self.adapter_config
        peft_type = str(cfg.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise CheckpointError(f"{self._where()}: peft_type {peft_type!r} is not supported; featcal applies LoRA adapters")
        for key, what in UNSUPPORTED.items():
            if cfg.get(key):
                raise CheckpointError(f"{self._where()}: {key} is set ({what}); featcal does not apply such adapters")
        r = cfg.get("r")
        if not _is_rank(r):
            raise CheckpointError(f"{self._where()}: adapter_config.json has no valid rank r ({r!r}); r is an integer >= 1")
        if "lora_alpha" in cfg and not _is_number(cfg["lora_alpha"]):
            raise CheckpointError(f"{self._where()}: lora_alpha is {cfg['lora_alpha']!r}; it must be a finite number")
        for key in ("use_rslora", "fan_in_fan_out"):  # JSON "false" is a string, and a non-empty string is truthy
            if key in cfg and not isinstance(cfg[key], bool):
                raise CheckpointError(f"{self._where()}: {key} is {cfg[key]!r}; it must be true or false")
        for key, valid, what in (("rank_pattern", _is_rank, "an integer >= 1"), ("alpha_pattern", _is_number, "a number")):
            patterns = cfg.get(key)
            if patterns is None:
                continue
            if not isinstance(patterns, dict):
                raise CheckpointError(f"{self._where()}: {key} is a {type(patterns).__name__}; it must map module "
                                      "names to values")
            for name, value in patterns.items():
                self._patterns.compile(key_pattern(name), f"{key} key", name)
                if not valid(value):
                    raise CheckpointError(f"{self._where()}: {key}[{name!r}] is {value!r}; it must be {what}")
        targets = cfg.get("target_modules")
        if isinstance(targets, str):
            if targets != "all-linear":
                self._patterns.compile(targets, "target_modules")
        elif targets is not None and (not isinstance(targets, list) or not all(isinstance(t, str) for t in targets)):
            raise CheckpointError(f"{self._where()}: target_modules is {str(targets)[:80]}; it must be a regular "
                                  "expression or a list of module names")

    def _load_adapter_tensors(self, allow_pickle: bool) -> dict[str, torch.Tensor]:
        """The adapter's tensors (small: rank-r factors), read once."""
        st, pickled = self.adapter_dir / ADAPTER_WEIGHTS, self.adapter_dir / ADAPTER_PICKLE
        if st.is_file():
            from safetensors import safe_open

            try:
                with safe_open(str(st), framework="pt", device="cpu") as fh:
                    return {k: fh.get_tensor(k) for k in fh.keys()}
            except Exception as exc:
                raise CheckpointError(f"{self._where()}: cannot read {st.name}: {exc} (truncated?)") from None
        if pickled.is_file():
            if not allow_pickle:
                raise CheckpointError(
                    f"{self._where()} holds only a pickled {ADAPTER_PICKLE}; pickles can run code when loaded, so "
                    "featcal refuses them (convert it to safetensors, or pass --allow-pickle)"
                )
            try:
                return dict(torch.load(pickled, map_location="cpu", weights_only=True))
            except Exception as exc:
                raise CheckpointError(f"{self._where()}: cannot load {pickled.name} (weights_only): {exc}") from None
        raise CheckpointError(f"{self._where()}: no {ADAPTER_WEIGHTS} next to {ADAPTER_CONFIG}")

    def _base_name(self, module: str, suffix: str, base_keys: set[str], key: str) -> str:
        """The base tensor `<module>.<suffix>` an adapter key refers to (PEFT's prefix dropped)."""
        name = f"{module.removeprefix(PREFIX)}.{suffix}"
        if name in base_keys:
            return name
        ends = [k for k in base_keys if k.endswith("." + name) or name.endswith("." + k)]
        if len(ends) == 1:  # the base saved with or without the task head's prefix (model. / transformer.)
            return ends[0]
        raise CheckpointError(f"{self._where()}: tensor {key!r} adapts {name!r}, which the base does not have")

    def _plan(self, base: Any) -> None:
        cfg = self.adapter_config
        base_keys = set(base.keys())
        r0, alpha0 = cfg["r"], cfg.get("lora_alpha", cfg["r"])
        ranks, alphas = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
        rslora, fan_in_fan_out = bool(cfg.get("use_rslora")), bool(cfg.get("fan_in_fan_out"))
        pairs: dict[str, dict[str, str]] = {}
        for key in sorted(self._tensors):
            found = _LORA_KEY.match(key) or _LORA_EMBEDDING_KEY.match(key)
            if found:
                pairs.setdefault(found["module"], {})[found["kind"].replace("embedding_", "")] = key
            elif ".lora_" in key:
                raise CheckpointError(f"{self._where()}: tensor {key!r} is not a LoRA factor featcal knows")
            else:  # modules_to_save / trained biases: full tensors
                stripped = re.sub(r"\.modules_to_save\.[^.]+\.", ".", key)
                module, _, suffix = stripped.rpartition(".")
                self._replace[self._base_name(module, suffix, base_keys, key)] = key
        if not pairs and not self._replace:
            raise CheckpointError(f"{self._where()}: {ADAPTER_WEIGHTS} holds no LoRA weights")
        targets = cfg.get("target_modules")
        for module, keys in sorted(pairs.items()):
            if set(keys) != {"lora_A", "lora_B"}:
                raise CheckpointError(f"{self._where()}: module {module!r} has {sorted(keys)} but needs lora_A and lora_B")
            short = module.removeprefix(PREFIX)
            if not self._patterns.targets(targets, short):
                raise CheckpointError(
                    f"{self._where()}: its weights adapt {short!r}, which target_modules {targets!r} does not name"
                )
            a, b = self._tensors[keys["lora_A"]], self._tensors[keys["lora_B"]]
            embedding = "embedding" in keys["lora_A"]
            name = self._base_name(module, "weight", base_keys, keys["lora_A"])
            rank_key = self._patterns.pattern_key(ranks, short, "rank_pattern")
            alpha_key = self._patterns.pattern_key(alphas, short, "alpha_pattern")
            r = ranks[rank_key] if rank_key is not None else r0
            alpha = alphas[alpha_key] if alpha_key is not None else alpha0
            shape = tuple(base.meta(name)[0])
            if len(shape) != 2 or a.dim() != 2 or b.dim() != 2:
                raise CheckpointError(
                    f"{self._where()}: {short!r} is not a 2-D weight with 2-D factors (LoRA on convolutions is not supported)"
                )
            # Linear: A (r, in), B (out, r), ΔW = B A of shape (out, in) [transposed with fan_in_fan_out];
            # Embedding: A (r, num_embeddings), B (dim, r), ΔW = (B A)^T of shape (num_embeddings, dim)
            want_a = (r, shape[1 if not (embedding or fan_in_fan_out) else 0])
            want_b = (shape[0 if not (embedding or fan_in_fan_out) else 1], r)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise CheckpointError(
                    f"{self._where()}: {short!r}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the "
                    f"base weight {shape} with rank {r} (expected {want_a} and {want_b})"
                )
            scale = alpha / math.sqrt(r) if rslora else alpha / r
            self._lora[name] = (keys["lora_A"], keys["lora_B"], scale, embedding or fan_in_fan_out)
        if isinstance(targets, list):
            modules = {n.rpartition(".")[0] for n in base_keys}
            for t in targets:
                if not any(m == t or m.endswith("." + t) for m in modules):
                    raise CheckpointError(f"{self._where()}: target module {t!r} matches nothing in the base")
        for name, key in self._replace.items():
            got, want = tuple(self._tensors[key].shape), tuple(base.meta(name)[0])
            if got != want:
                raise CheckpointError(f"{self._where()}: {key!r} has shape {got} but the base's {name!r} has {want}")

    # --- the view ------------------------------------------------------------------------------------
    @property
    def adapted(self) -> list[str]:
        """Base tensors this adapter changes (LoRA deltas and replaced tensors)."""
        return sorted({*self._lora, *self._replace})

    def get(self, name: str) -> torch.Tensor:
        if name in self._replace:
            return self._tensors[self._replace[name]]
        w = super().get(name)
        if name not in self._lora:
            return w
        a_key, b_key, scale, transpose = self._lora[name]
        a, b = self._tensors[a_key].to(torch.float32), self._tensors[b_key].to(torch.float32)
        delta = b @ a
        if transpose:
            delta = delta.T
        return (w.to(torch.float32) + scale * delta).to(w.dtype)

    def describe(self) -> dict[str, Any]:
        """What featcal.json says of this expert."""
        from featcal.io.read.hashes import file_sha256

        files = {p.name: file_sha256(p) for p in sorted(self.adapter_dir.iterdir())
                 if p.is_file() and p.suffix in {".safetensors", ".json", ".bin"}}
        cfg = self.adapter_config
        return {
            "path": str(self.adapter_dir), "sha256": files, "lora_adapter": True,
            "applied_to": str(self.source.path), "base_model_name_or_path": cfg.get("base_model_name_or_path"),
            "r": cfg.get("r"), "lora_alpha": cfg.get("lora_alpha"), "use_rslora": bool(cfg.get("use_rslora")),
            "adapted_tensors": len(self.adapted),
            "base_name_warning": getattr(self, "base_name_warning", None),
        }


def base_name_mismatch(adapter_config: Mapping[str, Any], base_path: Any, base_config: Mapping[str, Any]) -> str | None:
    """A warning when the adapter names another base than the one given (by its last path component)."""
    named = adapter_config.get("base_model_name_or_path")
    if not named:
        return None
    wanted = Path(str(named)).name
    known = {Path(str(base_path)).name, Path(str(base_config.get("_name_or_path", ""))).name}
    if Path(str(base_path)).is_file():  # a GGUF file: SmolLM2-135M-Instruct.Q4_1.gguf names SmolLM2-135M-Instruct
        known.add(Path(str(base_path)).name.split(".")[0])
    if wanted in known:
        return None
    return (f"the adapter was trained on {named!r}, the base given is {base_path}; its shapes fit, so it is "
            "applied, but check that this is the base it was trained on")


def open_adapter(adapter_dir: str | Path, base: Any, label: str, *, allow_pickle: bool = False) -> LoraSource:
    """An adapter folder as an expert over `base` (a TensorSource); refuses what it cannot apply."""
    source = LoraSource(adapter_dir, base, label, allow_pickle=allow_pickle)
    warning = base_name_mismatch(source.adapter_config, getattr(base, "path", ""), base.config)
    source.base_name_warning = warning  # featcal.json says it too
    if warning:
        log.warning("%s: %s", label, warning)
    return source
