"""The host allocator's settings for one featcal process (glibc's malloc; elsewhere nothing is changed).

Why: by default glibc serves a request above its mmap threshold (128 KiB, raised dynamically up to 32 MiB)
with a fresh mapping and gives freed memory at the top of its heap back to the system above its trim
threshold. A forward over many batches then frees every activation at the end of each batch and faults
the same pages in again for the next: on the 2-core CPU machine, run alternately, the forward floor took
0.89x the time with the settings below and calibrate() 0.97x (docs/scaling.md, "The host
allocator"). `tuned` fixes the mmap threshold at glibc's ceiling (32 MiB: smaller blocks come from the
heap and are reused) and never trims the heap's top, so a process keeps the pages it has used (the one-pass
variant's few GB of paused activations are faulted in once, not once per block).

`featcal`'s command line applies it at start when FEATCAL_HOST_ALLOCATOR=tuned. It is not the default: over a
whole `featcal bench` (text preset, 256 per task) it saved 1 % of the wall time and raised the peak RSS 10 %
(2.87 -> 3.16 GB: memory a phase freed stays with the process into the next), and featcal's memory matters as
much as its speed. The Python API leaves the allocator to the program that imports featcal (call `apply()`).
Benchmarks set the same values through the environment (`environment()`) for every process they time, the
floor's included, so that a ratio compares like with like.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from typing import Literal

Setting = Literal["tuned", "default"]
ENV = "FEATCAL_HOST_ALLOCATOR"
SETTINGS: tuple[Setting, ...] = ("tuned", "default")
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit systems
TRIM_NEVER = -1  # mallopt(M_TRIM_THRESHOLD, -1): "disables trimming completely" (mallopt(3))
TRIM_THRESHOLD_ENV = 1 << 62  # the environment's form of the same: a threshold no heap reaches
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# "pages": apply("tuned") ran in this process, freed pages are to stay with it; "trimmed_free": malloc's free
# bytes when release_free_pages last trimmed (or the lowest seen since)
_kept = {"pages": False, "trimmed_free": 0}
_GLIBC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD_ENV)}


def check(setting: str) -> Setting:
    """A known setting, or a clear error naming the choices."""
    if setting not in SETTINGS:
        raise ValueError(f"host allocator setting {setting!r}: choose from {', '.join(SETTINGS)}")
    return setting  # type: ignore[return-value]


def requested(environ: dict[str, str] | None = None) -> Setting:
    """The setting FEATCAL_HOST_ALLOCATOR asks for (default: default, malloc as it is)."""
    value = (os.environ if environ is None else environ).get(ENV, "default").strip().lower() or "default"
    return check(value)


def _glibc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - present only in glibc (musl has no such symbol)
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.mallopt.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


def apply(setting: Setting = "tuned") -> bool:
    """Set this process's malloc to `setting`; True when it was applied (glibc only). `default` leaves the
    allocator as it is (glibc's settings cannot be put back to their dynamic mode once fixed)."""
    if check(setting) == "default":
        return False
    libc = _glibc()
    if libc is None:
        return False
    _kept["pages"] = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        libc.mallopt(_M_TRIM_THRESHOLD, TRIM_NEVER))
    return _kept["pages"]


def environment(setting: Setting) -> dict[str, str]:
    """Environment variables that give a child process `setting` from its first allocation (glibc reads
    them at start; other C libraries ignore them): merge into the child's environment."""
    return dict(_GLIBC_ENV) if check(setting) == "tuned" else {}


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


RELEASE_AT = 64 * 1024 * 1024  # free bytes held in malloc's heaps above which release_free_pages trims
# glibc's initial mmap threshold: tensors below it always came from the heap, so work on them alone never moves
# the dynamic threshold, and checking after it (mallinfo2 walks the free lists: ~4 ms) is not worth its time
MMAP_THRESHOLD_START = 128 * 1024


def free_heap_bytes() -> int | None:
    """Bytes malloc holds free in its heaps, all arenas (glibc >= 2.33's mallinfo2); None elsewhere."""
    libc = _glibc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = _MallInfo2
    return int(fn().fordblks)


def release_free_pages(at_least: int = RELEASE_AT) -> bool:
    """Give the pages malloc holds free back to the system (glibc's malloc_trim(0), which also releases whole
    free pages inside its heaps) when `at_least` more bytes are free than after the last trim; True when it released any.

    Why: with glibc's dynamic mmap threshold, a block's freed statistics and activations stay in the heap,
    fragmented, and were counted in the next block's peak RSS: 900 to 1,226 MiB over four identical runs of
    the planner's test model (96 small blocks); 896 to 919 MiB over seven trimming after every block, 922 to
    989 MiB over four with the threshold below. Trimming costs a walk over the heap and faults the pages in
    again when they are reused, hence the threshold: only when there is enough to give back (callers skip it
    for work on tensors below MMAP_THRESHOLD_START)."""
    if _kept["pages"] or "MALLOC_TRIM_THRESHOLD_" in os.environ:  # `tuned` (or the environment) keeps them
        return False
    free = free_heap_bytes()
    if free is None:
        return False
    # free bytes already given back stay counted as free: trim again only when that much more came free since
    # (the lowest count seen since the last trim: what was reused in between was faulted in again)
    floor = _kept["trimmed_free"] = min(_kept["trimmed_free"], free)
    if free - floor < at_least:
        return False
    _kept["trimmed_free"] = free
    return bool(_glibc().malloc_trim(0))
