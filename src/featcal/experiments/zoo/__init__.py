"""The offline model zoo: a pretrained CLIPVisionModel base, frozen probe heads and 8 task experts."""

from featcal.experiments.zoo.build import build_zoo
from featcal.experiments.zoo.presets import PRESETS, get_preset
from featcal.experiments.zoo.store import Zoo

__all__ = ["PRESETS", "Zoo", "build_zoo", "get_preset"]
