"""Pack documents into windows of `max_length` tokens, as decoders are trained and MergeBench calibrates.

Documents are taken in a seeded order, each tokenised whole as the tokenizer does it (a conversation
through its chat template) and closed with the eos token, then concatenated into one stream that is cut
into windows of `window` tokens. Only as many documents are tokenised as `count` windows need, so
packing 256 windows out of a large corpus reads a small part of it. When the documents run out first,
the last, shorter window is kept (it is padded and masked like any short text).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from featcal.data.types import Example

READ_CHUNK = 32  # documents read from the source at a time


def pack(documents: Iterable[Sequence[int]], window: int, count: int) -> list[list[int]]:
    """At most `count` windows of `window` tokens cut from the concatenated `documents` (token id lists)."""
    windows: list[list[int]] = []
    stream: list[int] = []
    for ids in documents:
        stream.extend(ids)
        start = 0
        while len(stream) - start >= window and len(windows) < count:
            windows.append(stream[start:start + window])
            start += window
        del stream[:start]
        if len(windows) == count:
            return windows
    if stream and len(windows) < count:
        windows.append(stream)
    return windows


def documents_in_order(read: Callable[[Sequence[int]], list[Example]], order: Sequence[int],
                       token_ids: Callable[[Example], list[int]]) -> Iterable[list[int]]:
    """The token ids of the documents at `order`, read from the source a chunk at a time, lazily."""
    for start in range(0, len(order), READ_CHUNK):
        for example in read(order[start:start + READ_CHUNK]):
            yield token_ids(example)
