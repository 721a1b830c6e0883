"""A tool call, and one call's stream deltas from its growing JSON body.

Every parser finds calls written as a JSON object ``{"name": ..., "arguments": ...}``
(``"parameters"`` is accepted for ``"arguments"``, as Llama 3 writes it). ``CallStream``
turns the object's text so far into OpenAI's deltas: first one with the call's id and
name, once the name's string is complete; then pieces of the arguments' JSON text as the
model writes it. The pieces join into exactly the finished call's ``arguments``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()
_NAME_KEY = re.compile(r'"name"\s*:\s*')
_ARGUMENTS_KEY = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=tool_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def arguments_json(arguments: Any) -> str:
    """Arguments as JSON text; a string that already holds JSON passes through."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
            return arguments
        except json.JSONDecodeError:
            pass
    return json.dumps(arguments, ensure_ascii=False)


def parse_call(body: str) -> ToolCall | None:
    """The call a complete JSON object describes, or None if it is not one."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    arguments = data.get("arguments", data.get("parameters", {}))
    return ToolCall(data["name"], arguments_json(arguments))


def partial_name(body: str) -> str | None:
    """The call's name once its string is complete in a partial ``{"name": "...", ...``."""
    key = _NAME_KEY.search(body)
    if key is None or not body.startswith('"', key.end()):
        return None
    try:
        name, _ = _DECODER.raw_decode(body, key.end())
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) else None


def arguments_text(body: str, final: bool) -> str:
    """The arguments' JSON text as written so far in a call's body.

    Once the value is a complete object or array, exactly its text. Before that, the text
    without trailing ``}`` and whitespace (they may close the call, not the arguments).
    At the end of a body whose arguments never completed: the parsed call's arguments if
    the body is valid JSON, else the text as it stands; no arguments at all are ``{}``.
    """
    key = _ARGUMENTS_KEY.search(body)
    if key is None:
        return "{}" if final else ""
    text = body[key.end():]
    if text[:1] in ("{", "["):
        try:
            _, end = _DECODER.raw_decode(text)
            return text[:end]
        except json.JSONDecodeError:
            pass
    if final:
        call = parse_call(body)
        return call.arguments if call is not None else text.rstrip() or "{}"
    return text.rstrip("} \n\r\t")


class CallStream:
    """Deltas of the call at ``index`` as its body grows (``update``, last with ``final``);
    ``make_id`` replaces the default id form."""

    def __init__(self, index: int, make_id: Callable[[], str] | None = None) -> None:
        self.index = index
        self.make_id = make_id or tool_call_id
        self.call: ToolCall | None = None  # set once the name has been sent

    def update(self, body: str, final: bool) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.call is None:
            name = partial_name(body)
            if name is None and final:
                call = parse_call(body)
                name = call.name if call is not None else None
            if name is None:
                return []
            self.call = ToolCall(name, "", self.make_id())
            deltas.append({"index": self.index, "id": self.call.id, "type": "function",
                           "function": {"name": name, "arguments": ""}})
        arguments = arguments_text(body, final)
        if not arguments.startswith(self.call.arguments):
            return deltas  # cannot un-send; keep what was streamed (rare)
        new = arguments[len(self.call.arguments):]
        if new:
            deltas.append({"index": self.index, "function": {"arguments": new}})
            self.call.arguments = arguments
        return deltas
