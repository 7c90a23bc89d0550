"""SIGTERM as a flag the long loops check, and as an interrupt raised once.

Why not only an exception raised by the handler: Python runs a signal handler between any two bytecodes
of the main thread, finalisers (`__del__`, weakref callbacks, a generator's close) included, and an
exception raised inside a finaliser is printed and swallowed; the run then went on and finished with exit
code 0. So the handler records the request first, then raises (once: a second SIGTERM must not cut the
first one's cleanup short); the streaming merge, the calibration's block loop and the output's final
rename (`check`) stop on the flag whatever happened to the exception, and the CLI never reports success
once it is set.
"""

from __future__ import annotations

import signal
from typing import Any

_requested = False


class Terminated(KeyboardInterrupt):
    """SIGTERM, turned into an interrupt so that the same cleanup runs (temporary output removed)."""


def on_sigterm(signum: int, frame: Any) -> None:  # pragma: no cover - exercised through os.kill in the tests
    global _requested
    first = not _requested
    _requested = True
    if first:
        raise Terminated()


def requested() -> bool:
    """Whether a SIGTERM arrived since `install`."""
    return _requested


def check() -> None:
    """Stop here (Terminated) when a SIGTERM arrived, even if the exception its handler raised was swallowed."""
    if _requested:
        raise Terminated()


def install() -> Any:
    """Handle SIGTERM with `on_sigterm` (main thread only); returns the previous handler for `restore`."""
    global _requested
    _requested = False
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_sigterm)
    return previous


def restore(previous: Any) -> None:
    """Put the previous handler back and forget the request: the command that saw it has ended (and said so),
    and a later library call in the same process (a notebook, a test) must not stop on a stale flag."""
    global _requested
    signal.signal(signal.SIGTERM, previous)
    _requested = False
