"""Where the models live during a calibration: wholly on the device, or offloaded block by block.

Without offloading (the default) the merged model and the expert template are moved to the device
once and stay there, and so do the chains: the whole run needs two models and every chain in
device memory. With `offload_blocks` both models stay on the host (CPU) and only what the current
step runs is put on the device:

- while block-0 inputs are captured: the stems (everything under a stack's entry module except the
  blocks: embeddings, final norms, rotary tables) of both models, and the merged model's block 0,
  which the one-time context replay check runs;
- while block l is calibrated: block l of the merged model and block l of the template. Expert
  weights are copied straight into the template's device block, one tensor at a time, and the
  solved parameters go back to the host with the merged block.

The chains are then held on the host and each batch's entry is moved to the device when it is
used, so a device's peak is one block per model, the statistics and one batch (the planner's
"device" lines). Every move goes through `Placement._place`, the one place a test can watch.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from featcal.blocks.structure import Stack, get_path

log = logging.getLogger("featcal.calibration")

HOST = torch.device("cpu")


def stem_parts(model: nn.Module, stacks: Sequence[Stack]) -> list[tuple[nn.Module, bool]]:
    """(module, recurse) pairs covering every stack entry's parameters and buffers except its blocks.

    A module holding no block list is moved whole (recurse=True); one above a block list moves only
    its own tensors (recurse=False) and its children are visited. Modules shared between stacks (T5's
    embedding) are listed once.
    """
    lists = {id(s.blocks(model)) for s in stacks}
    out: list[tuple[nn.Module, bool]] = []
    seen: set[int] = set()

    def walk(mod: nn.Module) -> None:
        if id(mod) in seen or id(mod) in lists:
            return
        seen.add(id(mod))
        if not any(id(sub) in lists for sub in mod.modules()):
            out.append((mod, True))
            return
        out.append((mod, False))
        for child in mod.children():
            walk(child)

    for s in stacks:
        entry = get_path(model, s.entry_path)
        if entry is not None:
            walk(entry)
    return out


class Placement:
    """Moves models, stems and blocks between the host and `device` (see the module docstring)."""

    def __init__(self, device: torch.device | str, offload: bool, host: torch.device = HOST) -> None:
        self.device = torch.device(device)
        self.offload = bool(offload)
        self.host = torch.device(host)
        if self.offload and self.device == self.host:
            log.info("featcal: offload_blocks on device %s: host and device are the same, nothing moves", self.device)

    @property
    def chain_home(self) -> torch.device | None:
        """Where chain entries are held between blocks: the host when offloading, else where they were made."""
        return self.host if self.offload else None

    def _place(self, module: nn.Module, on_device: bool, recurse: bool = True) -> None:
        """Move `module`'s parameters and buffers (its own only, unless `recurse`) to the device or the host.

        nn.Module._apply is what Module.to uses; parameters keep their identity (their .data moves),
        so tied weights stay tied and the engine's references to parameters stay valid.
        """
        target = self.device if on_device else self.host
        module._apply(lambda t: t.to(target), recurse=recurse)

    def move(self, module: nn.Module, on_device: bool) -> None:
        """`module` wholly to the device (or back to the host); nothing moves without offloading."""
        if self.offload:
            self._place(module, on_device)

    def setup(self, *models: nn.Module) -> None:
        """Before the run: every model wholly on the device, or (offloading) wholly on the host."""
        for m in models:
            self._place(m, not self.offload)

    @contextmanager
    def stems(self, models: Sequence[nn.Module], stacks: Sequence[Stack],
              blocks: Sequence[nn.Module] = ()) -> Iterator[None]:
        """While capturing block-0 inputs: the stems of `models` (and `blocks`) on the device, then back."""
        if not self.offload:
            yield
            return
        parts = [p for m in models for p in stem_parts(m, stacks)] + [(b, True) for b in blocks]
        moved: list[tuple[nn.Module, bool]] = []
        try:
            for mod, recurse in parts:
                self._place(mod, True, recurse)
                moved.append((mod, recurse))
            yield
        finally:
            for mod, recurse in moved:
                self._place(mod, False, recurse)

    @contextmanager
    def blocks(self, *blocks: nn.Module) -> Iterator[None]:
        """While calibrating one block: `blocks` (the merged one, the template's) on the device, then back."""
        if not self.offload:
            yield
            return
        moved: list[nn.Module] = []
        try:
            for b in blocks:
                self._place(b, True)
                moved.append(b)
            yield
        finally:
            for b in moved:
                self._place(b, False)
