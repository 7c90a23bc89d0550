"""One progress bar over a whole bench run: one step per stage (an expert trained, a merge, a calibration...),
the current stage named beside it. The stages' own bars (training, merging, calibrating, transformers' loading)
stay off while it runs, so the terminal shows one bar, not one per stage; `progress=False` shows none."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tqdm import tqdm


class RunProgress:
    """A tqdm bar counted in stages; `total` grows or shrinks as the run learns what it has to do."""

    def __init__(self, total: int, enabled: bool, desc: str = "bench") -> None:
        self.bar = tqdm(total=total, desc=desc, unit="stage", disable=not enabled, leave=True)

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Name the stage while it runs; count it once it is done."""
        self.bar.set_postfix_str(name, refresh=True)
        yield
        self.bar.update(1)

    def tick(self, name: str) -> None:
        """A stage done elsewhere (an expert trained by the zoo build), counted as it finishes."""
        self.bar.set_postfix_str(name, refresh=False)
        self.bar.update(1)

    def add(self, stages: int) -> None:
        """Change the planned number of stages (a stage found unnecessary: -1)."""
        if self.bar.total is not None:
            self.bar.total += stages
            self.bar.refresh()

    def catch_up(self, done: int) -> None:
        """Count stages up to `done` (a zoo reused, or built by a builder that reports no stages)."""
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)

    @property
    def done(self) -> int:
        return self.bar.n

    def close(self) -> None:
        self.bar.set_postfix_str("done", refresh=False)
        self.bar.close()
