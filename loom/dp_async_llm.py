"""DPAsyncLLM: N data-parallel replicas behind one API server (``--data-parallel-size N``).

    API server ─ DPAsyncLLM ─ RoutingPolicy (loom/router/policy.py) chooses a replica
                   ├─ AsyncLLM replica 0 ─ EngineCoreClient ─ engine core 0 ─ its workers, KV cache
                   └─ AsyncLLM replica 1 ─ EngineCoreClient ─ engine core 1 ─ its workers, KV cache

Each replica is a whole ``AsyncLLM`` (its own engine core process, executor, workers,
KV cache; each may be tensor parallel) built from the server's config with its own
``parallel.data_parallel_rank``; they share the tokenizer and one metrics registry
(every series labelled ``replica``). Each request goes to one replica, chosen by the
policy from the prompt's token ids, in KV-block-sized chunks (prefix affinity: a
prompt goes where its prefix was sent, so it hits that replica's prefix cache) and
the replicas' requests and tokens in flight (load; a load imbalance overrides
affinity). ``abort`` follows the request to its replica.

Failure, under the rules of one engine: a replica whose engine core dies (or hangs)
fails its own requests with its error; the server is then dead as a whole (``/health``
503, exit 1, as ``ServerState.engine_died``), so the other replicas' requests in
flight are aborted at once with a message naming the dead replica, rather than cut
off when the server exits.

Control calls (pause, weights, sleep, reset_prefix_cache, ...) go to every replica;
the answer is replica 0's once all have answered.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from loom.async_llm import AsyncLLM, RequestStream
from loom.config import EngineConfig
from loom.executor.base import EngineDeadError
from loom.metrics import ServerMetrics
from loom.router.policy import PolicyConfig, RoutingPolicy, Ticket
from loom.sampling_params import SamplingParams
from loom.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    return dataclasses.replace(config, parallel=dataclasses.replace(
        config.parallel, data_parallel_rank=rank))


class DPAsyncLLM:
    def __init__(self, config: EngineConfig, *, max_num_waiting: int | None = None,
                 log_requests: bool = True) -> None:
        self.config = config
        size = config.parallel.data_parallel_size
        self.tokenizer = load_tokenizer(config.model.model, config.model.tokenizer,
                                        config.model.chat_template)
        metrics = ServerMetrics.for_replicas(config.model.name, size)
        self.replicas = [AsyncLLM(replica_config(config, rank), max_num_waiting=max_num_waiting,
                                  log_requests=log_requests, tokenizer=self.tokenizer,
                                  metrics=metrics[rank]) for rank in range(size)]
        self.input_processor = self.replicas[0].input_processor
        self.metrics = metrics[0]  # render() gives every replica's series (one registry)
        self.log_requests = log_requests
        self.on_dead: list[Callable[[], None]] = []
        self.dead_error: EngineDeadError | None = None
        # Sized at start, from the replicas' KV blocks: what a replica can hold cached.
        self.policy: RoutingPolicy | None = None
        self._tickets: dict[str, tuple[int, Ticket]] = {}
        for rank, replica in enumerate(self.replicas):
            replica.on_dead.append(lambda rank=rank: self._replica_died(rank))
            replica.on_request_done.append(self._request_done)

    # ----------------------------------------------------------------- life cycle

    async def start(self) -> int:
        """Start every replica's engine core, side by side; returns one replica's KV
        blocks (each has its own cache of that size). If one fails to start, those
        started are stopped and its error raised."""
        results = await asyncio.gather(*(replica.start() for replica in self.replicas),
                                       return_exceptions=True)
        errors = [(rank, r) for rank, r in enumerate(results) if isinstance(r, BaseException)]
        if errors:
            await self.shutdown(timeout=2.0)
            rank, error = errors[0]
            if isinstance(error, RuntimeError):
                raise RuntimeError(f"data-parallel replica {rank}: {error}") from error
            raise error
        num_blocks = min(results)
        self.policy = RoutingPolicy(len(self.replicas), PolicyConfig(
            chunk_size=self.config.cache.block_size, capacity_chunks=max(1, num_blocks)))
        return num_blocks

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(replica.shutdown(timeout) for replica in self.replicas))

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None

    @property
    def num_requests_in_flight(self) -> int:
        return sum(replica.num_requests_in_flight for replica in self.replicas)

    @property
    def replica_metrics(self) -> list[ServerMetrics]:
        return [replica.metrics for replica in self.replicas]

    # ----------------------------------------------------------------- requests

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, stream: bool = True) -> RequestStream:
        """As ``AsyncLLM.add_request``, on the replica the policy chooses."""
        if self.dead_error is not None:
            raise self.dead_error
        if self.policy is None:
            raise RuntimeError("DPAsyncLLM.add_request before start()")
        # weight: the tokens it may still hold in the replica's KV cache
        max_tokens = params.max_tokens or self.config.model.max_model_len - len(prompt_token_ids)
        ticket = self.policy.route(prompt_token_ids,
                                   num_tokens=len(prompt_token_ids) + max_tokens * params.n)
        rank = ticket.target
        self._tickets[request_id] = (rank, ticket)
        try:
            request_stream = self.replicas[rank].add_request(request_id, prompt,
                                                             prompt_token_ids, params, stream)
        except BaseException:
            self._release(request_id)
            raise
        if self.log_requests:
            logger.info("request %s -> replica %d (%s, %d prefix chunks matched)", request_id,
                        rank, ticket.reason, ticket.matched_chunks)
        return request_stream

    def replica_of(self, request_id: str) -> int | None:
        """The replica a request in flight runs on (None once it ended)."""
        entry = self._tickets.get(request_id)
        return entry[0] if entry is not None else None

    def abort(self, request_id: str, reason: str | None = None) -> None:
        entry = self._tickets.get(request_id)
        if entry is not None:
            self.replicas[entry[0]].abort(request_id, reason)

    def abort_all(self, reason: str) -> None:
        for replica in self.replicas:
            replica.abort_all(reason)

    async def wait_until_idle(self) -> None:
        await asyncio.gather(*(replica.wait_until_idle() for replica in self.replicas))

    async def control(self, method: str, **kwargs: Any) -> Any:
        """``AsyncLLM.control`` on every replica at once; replica 0's answer."""
        if self.dead_error is not None:
            raise self.dead_error
        results = await asyncio.gather(*(replica.control(method, **kwargs)
                                         for replica in self.replicas))
        return results[0]

    # ----------------------------------------------------------------- internals

    def _request_done(self, request_id: str) -> None:
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        entry = self._tickets.pop(request_id, None)
        if entry is not None and self.policy is not None:
            self.policy.release(entry[1])

    def _replica_died(self, rank: int) -> None:
        if self.dead_error is not None:
            return
        error = self.replicas[rank].dead_error
        self.dead_error = EngineDeadError(str(error))  # it names the replica
        if self.policy is not None:
            self.policy.set_available(rank, False)
        for other, replica in enumerate(self.replicas):
            if other != rank and not replica.is_dead:
                replica.abort_all(f"the server is exiting: {error}")
        for callback in self.on_dead:
            callback()
