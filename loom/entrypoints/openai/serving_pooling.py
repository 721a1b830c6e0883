"""The pooling routes (an engine started with ``--task embed`` or ``score``; loom/pooling.py).

    POST /v1/embeddings    OpenAI's: ``input`` as text, token ids or a batch of either;
                           ``dimensions`` (Matryoshka models), ``encoding_format`` float or
                           base64 (little-endian float32, as OpenAI's SDK decodes it)
    POST /v1/rerank        Jina's and Cohere's (as vLLM and llama-server serve them): a
    POST /v2/rerank        ``query`` and ``documents``, the results best first, ``top_n``
    POST /score            vLLM's: ``text_1`` against each ``text_2`` (or pairs one to
    POST /v1/score         one), in input order
    POST /classify         vLLM's: each input's label probabilities (--task classify)

Each prompt (a text, or a query and document put in the reranker's template) is one
engine request, prefilled and pooled, all of a request's prompts submitted before any
is awaited so that they share steps. A generation request to a pooling engine, or
the reverse, is a 400 from the input processor naming ``model``.
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
import uuid
from typing import Literal

from pydantic import field_validator
from starlette.responses import JSONResponse, Response

from loom.async_llm import RequestStream
from loom.entrypoints.openai.errors import OpenAIError, RequestError, engine_error
from loom.entrypoints.openai.protocol import Int64, OpenAIModel
from loom.entrypoints.openai.serving_engine import OpenAIServing
from loom.input_processor import InvalidInputError
from loom.outputs import RequestOutput
from loom.pooling import cross_encoder_pair, score_pairs, score_prompt
from loom.sampling_params import PoolingParams, SamplingParams


class EmbeddingRequest(OpenAIModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Int64 | None = None
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None as the model's pooler config says
    truncate_prompt_tokens: Int64 | None = None

    @field_validator("dimensions")
    @classmethod
    def _positive(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise ValueError(f"dimensions must be a positive integer, got {value}")
        return value


class RerankDocument(OpenAIModel):
    text: str


class RerankRequest(OpenAIModel):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: Int64 | None = None
    return_documents: bool = True


class ScoreRequest(OpenAIModel):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None


class ClassificationRequest(OpenAIModel):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    truncate_prompt_tokens: Int64 | None = None


class OpenAIServingPooling(OpenAIServing):
    async def embeddings(self, body: bytes) -> Response:
        request = EmbeddingRequest.parse(body)
        lora_name = self.check_model(request.model)
        pooling = PoolingParams(task="embed", normalize=request.normalize,
                                dimensions=request.dimensions)
        token_ids = self._inputs(request.input, request.truncate_prompt_tokens)
        outputs = await self._pool("embd", token_ids, pooling, lora_name)
        data = []
        for index, output in enumerate(outputs):
            vector = output.pooled
            if request.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()
            data.append({"object": "embedding", "index": index, "embedding": vector})
        num_tokens = sum(len(ids) for ids in token_ids)
        return JSONResponse({"object": "list", "data": data, "model": self.model_name,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    async def classify(self, body: bytes) -> Response:
        """vLLM's /classify: each input's label probabilities, its label the likeliest
        (the checkpoint's id2label names it)."""
        request = ClassificationRequest.parse(body)
        lora_name = self.check_model(request.model)
        token_ids = self._inputs(request.input, request.truncate_prompt_tokens)
        outputs = await self._pool("classify", token_ids, PoolingParams(task="classify"),
                                   lora_name)
        labels = (self.engine.config.model.hf_config or {}).get("id2label") or {}
        data = []
        for index, output in enumerate(outputs):
            probs = output.pooled
            best = max(range(len(probs)), key=probs.__getitem__)
            data.append({"index": index, "label": labels.get(str(best), labels.get(best, str(best))),
                         "probs": probs, "num_classes": len(probs)})
        num_tokens = sum(len(ids) for ids in token_ids)
        return JSONResponse({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                             "created": int(time.time()), "model": self.model_name,
                             "data": data,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    async def rerank(self, body: bytes) -> Response:
        request = RerankRequest.parse(body)
        lora_name = self.check_model(request.model)
        if not request.documents:
            raise RequestError("documents is empty; give at least one", param="documents")
        documents = [d if isinstance(d, str) else d.text for d in request.documents]
        if request.top_n is not None and request.top_n < 1:
            raise RequestError(f"top_n must be at least 1, got {request.top_n}", param="top_n")
        scores, num_tokens = await self._scores([(request.query, d) for d in documents],
                                                lora_name)
        results = [{"index": i, "relevance_score": score} |
                   ({"document": {"text": documents[i]}} if request.return_documents else {})
                   for i, score in enumerate(scores)]
        results.sort(key=lambda result: result["relevance_score"], reverse=True)
        if request.top_n is not None:
            results = results[:request.top_n]
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": self.model_name,
                             "usage": {"total_tokens": num_tokens}, "results": results})

    async def score(self, body: bytes) -> Response:
        request = ScoreRequest.parse(body)
        lora_name = self.check_model(request.model)
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as error:
            raise RequestError(str(error), param="text_2") from None
        scores, num_tokens = await self._scores(pairs, lora_name)
        return JSONResponse({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    # ------------------------------------------------------------------ the steps

    async def _scores(self, pairs: list[tuple[str, str]],
                      lora_name: str | None) -> tuple[list[float], int]:
        pooler = self.engine.config.model.pooler
        if pooler is None or self.engine.config.model.task != "score":
            raise RequestError(f"this model serves --task {self.engine.config.model.task}; "
                               "rerank and score need an engine started with --task score",
                               param="model")
        if pooler.cross_encoder:  # each pair encoded by the tokenizer, with its token types
            tokenizer = self.engine.input_processor.tokenizer.hf
            encoded = [cross_encoder_pair(tokenizer, query, document) for query, document in pairs]
            token_ids = [self._token_ids(ids, "documents") for ids, _ in encoded]
            pooling: PoolingParams | list[PoolingParams] = [
                PoolingParams(task="score", token_type_start=start) for _, start in encoded]
        else:
            token_ids = [self._token_ids(score_prompt(pooler, query, document), "documents")
                         for query, document in pairs]
            pooling = PoolingParams(task="score")
        outputs = await self._pool("score", token_ids, pooling, lora_name)
        return [output.pooled[0] for output in outputs], sum(len(ids) for ids in token_ids)

    def _inputs(self, inputs: str | list[str] | list[int] | list[list[int]],
                keep_last: int | None) -> list[list[int]]:
        """An ``input`` field (a text, token ids, or a batch of either) as token ids."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]
        if not inputs:
            raise RequestError("input is empty; give a string, token ids or a batch of them",
                               param="input")
        return [self._token_ids(prompt, "input", keep_last) for prompt in inputs]

    def _token_ids(self, prompt: str | list[int], param: str,
                   keep_last: int | None = None) -> list[int]:
        try:
            _, token_ids = self.engine.input_processor.process_prompt(prompt)
            if keep_last is not None:
                token_ids = token_ids[-keep_last:] if keep_last > 0 else token_ids
            self.engine.input_processor.validate_prompt(token_ids, param)
        except InvalidInputError as error:
            if error.param == "prompt":  # the completions route's name for it
                error.param = param
            raise RequestError.from_invalid_input(error) from None
        return token_ids

    async def _pool(self, prefix: str, prompts: list[list[int]],
                    pooling: PoolingParams | list[PoolingParams],
                    lora_name: str | None) -> list[RequestOutput]:
        """Every prompt one engine request (``pooling``: for all, or one per prompt), all
        submitted, then awaited together."""
        each = pooling if isinstance(pooling, list) else [pooling] * len(prompts)
        params = [SamplingParams(max_tokens=1, temperature=0.0, pooling=p) for p in each]
        longest = max(len(ids) for ids in prompts)
        for one in params:
            self.use_lora(one, lora_name)
            self.check_params(one, longest)
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for i, (token_ids, one) in enumerate(zip(prompts, params)):
                streams.append(self.submit(f"{request_id}-{i}", None, token_ids, one, False))
        except OpenAIError:
            for stream in streams:
                stream.abort()
            raise

        async def last(stream: RequestStream) -> RequestOutput:
            final = None
            async for output in stream:
                final = output
            return final

        try:
            outputs = await asyncio.gather(*(last(stream) for stream in streams))
        except BaseException as error:  # the engine died, an abort, or the client left
            for stream in streams:
                stream.abort()
            if isinstance(error, Exception):
                raise engine_error(error) from None
            raise
        for output in outputs:
            if output is None or output.pooled is None:
                reason = output.outputs[0].stop_reason if output and output.outputs else None
                raise engine_error(RuntimeError(f"the request was not pooled: {reason}"))
        return outputs
