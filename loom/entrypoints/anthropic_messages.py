"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) over the
chat route: a request is translated into a chat completion request, run by the same
code (template, sampling, tools, reasoning, limits), and the answer translated back::

    Messages                               chat completions
    system (text or text blocks)           a system message
    user text / tool_result blocks         user content / tool messages
    user image blocks (source base64       image_url parts (a data: URL / the URL),
      or url)                                beside the text in order
    assistant text / tool_use blocks       assistant content / tool_calls
    tools {name, description,              tools {function: {name, description,
           input_schema}                          parameters}}
    tool_choice auto | any | tool | none   auto | required | a named function | none
    thinking {type: enabled, budget_tokens} thinking_token_budget (disabled: 0)
    stop_sequences, max_tokens, ...        stop, max_tokens, ...

    answer: thinking / text / tool_use blocks from reasoning_content / content /
    tool_calls; stop_reason end_turn | stop_sequence | max_tokens | tool_use

Streamed, the chat chunks become Anthropic's events: ``message_start``, per block
``content_block_start``, ``content_block_delta`` (text_delta, thinking_delta,
input_json_delta) and ``content_block_stop``, then ``message_delta`` and
``message_stop``. Errors come in Anthropic's shape: ``{"type": "error", "error":
{"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from loom.entrypoints.openai.errors import OpenAIError
from loom.entrypoints.openai.responses import SSEResponse, sse_payloads

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error"}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


class MessagesError(Exception):
    def __init__(self, message: str, status_code: int = 400) -> None:
        super().__init__(message)
        self.status_code = status_code


def error_response(status_code: int, message: str) -> JSONResponse:
    """Anthropic's error shape."""
    return JSONResponse({"type": "error", "error": {
        "type": _ERROR_TYPES.get(status_code, "api_error"), "message": message}},
        status_code=status_code)


def _text(content: Any, where: str) -> str:
    """A string, or text blocks joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") == "text"
                                         and isinstance(b.get("text"), str) for b in content):
        return "".join(block["text"] for block in content)
    raise MessagesError(f"{where} must be a string or a list of text blocks")


def _image_url(block: dict[str, Any], where: str) -> str:
    """An image block's source as a URL: base64 data as a data: URL, or the URL."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("media_type"), str) \
            and isinstance(source.get("data"), str):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise MessagesError(f"{where}: an image block's source is {{type: base64, media_type, "
                        "data}} or {type: url, url}")


def chat_request(body: Any) -> dict[str, Any]:
    """The chat completion request of a Messages request (a MessagesError if malformed)."""
    if not isinstance(body, dict):
        raise MessagesError("the body must be a JSON object")
    for name in ("max_tokens", "messages"):
        if name not in body:
            raise MessagesError(f"{name}: Field required")
    if not isinstance(body["messages"], list) or not body["messages"]:
        raise MessagesError("messages: at least one message is required")
    messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        messages.append({"role": "system", "content": _text(body["system"], "system")})
    for index, message in enumerate(body["messages"]):
        where = f"messages.{index}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise MessagesError(f"{where}.role must be user or assistant")
        content = message.get("content")
        if isinstance(content, str):
            messages.append({"role": message["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise MessagesError(f"{where}.content must be a string or a list of blocks")
        parts, calls, results = [], [], []
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                parts.append({"type": "text", "text": block["text"]})
            elif kind == "image" and message["role"] == "user":
                parts.append({"type": "image_url",
                              "image_url": {"url": _image_url(block, f"{where}.content")}})
            elif kind == "tool_use" and message["role"] == "assistant":
                calls.append({"id": str(block.get("id") or f"toolu_{uuid.uuid4().hex[:24]}"),
                              "type": "function",
                              "function": {"name": block.get("name"),
                                           "arguments": json.dumps(block.get("input") or {})}})
            elif kind == "tool_result" and message["role"] == "user":
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id")),
                                "content": _text(block.get("content", ""),
                                                 f"{where}.tool_result.content")})
            else:
                raise MessagesError(f"{where}.content: a {kind!r} block is not supported in a "
                                    f"{message['role']} message")
        messages += results
        if parts or calls or not results:
            images = any(part["type"] == "image_url" for part in parts)
            entry: dict[str, Any] = {"role": message["role"], "content": (
                parts if images else "".join(part["text"] for part in parts))}
            if calls:
                entry["tool_calls"] = calls
            messages.append(entry)
    request: dict[str, Any] = {"messages": messages, "max_tokens": body["max_tokens"],
                               "stream": bool(body.get("stream", False))}
    if body.get("model") is not None:
        request["model"] = body["model"]
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k"), ("stop_sequences", "stop")):
        if body.get(ours) is not None:
            request[theirs] = body[ours]
    if request["stream"]:
        request["stream_options"] = {"include_usage": True}
    if body.get("tools"):
        request["tools"] = [{"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("input_schema") or {"type": "object"}}}
            for tool in body["tools"]]
        request["tool_choice"] = "auto"
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        if kind == "tool":
            request["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in ("auto", "any", "none"):
            request["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise MessagesError("tool_choice.type must be auto, any, tool or none")
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        if thinking.get("type") == "enabled":
            request["thinking_token_budget"] = thinking.get("budget_tokens", -1)
        elif thinking.get("type") == "disabled":
            request["thinking_token_budget"] = 0
    return request


def _stop_reason(finish_reason: str | None, stop_reason: Any,
                 stop_sequences: list[str]) -> tuple[str | None, str | None]:
    if finish_reason == "stop" and isinstance(stop_reason, str) and stop_reason in stop_sequences:
        return "stop_sequence", stop_reason
    if finish_reason is None:
        return None, None
    return _STOP_REASONS.get(finish_reason, "end_turn"), None


def message_response(chat: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion's answer as a Message."""
    choice = chat["choices"][0]
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    stop_reason, stop_sequence = _stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                              body.get("stop_sequences") or [])
    return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
            "model": chat["model"], "content": content, "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": {"input_tokens": chat["usage"]["prompt_tokens"],
                      "output_tokens": chat["usage"]["completion_tokens"]}}


def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


async def message_events(chunks: AsyncIterator[str], body: dict[str, Any],
                         model: str) -> AsyncIterator[str]:
    """The chat route's SSE chunks as Anthropic's stream events."""
    message_id = f"msg_{uuid.uuid4().hex}"
    block = None  # (index, kind) of the open content block
    count = 0
    finish = stop = None
    output_tokens = input_tokens = 0
    started = False

    def open_block(kind: str, start: dict[str, Any]) -> list[str]:
        nonlocal block, count
        events = close_block()
        block = (count, kind)
        count += 1
        return events + [_event("content_block_start", {
            "type": "content_block_start", "index": block[0], "content_block": start})]

    def close_block() -> list[str]:
        nonlocal block
        if block is None:
            return []
        index, block = block[0], None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": index})]

    async for chunk in sse_payloads(chunks):
        if "error" in chunk:  # the engine failed mid-stream
            yield _event("error", {"type": "error", "error": {
                "type": "api_error", "message": chunk["error"].get("message", "")}})
            return
        if chunk.get("usage"):
            input_tokens = chunk["usage"]["prompt_tokens"]
            output_tokens = chunk["usage"]["completion_tokens"]
        if not started:
            started = True
            yield _event("message_start", {"type": "message_start", "message": {
                "id": message_id, "type": "message", "role": "assistant", "model": model,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0}}})
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if block is None or block[1] != "thinking":
                    for event in open_block("thinking", {"type": "thinking", "thinking": "",
                                                         "signature": ""}):
                        yield event
                yield _event("content_block_delta", {
                    "type": "content_block_delta", "index": block[0],
                    "delta": {"type": "thinking_delta", "thinking": delta["reasoning_content"]}})
            if delta.get("content"):
                if block is None or block[1] != "text":
                    for event in open_block("text", {"type": "text", "text": ""}):
                        yield event
                yield _event("content_block_delta", {
                    "type": "content_block_delta", "index": block[0],
                    "delta": {"type": "text_delta", "text": delta["content"]}})
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if function.get("name"):
                    for event in open_block("tool_use", {
                            "type": "tool_use", "id": call.get("id"),
                            "name": function["name"], "input": {}}):
                        yield event
                if function.get("arguments"):
                    yield _event("content_block_delta", {
                        "type": "content_block_delta", "index": block[0],
                        "delta": {"type": "input_json_delta",
                                  "partial_json": function["arguments"]}})
            if choice.get("finish_reason"):
                finish, stop = choice["finish_reason"], choice.get("stop_reason")
    for event in close_block():
        yield event
    stop_reason, stop_sequence = _stop_reason(finish, stop, body.get("stop_sequences") or [])
    yield _event("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": stop_reason,
                                           "stop_sequence": stop_sequence},
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}})
    yield _event("message_stop", {"type": "message_stop"})


def _parse(raw: bytes) -> Any:
    """The body's JSON (a MessagesError if it is not JSON, or not UTF-8)."""
    try:
        return json.loads(raw)
    except ValueError as error:
        raise MessagesError(f"the body is not valid JSON: {error}") from None


async def create_message(chat, raw: bytes) -> Response:
    """``POST /v1/messages`` through ``chat`` (OpenAIServingChat)."""
    try:
        body = _parse(raw)
        response = await chat.create(json.dumps(chat_request(body)).encode())
    except MessagesError as error:
        return error_response(error.status_code, str(error))
    except OpenAIError as error:
        return error_response(error.status_code, error.message)
    if isinstance(response, SSEResponse):
        return SSEResponse(message_events(response.body_iterator, body, chat.model_name),
                           abort=response.abort)
    if response.status_code != 200:
        return error_response(response.status_code,
                              json.loads(response.body)["error"]["message"])
    return JSONResponse(message_response(json.loads(response.body), body))


async def count_tokens(chat, raw: bytes) -> Response:
    """``POST /v1/messages/count_tokens``: the prompt's tokens as the template renders it."""
    from loom.entrypoints.openai.protocol import ChatCompletionRequest

    try:
        body = _parse(raw)
        if not isinstance(body, dict):
            raise MessagesError("the body must be a JSON object")
        request = ChatCompletionRequest.parse(json.dumps(
            {**chat_request({**body, "max_tokens": body.get("max_tokens", 1)}),
             "stream": False}).encode())
        return JSONResponse({"input_tokens": len((await chat.render(request)).token_ids)})
    except MessagesError as error:
        return error_response(error.status_code, str(error))
    except OpenAIError as error:
        return error_response(error.status_code, error.message)
