"""mergekit's YAML as a featcal run file: `featcal run mergekit.yml [--out DIR]`.

mergekit (arcee-ai) is where most people who merge LLMs start; its configuration names the method, the
base and each model with its parameters. This module translates such a file into featcal's run-file
mapping (featcal.config.RunConfig), so that the same file merges the same way in featcal and can carry a
featcal `calibrate:` section beside mergekit's keys. What is read and how each method maps is documented
in docs/mergekit.md; in short, for the methods both tools have:

- linear:           Σ w·θ / Σ w (normalize, default true) over the models, the base_model included as an
                    input when given (mergekit's rule) -> featcal `linear`;
- task_arithmetic:  θ0 + λ·Σ w·τ (÷ Σ w with normalize, default false) -> featcal `task_arithmetic`;
- ties:             per-tensor magnitude trim at each model's density (default 1), sign election on the
                    weighted sum, weighted disjoint mean (normalize, default true), λ
                    -> featcal `ties`, ties_threshold per_tensor;
- dare_linear:      random drop at keep-probability density, survivors rescaled to the tensor's L1 norm
                    (rescale, default true), weighted sum (normalize, default false), λ -> featcal `dare_ta`;
- dare_ties:        the same drop and rescale, then the TIES sign election (no magnitude trim)
                    -> featcal `dare_ties` at density 1.

The arithmetic is mergekit's too: the methods get `mergekit_arithmetic` = the YAML's `dtype` (else 'inputs'), so
that a bfloat16 YAML is computed in bfloat16 with mergekit's exactly-k TIES trim (featcal.merging.mergekit_arithmetic).
What still differs is said at run time, in a log line: DARE's random masks (featcal's seeded ones), and int8_mask
(read, ignored).

Everything else mergekit can express (another method, slices, per-layer gradients and filters, tokenizer
surgery, chat templates by name, LoRA references) is refused in one line naming it, before any work.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from featcal.config import RunOptions
from featcal.errors import ConfigError

log = logging.getLogger(__name__)

# mergekit method -> (featcal method, mergekit's default normalize, its default rescale)
METHODS: dict[str, tuple[str, bool, bool]] = {
    "linear": ("linear", True, False),
    "task_arithmetic": ("task_arithmetic", False, False),
    "ties": ("ties", True, False),
    "dare_linear": ("dare_ta", False, True),
    "dare_ties": ("dare_ties", False, True),
}
# mergekit's other methods (0.1.x), refused by name
NOT_IMPLEMENTED = (
    "slerp", "nuslerp", "multislerp", "model_stock", "della", "della_linear", "breadcrumbs", "breadcrumbs_ties",
    "passthrough", "sce", "karcher", "nearswap", "arcee_fusion", "ram", "ramplus_tl", "task_adapter",
)
MODEL_PARAMETERS = ("weight", "density")  # per model, or given once under the top-level `parameters`
SHARED_PARAMETERS = ("normalize", "lambda", "rescale", "int8_mask")  # top-level `parameters` only
# featcal's own keys a mergekit file may carry beside mergekit's
FEATCAL_KEYS = ("calibrate", "out", "seed", *RunOptions.model_fields)
MERGEKIT_KEYS = ("merge_method", "base_model", "models", "parameters", "dtype", "out_dtype", "tokenizer_source",
                 "tokenizer", "chat_template", "slices", "modules", "name")


def is_mergekit(data: Mapping[str, Any]) -> bool:
    """A mergekit configuration names its method with `merge_method` (featcal's run files use `merge:`)."""
    return "merge_method" in data


def translate(data: Mapping[str, Any], source: str = "the mergekit config") -> dict[str, Any]:
    """featcal's run-file mapping for a mergekit configuration (ConfigError naming what cannot be read)."""
    where = f"{source}:"
    method = data.get("merge_method")
    if method not in METHODS:
        if method in NOT_IMPLEMENTED:
            raise ConfigError(f"{where} mergekit merge_method {method!r} is not implemented in featcal (it reads "
                              f"{', '.join(METHODS)}); merge with mergekit, then calibrate its output with a "
                              "`merged:` run file")
        raise ConfigError(f"{where} unknown mergekit merge_method {method!r}; featcal reads {', '.join(METHODS)}")
    _refuse_unsupported(data, where)
    featcal_method, default_normalize, default_rescale = METHODS[method]
    shared, defaults = _top_parameters(data.get("parameters"), where)
    base = data.get("base_model")
    if base is not None:
        base = _reference(base, f"{where} base_model")
    elif method != "linear":
        raise ConfigError(f"{where} merge_method {method} needs a base_model")
    models = _models(data.get("models"), where)
    inputs = [(n, p, v) for n, p, v in models if method == "linear" or p != base]  # the base is no task vector
    if method == "linear" and base is not None and all(p != base for _, p, _ in models):
        inputs.append((_unique_name(base, [n for n, _, _ in inputs], where), base, {}))  # mergekit's linear input
    if not inputs:
        raise ConfigError(f"{where} no model to merge besides the base_model")

    weights, densities = _weights_and_densities(inputs, defaults, method, where)
    normalize = shared.get("normalize", default_normalize)
    rescale = shared.get("rescale", default_rescale)
    params: dict[str, Any] = {"weights": weights, "normalize": normalize,
                              "mergekit_arithmetic": _arithmetic(data.get("dtype"))}
    _say_what_differs(method, shared, densities, data.get("seed", 0), source)
    if method != "linear":
        params["scaling"] = shared.get("lambda", 1.0)
    params.update(_sparsity(method, densities, rescale, where))
    if "seed" in data:
        params["seed"] = data["seed"]

    run: dict[str, Any] = {k: data[k] for k in FEATCAL_KEYS if k in data and k != "seed"}
    run["merge"] = {"base": base if base is not None else inputs[0][1],
                    "experts": {n: p for n, p, _ in inputs}, "method": featcal_method, "params": params}
    dtype = data.get("out_dtype", data.get("dtype"))
    if dtype is not None:
        run["dtype"] = dtype
    tokenizer = data.get("tokenizer_source")
    if tokenizer is not None:
        run["tokenizer_source"] = _tokenizer_source(tokenizer, base, inputs, where)
    return run


def _weights_and_densities(inputs: list[tuple[str, Any, dict]], defaults: Mapping[str, Any], method: str,
                           where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Each merged model's weight (required) and density (1.0 by default; refused for linear and task_arithmetic),
    from its own parameters, else the top-level ones."""
    weights, densities = {}, {}
    for name, _, values in inputs:
        weight = values.get("weight", defaults.get("weight"))
        if weight is None:
            raise ConfigError(f"{where} model {name!r} has no weight (mergekit requires one per model for "
                              f"{method}; give it under the model's parameters or the top-level parameters)")
        weights[name] = weight
        density = values.get("density", defaults.get("density", 1.0))
        if method in ("linear", "task_arithmetic") and density != 1.0:
            raise ConfigError(f"{where} model {name!r}: {method} takes no density")
        densities[name] = density
    return weights, densities


def _sparsity(method: str, densities: Mapping[str, Any], rescale: bool, where: str) -> dict[str, Any]:
    """The TIES / DARE parameters of mergekit's densities and rescale, as featcal's methods take them."""
    params: dict[str, Any] = {}
    if method == "ties":
        params.update(ties_threshold="per_tensor", density=1.0, densities=densities)
    if method.startswith("dare_"):
        drops = {}
        for name, density in densities.items():
            if not isinstance(density, (int, float)) or isinstance(density, bool) or not 0.0 < density <= 1.0:
                raise ConfigError(f"{where} model {name!r}: density {density!r} is outside (0, 1]")
            drops[name] = 1.0 - density
        params.update(drop_rates=drops, dare_rescale="l1" if rescale else "none")
        if method == "dare_ties":
            params.update(density=1.0, ties_threshold="per_tensor")  # mergekit's dare_ties trims by the drop only
    elif rescale:
        raise ConfigError(f"{where} rescale: true is not implemented for {method} in featcal")
    return params


def _arithmetic(dtype: Any) -> Any:
    """The methods' mergekit_arithmetic: mergekit computes in the YAML's `dtype` (its inputs cast to it), else in
    the inputs' own dtypes ('inputs'); a name the parameter does not know is refused by its validation."""
    if dtype is None:
        return "inputs"
    return dtype.removeprefix("torch.") if isinstance(dtype, str) else dtype


def _say_what_differs(method: str, shared: Mapping[str, Any], densities: Mapping[str, Any], seed: Any,
                      source: str) -> None:
    """Log, at run time, what featcal does not do as mergekit does for this YAML: DARE's random masks, and
    int8_mask (read, ignored)."""
    if method.startswith("dare_") and any(d != 1.0 for d in densities.values()):
        log.warning("%s: DARE's random masks are featcal's own (drawn from seed %s per expert and tensor), not "
                    "mergekit's (torch's global generator): the two tools drop different entries, so this merge "
                    "differs from mergekit-yaml's output by the random draw (equal in expectation); everything "
                    "after the mask follows mergekit", source, seed)
    if "int8_mask" in shared:
        log.info("%s: int8_mask is ignored: in mergekit it only stores the sign mask in int8 to save memory, and "
                 "leaves the merge unchanged", source)


def _refuse_unsupported(data: Mapping[str, Any], where: str) -> None:
    unknown = [k for k in data if k not in MERGEKIT_KEYS and k not in FEATCAL_KEYS and k != "merge"]
    if unknown:
        raise ConfigError(f"{where} unknown key(s) {', '.join(map(str, unknown))} (mergekit's "
                          f"{', '.join(MERGEKIT_KEYS)}, or featcal's {', '.join(FEATCAL_KEYS)})")
    if "merge" in data:
        raise ConfigError(f"{where} holds both mergekit's merge_method and featcal's merge:; keep one")
    for key, what in (("slices", "slices (layer ranges)"), ("modules", "modules"),
                      ("tokenizer", "the tokenizer: section (vocabulary surgery); use tokenizer_source"),
                      ("chat_template", "chat_template (featcal carries the base's or the experts' agreed one)")):
        if data.get(key) is not None:
            raise ConfigError(f"{where} mergekit {what} is not supported by featcal")


def _scalar(value: Any, what: str) -> Any:
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{what}: per-layer gradients and filtered values (lists, mappings) are not supported "
                          "by featcal; give one number")
    return value


def _top_parameters(parameters: Any, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(shared parameters, defaults of the per-model ones) from the top-level `parameters`."""
    if parameters is None:
        return {}, {}
    if not isinstance(parameters, Mapping):
        raise ConfigError(f"{where} parameters must be a mapping")
    shared, defaults = {}, {}
    for key, value in parameters.items():
        value = _scalar(value, f"{where} parameters.{key}")
        if key in SHARED_PARAMETERS:
            shared[key] = value
        elif key in MODEL_PARAMETERS:
            defaults[key] = value
        else:
            raise ConfigError(f"{where} parameter {key!r} is not read by featcal (it reads "
                              f"{', '.join(SHARED_PARAMETERS + MODEL_PARAMETERS)})")
    return shared, defaults


def _reference(value: Any, what: str) -> str:
    """A model reference: a path or hub id (mergekit's `model+lora` and mapping forms are refused)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{what}: a model path or hub id, not {value!r}")
    if "+" in value:
        raise ConfigError(f"{what}: {value!r} applies a LoRA with mergekit's '+' syntax, which featcal does not "
                          "read; give the adapter folder itself as the model")
    return value


def _unique_name(path: str, taken: list[str], where: str) -> str:
    name = PurePath(path.rstrip("/")).name or path
    if name in taken:
        raise ConfigError(f"{where} two models would both be named {name!r} (the folder's name); give each a "
                          "featcal `name:` in its models entry")
    return name


def _models(models: Any, where: str) -> list[tuple[str, str, dict[str, Any]]]:
    """(featcal name, path, per-model parameters) of each `models` entry."""
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{where} models must be a non-empty list of {{model: PATH, parameters: {{...}}}}")
    out: list[tuple[str, str, dict[str, Any]]] = []
    for i, entry in enumerate(models):
        if not isinstance(entry, Mapping) or "model" not in entry:
            raise ConfigError(f"{where} models[{i}] must be a mapping with a `model:` key")
        extra = [k for k in entry if k not in ("model", "parameters", "name")]
        if extra:
            raise ConfigError(f"{where} models[{i}]: unknown key(s) {', '.join(map(str, extra))}")
        path = _reference(entry["model"], f"{where} models[{i}].model")
        name = entry.get("name") or _unique_name(path, [n for n, _, _ in out], where)
        if name in [n for n, _, _ in out]:
            raise ConfigError(f"{where} models[{i}]: the name {name!r} is taken")
        values = {}
        for key, value in (entry.get("parameters") or {}).items():
            if key not in MODEL_PARAMETERS:
                raise ConfigError(f"{where} models[{i}].parameters.{key}: featcal reads only "
                                  f"{', '.join(MODEL_PARAMETERS)} per model")
            values[key] = _scalar(value, f"{where} models[{i}].parameters.{key}")
        out.append((str(name), path, values))
    return out


def _tokenizer_source(value: Any, base: str | None, inputs: list[tuple[str, str, dict]], where: str) -> str:
    """mergekit's tokenizer_source (base, or a model reference) as featcal's (base, or an expert's name)."""
    if value == "base" or (base is not None and value == base):
        return "base"
    if value == "union":
        raise ConfigError(f"{where} tokenizer_source: union (a merged vocabulary) is not supported by featcal; use "
                          "base or one of the models")
    for name, path, _ in inputs:
        if value in (path, name):
            return name
    raise ConfigError(f"{where} tokenizer_source {value!r} is neither base nor one of the models")
