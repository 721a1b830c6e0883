"""The KV offload tier, a rank's half: copies blocks between the KV cache and the tier's
slots, as each step's ``KVTierOps`` say (the scheduler's half, core/kv_tier.py, decides).

Each slot is a record: a header, then the block's bytes: for every cache the rank holds
(the target's, a draft model's layers on rank 0), that block's piece, all layers, K and
V, this rank's heads, in the cache's own layout and dtype (int8 and fp8 rows carry their
scales; the fingerprint names the dtype, as their rows have the same bytes).

    header (64 bytes): magic "LKVT" | format | block hash | group | weights epoch |
                       model fingerprint | payload bytes | crc32 of the payload

A load takes a record only if every field is the one expected: the key the scheduler
asked for, this rank's weights epoch (moved on by every weight change or KV cache free:
``invalidate``), the fingerprint of the model and cache layout, and the payload's CRC-32.
Anything else is refused, and the step's refusals, summed over the ranks, go back to
the scheduler (``ModelRunnerOutput.kv_tier_failed``), for which those blocks are misses:
computed again, never read. A save that fails (the disk is full) leaves its record's
header cleared, so a later load of it is refused too.

Where the slots live is a ``TierSlots``: ``MappedFileSlots`` keeps them in one file per
rank under ``--kv-offload-path``, written with ``pwrite`` (a full disk is an error, not
a SIGBUS) and read through a memory map (no copy before the checksum): the CPU's tier,
whose cache already sits in host memory. ``HostMemorySlots`` keeps them in this
process's memory, page-locked beside a CUDA cache so a block moves by DMA: the tier on
CUDA unless ``--kv-offload-path`` asks for files (vLLM's CPU offloading). The records,
checks and copies are the same code for both; the CUDA side has not run on a GPU yet.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import struct
import uuid
import weakref
import zlib
from typing import Protocol

import numpy as np
import torch

from loom.core.kv_tier import TIER_RECORD_HEADER_BYTES
from loom.core.wire import KVTierCopy, KVTierOps
from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.ipc.debris import remove_debris

logger = logging.getLogger(__name__)

_MAGIC = b"LKVT"
_FORMAT = 1
# magic, format, block hash, group, epoch, fingerprint, payload bytes, crc32
_HEADER = struct.Struct("<4sIqiQQQI")
assert _HEADER.size <= TIER_RECORD_HEADER_BYTES
_ALIGN = 64  # each cache's piece starts on this boundary within a payload
_PAGE = 4096


class TierSlots(Protocol):
    """Where a rank's tier keeps ``num_slots`` records of ``payload_bytes`` each, on the
    host. ``read_header`` / ``payload`` return views of what is stored (no copy);
    ``write`` stores a record whole, or raises OSError (then the slot reads as empty)."""

    num_slots: int
    payload_bytes: int

    def read_header(self, slot: int) -> bytes: ...
    def payload(self, slot: int) -> np.ndarray: ...
    def write(self, slot: int, header: bytes, payload: np.ndarray) -> None: ...
    def close(self) -> None: ...


class MappedFileSlots:
    """One file per rank in ``directory``, ``loom-<pid>-kvtier-<rank>-<id>.bin``:

        | headers: num_slots x 64 bytes, to a page | slot 0 payload | slot 1 payload | ...

    made sparse (disk is used as records are written), removed on ``close`` (and by the
    next engine's debris sweep, ``loom/ipc/debris.py``, if the process was killed)."""

    def __init__(self, directory: str, num_slots: int, payload_bytes: int, rank: int) -> None:
        remove_debris(shm_dir=directory, tmp_dir=directory)
        self.num_slots = num_slots
        self.payload_bytes = payload_bytes
        self._stride = -(-payload_bytes // _ALIGN) * _ALIGN
        self._first = -(-num_slots * TIER_RECORD_HEADER_BYTES // _PAGE) * _PAGE
        self.path = os.path.join(directory, f"loom-{os.getpid()}-kvtier-{rank}-"
                                            f"{uuid.uuid4().hex[:8]}.bin")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._finalizer = weakref.finalize(self, _remove, self._fd, self.path)
        size = self._first + num_slots * self._stride
        os.ftruncate(self._fd, size)
        self._map = mmap.mmap(self._fd, size)  # read through; written with pwrite
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)

    def read_header(self, slot: int) -> bytes:
        start = slot * TIER_RECORD_HEADER_BYTES
        return self._bytes[start:start + TIER_RECORD_HEADER_BYTES].tobytes()

    def payload(self, slot: int) -> np.ndarray:
        start = self._first + slot * self._stride
        return self._bytes[start:start + self.payload_bytes]

    def write(self, slot: int, header: bytes, payload: np.ndarray) -> None:
        at = slot * TIER_RECORD_HEADER_BYTES
        os.pwrite(self._fd, bytes(TIER_RECORD_HEADER_BYTES), at)  # empty while half written
        _pwrite_all(self._fd, memoryview(payload), self._first + slot * self._stride)
        os.pwrite(self._fd, header.ljust(TIER_RECORD_HEADER_BYTES, b"\0"), at)

    def close(self) -> None:
        self._bytes = None
        try:
            self._map.close()
        except BufferError:  # a view still held somewhere: the mapping goes with it
            pass
        self._finalizer()


class HostMemorySlots:
    """``num_slots`` records in this process's memory, gone with it: headers in one array,
    payloads in one buffer of ``num_slots`` x the payload (``pin``: page-locked, for a
    CUDA cache's copies). The buffer is reserved up front and its pages are touched only
    as records are written."""

    def __init__(self, num_slots: int, payload_bytes: int, pin: bool = False) -> None:
        self.num_slots = num_slots
        self.payload_bytes = payload_bytes
        self._stride = -(-payload_bytes // _ALIGN) * _ALIGN
        self._headers = np.zeros((num_slots, TIER_RECORD_HEADER_BYTES), dtype=np.uint8)
        self._buffer = torch.empty(num_slots * self._stride, dtype=torch.uint8, pin_memory=pin)
        self._bytes = self._buffer.numpy()

    def read_header(self, slot: int) -> bytes:
        return self._headers[slot].tobytes()

    def payload(self, slot: int) -> np.ndarray:
        start = slot * self._stride
        return self._bytes[start:start + self.payload_bytes]

    def write(self, slot: int, header: bytes, payload: np.ndarray) -> None:
        self._headers[slot] = 0  # empty while half written
        self.payload(slot)[:] = payload
        self._headers[slot] = np.frombuffer(header.ljust(TIER_RECORD_HEADER_BYTES, b"\0"),
                                            dtype=np.uint8)

    def close(self) -> None:
        self._bytes = None
        self._buffer = None


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while data:
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written


def _remove(fd: int, path: str) -> None:
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class KVTierWorker:
    """A rank's tier: ``run`` does a step's copies over the caches ``runner`` holds now
    (taken at each step: a wake-up makes new ones). ``directory``: files there; None:
    host memory (pinned beside a CUDA cache)."""

    def __init__(self, directory: str | None, num_slots: int, runner,
                 tp_group: TPGroup = SINGLE, model_name: str = "") -> None:
        self.runner = runner
        self.tp_group = tp_group
        self.epoch = 0
        caches = self._caches()
        self._pieces = []  # (offset in the payload, bytes) per cache
        offset = 0
        for cache, dim in caches:
            nbytes = cache.numel() // cache.shape[dim] * cache.element_size()
            self._pieces.append((offset, nbytes))
            offset = -(-(offset + nbytes) // _ALIGN) * _ALIGN
        layout = repr([(model_name, tuple(cache.shape[:dim] + cache.shape[dim + 1:]),
                        str(cache.dtype)) for cache, dim in caches])
        self.fingerprint = int.from_bytes(
            hashlib.blake2b(layout.encode(), digest_size=8).digest(), "little")
        if directory is None:
            pin = caches[0][0].is_cuda
            self.slots: TierSlots = HostMemorySlots(num_slots, offset, pin=pin)
        else:
            self.slots = MappedFileSlots(directory, num_slots, offset, tp_group.rank)
        self._staging = np.zeros(offset, dtype=np.uint8)

    def invalidate(self) -> None:
        """The weights (or the KV cache) changed: no record written before is valid."""
        self.epoch += 1

    def close(self) -> None:
        self.slots.close()

    @torch.inference_mode()
    def run(self, ops: KVTierOps) -> list[int]:
        """Saves, then loads; the indices of the loads some rank refused (every rank
        calls this with the same ops, so the ranks' refusals are summed here)."""
        caches = self._caches()
        for copy in ops.saves:
            self._save(copy, caches)
        if not ops.loads:
            return []
        why = [self._load(copy, caches) for copy in ops.loads]
        refused = [reason is not None for reason in why]
        if any(refused):
            logger.warning("rank %d: %d of %d KV offload tier records refused (%s); those "
                           "blocks are computed again", self.tp_group.rank, sum(refused),
                           len(refused), ", ".join(sorted({r for r in why if r})))
        if self.tp_group.world_size > 1:
            device = caches[0][0].device if caches[0][0].is_cuda else "cpu"
            counts = torch.tensor(refused, dtype=torch.int64, device=device)
            refused = [bool(n) for n in self.tp_group.all_reduce(counts).tolist()]
        return [i for i, bad in enumerate(refused) if bad]

    def _caches(self) -> list[tuple[torch.Tensor, int]]:
        """(cache, its block dimension): the target's one allocation, (slots, 2, heads,
        blocks, block size, head dim), and a draft model's layers, (2, heads, blocks, ...)."""
        caches = [(self.runner.kv_cache_storage, 3)]
        draft = getattr(self.runner, "draft_proposer", None)
        if draft is not None:
            caches += [(cache, 2) for cache in draft.kv_caches]
        return caches

    def _views(self, buffer: np.ndarray, caches) -> list[torch.Tensor]:
        """``buffer`` (a payload's bytes) as one tensor per cache, shaped as its block."""
        flat = torch.from_numpy(buffer)
        views = []
        for (cache, dim), (offset, nbytes) in zip(caches, self._pieces):
            shape = cache.shape[:dim] + cache.shape[dim + 1:]
            views.append(flat[offset:offset + nbytes].view(cache.dtype).view(shape))
        return views

    def _save(self, copy: KVTierCopy, caches) -> None:
        for view, (cache, dim) in zip(self._views(self._staging, caches), caches):
            view.copy_(cache.select(dim, copy.block_id))
        header = _HEADER.pack(_MAGIC, _FORMAT, copy.block_hash, copy.group, self.epoch,
                              self.fingerprint, self.slots.payload_bytes,
                              zlib.crc32(self._staging))
        try:
            self.slots.write(copy.slot, header, self._staging)
        except OSError as error:
            logger.warning("rank %d: KV offload tier slot %d not written (%s); that block "
                           "will be computed again", self.tp_group.rank, copy.slot, error)

    def _load(self, copy: KVTierCopy, caches) -> str | None:
        """Copy ``copy``'s record into its block; why not, if it is refused."""
        magic, fmt, block_hash, group, epoch, fingerprint, nbytes, crc = _HEADER.unpack(
            self.slots.read_header(copy.slot)[:_HEADER.size])
        payload = self.slots.payload(copy.slot)
        expected = (_MAGIC, _FORMAT, copy.block_hash, copy.group, self.epoch,
                    self.fingerprint, self.slots.payload_bytes)
        if magic != _MAGIC:
            return "no record"
        if (magic, fmt, block_hash, group, epoch, fingerprint, nbytes) != expected:
            return "another block's, or written under other weights"
        if zlib.crc32(payload) != crc:
            return "checksum mismatch"
        for view, (cache, dim) in zip(self._views(payload, caches), caches):
            cache.select(dim, copy.block_id).copy_(view)
        return None
