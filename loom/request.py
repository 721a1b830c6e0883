"""Request: one sequence's state as the engine core sees it (no tensors)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from loom.sampling_params import SamplingParams

if TYPE_CHECKING:
    from loom.core.wire import MultiModalFeature


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # decode side: its prompt's K/V is on the way
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


class FinishReason(str, enum.Enum):
    """The OpenAI spelling of why a sequence ended."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Token ids and progress of one sequence.

    ``num_computed_tokens`` catches up with ``num_tokens`` step by step; that gap is
    all the scheduler looks at (there is no prefill or decode phase).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] | set[int] = frozenset(),
        arrival_time: float | None = None,
        parent_request_id: str | None = None,
        index: int = 0,
        mm_features: list[MultiModalFeature] | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; give at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        if index and sampling_params.seed is not None:
            # Sequence i of a seeded n > 1 request samples with seed + i, as in vLLM.
            sampling_params = sampling_params.clone(seed=sampling_params.seed + index)
        if index and sampling_params.prompt_logprobs is not None:
            # The prompt's logprobs are reported once, by sequence 0; the others may
            # then share its blocks through the prefix cache.
            sampling_params = sampling_params.clone(prompt_logprobs=None)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        # For n > 1 the output side fans one user request out into n of these.
        self.parent_request_id = parent_request_id or request_id
        self.index = index
        # Its images, in prompt order: each fills a span of placeholder tokens
        # (loom/multimodal); the scheduler budgets their encoding, the prefix cache keys
        # their blocks by their content.
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())

        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        # Chained hashes of this request's full blocks, grown by the KV cache manager.
        self.block_hashes: list[int] = []
        # Speculative decoding: draft tokens to verify in the next step, after the last
        # token (never part of all_token_ids until accepted).
        self.spec_token_ids: list[int] = []
        # Early stop: how many tokens in a row were sampled above the threshold.
        self.num_confident_tokens = 0
        # prompt_logprobs: prompt tokens 1 .. n whose logprobs were already reported
        # (a preempted request recomputes its prompt; those are not sent twice).
        self.num_prompt_logprobs_sent = 0
        # Its grammar and matcher when sampling_params.structured_outputs is set
        # (a loom.structured_output.StructuredOutputRequest, set by the engine core).
        self.structured_output_request = None
        # Prefill/decode disaggregation (loom/core/kv_transfer.py): on a prefill instance
        # the id its held blocks are served under, and its prompt logprobs so far (they
        # travel with the blocks); on a decode instance where to pull the prompt's K/V
        # from (a KVTransferParams), until it has arrived, or the transfer another
        # request (sample 0 of n) is pulling for it.
        self.kv_transfer_id: str | None = None
        self.kv_prompt_logprobs: list = []
        self.kv_load = None
        self.kv_follows: str | None = None

    @property
    def use_structured_output(self) -> bool:
        return self.structured_output_request is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"computed={self.num_computed_tokens}/{self.num_tokens})")
