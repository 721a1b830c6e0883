"""ScriptedEngine: stands in for ``AsyncLLM`` where the API server uses it, answering in
milliseconds with scripted outputs, so the real app's routes run in this process.

What the server uses of AsyncLLM (server.py, serving_*.py), and so all this implements:

    config.model          max_model_len, max_logprobs, model, default_sampling_params
    tokenizer             a real one (the tiny ChatML tokenizer)
    input_processor       the real InputProcessor over that tokenizer
    metrics.render()      a real ServerMetrics
    add_request(...)      -> a stream of RequestOutputs with abort() / aclose() (the
                             prompt's images, mm_features, are kept, not run)
    is_dead, dead_error, on_dead, num_requests_in_flight, wait_until_idle(), abort_all()

Every sequence of a request generates ``replies[index % len(replies)]``, one text
piece per output (deltas when streamed, one finished output otherwise); each piece's
tokens are the tokenizer's. What the server asked for is kept in ``requests``
(request id -> prompt token ids and SamplingParams), what it aborted in ``aborted``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from loom.config import ModelConfig
from loom.input_processor import InputProcessor
from loom.metrics import ServerMetrics
from loom.outputs import CompletionOutput, Logprob, RequestOutput
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer


@dataclass
class ScriptedConfig:
    model: ModelConfig


@dataclass
class SubmittedRequest:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    mm_features: list = field(default_factory=list)  # the images' (loom/core/wire.py)


@dataclass
class ScriptedEngine:
    tokenizer: Tokenizer
    config: ScriptedConfig
    replies: list[list[str]] = field(default_factory=lambda: [["Hello", " world"]])
    finish_reason: str = "stop"
    stop_reason: int | str | None = None
    # After this many outputs a stream waits until aborted (a client that leaves).
    hold_after: int | None = None
    # Raised by add_request (e.g. QueueFullError), or by a stream after its first output.
    refuse_with: Exception | None = None
    fail_stream_with: Exception | None = None
    requests: dict[str, SubmittedRequest] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    dead_error: Exception | None = None
    on_dead: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.input_processor = InputProcessor(self.config.model, self.tokenizer)
        self.lora_names: dict[str, int] = {}  # AsyncLLM's LoRA adapters served by name
        self.metrics = ServerMetrics(self.config.model.name)
        self._in_flight: set[str] = set()

    @classmethod
    def on(cls, tokenizer: Tokenizer, model_dir: str, max_model_len: int = 128,
           sampling_defaults: tuple[tuple[str, Any], ...] = (),
           max_logprobs: int = 20) -> ScriptedEngine:
        """An engine for the model in ``model_dir`` (only its tokenizer is read);
        ``sampling_defaults`` as a generation config would give them."""
        model = ModelConfig(model=model_dir, max_model_len=max_model_len,
                            vocab_size=tokenizer.vocab_size, enable_warm_up=False,
                            sampling_defaults=sampling_defaults, max_logprobs=max_logprobs)
        return cls(tokenizer, ScriptedConfig(model))

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_requests_in_flight(self) -> int:
        return len(self._in_flight)

    async def wait_until_idle(self) -> None:
        while self._in_flight:
            await asyncio.sleep(0.001)

    def abort_all(self, reason: str) -> None:
        for request_id in list(self._in_flight):
            self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if request_id in self._in_flight:
            self._in_flight.discard(request_id)
            self.aborted.append(request_id)

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, stream: bool = True,
                    mm_features: list | None = None) -> ScriptedStream:
        if self.refuse_with is not None:
            raise self.refuse_with
        self.requests[request_id] = SubmittedRequest(prompt, prompt_token_ids, params, stream,
                                                     list(mm_features or []))
        self._in_flight.add(request_id)
        outputs = self._outputs(request_id, prompt, prompt_token_ids, params)
        if not stream:
            outputs = [self._final(outputs)]
        return ScriptedStream(self, request_id, outputs)

    # ----------------------------------------------------------------- the script

    def _outputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams) -> list[RequestOutput]:
        """One RequestOutput per step, each holding the deltas of the sequences still running."""
        replies = [self.replies[index % len(self.replies)] for index in range(params.n)]
        num_steps = max(len(pieces) for pieces in replies)
        outputs = []
        for step in range(num_steps):
            seqs = []
            for index, pieces in enumerate(replies):
                if step >= len(pieces):
                    continue
                token_ids = self.tokenizer.encode(pieces[step], add_special_tokens=False)
                last = step == len(pieces) - 1
                seqs.append(CompletionOutput(
                    index, pieces[step], token_ids,
                    logprobs=(self._logprobs(token_ids, params.logprobs)
                              if params.logprobs is not None else None),
                    finish_reason=self.finish_reason if last else None,
                    stop_reason=self.stop_reason if last else None))
            outputs.append(RequestOutput(request_id, prompt, prompt_token_ids, seqs,
                                         finished=step == num_steps - 1))
        if params.prompt_logprobs is not None:
            outputs[0].prompt_logprobs = [None, *self._logprobs(prompt_token_ids[1:],
                                                                params.prompt_logprobs)]
        return outputs

    def _final(self, deltas: list[RequestOutput]) -> RequestOutput:
        """The deltas of every step as one finished output, as a request not streamed gets."""
        seqs: dict[int, CompletionOutput] = {}
        for output in deltas:
            for delta in output.outputs:
                seq = seqs.setdefault(delta.index, CompletionOutput(
                    delta.index, "", [], logprobs=[] if delta.logprobs is not None else None))
                seq.text += delta.text
                seq.token_ids += delta.token_ids
                if delta.logprobs is not None:
                    seq.logprobs += delta.logprobs
                seq.finish_reason, seq.stop_reason = delta.finish_reason, delta.stop_reason
        first = deltas[0]
        return RequestOutput(first.request_id, first.prompt, first.prompt_token_ids,
                             [seqs[index] for index in sorted(seqs)], finished=True,
                             prompt_logprobs=first.prompt_logprobs)

    def _logprobs(self, token_ids: list[int], num_top: int) -> list[dict[int, Logprob]]:
        """The chosen token at rank 1 (logprob -0.25), then the next ids in the vocabulary
        at ranks 2..num_top (logprob -1, -2, ...)."""
        vocab_size = self.tokenizer.vocab_size
        entries = []
        for token_id in token_ids:
            entry = {token_id: Logprob(-0.25, 1, self.tokenizer.decode([token_id]))}
            for rank in range(2, num_top + 1):
                other = (token_id + rank - 1) % vocab_size
                entry[other] = Logprob(-float(rank - 1), rank, self.tokenizer.decode([other]))
            entries.append(entry)
        return entries


class ScriptedStream:
    """RequestStream's interface over a list of outputs."""

    def __init__(self, engine: ScriptedEngine, request_id: str,
                 outputs: list[RequestOutput]) -> None:
        self.engine = engine
        self.request_id = request_id
        self._outputs = list(outputs)
        self._num_sent = 0
        self._finished = False

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._finished or not self._outputs:
            raise StopAsyncIteration
        try:
            await asyncio.sleep(0)  # as a real stream would, let other tasks run
            if self.engine.hold_after is not None and self._num_sent >= self.engine.hold_after:
                await asyncio.Event().wait()  # until cancelled
        except asyncio.CancelledError:
            self.abort()
            raise
        if self.engine.fail_stream_with is not None and self._num_sent >= 1:
            self._finished = True
            self.engine._in_flight.discard(self.request_id)
            raise self.engine.fail_stream_with
        output = self._outputs.pop(0)
        self._num_sent += 1
        if output.finished:
            self._finished = True
            self.engine._in_flight.discard(self.request_id)
        return output

    async def aclose(self) -> None:
        self.abort()

    def abort(self) -> None:
        if not self._finished:
            self._finished = True
            self.engine.abort(self.request_id)

