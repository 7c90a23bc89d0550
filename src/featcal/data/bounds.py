"""Bounds on what foreign input may cost: chat templates rendered within a time and a size limit, and huge
documents tokenised only as far as they are read.

Why: a chat template is code that comes with a model folder (an expert's, one from the hub). A template
that raises, loops (`{% for i in range(100000) %}` nested), or multiplies a string into gigabytes must stop
the run in one line, not hang it or have the tokenizer abort the process. And a document of 200 MB (a
folder's one big file, a text file without blank lines) is read for its first `max_length` tokens, or for
the tokens packing needs: tokenising all of it whole costs tens of GB in the tokenizer.

`bounded_text` keeps results exact: it cuts a text only after enough tokens that the kept ones are
the whole text's (a cut changes at most the tokens next to it), and it leaves every text shorter than
16 characters per token it may need untouched.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from featcal.errors import CalibrationDataError

RENDER_SECONDS = 10.0  # one conversation's rendering; a template loops or recurses beyond it
RENDER_GROWTH = 64  # a rendering may hold this many characters per character of the conversation ...
RENDER_ALLOWANCE = 1 << 20  # ... plus this many (a long system prompt, tool descriptions)
CHARS_PER_TOKEN = 16  # texts up to this many characters per token needed are tokenised whole
MARGIN_TOKENS = 64  # tokens kept beyond those needed, before the cut


class _Expired(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise _Expired in the block after `seconds` (SIGALRM; in the main thread only, where signals arrive,
    and only when no other interval timer runs: elsewhere the block runs unbounded)."""
    usable = (hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()
              and signal.getitimer(signal.ITIMER_REAL)[0] == 0)
    if not usable:
        yield
        return

    def expire(signum, frame):
        raise _Expired

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def render_chat(tokenizer, conversation: Sequence[Mapping[str, Any]], template: str | None, *, origin: str,
                add_generation_prompt: bool = False) -> str:
    """`conversation` rendered by `template` (None: the tokenizer's own) as `apply_chat_template` renders it;
    a template that fails, runs past RENDER_SECONDS or renders a text far larger than the conversation is
    refused in one line naming `origin` (where the template came from) and the conversation's roles."""
    turns = [dict(t) for t in conversation]
    roles = ", ".join(str(t.get("role")) for t in turns)
    where = f"the chat template ({origin}) on a conversation of roles {roles}"
    try:
        with time_limit(RENDER_SECONDS):
            text = tokenizer.apply_chat_template(turns, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
    except _Expired:
        raise CalibrationDataError(f"{where} ran longer than {RENDER_SECONDS:g} s (a loop in the template?); fix the "
                                   "template or use another model's") from None
    except Exception as exc:  # the template is foreign code: anything it raises is its failure
        reason = " ".join(str(exc).split())[:300]
        raise CalibrationDataError(f"{where} fails: {type(exc).__name__}: {reason}") from None
    budget = RENDER_ALLOWANCE + RENDER_GROWTH * len(json.dumps(turns, ensure_ascii=False, default=str))
    if not isinstance(text, str) or len(text) > budget:
        size = len(text) if isinstance(text, str) else type(text).__name__
        raise CalibrationDataError(f"{where} renders {size} characters, far more than the conversation holds; fix "
                                   "the template or use another model's")
    return text


def bounded_text(tokenizer, text: str, tokens: int) -> str:
    """`text`, or a prefix of it holding more than `tokens` + MARGIN_TOKENS tokens (the first `tokens` of which
    are the whole text's): what is tokenised of a huge document. Texts up to CHARS_PER_TOKEN characters per
    token needed are returned whole, untouched."""
    limit = (tokens + MARGIN_TOKENS) * CHARS_PER_TOKEN
    while limit < len(text):
        prefix = text[:limit]
        if len(tokenizer(prefix, add_special_tokens=False)["input_ids"]) > tokens + MARGIN_TOKENS:
            return prefix
        limit *= 4
    return text
