"""The output of a Responses API answer (loom/entrypoints/openai_responses.py): its items
as the response object holds them, and the events that stream them::

    response.output_item.added              the item in progress (content empty)
      response.content_part.added           message, reasoning: their one part
      response.output_text.delta            message        } many, then their .done
      response.reasoning_text.delta         reasoning      } with the whole text
      response.function_call_arguments.delta  function_call  } (arguments)
      response.content_part.done            message, reasoning
    response.output_item.done               the item, whole

One item is open at a time: the first delta of its kind opens it (a tool call's first
delta, with its name, opens a new one), the next item or the end closes it. Every event
has ``type`` and ``sequence_number``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [output_text(text)]}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A chat answer's message as output items; the last carries the response's status."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"], "completed"))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or []:
        items.append(function_call_item(new_id("fc"), call["id"], call["function"]["name"],
                                        call["function"]["arguments"], "completed"))
    if items:
        items[-1]["status"] = status
    return items


class ResponseEvents:
    """The Responses events of one stream, numbered; one output item open at a time,
    opened by the first delta of its kind and closed (its .done events) by the next item
    or the end."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []  # the closed items
        self._open: dict[str, Any] | None = None  # the open item, as it will be closed

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def reasoning(self, delta: str) -> list[str]:
        events = self._start("reasoning", reasoning_item(new_id("rs"), "", "in_progress"),
                             {"type": "reasoning_text", "text": ""})
        return events + [self._delta("response.reasoning_text.delta", delta)]

    def text(self, delta: str) -> list[str]:
        events = self._start("message", message_item(new_id("msg"), "", "in_progress"),
                             output_text(""))
        return events + [self._delta("response.output_text.delta", delta, logprobs=[])]

    def call(self, call: dict[str, Any]) -> list[str]:
        """One tool call delta of the chat stream: a new call carries its id and name."""
        function = call.get("function") or {}
        events = []
        if function.get("name"):
            item = function_call_item(new_id("fc"), call.get("id") or new_id("call"),
                                      function["name"], "", "in_progress")
            events = self._start("function_call", item, new=True)
        if function.get("arguments"):
            events.append(self._delta("response.function_call_arguments.delta",
                                      function["arguments"]))
        return events

    def close(self, status: str = "completed") -> list[str]:
        """The open item's .done events; ``status`` is its final status."""
        item, self._open = self._open, None
        if item is None:
            return []
        index, text = len(self.output), "".join(item.pop("pieces"))
        where = {"item_id": item["id"], "output_index": index}
        item["status"] = status
        events = []
        if item["type"] == "function_call":
            item["arguments"] = text
            events.append(self.event("response.function_call_arguments.done", **where,
                                     arguments=text))
        else:
            item["content"][0]["text"] = text
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events += [self.event(f"response.{kind}.done", **where, content_index=0,
                                  text=text, **extra),
                       self.event("response.content_part.done", **where, content_index=0,
                                  part=item["content"][0])]
        self.output.append(item)
        return events + [self.event("response.output_item.done", output_index=index,
                                    item=item)]

    def _start(self, kind: str, item: dict[str, Any], part: dict[str, Any] | None = None,
               new: bool = False) -> list[str]:
        """Open ``item`` unless an item of this kind is open (``new``: always)."""
        if self._open is not None and self._open["type"] == kind and not new:
            return []
        events = self.close()
        index = len(self.output)
        if part is None:
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=item))
        else:  # added with no content, then its one part
            events += [self.event("response.output_item.added", output_index=index,
                                  item={**item, "content": []}),
                       self.event("response.content_part.added", item_id=item["id"],
                                  output_index=index, content_index=0, part=part)]
            item["content"] = [dict(part)]
        self._open = {**item, "pieces": []}
        return events

    def _delta(self, kind: str, delta: str, **extra: Any) -> str:
        item = self._open
        item["pieces"].append(delta)
        where = {"item_id": item["id"], "output_index": len(self.output)}
        if item["type"] != "function_call":
            where["content_index"] = 0
        return self.event(kind, **where, delta=delta, **extra)
