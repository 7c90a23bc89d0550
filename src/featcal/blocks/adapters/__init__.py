"""The adapter of a model: found from its structure (adapters/structural.py), never from a list of model types.

`adapter_for` checks first that the model can be calibrated at all (blocks/support.py: its stacks are found,
no recurrent or state-space layer, blocks not shared) and refuses it otherwise, naming the part. The one
specialisation, for blocks handing each other a position bias (T5), is chosen by structure as well.
"""

from __future__ import annotations

from torch import nn

from featcal.blocks.adapters.base import Adapter, FinalNorm
from featcal.blocks.adapters.structural import StructuralAdapter
from featcal.blocks.adapters.t5 import PositionBiasAdapter, passes_position_bias
from featcal.blocks.support import check_model

__all__ = ["Adapter", "FinalNorm", "StructuralAdapter", "adapter_for"]


def adapter_for(model: nn.Module) -> Adapter:
    """The adapter for `model`; UnsupportedModelError (a FeatCalError) names what cannot be calibrated."""
    stacks = check_model(model)
    cls = PositionBiasAdapter if passes_position_bias(model, stacks) else StructuralAdapter
    return cls(model)
