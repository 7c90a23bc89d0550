"""What `featcal supported` prints and docs/supported.md holds: generated from the code, never written by hand.

Support is decided by structure (blocks/support.py), for any model. What is listed here are the model types
the test suite calibrates end to end (tests/blocks/test_families.py builds a tiny random model of each and checks
that calibration lowers the drift, that the output loads, and where it applies that the result equals the
dense reference; tests/calibration/test_moe_checkpoints.py calibrates those whose checkpoints transformers
converts on load from their saved folders through the CLI), each described as `check_model` / `describe` see transformers' default config for it,
built on the meta device, and a few model types refused, with the reason the check gives.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from featcal.errors import FeatCalError

# the model types tests/blocks/test_families.py calibrates (a test keeps the two lists equal)
VERIFIED = (
    "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "phimoe", "phi3", "phi", "gemma", "gemma2",
    "gemma3_text",
    "olmo2", "cohere", "gpt2", "gpt_neox", "falcon",
    "bert", "roberta", "xlm-roberta", "deberta-v2", "distilbert", "modernbert", "electra",
    "clip", "siglip", "vit", "dinov2",
    "t5", "mt5", "bart",
)
# model types the checks refuse (tests/blocks/test_families.py checks each is refused from its config in under a second)
REFUSED = ("mamba", "rwkv", "jamba", "albert")


def config_of(name: str | Path) -> Any:
    """The transformers config of a checkpoint directory (its config.json), or the default config of a model type.

    A folder without a config.json, and a name transformers has no model type for, are refused before any
    config class is imported (each imports torch: io/read/configs.py)."""
    from featcal.io.read.configs import load_config

    if Path(name).expanduser().is_dir():
        return load_config(Path(name).expanduser())
    if not _may_be_model_type(str(name)):
        raise FeatCalError(f"{name!r} is neither a checkpoint directory nor a transformers model type")
    import transformers

    try:
        return transformers.AutoConfig.for_model(str(name))
    except ValueError:
        raise FeatCalError(f"{name!r} is neither a checkpoint directory nor a transformers model type") from None


def _may_be_model_type(name: str) -> bool:
    """False when `name` is surely no transformers model type: not in transformers' table of them (read without
    importing a config class, where the installed transformers has that table apart) and nothing could have
    registered one (AutoConfig.register needs configuration_auto imported). True otherwise: AutoConfig decides."""
    if "transformers.models.auto.configuration_auto" in sys.modules:
        return True
    try:
        from transformers.models.auto.auto_mappings import CONFIG_MAPPING_NAMES
    except ImportError:  # a transformers without the table apart
        return True
    return name in CONFIG_MAPPING_NAMES


def verdict(name: str | Path) -> dict[str, Any]:
    """{"name", "supported": True, **describe(...)} or {"name", "supported": False, "why"}, from the config alone.

    The structural check builds the model on the meta device, so torch is imported for every answer but the two
    refusals config_of gives before reading a config."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # default configs warn of token ids past their own defaults: noise here
    try:
        config = config_of(name)
        from featcal.blocks.support import check_config, describe  # torch

        model = check_config(config)
        return {"name": str(name), "supported": True, **describe(model)}
    except FeatCalError as exc:
        return {"name": str(name), "supported": False, "why": " ".join(str(exc).split())}
    finally:
        hf_logging.set_verbosity(level)


def _kinds(calibrated: dict[str, int]) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(calibrated.items()))


def _stacks(v: dict[str, Any]) -> str:
    return "; ".join(f"{s['stack']}: {s['count']} × {s['block']} at `{s['blocks']}`" for s in v["stacks"])


def _per_block(v: dict[str, Any]) -> str:
    return "; ".join(_kinds(s["calibrated"]) for s in v["stacks"])


def _kept(v: dict[str, Any]) -> str:
    kept = {name for s in v["stacks"] for name in s["kept_merged"]}
    return ", ".join(f"`{k}`" for k in sorted(kept)) or "—"


def _types(v: dict[str, Any]) -> str:
    types = sorted({t for s in v["stacks"] for t in s["layer_types"]})
    tokens = " (class token read)" if any(s["class_token"] for s in v["stacks"]) else ""
    return (", ".join(types) or "one") + tokens


def render_text(verdicts: list[dict[str, Any]]) -> str:
    """One paragraph per model type or checkpoint, for the terminal."""
    lines = []
    for v in verdicts:
        if not v["supported"]:
            lines.append(f"{v['name']}: NOT SUPPORTED: {v['why']}")
            continue
        lines.append(f"{v['name']}: supported ({v['model']})")
        for s in v["stacks"]:
            kept = ", ".join(f"{k} ({why})" for k, why in s["kept_merged"].items()) or "nothing"
            types = ", ".join(s["layer_types"]) or "one layer type"
            lines.append(f"  {s['stack']}: {s['count']} × {s['block']} at {s['blocks']} (entry {s['entry']}; {types}"
                         f"{'; output read from the class token' if s['class_token'] else ''})")
            lines.append(f"    calibrated per block: {_kinds(s['calibrated'])}")
            lines.append(f"    kept merged: {kept}")
    return "\n".join(lines)


def render_markdown(verified: list[dict[str, Any]], refused: list[dict[str, Any]]) -> str:
    """docs/supported.md."""
    out = [
        "# Supported models",
        "",
        "<!-- generated by `featcal supported --markdown`; tests/blocks/test_families.py checks it is current -->",
        "",
        "FeatCal calibrates any block-stacked transformers model whose structure it can find: a stack of residual",
        "blocks (an `nn.ModuleList` under the base model; an encoder and a decoder; a vision tower), with Linear /",
        "Conv1D layers and norms inside. Support is decided from the model's structure, not from a list: run",
        "`featcal supported MODEL_TYPE_OR_CHECKPOINT` to check any model from its config alone (no weights read).",
        "How a family is found, and where per-family code goes: [families.md](families.md).",
        "",
        "## Verified families",
        "",
        "Calibrated end to end by the test suite on tiny random models (tests/blocks/test_families.py). Those whose",
        "checkpoints hold tensors transformers converts on load (mixture-of-experts experts, one tensor per expert) are",
        "also calibrated by `featcal calibrate` from the folders `save_pretrained` writes",
        "(tests/calibration/test_moe_checkpoints.py). Described here as featcal sees transformers' default config of",
        "each model type.",
        "",
        "| model type | model | stacks | calibrated per block | layer types | kept merged |",
        "|---|---|---|---|---|---|",
    ]
    for v in verified:
        if not v["supported"]:
            out.append(f"| {v['name']} | — | NOT SUPPORTED: {v['why']} | | | |")
            continue
        out.append(f"| {v['name']} | {v['model']} | {_stacks(v)} | {_per_block(v)} | {_types(v)} | {_kept(v)} |")
    out += ["", "## Refused", "", "Refused from the config alone, before any weight is read:", "",
            "| model type | why |", "|---|---|"]
    for v in refused:
        out.append(f"| {v['name']} | {'supported' if v['supported'] else v['why']} |")
    return "\n".join(out) + "\n"


def markdown() -> str:
    """docs/supported.md, from the checks of VERIFIED and REFUSED."""
    return render_markdown([verdict(t) for t in VERIFIED], [verdict(t) for t in REFUSED])
