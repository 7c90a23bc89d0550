"""Peak resident memory of a stretch of work, sampled by a background thread.

`ru_maxrss` only ever grows over a process's life, so it cannot tell which of several models in one
benchmark needed the memory. This sampler records the largest RSS seen while a block runs.
"""

from __future__ import annotations

import threading
from types import TracebackType


class PeakRSS:
    """`with PeakRSS() as m: ...; m.mb` -> largest RSS in MiB observed during the block."""

    def __init__(self, interval_s: float = 0.01) -> None:
        import psutil  # the bench extra's; imported here so that `featcal --help` and the CLI parser need none

        self.interval_s = interval_s
        self._proc = psutil.Process()
        self._peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        self._peak = max(self._peak, self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> PeakRSS:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def mb(self) -> float:
        return self._peak / 2**20
