"""The Python API's calibration data: what the CLI takes, read the way the CLI reads it.

`featcal.calibrate(..., calibration={"code": "code.jsonl", "chat": convs, "img": batches})`: a task's data
is a source (a path, a hub dataset id, a `datasets.Dataset`, a list of texts, chat conversations, records
or PIL images; docs/data.md) or model-ready batches (a tensor, a dict of tensors, or a list of those,
passed on untouched, a lone batch as a list of one). Every task goes through the data seam's one door
(featcal.data.open_calibration), with the options in the FeatCalConfig, before any model is loaded.

The tokenizer (or image processor) is the `tokenizer=` argument (an object, or a folder holding it),
else the one saved with the merged model, else with the base: a path given, or a model's
`name_or_path` when that is a local folder. A text source with no tokenizer anywhere is refused, naming
where featcal looked. A chat template missing from that tokenizer is looked for beside the experts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import nn

from featcal.config import DEFAULT_MAX_LENGTH, FeatCalConfig, calibration_options, run_options
from featcal.data.calibration import DataReader
from featcal.data.calibration_set import CalibrationSet, open_calibration
from featcal.data.preprocess import has_processor_files, model_modality
from featcal.errors import CalibrationDataError
from featcal.io.read.models import load_config


def resolve_calibration(
    merged: Any, *, base: Any, experts: Mapping[str, Any], calibration: Any, config: FeatCalConfig,
    tokenizer: Any = None, max_length: int = DEFAULT_MAX_LENGTH, allow_fewer: bool = False, progress: bool = False,
) -> tuple[Any, dict[str, dict[str, Any]]]:
    """(`calibration` with every source read into batches, what featcal.json would record per source task).

    Batches pass through untouched (a lone batch as a list of one); no reader is looked for when no task is a
    source. A mapping that is not one, or names other tasks than `experts`, is left for the calibration's own
    checks to refuse.
    """
    run_options(max_length=max_length, allow_fewer=allow_fewer)  # validated as the CLI's flags are
    if not isinstance(calibration, Mapping) or set(calibration) != set(experts):
        return calibration, {}
    data = open_calibration(calibration, options=calibration_options(config, max_length=max_length,
                                                                     allow_fewer=allow_fewer))
    if data.sources:
        data = data.with_reader(_reader(merged, base, experts, tokenizer, data))
    loaded = data.load(batch_size=config.calibration_batch_size, progress=progress)
    return loaded.batches, loaded.records


def _reader(merged: Any, base: Any, experts: Mapping[str, Any], tokenizer: Any, data: CalibrationSet) -> DataReader:
    """What reads the sources: the merged model's config, its (or the base's, or the given) tokenizer or image
    processor, the experts' folders for chat templates."""
    model_config = _config_of(merged)
    model_dir, tokenizer_object = _processor(merged, base, tokenizer, model_config, list(data.sources))
    expert_dirs = {t: _folder_of(e) for t, e in experts.items()}
    return DataReader(model_dir, model_config, tokenizer_object,
                      experts={k: v for k, v in expert_dirs.items() if v is not None})


def _config_of(model: Any):
    if isinstance(model, nn.Module):
        config = getattr(model, "config", None)
        if config is None:
            raise CalibrationDataError(
                f"the merged model ({type(model).__name__}) has no transformers config, which says how to read "
                "calibration data for it; pass batches instead"
            )
        return config
    return load_config(model, error=CalibrationDataError)


def _folder_of(model: Any) -> Path | None:
    """The local folder a model (a path, or a loaded model's name_or_path) was read from, if any."""
    if isinstance(model, nn.Module):
        model = getattr(getattr(model, "config", None), "_name_or_path", None) or getattr(model, "name_or_path", None)
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        return None
    path = Path(model).expanduser()
    return path if path.is_dir() else None


def _processor(merged: Any, base: Any, tokenizer: Any, config, tasks: list[str]) -> tuple[Path | None, Any]:
    """(the folder whose tokenizer / image processor reads the data, or None; a tokenizer object, or None)."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return None, tokenizer
    if tokenizer is not None:
        folder = Path(tokenizer).expanduser()
        if not folder.is_dir():
            raise CalibrationDataError(f"tokenizer={tokenizer!r} is no folder (pass a tokenizer, or its folder)")
        return folder, None
    modality = model_modality(config)
    candidates = [f for f in (_folder_of(merged), _folder_of(base)) if f is not None]
    for folder in candidates:
        if has_processor_files(folder, modality):
            return folder, None
    if modality == "image":  # the image preprocessing falls back to a resize (with a warning)
        return (candidates[0] if candidates else None), None
    looked = ", ".join(str(f) for f in candidates) or "no folder: the models were given as objects"
    raise CalibrationDataError(
        f"task(s) {', '.join(map(repr, tasks))}: reading calibration texts needs the model's tokenizer, and none "
        f"was found (looked in {looked}); pass tokenizer= (a tokenizer, or the folder holding it)"
    )
