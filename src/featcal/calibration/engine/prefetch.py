"""The experts' next blocks read on one background thread while the current block computes (issue #40).

Why: streamed experts were read tensor by tensor on the main thread, between forwards, so the file reads added
to the compute instead of hiding behind it (10.75 s against 8.79 s with the experts in memory on the GPU check).

The engine names the (task, parameter names) loads it will make, in order (every task's load of block l, then of
block l+1, ...). One reader thread reads them ahead, at most `ahead` loads (one block of every expert) beyond the
ones the engine has taken, and checks each tensor for NaN / Inf as it is read, instead of a pass over every
parameter before any work. A load that is not among the next scheduled ones (the stems, the norms outside the
blocks, a sequential stage reading its expert again) is read on the main thread, as before, with the same check.
The values are copied into the template exactly as before (`p.copy_(value.to(p.device, p.dtype))`), so the
result is bit for bit the same with and without the reader.

An error in the reader (a NaN found, a file gone) is raised in the main thread when the engine takes that load:
the same one-line FeatCalError as a read on the main thread gives. `close` stops the thread (end of the run, an
error, Ctrl-C) without waiting for more than the read in flight.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from featcal.io.read.family import refuse_non_finite_tensor
from featcal.io.read.param_sources import ParamSource

Load = tuple[str, tuple[str, ...]]  # (task, parameter names): one expert's block


def checked_reads(source: ParamSource, names: Iterable[str], check: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, value) of `names` of `source` as read (dtype and device of the file), one at a time; each checked
    for NaN / Inf with `check` (the one-line error naming the source and the parameter)."""
    for name in names:
        value = source.get(name)
        if check:
            refuse_non_finite_tensor(source, name, value)
        yield name, value


class BlockReader:
    """Reads `schedule`'s loads from `sources` on one thread, at most `ahead` loads beyond those taken."""

    def __init__(self, sources: Mapping[str, ParamSource], schedule: Iterable[Load], ahead: int,
                 check: Callable[[str], bool]) -> None:
        self._sources, self._check, self._ahead = sources, check, max(1, ahead)
        self._pending: deque[Load] = deque(schedule)  # scheduled and not yet taken, in order
        self._slots = threading.Semaphore(self._ahead)
        self._done: queue.Queue = queue.Queue()  # (load, values or the exception the read raised), in order
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read_all, args=(list(self._pending),),
                                        name="featcal-block-reader", daemon=True)
        self._thread.start()

    def _read_all(self, schedule: list[Load]) -> None:
        for load in schedule:
            self._slots.acquire()
            if self._stop.is_set():
                return
            task, names = load
            try:
                values = dict(checked_reads(self._sources[task], names, self._check(task)))
            except BaseException as error:  # handed to the main thread, raised there by `take`
                self._done.put((load, error))
                return
            self._done.put((load, values))

    def take(self, task: str, names: list[str]) -> dict[str, torch.Tensor] | None:
        """The values of load (task, names) when it is among the next `ahead` scheduled (those scheduled before
        it are dropped: the engine went another way); None when it is not scheduled (read it on the main thread)."""
        load = (task, tuple(names))
        window = [self._pending[i] for i in range(min(self._ahead, len(self._pending)))]  # read, or being read
        if load not in window:
            return None
        for _ in range(window.index(load) + 1):
            self._pending.popleft()
            got, values = self._next()
            if got == load:
                return values

    def _next(self) -> tuple[Load, dict[str, torch.Tensor]]:
        """The next load the reader finished (waiting for it), its slot freed; its error raised here."""
        got, values = self._done.get()
        self._slots.release()
        if isinstance(values, BaseException):
            self._pending.clear()
            raise values
        return got, values

    def close(self) -> None:
        """Stop the reader after the read in flight; nothing it holds is kept."""
        self._stop.set()
        self._pending.clear()
        self._slots.release()
        self._thread.join()
        while not self._done.empty():
            self._done.get_nowait()
