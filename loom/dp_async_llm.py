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

Replicas on other hosts (``--data-parallel-size-local`` < size): this head runs ranks
0 .. local-1; each other rank's engine core is started by a ``loom serve --headless``
on its host and reached over TCP (``RemoteEngineCoreClient``), after a handshake on
``--data-parallel-rpc-port`` (``HeadRendezvous``; loom/ipc/remote_engine_core.py).
The server starts serving once every replica, local or remote, is ready.

Failure, under the rules of one engine: a replica whose engine core dies (or hangs)
fails its own requests with its error; the server is then dead as a whole (``/health``
503, exit 1, as ``ServerState.engine_died``), so the other replicas' requests in
flight are aborted at once with a message naming the dead replica, rather than cut
off when the server exits.

Control calls (pause, weights, sleep, reset_prefix_cache, ...) go to every replica at
once, and the answer is true of the whole server: a call succeeds only if it did on
every replica (``merge_control_results``: asleep or paused only if every replica is,
per-replica answers under ``replicas``); if any replica refused, the error names each
one that failed and says which others did it, since they now differ (a ``ControlError``
of the failures' type when every replica failed alike, else ``"PartialFailure"``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from typing import Any

from loom.async_llm import AsyncLLM, ControlError, RequestStream
from loom.config import EngineConfig
from loom.errors import EngineDeadError
from loom.ipc.remote_engine_core import HeadRendezvous, RemoteEngineCoreClient
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
                 log_requests: bool = True, affinity: bool = True) -> None:
        """``affinity`` False: route by load only (``--routing-policy load``)."""
        # the LoRA adapters served, by name, each with its load id (loom/lora.py;
        # SamplingParams.lora_id); the load/unload routes change it
        self.lora_names: dict[str, int] = {name: 0 for name, _ in config.model.lora_modules}
        if config.parallel.experts_across_replicas and \
                config.parallel.data_parallel_master_port is None:
            # one process group over every replica's ranks: its store's port, for all
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                config.parallel, data_parallel_master_port=_free_port(
                    config.parallel.data_parallel_address)))
        # ... and with replicas on other hosts, the relay of the cores' lock-step flags
        self._lockstep_relay = None
        parallel = config.parallel
        if parallel.experts_across_replicas and \
                parallel.num_local_replicas < parallel.data_parallel_size and \
                parallel.data_parallel_lockstep_addresses is None:
            from loom.core.dp_lockstep import LockstepRelay

            self._lockstep_relay = LockstepRelay(parallel.data_parallel_address,
                                                 parallel.data_parallel_size)
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                parallel, data_parallel_lockstep_addresses=tuple(
                    self._lockstep_relay.addresses)))
        self.config = config
        size = config.parallel.data_parallel_size
        self.tokenizer = load_tokenizer(config.model.model, config.model.tokenizer,
                                        config.model.chat_template)
        metrics = ServerMetrics.for_replicas(config.model.name, size)
        local = config.parallel.local_replica_ranks
        # Replicas on other hosts: their engine cores' sockets, bound at start.
        self.remote_cores = {rank: RemoteEngineCoreClient(replica_config(config, rank))
                             for rank in range(size) if rank not in local}
        self.replicas = [AsyncLLM(replica_config(config, rank), max_num_waiting=max_num_waiting,
                                  log_requests=log_requests, tokenizer=self.tokenizer,
                                  metrics=metrics[rank], core=self.remote_cores.get(rank))
                         for rank in range(size)]
        self.affinity = affinity
        self._rendezvous: HeadRendezvous | None = None
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
        if self.remote_cores:
            try:
                self._rendezvous = HeadRendezvous(self.config, {
                    rank: core.bind() for rank, core in self.remote_cores.items()})
                self._rendezvous.start()
            except RuntimeError:
                await self.shutdown(timeout=2.0)
                raise
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
            chunk_size=self.config.cache.block_size, capacity_chunks=max(1, num_blocks),
            affinity=self.affinity))
        return num_blocks

    async def shutdown(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(replica.shutdown(timeout) for replica in self.replicas))
        if self._rendezvous is not None:  # after the remote cores were told to stop
            await self._rendezvous.close()
            self._rendezvous = None
        if self._lockstep_relay is not None:
            self._lockstep_relay.close()
            self._lockstep_relay = None

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
                    params: SamplingParams, stream: bool = True,
                    mm_features: list | None = None) -> RequestStream:
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
                                                             prompt_token_ids, params, stream,
                                                             mm_features)
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

    async def wait_until_lora_idle(self, name: str) -> None:
        await asyncio.gather(*(replica.wait_until_lora_idle(name) for replica in self.replicas))

    async def control(self, method: str, /, **kwargs: Any) -> Any:
        """``AsyncLLM.control`` on every replica at once; the merged answer once all
        have answered, or a ControlError naming each replica that failed."""
        if self.dead_error is not None:
            raise self.dead_error
        results = await asyncio.gather(*(replica.control(method, **kwargs)
                                         for replica in self.replicas),
                                       return_exceptions=True)
        for result in results:  # a dead engine, a cancelled call: not a control's answer
            if isinstance(result, BaseException) and not isinstance(result, ControlError):
                raise result
        return merge_control_results(method, results)

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


def merge_control_results(method: str, results: list[Any]) -> Any:
    """One answer for the whole server from each replica's answer (or ControlError).

    status: paused / asleep only if every replica is; replicas' answers in "replicas".
    reset_prefix_cache: True only if every replica's cache was reset. sleep, wake_up,
    update_weights: replica 0's dict, bytes freed summed, every answer in "replicas".
    collective_rpc: each replica's list of its ranks' results.
    """
    failed = [(rank, r) for rank, r in enumerate(results) if isinstance(r, ControlError)]
    if failed:
        done = [rank for rank, r in enumerate(results) if not isinstance(r, ControlError)]
        reasons = "; ".join(f"replica {rank}: {error}" for rank, error in failed)
        message = (f"{method} failed on {len(failed)} of {len(results)} data-parallel "
                   f"replicas ({reasons})")
        types = {error.exc_type for _, error in failed}
        if done:
            message += (f"; it succeeded on replica{'s' if len(done) > 1 else ''} "
                        f"{', '.join(map(str, done))}, so the replicas now differ "
                        f"({_DIVERGED.get(method, 'retry the call')})")
            raise ControlError(message, "PartialFailure")
        raise ControlError(message, types.pop() if len(types) == 1 else None)
    if method == "status":
        return {"paused": all(r["paused"] for r in results),
                "is_sleeping": all(r["is_sleeping"] for r in results),
                "sleep_level": min(r["sleep_level"] for r in results),
                "num_held": sum(r["num_held"] for r in results), "replicas": results}
    if method == "reset_prefix_cache":
        return all(results)
    if method == "collective_rpc":
        return results
    if all(isinstance(r, dict) for r in results):
        merged = {**results[0], "replicas": results}
        if "kv_cache_bytes_freed" in merged:
            merged["kv_cache_bytes_freed"] = sum(r.get("kv_cache_bytes_freed", 0) for r in results)
        return merged
    return results[0]  # None from pause_generation and resume_generation


# What a caller should know when a control call succeeded on some replicas only.
_DIVERGED = {
    "update_weights": "those serve the new weights, the others the old; an update that "
                      "succeeds on every replica makes them one again",
    "pause_generation": "those are paused, the others generate; resume, or pause again",
    "resume_generation": "those generate, the others are still paused",
    "sleep": "those sleep and hold their requests, the others serve; wake up, or sleep again",
    "wake_up": "those are awake, the others still sleep",
}


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
