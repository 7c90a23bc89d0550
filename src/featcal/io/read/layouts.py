"""One naming for a family whose checkpoints were saved in different layouts.

Why: the hub's own pairings do not share tensor names. The CLIP commands of docs/quickstart.md pair a full
`CLIPModel` base (openai/clip-vit-base-patch32) with experts that are `CLIPVisionModel`s saved by
transformers 4 (every key under `vision_model.`); FLAN-T5 experts saved by transformers 4 store the
tied embeddings (`encoder.embed_tokens.weight`, ...) that a transformers-5 base stores once; some
versions keep a `position_ids` buffer that others drop. `harmonise` views every checkpoint of such
a family under the names a fresh model of the family's class has (transformers' own renaming
rules, the ones `from_pretrained` applies), so that validation, the merge and calibration compare
like with like. A family whose checkpoints already share their names is returned untouched.

A full CLIPModel base with CLIPVisionModel experts is viewed as its vision tower: what is merged
and calibrated is a `CLIPVisionModel` (transformers-5 names, `architectures: ["CLIPVisionModel"]`),
the layout `featcal reproduce` writes too; the base's text tower and projections are not part of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from featcal.errors import CheckpointError
from featcal.io.read.tensor_source import MappedSource

log = logging.getLogger(__name__)

# tensors a model recreates itself (non-persistent buffers in transformers 5) and that some versions saved
RECREATED_BUFFERS = ("position_ids",)


class RenamedSource(MappedSource):
    """A checkpoint's read interface (`path`, `config`, `keys`, `meta`, `get`) under other names."""

    def write_config(self, directory: Path) -> None:
        """The view's config.json when it is not the checkpoint's own (a CLIPModel base's vision tower)."""
        import json

        if self._config == self.source.config:
            return
        (Path(directory) / "config.json").write_text(json.dumps(self._config, indent=2, sort_keys=True) + "\n")


def _template(config: dict) -> torch.nn.Module | None:
    """A model of `config`'s built-in class on the meta device (no memory); None for unknown classes."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from featcal.io.read.models import model_class_for

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return None
    try:
        cfg = CONFIG_MAPPING[model_type].from_dict(config)
        cls = model_class_for(cfg)
        if cls is transformers.AutoModel:
            cls = transformers.AutoModel._model_mapping[type(cfg)]
        with torch.device("meta"):
            return cls(cfg)
    except Exception as exc:  # a config this transformers cannot build: leave the names as they are
        log.debug("no template for %s: %s", model_type, exc)
        return None


def vision_tower_config(clip_config: dict) -> dict:
    """The config.json of a CLIPModel's vision tower saved as a CLIPVisionModel."""
    vision = dict(clip_config.get("vision_config") or {})
    vision["model_type"] = "clip_vision_model"
    vision["architectures"] = ["CLIPVisionModel"]
    for key in ("dtype", "transformers_version"):
        if key in clip_config:
            vision.setdefault(key, clip_config[key])
    return vision


def _recreated(key: str) -> bool:
    return key.endswith(RECREATED_BUFFERS)


def _outside_vision_tower(key: str) -> bool:
    """A CLIPModel key that is not its vision tower's (text tower, projections, logit scale), or recreated."""
    return not key.startswith("vision_model.") or _recreated(key)


def _view(source: Any, label: str, template: torch.nn.Module, config: dict, *, drop: Callable[[str], bool],
          view: str) -> RenamedSource:
    """`source` under `template`'s canonical names; explicit copies of tied tensors must equal their tie.

    A checkpoint key the template does not know is dropped when `drop(key)`, else kept under its own name,
    so that validation names it (an expert with one block more than the base is refused, not truncated).
    """
    from featcal.io.read.param_sources import checkpoint_key_map, parameter_aliases

    keys = source.keys()
    aliases = parameter_aliases(template)  # every name -> all names of that parameter, canonical first
    # model name (aliases too) -> checkpoint key; tensors transformers converts on load (a mixture of experts'
    # per-expert tensors) keep their checkpoint names below: every input of the family holds them so
    found = checkpoint_key_map(template, keys, conversions={})
    key_map: dict[str, str] = {}
    for name in sorted(found, key=lambda n: aliases[n].index(n)):  # canonical spellings first
        canonical = aliases[name][0]
        if canonical not in key_map:
            key_map[canonical] = found[name]
        elif found[name] != key_map[canonical]:  # a tied tensor stored twice: only one value can load
            if not torch.equal(source.get(found[name]), source.get(key_map[canonical])):
                raise CheckpointError(
                    f"{label} ({source.path}): tensor {found[name]!r} differs from {key_map[canonical]!r}, "
                    "which the model ties it to; only one of them can be loaded"
                )
    buffers = set(template.state_dict()) - set(aliases)
    used = set(found.values())  # explicit copies of tied tensors included: they are not extra tensors
    for key in keys:
        if key in used:
            continue
        if key in buffers:
            key_map[key] = key
        elif not drop(key):
            key_map.setdefault(key, key)  # unknown to the class: left for validation to name
    return RenamedSource(source, key_map, config, view)


def harmonise(sources: Mapping[str, Any], reference: str) -> dict[str, Any]:
    """The family's sources under one naming (see the module docstring); `reference` gives the class.

    Untouched when every source already has the reference's model type and tensor names, or when the
    model types differ other than as a CLIPModel and its vision towers (validation then says how).
    """
    from featcal.io.read.sources import ModuleSource

    out = dict(sources)
    if any(isinstance(s, ModuleSource) for s in out.values()):
        return out  # in-memory models already have their class's names
    configs = {label: s.config for label, s in out.items()}
    types = {label: c.get("model_type") for label, c in configs.items()}
    if not all(isinstance(t, str) or t is None for t in types.values()):
        return out  # a model_type that is no string: validation names it
    if set(types.values()) == {"clip", "clip_vision_model"}:
        ref = configs[reference]
        config = ref if types[reference] == "clip_vision_model" else vision_tower_config(ref)
        template = _template(config)
        if template is None:
            return out
        for label, s in out.items():
            whole = types[label] == "clip"
            view = "the vision tower of a CLIPModel" if whole else "a CLIPVisionModel"
            out[label] = _view(s, label, template, config if whole else configs[label],
                               drop=_outside_vision_tower if whole else _recreated, view=view)
        return out
    if len(set(types.values())) != 1:
        return out
    names = {label: set(s.keys()) for label, s in out.items()}
    if all(n == names[reference] for n in names.values()):
        return out
    template = _template(configs[reference])
    if template is None:
        return out
    for label, s in out.items():
        out[label] = _view(s, label, template, configs[label], drop=_recreated, view="renamed")
    return out


def load_view(source: RenamedSource) -> torch.nn.Module:
    """The model a view describes, in float32, holding the view's tensors under the view's names.

    For the merges computed on whole models (RegMean, WUDI): loading the checkpoint itself would give
    the class of its own config (a whole CLIPModel), not the view's. The model is built fresh, so it
    carries no load-time renaming and `save_pretrained` / `checkpoint_state_dict` give the view's names.
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from featcal.io.read.models import model_class_for
    from featcal.io.read.param_sources import parameter_aliases

    config = CONFIG_MAPPING[source.config["model_type"]].from_dict(source.config)
    model = model_class_for(config)(config).to(torch.float32)
    state = {name: source.get(name) for name in source.keys()}
    result = model.load_state_dict(state, strict=False)
    tied = {n for names in parameter_aliases(model).values() for n in names[1:]}
    missing = [n for n in result.missing_keys if n not in tied]
    if missing or result.unexpected_keys:
        raise CheckpointError(
            f"{source.path}: read as {source.view}, it lacks {missing[:3]} / has unexpected {result.unexpected_keys[:3]}"
        )
    return model.eval()
