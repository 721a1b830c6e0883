"""KV transfer, the scheduler's half: prefill/decode disaggregation (docs/disaggregation.md).

Two instances serve one request. The prefill instance runs its prompt and samples the
first token; the decode instance pulls the prompt's KV blocks and generates the rest.
The client's request carries vLLM's ``kv_transfer_params``, which the router fills:

    router ──{"do_remote_decode": true}──▶ prefill instance: max_tokens 1 internally;
             when the request finishes, its blocks are *held*, not freed, and the
             answer's kv_transfer_params say where they are (KVTransferParams)
    router ──those params──▶ decode instance: allocates blocks for prompt + first
             token, its ranks pull rank to rank, then the request is scheduled as if
             its prompt had been computed here, continuing from the first token

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
    decode   admitted ─▶ blocks allocated (not yet in the prefix cache), loads sent
             every rank reported recv_done ─▶ prompt blocks cached, first token
             appended (stop checks apply), back to the head of the waiting queue
             any rank reported recv_failed ─▶ the request fails with the error;
             blocks freed only once every rank has stopped writing them

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
from loom.core.wire import KVConnectorMetadata, KVHold, KVLoad, KVTransferEvent
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
    first_token_id: int


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
        self._metadata = KVConnectorMetadata()

    # ----------------------------------------------------------------- admission

    def prepare_request(self, request: Request) -> None:
        """Read a new request's kv_transfer_params; a ValueError says what is wrong."""
        raw = request.sampling_params.kv_transfer_params
        if not raw:
            return
        params = request.sampling_params
        if raw.get("do_remote_decode"):
            if not self.config.is_producer:
                raise ValueError("kv_transfer_params asks for do_remote_decode but this is a "
                                 f"{self.config.splitwise_role} instance; send it to a "
                                 "prefill (or mixed) instance")
            if params.n != 1:
                raise ValueError("kv_transfer_params works with n = 1 only")
            # The prompt and the first token here; the decode instance does the rest.
            request.sampling_params = params.clone(max_tokens=1,
                                                   min_tokens=min(params.min_tokens, 1))
            request.kv_transfer_id = f"{self.engine_id}-{uuid.uuid4().hex[:16]}"
            return
        if not raw.get("do_remote_prefill"):
            return
        if not self.config.is_consumer:
            raise ValueError("kv_transfer_params asks for do_remote_prefill but this is a "
                             f"{self.config.splitwise_role} instance; send it to a decode "
                             "(or mixed) instance")
        try:
            load = msgspec.convert(raw, KVTransferParams)
        except msgspec.ValidationError as error:
            raise ValueError(f"kv_transfer_params is not what a prefill instance answers: "
                             f"{error}") from None
        if load.remote_tp_size != self.tp_size:
            raise ValueError(
                f"the prefill instance has tensor_parallel_size {load.remote_tp_size} but this "
                f"decode instance has {self.tp_size}; KV blocks move rank to rank, so start "
                "both with the same --tensor-parallel-size")
        if load.remote_block_size != self.block_size:
            raise ValueError(f"the prefill instance has block_size {load.remote_block_size} but "
                             f"this decode instance has {self.block_size}; start both with the "
                             "same --block-size")
        if load.remote_num_tokens != request.num_prompt_tokens:
            raise ValueError(
                f"the prefill instance computed {load.remote_num_tokens} prompt tokens but this "
                f"request's prompt has {request.num_prompt_tokens}; send the decode instance "
                "the same prompt (and the same model and chat template on both)")
        if len(load.remote_block_ids) != -(-load.remote_num_tokens // self.block_size):
            raise ValueError(f"kv_transfer_params has {len(load.remote_block_ids)} block ids "
                             f"for {load.remote_num_tokens} tokens")
        if len(load.remote_addresses) != self.tp_size:
            raise ValueError(f"kv_transfer_params has {len(load.remote_addresses)} rank "
                             f"addresses for tensor_parallel_size {self.tp_size}")
        request.kv_load = load

    # ----------------------------------------------------------------- prefill side

    def schedule_hold(self, request: Request, block_ids: list[int]) -> None:
        """``request``'s last prompt chunk runs this step: its ranks serve its blocks
        from the end of the step on."""
        num_prompt_blocks = -(-request.num_prompt_tokens // self.block_size)
        self._metadata.holds.append(KVHold(request.kv_transfer_id, block_ids[:num_prompt_blocks]))
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
        return msgspec.to_builtins(KVTransferParams(
            transfer_id=transfer_id, remote_engine_id=self.engine_id,
            remote_addresses=list(self.rank_addresses),
            remote_block_ids=[-1 if block is None else block.block_id
                              for block in blocks[:num_prompt_blocks]],
            remote_num_tokens=request.num_prompt_tokens, remote_tp_size=self.tp_size,
            remote_block_size=self.block_size, first_token_id=request.output_token_ids[0]))

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
        error = "; ".join(load.errors) if load.errors else None
        return load.request, error

    def take_metadata(self) -> KVConnectorMetadata | None:
        metadata, self._metadata = self._metadata, KVConnectorMetadata()
        return None if metadata.is_empty else metadata

    @property
    def has_pending_metadata(self) -> bool:
        return not self._metadata.is_empty
