"""KV transfer, the scheduler's half: prefill/decode disaggregation (docs/disaggregation.md).

Two instances serve one request. The prefill instance runs its prompt and samples the
first token; the decode instance pulls the prompt's KV blocks and generates the rest.
The client's request carries vLLM's ``kv_transfer_params``, which the router fills:

    router ──{"do_remote_decode": true}──▶ prefill instance: max_tokens 1 internally;
             when the request finishes, its blocks are *held*, not freed, and the
             answer's kv_transfer_params say where they are (KVTransferParams), with
             the prompt's logprobs if it asked for them
    router ──those params──▶ decode instance: allocates the prompt's blocks, its ranks
             pull rank to rank, then the request is scheduled as if all but its last
             prompt token had been computed here

The decode instance recomputes the last prompt position and samples the first token
itself, as vLLM's connectors do: the prefill instance's first token is not used. That
costs the decode instance one token of compute per request (one decode step more
before the first token) and buys a first token that is this instance's in every
respect: its logprobs, n samples each drawn from the prompt with its own seed, grammar
state, penalties, all as a mixed instance computes them. With n > 1 the first sample
pulls the blocks and the others wait for them, then share them through the prefix
cache (as the n samples on a mixed instance share their prompt's blocks).

This half decides and keeps account; the workers' half (loom/worker/kv_connector.py)
moves the bytes in background threads. They talk through ``KVConnectorMetadata`` in
each ``SchedulerOutput`` (holds to serve, releases, loads to pull) and, back, through
``KVTransferEvent`` messages on the engine core's own socket (loom/ipc/kv_events.py),
so neither instance's step ever waits on the wire.

The life of a transfer, and who frees what:

    prefill  scheduled last chunk ─▶ hold registered on every rank after the step
             finished ─▶ blocks held (deadline = now + kv_hold_timeout_s)
             every rank reported send_done / send_failed, or the deadline ─▶ freed,
             and the ranks told to stop serving it before the next step runs
    decode   admitted ─▶ blocks allocated (not yet in the prefix cache), loads sent;
             a request of the same transfer admitted while that load is on the way
             (sample i > 0 of n) waits for it instead of pulling again
             every rank reported recv_done ─▶ prompt blocks cached, back to the head
             of the waiting queue with all but the last prompt token computed; the
             requests waiting for it schedule as usual (prefix-cache hits)
             any rank reported recv_failed ─▶ the request, and those waiting for it,
             fail with the error; blocks freed only once every rank has stopped
             writing them

Sliding windows: blocks the prefill instance already freed behind the window are -1
in ``remote_block_ids``; the decode instance allocates none there (no query to come
reads them; ``allocate_slots``' ``num_absent_blocks``) and never pulls them, so they never
enter its prefix cache. A hybrid model's several KV cache groups are refused (Scheduler).

Imports no torch.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from loom.config import KVTransferConfig
from loom.core.block_pool import BlockPool, KVBlock
from loom.core.wire import (KVConnectorMetadata, KVHold, KVLoad, KVTransferEvent,
                            SampleLogprobs)
from loom.request import Request

logger = logging.getLogger(__name__)

class KVTransferParams(msgspec.Struct, kw_only=True):
    """What the prefill instance answers in ``kv_transfer_params``, and what the decode
    instance's request must carry (vLLM's field; these are loom's keys)."""

    do_remote_prefill: bool = True
    transfer_id: str
    remote_engine_id: str
    remote_addresses: list[str]  # rank i of the prefill instance: "host:port"
    remote_block_ids: list[int]  # the prompt's blocks there, in order
    remote_num_tokens: int  # prompt tokens whose K/V those blocks hold
    remote_tp_size: int
    remote_block_size: int
    # The prompt's logprobs (prompt_logprobs, or echo with logprobs), computed there:
    # the decode instance reports them as its own. None when not asked for.
    prompt_logprobs: SampleLogprobs | None = None


class KVTransferParamsError(ValueError):
    """kv_transfer_params (or ``param``, a field that contradicts them) this instance
    cannot serve; the API answers a 400 naming ``param``."""

    def __init__(self, message: str, param: str = "kv_transfer_params") -> None:
        super().__init__(message)
        self.param = param


def check_kv_transfer_params(raw: dict[str, Any] | None, config: KVTransferConfig | None,
                             tp_size: int, block_size: int, num_prompt_tokens: int,
                             n: int = 1, prompt_logprobs: int | None = None
                             ) -> KVTransferParams | None:
    """Read a request's kv_transfer_params on an instance with ``config`` (None: a
    plain instance). Returns the transfer to pull (decode side), or None; raises
    KVTransferParamsError saying what is wrong. The API process calls it first (a 400),
    the scheduler again (a request that got past it fails alone)."""
    if not raw or not (raw.get("do_remote_decode") or raw.get("do_remote_prefill")):
        return None
    if config is None:
        raise KVTransferParamsError("this instance moves no KV blocks; start it with "
                                    "--splitwise-role prefill|decode (or --kv-transfer-config) "
                                    "to serve kv_transfer_params")
    if raw.get("do_remote_decode"):
        if not config.is_producer:
            raise KVTransferParamsError(
                "kv_transfer_params asks for do_remote_decode but this is a "
                f"{config.splitwise_role} instance; send it to a prefill (or mixed) instance")
        if n != 1:
            raise KVTransferParamsError(
                f"a prefill instance computes the prompt once: send n = 1 with "
                f"do_remote_decode (got {n}); the decode instance samples the n sequences",
                param="n")
        return None
    if not config.is_consumer:
        raise KVTransferParamsError(
            "kv_transfer_params asks for do_remote_prefill but this is a "
            f"{config.splitwise_role} instance; send it to a decode (or mixed) instance")
    try:
        load = msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as error:
        raise KVTransferParamsError(
            f"kv_transfer_params is not what a prefill instance answers: {error}") from None
    if load.remote_tp_size != tp_size:
        raise KVTransferParamsError(
            f"the prefill instance has tensor_parallel_size {load.remote_tp_size} but this "
            f"decode instance has {tp_size}; KV blocks move rank to rank, so start both with "
            "the same --tensor-parallel-size")
    if load.remote_block_size != block_size:
        raise KVTransferParamsError(
            f"the prefill instance has block_size {load.remote_block_size} but this decode "
            f"instance has {block_size}; start both with the same --block-size")
    if load.remote_num_tokens != num_prompt_tokens:
        raise KVTransferParamsError(
            f"the prefill instance computed {load.remote_num_tokens} prompt tokens but this "
            f"request's prompt has {num_prompt_tokens}; send the decode instance the same "
            "prompt (and the same model and chat template on both)")
    if len(load.remote_block_ids) != -(-load.remote_num_tokens // block_size):
        raise KVTransferParamsError(f"kv_transfer_params has {len(load.remote_block_ids)} "
                                    f"block ids for {load.remote_num_tokens} tokens")
    if len(load.remote_addresses) != tp_size:
        raise KVTransferParamsError(f"kv_transfer_params has {len(load.remote_addresses)} rank "
                                    f"addresses for tensor_parallel_size {tp_size}")
    if prompt_logprobs is not None and num_prompt_tokens > 1:
        computed = (len(load.prompt_logprobs.token_ids[0]) - 1
                    if load.prompt_logprobs is not None and load.prompt_logprobs.token_ids
                    else None)
        if computed is None or computed < prompt_logprobs:
            raise KVTransferParamsError(
                f"the request asks for the prompt's logprobs (top {prompt_logprobs}) but the "
                f"prefill instance computed {'none' if computed is None else f'top {computed}'}"
                "; send the prefill instance the same request")
    return load


@dataclass
class _Hold:
    """Prefill side: a finished request's blocks, kept for the decode instance."""

    request_id: str
    blocks: list[KVBlock]  # those it holds (a sliding window may have freed the first)
    deadline: float
    ranks_reported: set[int] = field(default_factory=set)


@dataclass
class _Load:
    """Decode side: a request whose blocks the ranks are pulling."""

    request: Request
    ranks_reported: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)


class KVTransferScheduler:
    def __init__(self, config: KVTransferConfig, pool: BlockPool, block_size: int,
                 tp_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.pool = pool
        self.block_size = block_size
        self.tp_size = tp_size
        self.clock = clock
        self.engine_id = uuid.uuid4().hex[:12]
        # Each rank's "host:port" (prefill side), set once the ranks listen.
        self.rank_addresses: list[str] = []
        self._holds: dict[str, _Hold] = {}
        self._scheduled_holds: dict[str, str] = {}  # transfer id -> request id, not yet held
        self._loads: dict[str, _Load] = {}
        # Decode side: transfer id -> the request pulling its blocks, from admission
        # until they arrived (or failed); others of that transfer wait for them.
        self._leaders: dict[str, Request] = {}
        self._metadata = KVConnectorMetadata()

    # ----------------------------------------------------------------- admission

    def prepare_request(self, request: Request) -> None:
        """Read a new request's kv_transfer_params; a ValueError says what is wrong."""
        params = request.sampling_params
        load = check_kv_transfer_params(params.kv_transfer_params, self.config, self.tp_size,
                                        self.block_size, request.num_prompt_tokens, params.n,
                                        params.prompt_logprobs)
        if load is not None:
            if load.transfer_id in self._leaders:
                request.kv_follows = load.transfer_id  # another sample pulls these blocks
            else:
                request.kv_load = load
                self._leaders[load.transfer_id] = request
        elif params.kv_transfer_params and params.kv_transfer_params.get("do_remote_decode"):
            # The prompt and one token here; the decode instance does the rest.
            request.sampling_params = params.clone(max_tokens=1,
                                                   min_tokens=min(params.min_tokens, 1))
            request.kv_transfer_id = f"{self.engine_id}-{uuid.uuid4().hex[:16]}"

    def forget_request(self, request: Request) -> None:
        """``request`` left before its load started (aborted while waiting)."""
        if request.kv_load is not None and self._leaders.get(
                request.kv_load.transfer_id) is request:
            del self._leaders[request.kv_load.transfer_id]

    def is_pending(self, transfer_id: str) -> bool:
        """Some request of this instance is still to pull ``transfer_id``'s blocks."""
        return transfer_id in self._leaders

    # ----------------------------------------------------------------- prefill side

    def schedule_hold(self, request: Request, blocks: list[KVBlock | None]) -> None:
        """``request``'s last prompt chunk runs this step: its ranks serve its prompt's
        blocks (not those a sliding window freed) from the end of the step on."""
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        self._metadata.holds.append(KVHold(request.kv_transfer_id, [
            block.block_id for block in blocks[:num_prompt_blocks] if block is not None]))
        self._scheduled_holds[request.kv_transfer_id] = request.request_id

    def hold(self, request: Request, blocks: list[KVBlock | None]) -> dict[str, Any]:
        """Keep a finished request's blocks for the decode instance; the answer's
        kv_transfer_params. A block that left the sliding window is -1 there: no query
        to come reads it, so the decode side does not pull it."""
        transfer_id = request.kv_transfer_id
        self._scheduled_holds.pop(transfer_id, None)
        self._holds[transfer_id] = _Hold(request.request_id,
                                         [block for block in blocks if block is not None],
                                         self.clock() + self.config.kv_hold_timeout_s)
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        prompt_logprobs = None
        if request.kv_prompt_logprobs:
            chunks = request.kv_prompt_logprobs
            prompt_logprobs = SampleLogprobs(
                token_ids=[ids for chunk in chunks for ids in chunk.token_ids],
                # finite already: the sampler reports -inf as LOGPROB_FLOOR
                logprobs=[values for chunk in chunks for values in chunk.logprobs],
                ranks=[rank for chunk in chunks for rank in chunk.ranks])
        return msgspec.to_builtins(KVTransferParams(
            transfer_id=transfer_id, remote_engine_id=self.engine_id,
            remote_addresses=list(self.rank_addresses),
            remote_block_ids=[-1 if block is None else block.block_id
                              for block in blocks[:num_prompt_blocks]],
            remote_num_tokens=request.num_prompt_tokens, remote_tp_size=self.tp_size,
            remote_block_size=self.block_size, prompt_logprobs=prompt_logprobs))

    def cancel_hold(self, request: Request) -> None:
        """A request whose hold was registered ended otherwise (aborted, failed)."""
        if self._scheduled_holds.pop(request.kv_transfer_id, None) is not None:
            self._metadata.releases.append(request.kv_transfer_id)

    def expire_holds(self) -> int:
        """Free the blocks of holds past their deadline (a decode instance that died or
        never came); returns how many."""
        now = self.clock()
        expired = [tid for tid, hold in self._holds.items() if hold.deadline <= now]
        for transfer_id in expired:
            hold = self._holds[transfer_id]
            logger.warning("KV transfer %s (request %s): no decode instance took its %d blocks "
                           "within kv_hold_timeout_s=%gs; freed", transfer_id, hold.request_id,
                           len(hold.blocks), self.config.kv_hold_timeout_s)
            self._release(transfer_id)
        return len(expired)

    def _release(self, transfer_id: str) -> None:
        hold = self._holds.pop(transfer_id)
        self.pool.free_blocks(reversed(hold.blocks))
        self._metadata.releases.append(transfer_id)

    @property
    def num_held_blocks(self) -> int:
        return sum(len(hold.blocks) for hold in self._holds.values())

    # ----------------------------------------------------------------- decode side

    def start_load(self, request: Request, local_block_ids: list[int],
                   remote_block_ids: list[int]) -> None:
        load = request.kv_load
        self._loads[load.transfer_id] = _Load(request)
        pairs = [(remote, local) for remote, local in zip(remote_block_ids, local_block_ids)
                 if remote >= 0]  # -1: outside the sliding window there, never read
        self._metadata.loads.append(KVLoad(load.transfer_id, load.remote_addresses,
                                           [remote for remote, _ in pairs],
                                           [local for _, local in pairs]))

    @property
    def num_loading(self) -> int:
        return len(self._loads)

    @property
    def num_pending_transfers(self) -> int:
        """Transfers some request of this instance is still to pull (or pulling)."""
        return len(self._leaders)

    # ----------------------------------------------------------------- events

    def on_event(self, event: KVTransferEvent) -> tuple[Request, str | None] | None:
        """Account one rank's report. Returns (request, error or None) when every rank of
        a load has reported; prefill-side reports free blocks here."""
        if event.kind in ("send_done", "send_failed"):
            hold = self._holds.get(event.transfer_id)
            if hold is None:
                return None  # expired meanwhile: its blocks were freed then
            if event.kind == "send_failed":
                logger.warning("KV transfer %s: rank %d could not send: %s", event.transfer_id,
                               event.rank, event.error)
            hold.ranks_reported.add(event.rank)
            if len(hold.ranks_reported) == self.tp_size:
                self._release(event.transfer_id)
            return None
        if event.kind not in ("recv_done", "recv_failed"):
            raise ValueError(f"unknown KV transfer event kind {event.kind!r}")
        load = self._loads.get(event.transfer_id)
        if load is None:
            raise RuntimeError(f"rank {event.rank} reported {event.kind} for KV transfer "
                               f"{event.transfer_id}, which no request is waiting for")
        load.ranks_reported.add(event.rank)
        if event.error:
            load.errors.append(f"rank {event.rank}: {event.error}")
        if len(load.ranks_reported) < self.tp_size:
            return None
        del self._loads[event.transfer_id]
        if self._leaders.get(event.transfer_id) is load.request:
            del self._leaders[event.transfer_id]
        error = "; ".join(load.errors) if load.errors else None
        return load.request, error

    def take_metadata(self) -> KVConnectorMetadata | None:
        metadata, self._metadata = self._metadata, KVConnectorMetadata()
        return None if metadata.is_empty else metadata

    @property
    def has_pending_metadata(self) -> bool:
        return not self._metadata.is_empty
