"""POST /v1/completions: prompts as text, token ids or batches of either.

    create   parse -> check model -> prompts to token ids -> SamplingParams of each
             -> submit each -> _full or _stream (the prompts' streams merged)

Choice ``i * n + j`` is sequence j of prompt i, as in OpenAI and vLLM. A batch is
validated whole before any of it reaches the engine; each prompt is one engine request
(its n sequences one stream), so only a batch has several streams to merge.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import JSONResponse, Response

from loom.async_llm import RequestStream
from loom.beam_search import BeamSearch, BeamSearchParams
from loom.entrypoints.openai.errors import (OpenAIError, RequestError, engine_error,
                                           raise_if_failed)
from loom.entrypoints.openai.protocol import CompletionRequest
from loom.entrypoints.openai.responses import SSE_DONE, SSEResponse, sse
from loom.entrypoints.openai.serving_engine import OpenAIServing, finite, top_logprobs, usage
from loom.entrypoints.openai.structured_outputs import request_structured_outputs
from loom.input_processor import InvalidInputError
from loom.outputs import Logprob, RequestOutput

Prompt = tuple[str | None, list[int]]  # (text, token ids); text None for token ids given


class OpenAIServingCompletion(OpenAIServing):
    async def create(self, body: bytes) -> Response:
        request = CompletionRequest.parse(body)
        lora_name = self.check_model(request.model)
        prompts = self._prompts(request)
        if request.use_beam_search:
            return await self._beam_search(request, prompts)
        structured_outputs = request_structured_outputs(request)
        transfers = _kv_transfer_params_by_prompt(request.kv_transfer_params, len(prompts))
        params = []
        for (_, token_ids), transfer in zip(prompts, transfers):
            prompt_params = request.to_sampling_params(len(token_ids), self.max_model_len,
                                                       self.default_sampling_params,
                                                       structured_outputs, self.max_logprobs)
            if transfer is not request.kv_transfer_params:  # one of a prefill batch's
                prompt_params = prompt_params.clone(kv_transfer_params=transfer)
            self.use_lora(prompt_params, lora_name)
            params.append(prompt_params)
        for prompt_params, (_, token_ids) in zip(params, prompts):
            self.check_params(prompt_params, len(token_ids))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []

        def abort_all() -> None:
            for stream in streams:
                stream.abort()

        try:
            for i, ((text, token_ids), prompt_params) in enumerate(zip(prompts, params)):
                streams.append(self.submit(f"{request_id}-{i}", text, token_ids, prompt_params,
                                           request.stream))
        except OpenAIError:  # the queue filled up or the engine died midway: none of it runs
            abort_all()
            raise
        if request.stream:
            return SSEResponse(self._stream(request, request_id, prompts, streams),
                               abort=abort_all)
        return await self._full(request, request_id, prompts, streams)

    async def _beam_search(self, request: CompletionRequest, prompts: list[Prompt]) -> Response:
        """vLLM's ``use_beam_search``: ``n`` beams of each prompt (loom/beam_search.py),
        each step every live beam one non-streamed request to the engine; the beams are
        the choices, best first."""
        if request.stream:
            raise RequestError("use_beam_search gives whole beams; set stream to false",
                               param="stream")
        max_tokens = request.max_tokens or 16
        longest = max(len(token_ids) for _, token_ids in prompts)
        if longest + max_tokens > self.max_model_len:
            raise RequestError(f"This model's maximum context length is {self.max_model_len} "
                               f"tokens; {longest} in the prompt and {max_tokens} to generate "
                               "do not fit", param="prompt", code="context_length_exceeded")
        try:
            params = BeamSearchParams(beam_width=request.n, max_tokens=max_tokens,
                                      ignore_eos=request.ignore_eos,
                                      length_penalty=request.length_penalty)
        except ValueError as error:
            raise RequestError(str(error), param="n") from None
        search = BeamSearch([token_ids for _, token_ids in prompts], params,
                            frozenset(self.engine.tokenizer.eos_token_ids))
        try:
            self.engine.input_processor.validate_params(search.ask)
        except InvalidInputError as error:  # 2 n logprobs a step: more than --max-logprobs
            raise RequestError(f"use_beam_search with n {request.n} asks for {2 * request.n} "
                               f"logprobs a step: {error}", param="n") from None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        while not search.done:
            streams = [self.submit(f"{request_id}-{search.steps}-{i}", None, tokens,
                                   search.ask, False)
                       for i, tokens in enumerate(search.asks())]
            answers = []
            for stream in streams:
                final = None
                try:
                    async for output in stream:
                        final = output
                except Exception as error:  # noqa: BLE001 — the engine died or aborted it
                    for other in streams:
                        other.abort()
                    raise engine_error(error) from None
                raise_if_failed(final.outputs[0])
                answers.append(sorted(((token_id, entry.logprob) for token_id, entry
                                       in final.outputs[0].logprobs[0].items()),
                                      key=lambda item: item[1], reverse=True))
            search.advance(answers)
        choices, num_completion_tokens = [], 0
        for prompt_index, ((text, token_ids), result) in enumerate(zip(prompts,
                                                                       search.outputs())):
            for beam_index, beam in enumerate(result.sequences):
                generated = beam.tokens[len(token_ids):]
                num_completion_tokens += len(generated)
                beam_text = self.engine.tokenizer.decode(generated)
                choices.append({
                    "index": prompt_index * request.n + beam_index,
                    "text": (text or "") + beam_text if request.echo else beam_text,
                    "logprobs": None, "finish_reason": "stop" if beam.finished else "length",
                    "stop_reason": None})
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        return JSONResponse({"id": request_id, "object": "text_completion",
                             "created": int(time.time()), "model": self.model_name,
                             "choices": choices,
                             "usage": usage(num_prompt_tokens, num_completion_tokens)})

    def _prompts(self, request: CompletionRequest) -> list[Prompt]:
        """The request's prompts, validated; with echo, each has its text."""
        prompt = request.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            batch = [prompt]
        else:
            batch = list(prompt)
        if not batch:
            raise RequestError("prompt is empty; give a string, token ids or a batch of them",
                               param="prompt")
        prompts = []
        for item in batch:
            try:
                text, token_ids = self.engine.input_processor.process_prompt(item)
            except InvalidInputError as error:
                raise RequestError.from_invalid_input(error) from None
            if request.echo and text is None:
                text = self.engine.tokenizer.decode(token_ids, skip_special_tokens=False)
            prompts.append((text, token_ids))
        return prompts

    async def _full(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                    streams: list[RequestStream]) -> Response:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async with contextlib.aclosing(_merge(streams)) as outputs:
                async for prompt_index, output in outputs:
                    finals[prompt_index] = output
        except Exception as error:  # noqa: BLE001 — the engine died or aborted the request
            raise engine_error(error) from None
        choices, num_completion_tokens = [], 0
        for prompt_index, output in enumerate(finals):
            text, token_ids = prompts[prompt_index]
            for seq in output.outputs:
                raise_if_failed(seq)
                num_completion_tokens += len(seq.token_ids)
                logprobs = None
                if seq.logprobs is not None:
                    echoed, offset = self._echo_logprobs(request, token_ids,
                                                         output.prompt_logprobs)
                    logprobs = _join(echoed, _logprobs(seq.token_ids, seq.logprobs,
                                                       request.logprobs, offset)[0])
                choices.append({
                    "index": prompt_index * request.n + seq.index,
                    "text": (text or "") + seq.text if request.echo else seq.text,
                    "logprobs": logprobs,
                    "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason})
        choices.sort(key=lambda choice: choice["index"])
        num_prompt_tokens = sum(len(token_ids) for _, token_ids in prompts)
        body = {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": usage(num_prompt_tokens, num_completion_tokens)}
        if finals[0].kv_transfer_params is not None:  # a prefill instance's answer
            body["kv_transfer_params"] = (finals[0].kv_transfer_params if len(finals) == 1 else
                                          {"batch": [f.kv_transfer_params for f in finals]})
        return JSONResponse(body)

    async def _stream(self, request: CompletionRequest, request_id: str, prompts: list[Prompt],
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        created = int(time.time())
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        num_choices = len(prompts) * request.n
        text_offsets = [0] * num_choices
        echoed = [not request.echo] * num_choices
        prompt_logprobs: dict[int, list] = {}  # prompt index -> its prompt logprobs (echo)
        num_completion_tokens = 0
        try:
            async with contextlib.aclosing(_merge(streams)) as outputs:
                async for prompt_index, output in outputs:
                    if output.prompt_logprobs is not None:
                        prompt_logprobs[prompt_index] = output.prompt_logprobs
                    for seq in output.outputs:
                        raise_if_failed(seq)
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


def _kv_transfer_params_by_prompt(params: dict[str, Any] | None,
                                  num_prompts: int) -> list[dict[str, Any] | None]:
    """Each prompt's kv_transfer_params. A prefill instance answers a batch with
    ``{"batch": [each prompt's params]}``, which the decode instance gets back; other
    params (``{"do_remote_decode": true}``) hold for every prompt."""
    if not params or "batch" not in params:
        return [params] * num_prompts
    batch = params["batch"]
    if not (isinstance(batch, list) and all(isinstance(item, dict) for item in batch)):
        raise RequestError("kv_transfer_params.batch must be a list of each prompt's params",
                           param="kv_transfer_params")
    if len(batch) != num_prompts:
        raise RequestError(f"kv_transfer_params has a batch of {len(batch)} transfers for "
                           f"{num_prompts} prompts; send the decode instance the prefill "
                           "instance's answer to the same prompts", param="kv_transfer_params")
    return batch


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(index of the prompt, output) from the prompts' streams as outputs arrive; a
    stream's failure is raised here.

    Closing the merged iterator, or a failure, cancels the tasks reading the other
    streams, and a RequestStream cancelled while it waits aborts its request.
    """
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as error:  # noqa: BLE001 — re-raised by the consumer
            queue.put_nowait((index, error))
        queue.put_nowait((index, done))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _join(first: dict[str, Any] | None, second: dict[str, Any]) -> dict[str, Any]:
    """Two logprobs objects as one, ``first`` (if any) before ``second``."""
    if first is None:
        return second
    return {key: first[key] + second[key] for key in second}


def _logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
              text_offset: int) -> tuple[dict[str, Any], int]:
    """OpenAI's completions logprobs object; also the text offset after these tokens."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs):
        sampled = entry[token_id]
        token = sampled.decoded_token or ""
        tokens.append(token)
        token_logprobs.append(finite(sampled.logprob))
        position_top = {lp.decoded_token: finite(lp.logprob)
                        for _, lp in top_logprobs(entry, num_top)}
        position_top.setdefault(token, finite(sampled.logprob))
        top.append(position_top)
        offsets.append(text_offset)
        text_offset += len(token)
    return ({"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
             "text_offset": offsets}, text_offset)
