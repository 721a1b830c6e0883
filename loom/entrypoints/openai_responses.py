"""OpenAI's Responses API (``POST /v1/responses``; ``GET``, ``DELETE /v1/responses/{id}``;
``POST /v1/responses/{id}/cancel``) over the chat route: a request is translated into a
chat completion request, run by the same code (template, sampling, tools, reasoning,
structured outputs, limits), and the answer translated back::

    Responses                                  chat completions
    instructions                               a system message, first
    input: a string                            one user message
    input items: message (user, system,        messages (developer as system), text
      developer, assistant; input_text /         parts joined; input_image {image_url}
      output_text / input_image parts)           an image_url part, beside the text
      function_call {call_id, name, arguments} an assistant message's tool_calls
      function_call_output {call_id, output}   a tool message
      reasoning {content: reasoning_text}      an assistant message's reasoning_content
    tools {type: function, name,               tools {type: function, function: {name,
           description, parameters}                   description, parameters}}
    tool_choice none | auto | required |       the same | a named function
      {type: function, name}
    text.format json_schema | json_object      response_format
    reasoning.effort low | medium | high       reasoning_effort, the reasoning budget
      | none                                     (none: 0); only with --reasoning-parser
    max_output_tokens, temperature, top_p,     max_tokens, temperature, top_p, user,
      user, parallel_tool_calls                  parallel_tool_calls

    answer: reasoning, message (output_text) and function_call items from
    reasoning_content, content and tool_calls; status incomplete, with
    incomplete_details.reason max_output_tokens, where finish_reason is length

Streamed, the chat chunks become the Responses events (openai_response_events.py):
``response.created``, ``response.in_progress``, each output item's events, then
``response.completed`` (``response.incomplete`` when cut short by max_output_tokens, as
OpenAI sends it; ``response.failed`` when the engine failed mid-stream).

Stored responses (``store``, true by default as OpenAI's): this API process keeps the
last ``STORE_CAPACITY`` (1024) in memory, the oldest evicted first, each with the
conversation it ended as chat messages, so ``previous_response_id`` continues it (its
input and output items first; its instructions are not carried over, as OpenAI's are
not). loom runs no background responses: ``background: true`` is a 400, and cancelling a
stored response is a 400, as vLLM answers for a response not run in the background.
Errors come in OpenAI's envelope, as the chat route's, naming the Responses field.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, field_validator
from starlette.responses import JSONResponse, Response

from loom.entrypoints.openai.errors import OpenAIError, RequestError
from loom.entrypoints.openai.protocol import Int64, OpenAIModel
from loom.entrypoints.openai.responses import SSEResponse, sse_payloads
from loom.entrypoints.openai.serving_chat import OpenAIServingChat
from loom.entrypoints.openai_response_events import ResponseEvents, new_id, output_items

STORE_CAPACITY = 1024
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
# The chat route's field -> the Responses field, for the param of a 400 from the chat route.
_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens",
           "response_format": "text.format", "reasoning_effort": "reasoning.effort",
           "thinking_token_budget": "reasoning.effort"}


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ReasoningConfig(OpenAIModel):
    effort: Literal["none", "low", "medium", "high"] | None = None
    summary: str | None = None  # loom writes no summaries; the reasoning text is the item


class ResponsesRequest(OpenAIModel):
    """The body of ``POST /v1/responses``; input items, tool_choice and text.format are
    checked where they are translated, so each 400 names the item or field at fault."""

    model: str | None = None
    input: Any = Field(default=None, validate_default=True)  # a string or a list of items
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: Int64 | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Any = None  # checked by _tool_choice
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool = True
    stream: bool = False
    background: bool | None = None
    conversation: Any = None

    @field_validator("input")
    @classmethod
    def _text_or_items(cls, value: Any) -> str | list[Any]:
        if not isinstance(value, str | list) or not value:
            raise ValueError("input must be a string or a list of input items, not empty")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None and (len(value) > 16 or any(
                len(key) > 64 or len(text) > 512 for key, text in value.items())):
            raise ValueError("metadata holds at most 16 pairs, keys of at most 64 characters "
                             "and values of at most 512")
        return value

    @field_validator("background")
    @classmethod
    def _not_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background: true is not supported: loom runs a response while "
                             "its request is open; leave background out")
        return value

    @field_validator("conversation")
    @classmethod
    def _no_conversation(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("conversation is not supported; continue a conversation with "
                             "previous_response_id")
        return value


# ----------------------------------------------------------------- the request

def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """Input items (or a response's output items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input.{index}"
        if not isinstance(item, dict):
            raise RequestError(f"{where} must be an input item (an object)", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            role = _ROLES.get(role) if isinstance(role, str) else None
            if role is None:
                raise RequestError(f"{where}.role must be user, system, developer or "
                                   f"assistant, not {item.get('role')!r}", param="input")
            content = _message_content(item.get("content"), f"{where}.content")
            last = _open_assistant(messages)
            if role == "assistant" and last is not None and not last["content"] \
                    and "tool_calls" not in last:  # after its reasoning item
                last["content"] = content
            else:
                messages.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where),
                                 "arguments": _string(item, "arguments", where)}}
            last = _open_assistant(messages)
            if last is None:
                messages.append(last := {"role": "assistant", "content": ""})
            last.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list) or not all(
                    isinstance(part, dict) and isinstance(part.get("text"), str)
                    for part in parts):
                raise RequestError(f"{where}.content must be a list of reasoning_text parts",
                                   param="input")
            messages.append({"role": "assistant", "content": "",
                             "reasoning_content": "".join(part["text"] for part in parts)})
        else:
            raise RequestError(f"{where}.type: loom takes message, function_call, "
                               f"function_call_output and reasoning items, not {kind!r}",
                               param="input")
    return messages


def _open_assistant(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message if it is the assistant's (a call or text may still join it)."""
    return messages[-1] if messages and messages[-1]["role"] == "assistant" else None


def _message_content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content: a string, text parts joined, or, where it holds input_image
    parts, the chat route's text and image_url parts in order."""
    if not isinstance(content, list) or not any(
            isinstance(part, dict) and part.get("type") == "input_image" for part in content):
        return _text(content, where)
    parts: list[dict[str, Any]] = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "input_image":
            parts.append({"type": "text", "text": _text_part(part, f"{where}.{index}")})
        elif isinstance(part.get("image_url"), str):
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            raise RequestError(f"{where}.{index}: an input_image needs image_url (a data: URL "
                               "or an http(s) URL); file_id is not supported", param="input")
    return parts


def _text(content: Any, where: str) -> str:
    """A string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of input_text parts",
                           param="input")
    return "".join(_text_part(part, f"{where}.{index}") for index, part in enumerate(content))


def _text_part(part: Any, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS:
        raise RequestError(f"{where}: loom takes text parts (input_text, output_text) and "
                           f"input_image parts, not {kind!r}", param="input")
    if not isinstance(part.get("text"), str):
        raise RequestError(f"{where}.text must be a string", param="input")
    return part["text"]


def _string(item: dict[str, Any], name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise RequestError(f"{where}.{name}: a {item['type']} item needs {name} as a string",
                           param="input")
    return item[name]


def chat_request(request: ResponsesRequest, messages: list[dict[str, Any]],
                 with_reasoning: bool) -> dict[str, Any]:
    """The chat completion request of a Responses request whose conversation, as chat
    messages, is ``messages``; reasoning.effort only ``with_reasoning`` (a parser)."""
    if request.instructions:
        messages = [{"role": "system", "content": request.instructions}, *messages]
    chat: dict[str, Any] = {"messages": messages, "stream": request.stream,
                            "parallel_tool_calls": request.parallel_tool_calls}
    if request.stream:
        chat["stream_options"] = {"include_usage": True}
    for ours, theirs in (("model", "model"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("user", "user"), ("max_output_tokens", "max_tokens")):
        if getattr(request, ours) is not None:
            chat[theirs] = getattr(request, ours)
    if request.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(
            exclude={"type"}, exclude_none=True)} for tool in request.tools]
    if request.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(request.tool_choice)
    response_format = _response_format((request.text or {}).get("format"))
    if response_format is not None:
        chat["response_format"] = response_format
    effort = request.reasoning.effort if request.reasoning else None
    if effort is not None and with_reasoning:
        if effort == "none":
            chat["thinking_token_budget"] = 0
        else:
            chat["reasoning_effort"] = effort
    return chat


def _tool_choice(choice: Any) -> str | dict[str, Any]:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError("tool_choice must be none, auto, required or {type: function, name}",
                       param="tool_choice")


def _response_format(text_format: Any) -> dict[str, Any] | None:
    if text_format is None or text_format == {"type": "text"}:
        return None
    kind = text_format.get("type") if isinstance(text_format, dict) else None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema", "json_schema": {
            key: text_format[key] for key in ("name", "description", "schema", "strict")
            if key in text_format}}
    raise RequestError("text.format.type must be text, json_object or json_schema",
                       param="text.format")


# ----------------------------------------------------------------- the answer

def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) of a chat choice's finish_reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _usage(input_tokens: int, output_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages: every input, then the output


class ResponseStore:
    """The last ``capacity`` stored responses by id, the oldest evicted first."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, stored: StoredResponse) -> None:
        self._responses[stored.response["id"]] = stored
        while len(self._responses) > self.capacity:
            self._responses.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        return self._responses.get(response_id)

    def pop(self, response_id: str) -> StoredResponse | None:
        return self._responses.pop(response_id, None)


def _not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id",
                       code="response_not_found")


class OpenAIResponses:
    """The Responses routes over the chat route, with the store."""

    def __init__(self, chat: OpenAIServingChat, capacity: int = STORE_CAPACITY) -> None:
        self.chat = chat
        self.store = ResponseStore(capacity)

    async def create(self, raw: bytes) -> Response:
        """``POST /v1/responses``."""
        request = ResponsesRequest.parse(raw)
        conversation = []
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:  # OpenAI's answer: a 400 naming the field
                raise RequestError(f"Previous response with id "
                                   f"'{request.previous_response_id}' not found.",
                                   param="previous_response_id",
                                   code="previous_response_not_found")
            conversation = list(previous.conversation)
        conversation += input_messages(request.input)
        chat = chat_request(request, conversation, self.chat.reasoning_parser is not None)
        try:
            answer = await self.chat.create(json.dumps(chat).encode())
        except OpenAIError as error:
            raise OpenAIError(error.status_code, error.message, error.type,
                              _FIELDS.get(error.param, error.param), error.code,
                              error.headers) from None
        response = self._response(request)
        if isinstance(answer, SSEResponse):
            return SSEResponse(self._events(answer.body_iterator, request, response,
                                            conversation), abort=answer.abort)
        body = json.loads(answer.body)
        choice = body["choices"][0]
        response["status"], response["incomplete_details"] = _status(choice["finish_reason"])
        response["output"] = output_items(choice["message"], response["status"])
        response["usage"] = _usage(body["usage"]["prompt_tokens"],
                                   body["usage"]["completion_tokens"],
                                   self._num_tokens(choice["message"].get("reasoning_content")))
        self._keep(request, response, conversation)
        return JSONResponse(response)

    def retrieve(self, response_id: str, stream: bool) -> Response:
        """``GET /v1/responses/{id}``."""
        if stream:
            raise RequestError("stream: loom keeps no events of a stored response (it runs "
                               "no background responses); retrieve it without stream",
                               param="stream")
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return JSONResponse(stored.response)

    def delete(self, response_id: str) -> Response:
        """``DELETE /v1/responses/{id}``."""
        if self.store.pop(response_id) is None:
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    def cancel(self, response_id: str) -> Response:
        """``POST /v1/responses/{id}/cancel``: only a background response can be cancelled,
        and loom runs none, so a stored response is a 400 (vLLM's answer)."""
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        raise RequestError(f"Cannot cancel a synchronous response: '{response_id}' is "
                           f"{stored.response['status']}; only background responses can be "
                           "cancelled, and loom runs none", param="response_id")

    def _response(self, request: ResponsesRequest) -> dict[str, Any]:
        """The response object, in progress: no output yet."""
        return {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "background": False, "error": None,
            "incomplete_details": None, "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens, "metadata": request.metadata or {},
            "model": self.chat.model_name, "output": [],
            "parallel_tool_calls": request.parallel_tool_calls,
            "previous_response_id": request.previous_response_id,
            "reasoning": {"effort": request.reasoning.effort if request.reasoning else None,
                          "summary": None},
            "store": request.store, "temperature": request.temperature,
            "text": {"format": (request.text or {}).get("format") or {"type": "text"}},
            "tool_choice": request.tool_choice or "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in request.tools or []],
            "top_p": request.top_p, "truncation": "disabled", "usage": None,
            "user": request.user}

    def _num_tokens(self, text: str | None) -> int:
        return len(self.chat.engine.tokenizer.encode(text, add_special_tokens=False)) \
            if text else 0

    def _keep(self, request: ResponsesRequest, response: dict[str, Any],
              conversation: list[dict[str, Any]]) -> None:
        if request.store:
            self.store.put(StoredResponse(
                response, conversation + input_messages(response["output"])))

    async def _events(self, chunks: AsyncIterator[str], request: ResponsesRequest,
                      response: dict[str, Any],
                      conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
        """The chat route's SSE chunks as the Responses events."""
        events = ResponseEvents()
        yield events.event("response.created", response=response)
        yield events.event("response.in_progress", response=response)
        finish_reason, usage, reasoning = None, None, []
        async for chunk in sse_payloads(chunks):
            if "error" in chunk:  # the engine failed mid-stream
                response.update(status="failed", output=events.output, error={
                    "code": "server_error", "message": chunk["error"].get("message", "")})
                yield events.event("response.failed", response=response)
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    reasoning.append(delta["reasoning_content"])
                    for event in events.reasoning(delta["reasoning_content"]):
                        yield event
                if delta.get("content"):
                    for event in events.text(delta["content"]):
                        yield event
                for call in delta.get("tool_calls") or []:
                    for event in events.call(call):
                        yield event
                finish_reason = choice.get("finish_reason") or finish_reason
        response["status"], response["incomplete_details"] = _status(finish_reason)
        for event in events.close(response["status"]):
            yield event
        response["output"] = events.output
        response["usage"] = _usage(usage["prompt_tokens"], usage["completion_tokens"],
                                   self._num_tokens("".join(reasoning)))
        self._keep(request, response, conversation)
        yield events.event("response.incomplete" if response["status"] == "incomplete"
                           else "response.completed", response=response)
