"""The options of `featcal reproduce`, validated in one place (CLI flags and Python calls alike)."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from pydantic import Field

from featcal.config import Device, FeatCalConfig, StrictModel, data_field


class ReproduceOptions(StrictModel):
    """`featcal reproduce`'s options; the calibration data options are FeatCal's own (config/data.py)."""

    concern: ClassVar[str] = "reproduce options"

    setting: str
    out: Path
    tasks: list[str] | None = Field(None, description="run only these tasks of the setting")
    num_calibration_examples: int = data_field("num_calibration_examples", description="calibration examples per task")
    calibration_batch_size: int = data_field("calibration_batch_size")
    seed: int = Field(42, ge=0, description="draws the calibration examples and any eval subset")
    max_eval_samples: int | None = Field(None, ge=1, description="evaluate each task on a seeded subset of this "
                                         "many examples (default: the whole split)")
    device: Device = Field("auto", description="auto, cpu, cuda or cuda:N")
    batch_size: int = Field(64, ge=1, description="evaluation batch size")
    model_dir: Path | None = Field(None, description="local models: one folder per hub id, e.g. "
                                   "D/openai/clip-vit-base-patch32/")
    data_dir: Path | None = Field(None, description="local datasets saved with save_to_disk, one folder per id, "
                                  "e.g. D/tanganke/eurosat/ (a config in a subfolder: D/nyu-mll/glue/cola/)")
    scaling: float | None = Field(None, gt=0.0, le=10.0, description="TA scaling; default: the setting's (0.3)")
    # the paper's 512, not the library's DEFAULT_MAX_LENGTH (128): the reproduced figures were made with it
    max_length: int = Field(512, ge=8, description="token limit of text calibration / evaluation inputs (the "
                            "paper's settings: 512)")


    def torch_device(self) -> str:
        """The concrete device; asking for CUDA where there is none is refused before any work."""
        import torch

        from featcal.errors import ConfigError

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {self.device}: CUDA is not available here (use --device cpu or auto)")
        return self.device

    def featcal_config(self) -> FeatCalConfig:
        return FeatCalConfig(
            num_calibration_examples=self.num_calibration_examples,
            calibration_batch_size=self.calibration_batch_size,
            seed=self.seed,
            device=self.torch_device(),
        )

    def identity(self) -> dict:
        """The options that determine the checkpoints: a resumed run must agree on all of them."""
        return {
            "setting": self.setting,
            "tasks": self.tasks,
            "num_calibration_examples": self.num_calibration_examples,
            "calibration_batch_size": self.calibration_batch_size,
            "seed": self.seed,
            "scaling": self.scaling,
            "max_length": self.max_length,
        }
