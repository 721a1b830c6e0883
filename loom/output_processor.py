"""OutputProcessor: engine-core token ids -> user-facing RequestOutputs.

Runs where the tokenizer lives (the caller's process offline, the API server
online). Per sequence it detokenizes incrementally, looks for stop strings in the
text (telling the engine core to stop a sequence that hit one), and converts
logprobs. A request with ``n > 1`` fans out into n engine requests, one per
sequence, that share the prompt's KV blocks through the prefix cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loom.core.wire import EngineCoreOutput, SampleLogprobs
from loom.detokenizer import (FastIncrementalDetokenizer, IncrementalDetokenizer,
                              StopStringMatcher, make_detokenizer)
from loom.outputs import CompletionOutput, Logprob, RequestOutput, SampleLogprobList
from loom.sampling_params import SamplingParams
from loom.tokenizer import Tokenizer


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


@dataclass
class SequenceState:
    index: int
    engine_request_id: str
    detokenizer: FastIncrementalDetokenizer | IncrementalDetokenizer
    stop_matcher: StopStringMatcher
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: SampleLogprobList | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Not yet handed out, for streaming.
    new_text: str = ""
    num_new_tokens: int = 0
    num_new_logprobs: int = 0
    finish_reported: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    sequences: list[SequenceState]
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    # prompt_logprobs: None for the first token, then one dict per prompt token, filled
    # chunk by chunk from sequence 0; handed out once when streaming.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_reported: bool = False
    # A prefill instance's answer: where the decode instance pulls the KV blocks from.
    kv_transfer_params: dict | None = None
    # A pooling request's vector (loom/pooling.py)
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return all(seq.finished for seq in self.sequences)


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    # Engine requests that reached a stop string: the engine core must finish them.
    stopped_by_string: list[tuple[str, str]]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self._sequences: dict[str, tuple[RequestState, SequenceState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, stream: bool = False) -> list[str]:
        """Track a request; returns the engine request ids of its n sequences."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        sequences = []
        for index in range(params.n):
            sequences.append(SequenceState(
                index=index, engine_request_id=child_request_id(request_id, index, params.n),
                detokenizer=make_detokenizer(self.tokenizer, prompt_token_ids,
                                             params.skip_special_tokens),
                stop_matcher=StopStringMatcher(params.stop, params.include_stop_str_in_output),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None))
        state = RequestState(request_id, prompt, prompt_token_ids, params, stream, sequences)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
        self.requests[request_id] = state
        for seq in sequences:
            self._sequences[seq.engine_request_id] = (state, seq)
        return [seq.engine_request_id for seq in sequences]

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns the engine request ids still to abort in the core."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for seq in state.sequences:
            self._sequences.pop(seq.engine_request_id, None)
        return [seq.engine_request_id for seq in state.sequences if not seq.finished]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every tracked request with an error (the engine died)."""
        outputs = []
        for state in list(self.requests.values()):
            for seq in state.sequences:
                if not seq.finished:
                    seq.finish_reason, seq.stop_reason = "error", message
            outputs.append(self._make_output(state))
        self.requests.clear()
        self._sequences.clear()
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        touched: dict[str, RequestState] = {}
        stopped_by_string: list[tuple[str, str]] = []
        now = time.time()
        for out in core_outputs:
            entry = self._sequences.get(out.req_id)
            if entry is None:
                continue  # aborted meanwhile
            state, seq = entry
            if seq.finished:
                continue
            if out.kv_transfer_params is not None:
                state.kv_transfer_params = out.kv_transfer_params
            if out.pooled is not None:
                state.pooled = out.pooled
            if out.prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs += self._convert_logprobs(out.prompt_logprobs)
            if not out.new_token_ids and not out.finished:
                continue  # a prefill chunk's prompt logprobs only
            if state.first_token_time is None:
                state.first_token_time = now
                state.num_cached_tokens = out.num_cached_tokens
            seq.token_ids.extend(out.new_token_ids)
            seq.num_new_tokens += len(out.new_token_ids)
            if out.logprobs is not None and seq.logprobs is not None:
                self._append_logprobs(seq, out.logprobs)
            delta = seq.detokenizer.update(out.new_token_ids)
            check_stop = len(seq.token_ids) >= state.params.min_tokens
            text, stopped, stop_str = seq.stop_matcher.feed(delta, check_stop)
            if stopped and not out.finished:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                stopped_by_string.append((seq.engine_request_id, stop_str))
            elif out.finished:
                seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
                if not stopped:
                    text += seq.stop_matcher.feed(seq.detokenizer.flush(), check_stop)[0]
                    text += seq.stop_matcher.flush()
                else:
                    seq.finish_reason, seq.stop_reason = "stop", stop_str
            seq.text += text
            seq.new_text += text
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            finished = state.finished
            if state.stream or finished:
                outputs.append(self._make_output(state))
            if finished:
                self.requests.pop(state.request_id, None)
                for seq in state.sequences:
                    self._sequences.pop(seq.engine_request_id, None)
        return ProcessedOutputs(outputs, stopped_by_string)

    def _append_logprobs(self, seq: SequenceState, logprobs: SampleLogprobs) -> None:
        for entry, values in zip(self._convert_logprobs(logprobs), logprobs.logprobs):
            seq.logprobs.append(entry)
            seq.cumulative_logprob += values[0]
            seq.num_new_logprobs += 1

    def _convert_logprobs(self, logprobs: SampleLogprobs) -> list[dict[int, Logprob]]:
        """One dict per token: the token itself with its rank, then the top-k by rank."""
        decode = self.tokenizer.decode
        entries = []
        for token_ids, values, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks):
            entry = {token_ids[0]: Logprob(values[0], rank, decode([token_ids[0]]))}
            for k, (token_id, value) in enumerate(zip(token_ids[1:], values[1:]), start=1):
                entry.setdefault(token_id, Logprob(value, k, decode([token_id])))
            entries.append(entry)
        return entries

    def _make_output(self, state: RequestState) -> RequestOutput:
        completions = []
        for seq in state.sequences:
            if state.stream:
                if not (seq.num_new_tokens or seq.new_text
                        or (seq.finished and not seq.finish_reported)):
                    continue
                token_ids = seq.token_ids[len(seq.token_ids) - seq.num_new_tokens:]
                logprobs = (seq.logprobs[len(seq.logprobs) - seq.num_new_logprobs:]
                            if seq.logprobs is not None else None)
                text = seq.new_text
            else:
                token_ids, logprobs, text = list(seq.token_ids), seq.logprobs, seq.text
            completions.append(CompletionOutput(
                index=seq.index, text=text, token_ids=token_ids,
                cumulative_logprob=seq.cumulative_logprob, logprobs=logprobs,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason))
            seq.new_text, seq.num_new_tokens, seq.num_new_logprobs = "", 0, 0
            seq.finish_reported = seq.finished
        metrics = {"arrival_time": state.arrival_time}
        if state.first_token_time is not None:
            metrics["first_token_time"] = state.first_token_time
        prompt_logprobs = state.prompt_logprobs
        if state.stream:
            prompt_logprobs = None if state.prompt_logprobs_reported else prompt_logprobs
            state.prompt_logprobs_reported = True
        return RequestOutput(
            request_id=state.request_id, prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids, outputs=completions,
            finished=state.finished, num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs, metrics=metrics,
            kv_transfer_params=state.kv_transfer_params, pooled=state.pooled)
