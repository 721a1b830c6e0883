"""KV transfer, the workers' half: one per rank, moving blocks in background threads.

The scheduler's half (loom/core/kv_transfer.py) decides; this half only does what each
``SchedulerOutput``'s ``KVConnectorMetadata`` says, around the step:

    before the step   releases: stop serving those transfers (their blocks may be
                      reused in this step; a send in progress finishes first)
    after the step    holds: serve those blocks (the request's last prompt chunk has
                      just been computed); loads: pull them, in a thread pool

Prefill side (producer): a listener on ``kv_ip:kv_port + rank`` (or any free port)
takes one connection per transfer from the decode rank of the same index:

    decode rank i ──KVPull(transfer id, block ids, rank, tp size, layout)──▶ prefill rank i
                  ◀─KVPullReply(ok | error)── then the blocks' bytes (tcp)
                  ──ack byte──▶   (shm: the decode rank copied from the shared cache)
    prefill rank i reports send_done (or send_failed) to its engine core

Decode side (consumer): each load connects to ``remote_addresses[rank]``, receives
into the blocks the scheduler allocated, and reports recv_done or recv_failed (with
why: refused, the peer closed mid-transfer, a timeout) to its engine core. Nothing a
step does waits for any of it.
"""

from __future__ import annotations

import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from loom.config import KVTransferConfig
from loom.core.wire import (KVConnectorMetadata, KVLoad, KVPull, KVPullReply,
                            KVTransferEvent)
from loom.envs import settings
from loom.ipc.kv_events import KVEventSender
from loom.worker.kv_transport import (KVLayout, SharedKVMapping, block_buffers,
                                      copy_blocks, gather_to_host, recv_frame,
                                      recv_into_buffers, send_buffers, send_frame,
                                      tune_socket)

logger = logging.getLogger(__name__)

# A pull may arrive just before this rank has registered the hold (the rank that
# answered the engine was faster): it waits this long for it.
_REGISTRATION_WAIT_S = 5.0
_PULL_THREADS = 4


class KVTransferError(RuntimeError):
    """A transfer the peer refused or could not complete."""


class KVConnectorWorker:
    def __init__(self, config: KVTransferConfig, rank: int, tp_size: int,
                 storage: torch.Tensor, notify_address: str,
                 segment_name: str | None = None, data_parallel_rank: int = 0) -> None:
        self.config = config
        self.rank = rank
        self.tp_size = tp_size
        self.events = KVEventSender(notify_address)
        self.set_storage(storage, segment_name)
        self._lock = threading.Condition()
        self._served: dict[str, frozenset[int]] = {}  # transfer id -> blocks it may read
        self._sending: dict[str, int] = {}  # transfer id -> sends in progress
        self._mappings: dict[str, SharedKVMapping] = {}
        self._closed = False
        self._stall_sends = settings().test_stall_kv_send
        self.address = ""
        self._listener: socket.socket | None = None
        self._pool: ThreadPoolExecutor | None = None
        if config.is_producer:
            # A fixed kv_port: rank i of data-parallel replica r listens on
            # kv_port + r * tp_size + i, so the replicas of one server never collide.
            port = config.kv_port + data_parallel_rank * tp_size + rank if config.kv_port else 0
            try:
                self._listener = socket.create_server((config.kv_ip, port), backlog=128)
            except OSError as error:
                self.events.close()
                raise RuntimeError(
                    f"rank {rank} (data-parallel replica {data_parallel_rank}) cannot listen "
                    f"for KV transfers on {config.kv_ip}:{port}: {error}; give "
                    "--kv-transfer-config another kv_port (rank i of replica r takes "
                    "kv_port + r * tensor_parallel_size + i) or kv_port 0 (any free port)"
                ) from None
            self.address = f"{config.kv_ip}:{self._listener.getsockname()[1]}"
            threading.Thread(target=self._accept_loop, daemon=True,
                             name=f"loom-kv-listener-{rank}").start()
        if config.is_consumer:
            self._pool = ThreadPoolExecutor(_PULL_THREADS, thread_name_prefix=f"loom-kv-pull-{rank}")

    def set_storage(self, storage: torch.Tensor, segment_name: str | None) -> None:
        """The rank's cache (again after a wake-up): (layers, 2, heads, blocks, block size,
        head dim); ``segment_name`` if it lives in shared memory."""
        self.storage = storage
        self.layout = KVLayout.of(storage)
        self.segment_name = segment_name

    # ----------------------------------------------------------------- around a step

    def before_step(self, metadata: KVConnectorMetadata) -> None:
        if not metadata.releases:
            return
        with self._lock:
            for transfer_id in metadata.releases:
                self._lock.wait_for(lambda: not self._sending.get(transfer_id))
                self._served.pop(transfer_id, None)

    def after_step(self, metadata: KVConnectorMetadata) -> None:
        if metadata.holds:
            with self._lock:
                for hold in metadata.holds:
                    self._served[hold.transfer_id] = frozenset(hold.block_ids)
                self._lock.notify_all()
        for load in metadata.loads:
            self._pool.submit(self._run_load, load)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._listener is not None:
            self._listener.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        for mapping in self._mappings.values():
            mapping.close()
        self.events.close()

    # ----------------------------------------------------------------- prefill side

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(conn,), daemon=True,
                             name=f"loom-kv-send-{self.rank}").start()

    def _serve(self, conn: socket.socket) -> None:
        transfer_id = None
        kind, error = "send_done", None
        with conn:
            try:
                conn.settimeout(self.config.kv_transfer_timeout_s)
                tune_socket(conn)
                pull = recv_frame(conn, KVPull)
                refusal = self._check_pull(pull)
                if refusal is None:
                    refusal = self._begin_send(pull)
                if refusal is not None:
                    send_frame(conn, KVPullReply(ok=False, error=refusal))
                    return
                transfer_id = pull.transfer_id
                if pull.transport == "tcp":
                    buffers = self._send_buffers(pull.block_ids)
                    send_frame(conn, KVPullReply(ok=True, nbytes=sum(len(b) for b in buffers)))
                    if self._stall_sends:  # LOOM_TEST_STALL_KV_SEND
                        send_buffers(conn, buffers[:len(buffers) // 2])
                        threading.Event().wait()
                    send_buffers(conn, buffers)
                else:
                    send_frame(conn, KVPullReply(ok=True, shm_name=self.segment_name,
                                                 num_blocks=self.storage.shape[3]))
                if conn.recv(1) != b"\x01":
                    raise ConnectionError("the decode rank closed the connection before it "
                                          "acknowledged the blocks")
            except (OSError, msgspec.DecodeError, msgspec.ValidationError) as exc:
                kind, error = "send_failed", f"{type(exc).__name__}: {exc}"
            finally:
                if transfer_id is not None:
                    with self._lock:
                        self._sending[transfer_id] -= 1
                        if not self._sending[transfer_id]:
                            del self._sending[transfer_id]
                        self._lock.notify_all()
        if transfer_id is not None:
            self.events.send(KVTransferEvent(self.rank, transfer_id, kind, error))

    def _check_pull(self, pull: KVPull) -> str | None:
        if pull.transport != self.config.kv_transport:
            return (f"the decode instance uses kv_transport {pull.transport} but this prefill "
                    f"instance {self.config.kv_transport}; start both with the same one")
        if pull.tp_size != self.tp_size or pull.rank != self.rank:
            return (f"rank {pull.rank} of a decode instance with tensor_parallel_size "
                    f"{pull.tp_size} asked rank {self.rank} of a prefill instance with "
                    f"{self.tp_size}; KV blocks move rank to rank, so both need the same size")
        if pull.layout != self.layout.key():
            return (f"the decode rank's KV layout {pull.layout} (layers, kv heads, block size, "
                    f"head dim, bytes, dtype) differs from this prefill rank's "
                    f"{self.layout.key()}; serve the same model with the same dtype, "
                    "--kv-cache-dtype and block size on both")
        return None

    def _begin_send(self, pull: KVPull) -> str | None:
        """Count a send in progress on a transfer this rank holds; else why not."""
        with self._lock:
            self._lock.wait_for(lambda: pull.transfer_id in self._served or self._closed,
                                timeout=_REGISTRATION_WAIT_S)
            served = self._served.get(pull.transfer_id)
            if served is None:
                return (f"KV transfer {pull.transfer_id} is not held here: its blocks were "
                        "freed (kv_hold_timeout_s passed, or it was pulled already) or it never "
                        "existed")
            if not served.issuperset(pull.block_ids):
                return f"KV transfer {pull.transfer_id} does not hold blocks {pull.block_ids}"
            self._sending[pull.transfer_id] = self._sending.get(pull.transfer_id, 0) + 1
            return None

    def _send_buffers(self, block_ids: list[int]) -> list[memoryview]:
        if self.storage.device.type == "cpu":
            return block_buffers(self.storage, block_ids)
        staged = gather_to_host(self.storage, block_ids)
        return block_buffers(staged, list(range(len(block_ids))))

    # ----------------------------------------------------------------- decode side

    def _run_load(self, load: KVLoad) -> None:
        kind, error = "recv_done", None
        try:
            self._pull(load)
        except Exception as exc:  # noqa: BLE001 — every failure is this load's report
            kind, error = "recv_failed", f"{type(exc).__name__}: {exc}"
            logger.warning("rank %d: KV transfer %s failed: %s", self.rank, load.transfer_id,
                           error)
        self.events.send(KVTransferEvent(self.rank, load.transfer_id, kind, error))

    def _pull(self, load: KVLoad) -> None:
        address = load.remote_addresses[self.rank]
        host, port = address.rsplit(":", 1)
        timeout = self.config.kv_transfer_timeout_s
        try:
            conn = socket.create_connection((host, int(port)), timeout=timeout)
        except OSError as exc:
            raise KVTransferError(f"cannot reach rank {self.rank} of the prefill instance at "
                                  f"{address}: {exc}") from None
        with conn:
            tune_socket(conn)
            try:
                send_frame(conn, KVPull(transfer_id=load.transfer_id,
                                        block_ids=load.remote_block_ids, rank=self.rank,
                                        tp_size=self.tp_size, layout=self.layout.key(),
                                        transport=self.config.kv_transport))
                reply = recv_frame(conn, KVPullReply)
                if not reply.ok:
                    raise KVTransferError(f"the prefill instance at {address} refused: "
                                          f"{reply.error}")
                if self.config.kv_transport == "tcp":
                    self._receive(conn, load, reply.nbytes)
                else:
                    mapping = self._mapping(reply.shm_name, reply.num_blocks)
                    copy_blocks(mapping.tensor, load.remote_block_ids, self.storage,
                                load.local_block_ids)
            except ConnectionError as exc:
                raise KVTransferError(f"the prefill instance at {address} went away during the "
                                      f"transfer ({exc})") from None
            try:
                conn.sendall(b"\x01")
            except OSError:
                pass  # the blocks are here; the prefill side frees its copy after its timeout

    def _receive(self, conn: socket.socket, load: KVLoad, nbytes: int) -> None:
        num_blocks = len(load.local_block_ids)
        if nbytes != num_blocks * self.layout.bytes_per_block:
            raise KVTransferError(f"the prefill instance sends {nbytes:,} bytes for "
                                  f"{num_blocks} blocks of {self.layout.bytes_per_block:,}")
        if self.storage.device.type == "cpu":
            recv_into_buffers(conn, block_buffers(self.storage, load.local_block_ids))
            return
        shape = list(self.storage.shape)
        shape[3] = num_blocks
        staged = torch.empty(shape, dtype=self.storage.dtype)
        recv_into_buffers(conn, block_buffers(staged, list(range(num_blocks))))
        index = torch.tensor(load.local_block_ids, device=self.storage.device)
        self.storage.index_copy_(3, index, staged.to(self.storage.device))

    def _mapping(self, name: str | None, num_blocks: int) -> SharedKVMapping:
        if name is None:
            raise KVTransferError("the prefill instance's cache is not in shared memory")
        with self._lock:
            mapping = self._mappings.get(name)
            if mapping is None:
                shape = list(self.storage.shape)
                shape[3] = num_blocks
                try:
                    mapping = SharedKVMapping(name, tuple(shape), self.storage.dtype)
                except FileNotFoundError:
                    raise KVTransferError(
                        f"no shared-memory segment {name}: kv_transport shm needs both "
                        "instances on one host (use tcp across hosts)") from None
                self._mappings[name] = mapping
            return mapping
