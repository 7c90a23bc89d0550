"""The check that the engine's replay of a stack is the model's own forward (docs/method.md §3).

The engine calls block l with block 0's context (updated block by block by `adapter.next_context`, and
picked per block by `adapter.block_kwargs`: per layer type where types differ) on the previous block's
output. An architecture that gives a block another mask or bias than that, runs something between two
blocks, or calls a block twice would be calibrated silently wrong, so it is refused here, once per run.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Any

import torch
from torch import nn

from featcal.blocks.adapters import Adapter
from featcal.blocks.capture import hidden_of, split_call
from featcal.blocks.structure import Stack
from featcal.calibration.engine.placement import Placement
from featcal.errors import FeatCalError


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
            return False
        return bool(torch.equal(a, b)) or (a.is_floating_point() and torch.allclose(a, b, rtol=1e-5, atol=1e-6))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or a == b


def check_context_replay(adapter: Adapter, stack: Stack, model: nn.Module, module: nn.Module,
                         kwargs: dict[str, Any], hidden: torch.Tensor, ctx: dict[str, Any],
                         place: Placement | None = None) -> None:
    """Check once, on one batch, that every block is called with what the engine would replay.

    The model's own forward is run once, in full, and each block's call is compared with the replay,
    argument by argument, as it happens (one block's output is held at a time). With `place` offloading,
    each block visits the device for its own call.
    """
    blocks = stack.blocks(model)
    state: dict[str, Any] = {"ctx": ctx, "out": None, "calls": [0] * len(blocks)}
    name = type(model).__name__

    def refuse(why: str) -> FeatCalError:
        return FeatCalError(f"{name}: {stack.name} {why}; FeatCal replays each block on the previous block's output "
                            "with the context it captured, so this architecture is not supported")

    def pre(layer: int, block: nn.Module, args: tuple, kw: dict) -> None:
        state["calls"][layer] += 1
        if state["calls"][layer] > 1:
            raise refuse(f"block {layer} is called more than once per forward")
        if place is not None:
            place.move(block, True)
        h, actual = split_call(block, inspect.signature(block.forward), args, kw)
        predicted = adapter.block_kwargs(stack, layer, state["ctx"])
        for arg in sorted(set(predicted) | set(actual)):
            if not _same(predicted.get(arg), actual.get(arg)):
                raise refuse(f"block {layer} is called with another {arg!r} than block {max(layer - 1, 0)} passes on")
        if layer > 0 and not _same(h, hidden_of(state["out"])):
            raise refuse(f"block {layer}'s input is not block {layer - 1}'s output (something runs between them)")

    def post(layer: int, block: nn.Module, out: Any) -> None:
        if place is not None:
            place.move(block, False)
        state["ctx"] = adapter.next_context(stack, layer, state["ctx"], out)
        state["out"] = out

    handles = []
    for layer, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(partial(_pre_hook, pre, layer), with_kwargs=True))
        handles.append(block.register_forward_hook(partial(_post_hook, post, layer)))
    try:
        module(**kwargs)
    finally:
        for h in handles:
            h.remove()
        if place is not None:
            for block in blocks:
                place.move(block, False)
    missing = [i for i, n in enumerate(state["calls"]) if n == 0]
    if missing:
        raise refuse(f"block(s) {missing} never run in the model's forward")


def _pre_hook(fn, layer: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
    fn(layer, block, args, kwargs)


def _post_hook(fn, layer: int, block: nn.Module, _args: tuple, out: Any) -> None:
    fn(layer, block, out)
