"""POST /v1/chat/completions: messages through the chat template, then one prompt.

    create   parse -> check model -> render the messages (their images loaded and
             expanded) -> output constraints (tool choice, response_format)
             -> SamplingParams -> submit -> _full or _stream

Images: each ``image_url`` part reaches the template as ``{"type": "image"}`` (its
placeholder), each ``video_url`` part as ``{"type": "video"}``; the items are loaded in
worker threads under the server's media policy (a video sampled to frames) and each
placeholder is expanded into the item's tokens, which ``usage.prompt_tokens`` counts
(loom/entrypoints/chat_images.py).

A stream opens each choice with a ``{"role": "assistant", "content": ""}`` delta, as
OpenAI and vLLM do, then sends text deltas; the last delta of a choice carries its
finish_reason. The n choices of a request are one engine request, so one stream.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

from starlette.responses import JSONResponse, Response

from loom.async_llm import AsyncLLM, RequestStream
from loom.core.wire import MultiModalFeature
from loom.entrypoints.chat_images import ChatMedia, take_images
from loom.entrypoints.openai.chat_output import ChatOutputBuilder
from loom.entrypoints.openai.errors import RequestError, engine_error, raise_if_failed
from loom.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, ChatTool
from loom.entrypoints.openai.reasoning_parsers import (explicit_reasoning_parser,
                                                       get_reasoning_parser)
from loom.entrypoints.openai.responses import SSE_DONE, SSEResponse, sse
from loom.entrypoints.openai.serving_engine import OpenAIServing, finite, top_logprobs, usage
from loom.entrypoints.openai.structured_outputs import (check_tool_choice,
                                                        request_structured_outputs,
                                                        tool_choice_structured_outputs)
from loom.entrypoints.openai.tool_parsers import get_tool_parser
from loom.input_processor import InvalidInputError
from loom.outputs import CompletionOutput, Logprob
from loom.sampling_params import (GrammarAfterThinking, StructuredOutputsParams,
                                  thinking_left_open)
from loom.tokenizer import Tokenizer


class ChatPrompt(NamedTuple):
    """A chat request's prompt: its token ids (each image's placeholder expanded into its
    tokens) and its images' features."""

    token_ids: list[int]
    mm_features: list[MultiModalFeature]


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_name: str, *,
                 enable_auto_tool_choice: bool = False, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        super().__init__(engine, served_model_name)
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.tool_call_parser = tool_call_parser
        self.tool_parser = get_tool_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = (get_reasoning_parser(reasoning_parser) if reasoning_parser
                                 else None)

    async def create(self, body: bytes) -> Response:
        request = ChatCompletionRequest.parse(body)
        lora_name = self.check_model(request.model)
        token_ids, mm_features = await self.render(request)
        structured_outputs, output_builder = self._output_constraints(
            request, self._opens_thinking(token_ids))
        params = request.to_sampling_params(len(token_ids), self.max_model_len,
                                            self.default_sampling_params, structured_outputs,
                                            self.max_logprobs, self.effort_budgets)
        think_ids = self.engine.input_processor.think_token_ids()
        if structured_outputs is not None and output_builder.reasoning_parser is not None \
                and think_ids is not None:  # the grammar constrains the answer only
            params.grammar_after_thinking = GrammarAfterThinking(*think_ids)
        self.use_lora(params, lora_name)
        self.check_params(params, len(token_ids))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = self.submit(request_id, None, token_ids, params, request.stream, mm_features)
        if request.stream:
            return SSEResponse(self._stream(request, request_id, len(token_ids), stream,
                                            output_builder), abort=stream.abort)
        return await self._full(request, request_id, len(token_ids), stream, output_builder)

    def _opens_thinking(self, token_ids: list[int]) -> bool:
        """Whether the rendered prompt leaves a <think> open for the output (True where
        the tokenizer has no such tokens: the parser's own rule then)."""
        think_ids = self.engine.input_processor.think_token_ids()
        if think_ids is None:
            return True
        return thinking_left_open(token_ids, *think_ids)

    def _output_constraints(self, request: ChatCompletionRequest, opens_thinking: bool = True
                            ) -> tuple[StructuredOutputsParams | None, ChatOutputBuilder]:
        """The grammar the output must follow (response_format and the like, or the tool
        calls tool_choice forces), and the builder that turns output text into messages.

        With a reasoning parser, on a tokenizer that has <think> and </think>, the grammar
        constrains only the answer: the thinking before it is free and parsed as usual.
        Elsewhere the grammar constrains the output from its first token, so forced tool
        calls have no reasoning, and other constrained outputs have reasoning only where
        the grammar itself opens with <think>."""
        tool_choice = check_tool_choice(request, self.enable_auto_tool_choice,
                                        self.tool_call_parser)
        structured_outputs = request_structured_outputs(request)
        forced_tool_calls = tool_choice_structured_outputs(request, tool_choice)
        reasoning_parser = self.reasoning_parser
        if reasoning_parser is not None and not opens_thinking:  # the template closed it
            reasoning_parser = reasoning_parser.with_thinking_closed()
        thinks_first = (reasoning_parser is not None
                        and self.engine.input_processor.think_token_ids() is not None)
        if forced_tool_calls is not None:
            if structured_outputs is not None:
                raise RequestError(f'tool_choice "{tool_choice}" constrains the output itself; '
                                   "drop response_format / structured_outputs",
                                   param="tool_choice")
            structured_outputs = forced_tool_calls
            if not thinks_first:
                reasoning_parser = None
        elif structured_outputs is not None and reasoning_parser is not None \
                and not thinks_first:
            reasoning_parser = explicit_reasoning_parser()
        tool_name = request.tool_choice.function.name if tool_choice == "named" else None
        return structured_outputs, ChatOutputBuilder(tool_choice, tool_name, self.tool_parser,
                                                     reasoning_parser)

    async def render(self, request: ChatCompletionRequest) -> ChatPrompt:
        """The request's prompt, as the template renders its messages, with its images."""
        kwargs = dict(request.chat_template_kwargs or {})
        if request.thinking_budget(self.effort_budgets) == 0:  # no thinking, where the
            kwargs.setdefault("enable_thinking", False)       # template can leave it out
        images = chat_images(request.messages)
        if images:  # a text-only model, too many images: before any is loaded
            self.check_images(images)
        text = render_chat_prompt(self.engine.tokenizer, request.messages, request.tools,
                                  request.add_generation_prompt, kwargs)
        # The template writes any BOS token itself.
        token_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        mm_features: list[MultiModalFeature] = []
        try:
            self.engine.input_processor.validate_prompt(token_ids, param="messages")
            if images:
                token_ids, mm_features = await self.apply_images(token_ids, images)
                self.engine.input_processor.validate_prompt(token_ids, param="messages")
        except InvalidInputError as error:
            raise RequestError.from_invalid_input(error) from None
        return ChatPrompt(token_ids, mm_features)

    async def _full(self, request: ChatCompletionRequest, request_id: str,
                    num_prompt_tokens: int, stream: RequestStream,
                    output_builder: ChatOutputBuilder) -> Response:
        # Not streamed, the engine sends one output: the finished one.
        try:
            async for output in stream:
                final = output
        except Exception as error:  # noqa: BLE001 — the engine died or aborted the request
            raise engine_error(error) from None
        choices, num_completion_tokens = [], 0
        for seq in final.outputs:
            raise_if_failed(seq)
            num_completion_tokens += len(seq.token_ids)
            message, finish_reason = output_builder.message(seq.text, seq.finish_reason)
            choices.append({
                "index": seq.index, "message": message,
                "logprobs": _logprobs(seq, request.top_logprobs or 0),
                "finish_reason": finish_reason, "stop_reason": seq.stop_reason})
        body = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": usage(num_prompt_tokens, num_completion_tokens)}
        if final.kv_transfer_params is not None:  # a prefill instance's answer
            body["kv_transfer_params"] = final.kv_transfer_params
        return JSONResponse(body)

    async def _stream(self, request: ChatCompletionRequest, request_id: str,
                      num_prompt_tokens: int, stream: RequestStream,
                      output_builder: ChatOutputBuilder) -> AsyncIterator[str]:
        created = int(time.time())
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
            async for output in stream:
                for seq in output.outputs:
                    raise_if_failed(seq)
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
        except Exception as error:  # noqa: BLE001 — the engine died or aborted us mid-stream
            yield sse(engine_error(error).body())
        yield SSE_DONE


def chat_images(messages: list[ChatMessage]) -> list[ChatMedia]:
    """The images and videos of chat messages (their image_url and video_url parts), in
    order."""
    return take_images([message.model_dump(exclude_none=True) for message in messages])[1]


def render_chat_prompt(tokenizer: Tokenizer, messages: list[ChatMessage],
                       tools: list[ChatTool] | None, add_generation_prompt: bool,
                       template_kwargs: dict[str, Any]) -> str:
    """The prompt text of chat messages (also what /tokenize counts), each image part an
    ``{"type": "image"}`` for the template to write its placeholder; a 400 when the
    template fails on them: whatever a template raises (a ZeroDivisionError as well as
    raise_exception's TemplateError), it raised on what this request gave it."""
    template_messages, _ = take_images([message.model_dump(exclude_none=True)
                                        for message in messages])
    try:
        return tokenizer.render_chat_template(
            template_messages,
            add_generation_prompt,
            tools=[tool.model_dump(exclude_none=True) for tool in tools] if tools else None,
            **template_kwargs)
    except Exception as error:  # noqa: BLE001 — see above
        raise RequestError(f"the chat template failed on these messages: "
                           f"{type(error).__name__}: {error}", param="messages") from None


def _logprobs(seq: CompletionOutput, num_top: int) -> dict[str, Any] | None:
    """OpenAI's chat logprobs object for this output's tokens."""
    if seq.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(seq.token_ids, seq.logprobs):
        item = _token_logprob(entry[token_id])
        item["top_logprobs"] = [_token_logprob(lp) for _, lp in top_logprobs(entry, num_top)]
        content.append(item)
    return {"content": content}


def _token_logprob(logprob: Logprob) -> dict[str, Any]:
    token = logprob.decoded_token or ""
    return {"token": token, "logprob": finite(logprob.logprob), "bytes": list(token.encode())}
