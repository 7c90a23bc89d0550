"""Reading a checkpoint's transformers config, apart from io/read/models.py so that it imports no torch itself.

transformers 5's config classes import torch wherever torch is installed (configuration_utils through
modeling_rope_utils, each model's configuration module through utils/type_validators), so a config that is
read still brings torch in; what this module spares is featcal's own imports (io/read/models.py and io/read/checkpoint.py
import torch), and a folder without a config.json is refused before transformers is imported at all
(`featcal supported DIR`, tests/cli/test_start_up.py).
"""

from __future__ import annotations

import os
from pathlib import Path

from featcal.errors import CheckpointError, FeatCalError


def load_config(path: str | os.PathLike, *, error: type[FeatCalError] = CheckpointError):
    """The transformers config of a local checkpoint directory, never running code shipped with it.

    Every caller reads a model's config through here (its architecture, modality, input sizes). `error`:
    the exception a failure raises (the calibration-data loaders raise CalibrationDataError, since there the
    config is what decides how to preprocess the data).
    """
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise error(f"model directory {Path(path)} has no config.json: cannot tell the model's architecture "
                    "(nor how to preprocess data for it)")
    import transformers

    try:
        return transformers.AutoConfig.from_pretrained(path, trust_remote_code=False)
    except Exception as exc:  # unknown model_type, custom code (auto_map), broken config.json
        reason = " ".join(str(exc).split())
        if "trust_remote_code" in reason:
            reason = "its config needs custom code shipped with the checkpoint, and featcal never runs such code"
        raise error(f"cannot load the config of {Path(path)}: {reason}") from None
