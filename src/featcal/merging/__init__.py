"""Merging fine-tuned experts into their base: pure maths (methods), streaming driver (api).

`merge` streams the experts tensor by tensor; `available_methods()` lists what `method=` accepts,
and `register` adds a method (see featcal.merging.registry).
"""

from featcal.merging.api import merge
from featcal.merging.registry import Merger, available_methods, register

__all__ = ["merge", "available_methods", "register", "Merger"]
