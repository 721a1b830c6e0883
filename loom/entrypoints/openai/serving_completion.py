"""POST /v1/completions: prompts as text, token ids or batches of either.

Choice ``i * n + j`` is sequence j of prompt i, as in OpenAI and vLLM. A batch is
validated whole before any of it reaches the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from loom.async_llm import AsyncLLM, RequestStream
from loom.entrypoints.openai.protocol import CompletionRequest
from loom.entrypoints.openai.serving_engine import (SSE_DONE, OpenAIError, SSEResponse, bad_request,
                                                    check_model, engine_error, finite, input_error,
                                                    merge_generators, new_id, now_s, parse_body,
                                                    resolve_max_tokens, sorted_top_logprobs, sse,
                                                    to_sampling_params, usage)
from loom.entrypoints.openai.structured_outputs import request_structured_outputs
from loom.input_processor import InvalidInputError
from loom.outputs import CompletionOutput, Logprob, RequestOutput
from loom.sampling_params import SamplingParams


class OpenAIServingCompletion:
    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = engine.config.model.max_model_len

    async def create(self, body: bytes) -> Response:
        request = parse_body(CompletionRequest, body)
        check_model(request.model, self.model_name)
        if request.suffix is not None:
            raise bad_request("suffix is not supported", param="suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        prompts = self._process_prompts(request)
        params = [self._sampling_params(request, len(token_ids)) for _, token_ids in prompts]
        request_id = new_id("cmpl")
        streams: list[RequestStream] = []
        try:
            for i, ((text, token_ids), sp) in enumerate(zip(prompts, params)):
                streams.append(self.engine.add_request(f"{request_id}-{i}", text, token_ids, sp,
                                                       stream=request.stream))
        except Exception as error:
            for stream in streams:
                stream.abort()
            raise engine_error(error) from None
        if request.stream:
            return SSEResponse(self._stream(request, request_id, prompts, streams))
        return await self._full(request, request_id, prompts, params, streams)

    def _process_prompts(self, request: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise bad_request("prompt is empty; give a string, token ids or a batch of them",
                              param="prompt")
        processor = self.engine.input_processor
        prompts = []
        for item in batch:
            try:
                text, token_ids = processor.process_prompt(item)
            except InvalidInputError as error:
                raise input_error(error, "prompt") from None
            if request.echo and text is None:
                text = self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)
            prompts.append((text, token_ids))
        return prompts

    def _sampling_params(self, request: CompletionRequest, num_prompt_tokens: int
                         ) -> SamplingParams:
        defaults = self.engine.config.model.default_sampling_params
        max_tokens = resolve_max_tokens(request.max_tokens, num_prompt_tokens,
                                        self.max_model_len, "prompt", defaults.get("max_tokens"))
        params = to_sampling_params(request, max_tokens, request.logprobs, "logprobs",
                                    request_structured_outputs(request), defaults)
        if request.echo and request.logprobs is not None:
            # The echoed prompt's tokens carry logprobs too (the first one None).
            params = params.clone(prompt_logprobs=request.logprobs)
        try:
            self.engine.input_processor.validate_params(params)
        except InvalidInputError as error:
            raise input_error(error, error.param) from None
        return params

    async def _full(self, request: CompletionRequest, request_id: str,
                    prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams],
                    streams: list[RequestStream]) -> Response:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, output in merge_generators(streams):
                finals[index] = output
        except Exception as error:  # noqa: BLE001 — the engine died or aborted the request
            raise engine_error(error) from None
        choices, num_completion_tokens = [], 0
        for prompt_index, output in enumerate(finals):
            for seq in output.outputs:
                _raise_if_error(seq)
                num_completion_tokens += len(seq.token_ids)
                text = (prompts[prompt_index][0] or "") + seq.text if request.echo else seq.text
                logprobs = None
                if seq.logprobs is not None:
                    echoed, offset = self._echo_logprobs(request, prompts[prompt_index][1],
                                                         output.prompt_logprobs)
                    logprobs = _join(echoed, _logprobs(seq.token_ids, seq.logprobs,
                                                       request.logprobs, offset)[0])
                choices.append({
                    "index": prompt_index * request.n + seq.index, "text": text,
                    "logprobs": logprobs,
                    "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason})
        choices.sort(key=lambda choice: choice["index"])
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": now_s(),
            "model": self.model_name, "choices": choices,
            "usage": usage(num_prompt_tokens, num_completion_tokens)})

    async def _stream(self, request: CompletionRequest, request_id: str,
                      prompts: list[tuple[str | None, list[int]]],
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        created = now_s()
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        num_choices = len(prompts) * request.n
        text_offsets = [0] * num_choices
        echoed = [not request.echo] * num_choices
        prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt logprobs (echo)
        num_completion_tokens = 0
        try:
            async for prompt_index, output in merge_generators(streams):
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                for seq in output.outputs:
                    _raise_if_error(seq)
                    index = prompt_index * request.n + seq.index
                    text = seq.text
                    echoed_logprobs = None
                    if not echoed[index]:
                        text, echoed[index] = (prompts[prompt_index][0] or "") + text, True
                        if seq.logprobs is not None:
                            echoed_logprobs, text_offsets[index] = self._echo_logprobs(
                                request, prompts[prompt_index][1],
                                prompt_logprobs.get(prompt_index))
                    logprobs = None
                    if seq.logprobs is not None:
                        logprobs, text_offsets[index] = _logprobs(
                            seq.token_ids, seq.logprobs, request.logprobs, text_offsets[index])
                        logprobs = _join(echoed_logprobs, logprobs)
                    num_completion_tokens += len(seq.token_ids)
                    chunk: dict[str, Any] = {
                        "id": request_id, "object": "text_completion", "created": created,
                        "model": self.model_name,
                        "choices": [{"index": index, "text": text, "logprobs": logprobs,
                                     "finish_reason": seq.finish_reason,
                                     "stop_reason": seq.stop_reason}]}
                    if include_usage:
                        chunk["usage"] = None
                    yield sse(chunk)
            if include_usage:
                num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.model_name, "choices": [],
                           "usage": usage(num_prompt_tokens, num_completion_tokens)})
        except OpenAIError as error:
            yield sse(error.body())
        except Exception as error:  # noqa: BLE001 — the engine died or aborted us mid-stream
            yield sse(engine_error(error).body())
        yield SSE_DONE


    def _echo_logprobs(self, request: CompletionRequest, prompt_token_ids: list[int],
                       prompt_logprobs: list[dict[int, Logprob] | None] | None
                       ) -> tuple[dict[str, Any] | None, int]:
        """The echoed prompt's part of the logprobs object (the first token has none),
        and the text offset after it; (None, 0) without echo."""
        if not request.echo or not prompt_logprobs:
            return None, 0
        first = self.engine.tokenizer.decode(prompt_token_ids[:1])
        rest, offset = _logprobs(prompt_token_ids[1:], prompt_logprobs[1:], request.logprobs,
                                 len(first))
        return _join({"tokens": [first], "token_logprobs": [None], "top_logprobs": [None],
                      "text_offset": [0]}, rest), offset


def _join(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two logprobs objects as one, ``first`` (if any) before ``second``."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}


def _raise_if_error(seq: CompletionOutput) -> None:
    if seq.finish_reason == "error":
        raise OpenAIError(500, f"the engine failed this request: {seq.stop_reason}",
                          "server_error")


def _logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
              text_offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's completions logprobs object; also the text offset after these tokens."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(finite(sampled.logprob))
        top = {lp.decoded_token: finite(lp.logprob)
               for _, lp in sorted_top_logprobs(entry, num_top)}
        top.setdefault(token, finite(sampled.logprob))
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(token)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
             "text_offset": offsets}, text_offset)
