"""Block-input capture: run a model until its first block and keep what that block receives."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from featcal.errors import FeatCalError


class _StopForward(Exception):
    """Raised by the block-0 pre-hook: the rest of the model's forward is not needed."""


def _hidden(output: Any) -> torch.Tensor:
    """Blocks return a tensor (CLIP, Llama in transformers 5) or a tuple whose first item is it (T5)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def capture_block_input(module: nn.Module, block: nn.Module, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict]:
    """Run `module(**kwargs)` until `block` is called; return (hidden_states, other arguments by name)."""
    seen: dict[str, Any] = {}

    def hook(_mod, args, kw):
        seen["args"], seen["kwargs"] = args, kw
        raise _StopForward

    handle = block.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        module(**kwargs)
    except _StopForward:
        pass
    finally:
        handle.remove()
    if "args" not in seen:
        raise FeatCalError(f"{type(module).__name__}: the forward never reached {type(block).__name__} 0")
    bound = inspect.signature(block.forward).bind(*seen["args"], **seen["kwargs"])
    params = inspect.signature(block.forward).parameters
    ctx: dict[str, Any] = {}
    hidden_name = next(iter(params))
    for name, value in bound.arguments.items():
        kind = params[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            ctx.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise FeatCalError(f"{type(block).__name__} is called with extra positional arguments")
        elif name != hidden_name:
            ctx[name] = value
    return bound.arguments[hidden_name], ctx
