"""POST /v1/chat/completions: messages through the chat template, then one prompt.

A stream opens each choice with a ``{"role": "assistant", "content": ""}`` delta, as
OpenAI and vLLM do, then sends text deltas; the last delta of a choice carries its
finish_reason.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from loom.async_llm import AsyncLLM, RequestStream
from loom.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from loom.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIError, SSEResponse, bad_request,
                                                    check_model, engine_error, finite, input_error,
                                                    merge_generators, new_id, now_s, parse_body,
                                                    resolve_max_tokens, sorted_top_logprobs, sse,
                                                    to_sampling_params, usage)
from loom.entrypoints.openai.chat_output import ChatOutputBuilder
from loom.entrypoints.openai.reasoning_parsers import (ReasoningParser,
                                                       explicit_reasoning_parser,
                                                       get_reasoning_parser)
from loom.entrypoints.openai.structured_outputs import (check_tool_choice,
                                                        request_structured_outputs,
                                                        tool_choice_structured_outputs)
from loom.entrypoints.openai.tool_parsers import get_tool_parser
from loom.input_processor import InvalidInputError
from loom.outputs import CompletionOutput, Logprob
from loom.tokenizer import Tokenizer


class OpenAIServingChat:
    def __init__(self, engine: AsyncLLM, served_model_name: str, *,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = engine.config.model.max_model_len
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = (get_reasoning_parser(reasoning_parser) if reasoning_parser
                                 else None)

    async def create(self, body: bytes) -> Response:
        request = parse_body(ChatCompletionRequest, body)
        check_model(request.model, self.model_name)
        if request.top_logprobs is not None and not request.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
        tool_choice = check_tool_choice(request, self.enable_auto_tool_choice,
                                        self.tool_call_parser)
        structured_outputs = request_structured_outputs(request)
        forced_tool_calls = tool_choice_structured_outputs(request, tool_choice)
        if forced_tool_calls is not None:
            if structured_outputs is not None:
                raise bad_request(f'tool_choice "{tool_choice}" constrains the output itself; '
                                  "drop response_format / structured_outputs", param="tool_choice")
            structured_outputs = forced_tool_calls
        output_builder = ChatOutputBuilder(
            tool_choice, request.tool_choice.function.name if tool_choice == "named" else None,
            self.tool_parser, self._reasoning_parser(structured_outputs, forced_tool_calls))
        token_ids = self._render(request)
        requested = (request.max_completion_tokens if request.max_completion_tokens is not None
                     else request.max_tokens)
        defaults = self.engine.config.model.default_sampling_params
        max_tokens = resolve_max_tokens(requested, len(token_ids), self.max_model_len, "messages",
                                        defaults.get("max_tokens"))
        params = to_sampling_params(request, max_tokens,
                                    (request.top_logprobs or 0) if request.logprobs else None,
                                    "top_logprobs", structured_outputs, defaults)
        try:
            self.engine.input_processor.validate_params(params)
        except InvalidInputError as error:
            raise input_error(error, error.param) from None
        request_id = new_id("chatcmpl")
        try:
            stream = self.engine.add_request(request_id, None, token_ids, params,
                                             stream=request.stream)
        except Exception as error:  # noqa: BLE001 — queue full or engine dead
            raise engine_error(error) from None
        if request.stream:
            return SSEResponse(self._stream(request, request_id, len(token_ids), stream,
                                            output_builder))
        return await self._full(request, request_id, len(token_ids), stream, output_builder)

    def _reasoning_parser(self, structured_outputs, forced_tool_calls) -> ReasoningParser | None:
        """The grammar constrains a request's output from its first token (there is no
        free thinking phase before it), so: forced tool calls have no reasoning, and other
        constrained outputs have reasoning only where they open with <think>."""
        if self.reasoning_parser is None or forced_tool_calls is not None:
            return None
        if structured_outputs is not None:
            return explicit_reasoning_parser()
        return self.reasoning_parser

    def _render(self, request: ChatCompletionRequest) -> list[int]:
        text = render_chat_prompt(self.engine.tokenizer, request.messages, request.tools,
                                  request.add_generation_prompt,
                                  request.chat_template_kwargs or {})
        # The template writes any BOS token itself.
        token_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        try:
            self.engine.input_processor.validate_prompt(token_ids, param="messages")
        except InvalidInputError as error:
            raise input_error(error, "messages") from None
        return token_ids

    async def _full(self, request: ChatCompletionRequest, request_id: str,
                    num_prompt_tokens: int, stream: RequestStream,
                    output_builder: ChatOutputBuilder) -> Response:
        output = None
        try:
            async for _, output in merge_generators([stream]):
                pass
        except Exception as error:  # noqa: BLE001 — the engine died or aborted the request
            raise engine_error(error) from None
        choices, num_completion_tokens = [], 0
        for seq in output.outputs:
            _raise_if_error(seq)
            num_completion_tokens += len(seq.token_ids)
            message, finish_reason = output_builder.message(seq.text, seq.finish_reason)
            choices.append({
                "index": seq.index, "message": message,
                "logprobs": _logprobs(seq, request.top_logprobs or 0),
                "finish_reason": finish_reason, "stop_reason": seq.stop_reason})
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": now_s(),
            "model": self.model_name, "choices": choices,
            "usage": usage(num_prompt_tokens, num_completion_tokens)})

    async def _stream(self, request: ChatCompletionRequest, request_id: str,
                      num_prompt_tokens: int, stream: RequestStream,
                      output_builder: ChatOutputBuilder) -> AsyncIterator[str]:
        created = now_s()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)

        def chunk(choices: list[dict[str, Any]], with_usage: dict | None = None) -> str:
            data: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                                    "created": created, "model": self.model_name,
                                    "choices": choices}
            if include_usage:
                data["usage"] = with_usage
            return sse(data)

        num_completion_tokens = 0
        streamers = [output_builder.streaming() for _ in range(request.n)]
        try:
            for index in range(request.n):
                yield chunk([{"index": index, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for _, output in merge_generators([stream]):
                for seq in output.outputs:
                    _raise_if_error(seq)
                    num_completion_tokens += len(seq.token_ids)
                    streamer = streamers[seq.index]
                    deltas = streamer.feed(seq.text, seq.finished) or [{}]
                    logprobs = _logprobs(seq, request.top_logprobs or 0)
                    for i, delta in enumerate(deltas):
                        last = i == len(deltas) - 1
                        yield chunk([{"index": seq.index, "delta": delta,
                                      "logprobs": logprobs if last else None,
                                      "finish_reason": (streamer.finish_reason(seq.finish_reason)
                                                        if last else None),
                                      "stop_reason": seq.stop_reason if last else None}])
            if include_usage:
                yield chunk([], usage(num_prompt_tokens, num_completion_tokens))
        except OpenAIError as error:
            yield sse(error.body())
        except Exception as error:  # noqa: BLE001 — the engine died or aborted us mid-stream
            yield sse(engine_error(error).body())
        yield SSE_DONE


def render_chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage],
                       tools: list[ChatTool] | None, add_generation_prompt: bool,
                       template_kwargs: dict[str, Any]) -> str:
    """The prompt text of chat messages (also what /tokenize counts); a 400 when the
    template fails on them: whatever a template raises (a ZeroDivisionError as well as
    raise_exception's TemplateError), it raised on what this request gave it."""
    try:
        return tokenizer.render_chat_template(
            [message.model_dump(exclude_none=True) for message in messages],
            add_generation_prompt,
            tools=[tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
            **template_kwargs)
    except Exception as error:  # noqa: BLE001 — see above
        raise bad_request(f"the chat template failed on these messages: "
                          f"{type(error).__name__}: {error}", param="messages") from None


def _raise_if_error(seq: CompletionOutput) -> None:
    if seq.finish_reason == "error":
        raise OpenAIError(500, f"the engine failed this request: {seq.stop_reason}",
                          "server_error")


def _logprobs(seq: CompletionOutput, num_top: int) -> dict[str, Any] | None:
    """OpenAI's chat logprobs object for this output's tokens."""
    if seq.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(seq.token_ids, seq.logprobs):
        item = _token_logprob(entry[token_id])
        item["top_logprobs"] = [_token_logprob(lp) for _, lp in sorted_top_logprobs(entry, num_top)]
        content.append(item)
    return {"content": content}


def _token_logprob(logprob: Logprob) -> dict[str, Any]:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": finite(logprob.logprob), "bytes": list(token.encode())}
