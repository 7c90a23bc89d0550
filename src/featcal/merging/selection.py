"""The exact k-th largest value of a stream of non-negative tensors, in bounded memory.

TIES needs, per expert, the k-th largest |τ| over ALL of that expert's parameters. Concatenating a
whole task vector would cost a model's worth of memory per expert; instead this is a radix select
on the IEEE-754 bit patterns: for non-negative floats the bit pattern, read as an integer, orders
like the value. Each pass over the stream histograms the next 16 bits of the entries whose higher
bits match the prefix found so far (65,536 counters), and picks the digit that holds the k-th
largest. float32 needs 2 passes, float64 4; the result is exact, with no tolerance.
"""

from __future__ import annotations

import torch
from torch import Tensor

DIGIT_BITS = 16
_INT_VIEW = {torch.float32: torch.int32, torch.float64: torch.int64}


class StreamingKthLargest:
    """Find the k-th largest of non-negative values fed as tensors, over several identical passes.

    Usage: `while not sel.done: for t in stream(): sel.observe(t); sel.end_pass()`, then `sel.value`.
    Every pass must feed the same values (any order); NaN must not occur (validation rejects it).
    """

    def __init__(self, k: int, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in _INT_VIEW:
            raise ValueError(f"StreamingKthLargest works on float32 or float64, not {dtype}")
        if k < 1:
            raise ValueError("k must be at least 1")
        self.k = k
        self.dtype = dtype
        self.total_bits = torch.finfo(dtype).bits
        self.passes = self.total_bits // DIGIT_BITS
        self.pass_index = 0
        self.prefix = 0  # bits chosen so far (the top DIGIT_BITS * pass_index bits)
        self.rank = k  # rank of the target among the entries that share the prefix
        self.seen = 0
        self._hist = torch.zeros(1 << DIGIT_BITS, dtype=torch.int64)

    @property
    def done(self) -> bool:
        return self.pass_index == self.passes

    def observe(self, values: Tensor) -> None:
        """Feed a tensor of non-negative values (cast to the selector's dtype)."""
        if self.done:
            raise RuntimeError("all passes are finished")
        bits = values.detach().to(self.dtype).reshape(-1).contiguous().view(_INT_VIEW[self.dtype])
        if self.pass_index == 0:
            self.seen += bits.numel()
        shift = self.total_bits - DIGIT_BITS * (self.pass_index + 1)
        if self.pass_index > 0:
            bits = bits[(bits >> (shift + DIGIT_BITS)) == self.prefix]
        digits = (bits >> shift) & ((1 << DIGIT_BITS) - 1)
        self._hist += torch.bincount(digits, minlength=1 << DIGIT_BITS)

    def end_pass(self) -> None:
        """Choose the digit holding the target rank, and narrow the search to it."""
        if self.pass_index == 0 and self.k > self.seen:
            raise ValueError(f"k={self.k} exceeds the {self.seen} values observed")
        # counts of entries whose digit is >= d, for every d (suffix sums)
        at_or_above = torch.flip(torch.cumsum(torch.flip(self._hist, [0]), 0), [0])
        digit = int((at_or_above >= self.rank).nonzero().max())
        above = int(at_or_above[digit + 1]) if digit + 1 < at_or_above.numel() else 0
        self.rank -= above
        self.prefix = (self.prefix << DIGIT_BITS) | digit
        self.pass_index += 1
        self._hist.zero_()

    @property
    def value(self) -> float:
        """The k-th largest value observed (available once `done`)."""
        if not self.done:
            raise RuntimeError("value is known only after all passes")
        int_dtype = _INT_VIEW[self.dtype]
        # the prefix of a non-negative float fits the signed integer type (its sign bit is 0)
        return float(torch.tensor([self.prefix], dtype=int_dtype).view(self.dtype)[0])
