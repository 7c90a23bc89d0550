"""Chat / SFT records as conversations: which columns make a record a chat, and the turns they mean.

Three layouts are read, the ones fine-tuning data comes in:
- `messages`: a list of turns `{"role", "content"}` (OpenAI's format, TRL's conversational format);
- `prompt` / `completion`: two strings (a user turn and the assistant's answer), or two lists of turns
  (TRL's conversational prompt-completion);
- `instruction` / `input` / `output` (Alpaca): the user turn is the instruction, followed by the input
  after a blank line when there is one; the assistant's turn is the output. A table with `instruction` and
  no `output` column at all is Alpaca prompts (layout `instruction/input`): each record is the user turn
  alone, the instruction then its input (never the input alone, which is only the instruction's context).

A record in any of them becomes a tuple of turns, each a dict with a `role` among CHAT_ROLES and a string
`content` (keys that are None, as Arrow fills them for fields other turns have, are dropped, so a chat
template never sees `name: None`). Anything else is refused naming the record and the turn, and so is a
conversation whose every turn is empty (nothing for the model to read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from featcal.errors import CalibrationDataError

CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
# the column sets that make a record a chat, in the order they are looked for
CHAT_LAYOUTS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "prompt/completion": ("prompt", "completion"),
    "instruction/input/output": ("instruction", "output"),
    "instruction/input": ("instruction",),  # Alpaca prompts without answers: the user turn alone
}

Conversation = tuple[dict[str, Any], ...]


def chat_layout(columns: Sequence[str]) -> str | None:
    """The chat layout whose columns `columns` hold (see CHAT_LAYOUTS), else None."""
    for layout, needed in CHAT_LAYOUTS.items():
        if all(c in columns for c in needed):
            return layout
    return None


def conversation(record: Mapping[str, Any], layout: str, where: str) -> Conversation:
    """The turns of one record in `layout`; `where` names the record in errors ("x.jsonl, line 3")."""
    if layout == "messages":
        return turns(record.get("messages"), where)
    if layout == "prompt/completion":
        prompt, completion = record.get("prompt"), record.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            _need_text(prompt, "prompt", where)
            return ({"role": "user", "content": prompt}, {"role": "assistant", "content": completion})
        if isinstance(prompt, list) and isinstance(completion, list):
            return turns(prompt + completion, where)
        raise CalibrationDataError(
            f"{where}: prompt and completion must both be strings or both be lists of chat turns "
            f"(got {type(prompt).__name__} and {type(completion).__name__})"
        )
    if layout in ("instruction/input/output", "instruction/input"):
        return _alpaca(record, layout == "instruction/input/output", where)
    raise ValueError(f"unknown chat layout {layout!r}")


def _alpaca(record: Mapping[str, Any], answered: bool, where: str) -> Conversation:
    """An Alpaca record: the instruction, then its input after a blank line, as the user turn; the output as
    the assistant's turn (`answered`), else the user turn alone."""
    instruction, extra, output = record.get("instruction"), record.get("input"), record.get("output")
    for name, value in (("instruction", instruction), ("output", output))[: 2 if answered else 1]:
        if not isinstance(value, str):
            raise CalibrationDataError(f"{where}: {name} must be a string, not {type(value).__name__}")
    _need_text(instruction, "instruction", where)
    if extra is not None and not isinstance(extra, str):
        raise CalibrationDataError(f"{where}: input must be a string, not {type(extra).__name__}")
    user = {"role": "user", "content": instruction + (f"\n\n{extra}" if extra and extra.strip() else "")}
    return (user, {"role": "assistant", "content": output}) if answered else (user,)


def turns(value: Any, where: str) -> Conversation:
    """A list of `{"role", "content"}` turns checked and cleaned (None-valued keys dropped)."""
    if not isinstance(value, (list, tuple)) or not value:
        raise CalibrationDataError(f"{where}: a chat conversation must be a non-empty list of turns")
    out = []
    for j, turn in enumerate(value, 1):
        if not isinstance(turn, Mapping):
            raise CalibrationDataError(f"{where}: turn {j} is a {type(turn).__name__}, not an object with role and content")
        role, content = turn.get("role"), turn.get("content")
        if role not in CHAT_ROLES:
            raise CalibrationDataError(
                f"{where}: turn {j} has role {role!r}; chat roles are {', '.join(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise CalibrationDataError(
                f"{where}: turn {j} ({role}) has no text content (content is {type(content).__name__})"
            )
        out.append({k: v for k, v in turn.items() if v is not None})
    if not any(t["content"].strip() for t in out):
        raise CalibrationDataError(f"{where}: every turn's content is empty; a conversation needs some text")
    return tuple(out)


def is_conversation(value: Any) -> bool:
    """Whether `value` looks like one chat conversation (a non-empty list of mappings with a role)."""
    return (isinstance(value, (list, tuple)) and bool(value)
            and all(isinstance(t, Mapping) and "role" in t for t in value))


def _need_text(value: str, name: str, where: str) -> None:
    if not value.strip():
        raise CalibrationDataError(f"{where}: {name} is empty")
