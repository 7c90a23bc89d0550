"""Where the block-input chains live between blocks: RAM (optionally in bf16/fp16) or spilled to disk.

A chain entry is one batch's hidden states for one side (the merged model, or expert t) plus the
context its blocks are called with (attention masks, position ids, rotary cos/sin, T5 position bias).
Hidden states are stored in `chain_dtype` and handed back in the compute dtype. With `spill_dir`,
every tensor goes to a safetensors file per entry (written atomically over the previous one); only
the non-tensor skeleton of the context stays in RAM. With `home` (the host, when blocks are offloaded
to an accelerator) entries kept in RAM are held there and moved to `device` one batch at a time.
"""

from __future__ import annotations

import os
import shutil
import weakref
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from featcal.io.write.atomic import make_marked, owned_tempdir, remove_marked_if_empty, sweep_stale

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
    """Replace tensors in a nested dict/tuple/list by placeholders; collect them in `out`."""
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
        return _Slot(prefix)
    if isinstance(obj, dict):
        return {k: _flatten(v, f"{prefix}.{k}", out) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_flatten(v, f"{prefix}.{i}", out) for i, v in enumerate(obj))
    return obj


def map_tensors(obj: Any, fn) -> Any:
    """`obj` with every tensor in a nested dict/tuple/list replaced by fn(tensor)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, _Slot):
        return tensors[obj.key]
    if isinstance(obj, dict):
        return {k: _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (tuple, list)):
        return type(obj)(_unflatten(v, tensors) for v in obj)
    return obj


class _Slot:
    __slots__ = ("key",)

    def __init__(self, key: str) -> None:
        self.key = key


SPILL_PREFIX = "featcal-chains-"


class ChainStore:
    """Per (side, task, batch): hidden states and block context, in RAM or on disk."""

    def __init__(self, chain_dtype: str = "float32", spill_dir: str | os.PathLike | None = None,
                 compute_dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 home: torch.device | str | None = None) -> None:
        self.store_dtype = DTYPES[chain_dtype]
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)  # where entries are handed out (the block forwards run there)
        self.home = None if home is None else torch.device(home)  # where RAM entries are held; None: as made
        self._ram: dict[tuple, torch.Tensor] = {}
        self._ctx: dict[tuple, Any] = {}
        self._tokens: dict[tuple, int] = {}  # key -> token positions of its hidden states
        self.dir: Path | None = None
        self._spill: Path | None = None  # the spill folder: removed by close() once empty, if featcal made it
        if spill_dir is not None:
            spill = Path(spill_dir).expanduser()
            make_marked(spill)  # marked: a rerun after a kill still knows featcal made them
            self._spill = spill
            sweep_stale(spill, SPILL_PREFIX)  # chains a killed run left (they are not resumed from)
            self.dir = owned_tempdir(SPILL_PREFIX, spill)
            # removed even if close() is never reached (an exception unwinding the run, interpreter exit)
            self._finalizer = weakref.finalize(self, shutil.rmtree, self.dir, ignore_errors=True)

    def _file(self, kind: str, key: tuple) -> Path:
        assert self.dir is not None
        return self.dir / (kind + "-" + "-".join(str(k) for k in key) + ".safetensors")

    def _write(self, path: Path, tensors: dict[str, torch.Tensor]) -> None:
        tmp = path.with_suffix(".tmp")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, path)

    def put_hidden(self, key: tuple, hidden: torch.Tensor) -> None:
        h = hidden.detach().to(self.store_dtype)  # cast where it was computed, then move: the same bits
        self._tokens[key] = h.shape[:-1].numel()
        if self.dir is None:
            self._ram[key] = h if self.home is None else self._to_home(self._ram.get(key), h)
        else:
            self._write(self._file("h", key), {"h": h})

    def _to_home(self, held: torch.Tensor | None, h: torch.Tensor) -> torch.Tensor:
        """`h` moved to the host, into the buffer the entry already holds when it has the same shape and dtype.

        Why: offloaded chains are rewritten every block; a fresh host tensor per entry and block costs page
        faults on every write (buffers past the allocator's mmap threshold, 39 MB for a ViT-B/32 batch of
        256, go back to the system when freed), several times the copy itself. Nothing else holds the old
        buffer: `hidden` hands out device copies, and checkpoints read `raw_hidden` synchronously.
        """
        if (held is not None and held.device == self.home and held.shape == h.shape and held.dtype == h.dtype
                and h.device != self.home):
            return held.copy_(h)
        return h.to(self.home)

    def hidden(self, key: tuple) -> torch.Tensor:
        if self.dir is None:
            h = self._ram[key]
        else:
            h = load_file(str(self._file("h", key)))["h"]
        return h.to(device=self.device, dtype=self.compute_dtype)

    def tokens(self, key: tuple) -> int:
        """Token positions (padding included) of chain `key`'s hidden states, without reading a spilled file."""
        return self._tokens[key]

    def raw_hidden(self, key: tuple) -> torch.Tensor:
        """The hidden states exactly as stored (chain dtype, on the CPU or the store's device): for checkpoints."""
        if self.dir is None:
            return self._ram[key]
        return load_file(str(self._file("h", key)))["h"]

    def raw_context(self, key: tuple) -> dict[str, Any]:
        """The context as held (on the host when offloading, the CPU when spilled): for checkpoints."""
        if self.dir is None:
            return self._ctx[key]
        return _unflatten(self._ctx[key], load_file(str(self._file("c", key))))

    def keys(self) -> list[tuple]:
        """Every (side, task, batch) entry held, in insertion order."""
        return list(self._ctx)

    def put_context(self, key: tuple, ctx: dict[str, Any]) -> None:
        if self.dir is None:
            self._ctx[key] = ctx if self.home is None else map_tensors(ctx, lambda t: t.to(self.home))
            return
        tensors: dict[str, torch.Tensor] = {}
        self._ctx[key] = _flatten(ctx, "c", tensors)
        self._write(self._file("c", key), tensors)

    def context(self, key: tuple) -> dict[str, Any]:
        if self.dir is None:
            ctx = self._ctx[key]
            return ctx if self.home is None else map_tensors(ctx, lambda t: t.to(self.device))
        tensors = load_file(str(self._file("c", key)), device=str(self.device))
        return _unflatten(self._ctx[key], tensors)

    def close(self) -> None:
        self._ram.clear()
        self._ctx.clear()
        if self.dir is not None:
            self._finalizer()  # rmtree, once
            self.dir = None
            remove_marked_if_empty(self._spill)  # featcal's own spill folders, this run's or a killed one's
