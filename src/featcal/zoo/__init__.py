"""The offline model zoo: a pretrained CLIPVisionModel base, frozen probe heads and 8 task experts."""

from featcal.zoo.build import build_zoo
from featcal.zoo.presets import PRESETS, get_preset
from featcal.zoo.store import Zoo

__all__ = ["PRESETS", "Zoo", "build_zoo", "get_preset"]
