"""The experts' side of a block pass, kept across the candidates of a search (issue 50).

Every candidate of `--tune` is a calibration of another merge (or of the same merge at other knobs) on the
same fit data. Expert t's chain starts at the expert's own stem output and passes only through expert t's
blocks, so what its block forward gives on batch b (the block's output, the Linear inputs and outputs the
statistics read, the block's recording plan) does not depend on the merge, on ρ, λ or α: every candidate
computes it again, bit for bit the same. The tape keeps it from the first candidate and replays it for the
others, so a candidate runs the merged side only.

Never stale: a tape is bound to what determines its entries (the fit batches and the config without the
searched knobs; the experts are the search's own, fixed); bound to anything else it empties itself first. It only saves time: a value
replayed is the value a forward would give (tests check a calibration with a tape against one without,
bit for bit), and past `max_bytes` it stops recording (later blocks are recomputed, as without a tape).
Entries are kept on the host.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from featcal.calibration.engine.chains import map_tensors

log = logging.getLogger("featcal.calibration")

# the knobs a search varies between candidates: the expert side does not depend on them
SEARCHED_KNOBS = frozenset({"anchor_blend_rho", "lambda_ratio", "teacher_interp_alpha"})


@dataclass
class TapeEntry:
    """Expert t's block forward on batch b: its chain context, its raw output, and what its recorder kept."""

    ctx: dict[str, Any] | None
    raw: Any
    inputs: dict[str, torch.Tensor]
    outputs: dict[str, torch.Tensor]


def _host(x: Any) -> Any:
    """Tensors (in dicts, tuples and lists) moved to the host; anything else as it is."""
    return map_tensors(x, lambda t: t.detach().to("cpu"))


def _bytes(x: Any) -> int:
    sizes: list[int] = []
    map_tensors(x, lambda t: sizes.append(t.numel() * t.element_size()) or t)
    return sum(sizes)


def data_key(calibration: Mapping[str, list[Mapping[str, Any]]]) -> tuple:
    """What identifies fit batches within one process: each tensor's identity, shape and in-place version.
    The tape holds the tensors themselves (`bind`), so no identity is reused while it is bound."""
    return tuple((t, b, k, id(v), tuple(v.shape), v._version)
                 for t, batches in calibration.items() for b, batch in enumerate(batches)
                 for k, v in batch.items() if isinstance(v, torch.Tensor))


class ExpertTape:
    """Expert block forwards kept per (stack, layer, task, batch), and each block's recording plan."""

    def __init__(self, max_bytes: int) -> None:
        """A tape lives inside one search (tuning/run.py), whose experts do not change: they are not part of
        its key."""
        self.max_bytes = max_bytes
        self.key: tuple | None = None
        self._held_data: Any = None  # the bound batches, kept alive so their identities are not reused
        self.plans: dict[tuple[str, int], Any] = {}
        self.entries: dict[tuple[str, int, str, int], TapeEntry] = {}
        self.nbytes = 0
        self.full = False  # stopped recording at max_bytes
        self.replayed = 0

    def bind(self, calibration: Mapping[str, list[Mapping[str, Any]]], config: Any) -> None:
        """Bind the tape to this run's fit data and config (the searched knobs aside); a tape bound to anything
        else is emptied first."""
        settings = tuple(sorted((k, repr(v)) for k, v in config.model_dump().items() if k not in SEARCHED_KNOBS))
        key = (data_key(calibration), settings)
        if key != self.key:
            if self.key is not None:
                log.info("featcal tune: the experts' tape was recorded for other inputs; emptied")
            self.clear()
            self.key, self._held_data = key, calibration
        log.debug("featcal tune: experts' tape bound (%d entries, %.1f MiB)", len(self.entries), self.nbytes / 2**20)

    def clear(self) -> None:
        self.key, self._held_data = None, None
        self.plans.clear()
        self.entries.clear()
        self.nbytes, self.full, self.replayed = 0, False, 0

    def get(self, stack: str, layer: int, task: str, b: int, device: torch.device) -> tuple[Any, TapeEntry] | None:
        """(the block's plan, the entry on `device`), or None where nothing was recorded."""
        entry = self.entries.get((stack, layer, task, b))
        if entry is None:
            return None
        self.replayed += 1
        def on(x: Any) -> Any:
            return map_tensors(x, lambda t: t.to(device))

        return self.plans[(stack, layer)], TapeEntry(on(entry.ctx), on(entry.raw), on(entry.inputs), on(entry.outputs))

    def put(self, stack: str, layer: int, task: str, b: int, plan: Any, entry: TapeEntry) -> None:
        """Keep one forward's recording (on the host), unless that would pass max_bytes."""
        if self.full:
            return
        size = _bytes(entry.raw) + _bytes(entry.inputs) + _bytes(entry.outputs) + _bytes(entry.ctx)
        if self.nbytes + size > self.max_bytes:
            self.full = True
            log.info("featcal tune: the experts' tape reached %.1f MiB (tune_cache_gb); later blocks are recomputed "
                     "for every candidate", self.nbytes / 2**20)
            return
        self.plans.setdefault((stack, layer), plan)
        self.entries[(stack, layer, task, b)] = TapeEntry(_host(entry.ctx), _host(entry.raw), _host(entry.inputs),
                                                          _host(entry.outputs))
        self.nbytes += size
