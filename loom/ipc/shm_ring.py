"""ShmRing: images' arrays between processes of one host through shared memory.

A request's pixels make two hops, and each hop has one ring, owned by its sender:

    API process ──EngineCoreRequest──▶ engine core ──NewRequestData──▶ every local rank
      ring "mm-input" (EngineCoreClient)    ring "mm-ranks" (MultiProcExecutor)

An array of at least ``INLINE_MAX_BYTES`` is copied into the sender's ring and its
``TensorData`` travels with ``data=b""`` and a ``ShmSlot`` (segment, position, length);
the receiver copies it out as soon as the message arrives (``fetch_features``) and from
then on holds plain bytes, as if they had come inline. Smaller arrays (an image's grid,
a video's timestamps) stay in the message. A peer on another host (a headless replica's
core, ranks of another node, Ray actors) has no ring: its messages carry the bytes.

Why one bounded ring per sender, not a segment per item (vLLM's
``SingleWriterShmRingBuffer`` is the model): a ring is created once, at the sender's
start, with a name carrying the sender's PID (``loom.ipc.debris`` removes it if the
whole process group is SIGKILLed), and unlinked at the sender's exit, however it exits;
there is nothing per item to leak, and no item's life depends on a receiver that may die
before freeing it. The cost: a ring bounds what may be in flight, so a full ring sends
inline (never blocks, never fails a request).

Layout of the segment (int64 words, then the data region of ``capacity`` bytes):

    | capacity | num_readers | published write position | 5 spare | ack[0..readers) | data |

Positions are logical (they only grow); an item lives at ``position % capacity``, never
split by the ring's end (a tail too short is skipped), as ``| start | length | bytes |``.
Two guards keep a reader from ever returning another item's bytes:

- the writer reuses space only once every reader has acknowledged what lay there
  (``ack[i]``: the end position of the last item reader i took; messages arrive in the
  order their items were written, so an item skipped is behind one taken), and sends the
  array inline when they have not;
- a reader checks the item's header against its slot, and after copying, that the
  writer's published position has not lapped the slot (the writer publishes before it
  writes); either failing raises ``StaleSlotError`` naming the item.
"""

from __future__ import annotations

import logging
import os
import weakref
from multiprocessing import shared_memory

import msgspec
import numpy as np

from loom.core.wire import MultiModalFeature, ShmSlot, TensorData
from loom.ipc.signal import attach_segment, release_segment

logger = logging.getLogger(__name__)

INLINE_MAX_BYTES = 64 * 1024  # smaller arrays stay in the message
_ALIGN = 64
_ITEM_HEADER = 16  # start, length: two int64
_CAPACITY, _NUM_READERS, _WRITE_POSITION, _ACKS = 0, 1, 2, 8  # header words


class StaleSlotError(RuntimeError):
    """An item's space was reused before its reader took it."""


def _align(size: int) -> int:
    return (size + _ALIGN - 1) // _ALIGN * _ALIGN


def _header_words(num_readers: int) -> int:
    return _align((_ACKS + num_readers) * 8) // 8


class _Mapped:
    """A ring segment mapped: its header words and its data region."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self.name = shm.name
        head = np.ndarray((_ACKS,), dtype=np.int64, buffer=shm.buf)
        words = _header_words(int(head[_NUM_READERS]))
        self.header = np.ndarray((words,), dtype=np.int64, buffer=shm.buf)
        self.capacity = int(self.header[_CAPACITY])
        self.num_readers = int(self.header[_NUM_READERS])
        self.acks = self.header[_ACKS:_ACKS + self.num_readers]
        self.data = np.ndarray((self.capacity,), dtype=np.uint8, buffer=shm.buf,
                               offset=words * 8)
        self._finalizer = weakref.finalize(self, release_segment, shm, owner)

    def close(self) -> None:
        """Unmap; the owner also unlinks. Idempotent."""
        self.header = self.acks = self.data = None
        self._finalizer()


class ShmRing:
    """The sender's end: creates the segment, writes items, unlinks at ``close``."""

    def __init__(self, name: str, capacity: int, num_readers: int) -> None:
        words = _header_words(num_readers)
        shm = shared_memory.SharedMemory(name=name, create=True, size=words * 8 + capacity)
        head = np.ndarray((words,), dtype=np.int64, buffer=shm.buf)
        head[:] = 0
        head[_CAPACITY], head[_NUM_READERS] = capacity, num_readers
        del head
        self._mapped = _Mapped(shm, owner=True)
        self.name, self.capacity = name, capacity
        self._position = 0

    @classmethod
    def create(cls, name: str, size_mib: int, num_readers: int,
               shm_dir: str = "/dev/shm") -> ShmRing | None:
        """A ring of ``size_mib`` MiB, or None (arrays travel inline) when it is 0 or the
        host cannot hold it: a tmpfs too small (a container's 64 MiB /dev/shm) would
        kill the writer with SIGBUS once its pages ran out."""
        capacity = size_mib * 2**20
        if capacity <= 0:
            return None
        try:
            stat = os.statvfs(shm_dir)
        except OSError:
            logger.warning("no %s: images' arrays travel inside messages", shm_dir)
            return None
        free = stat.f_bavail * stat.f_frsize
        if free < capacity:
            logger.warning("%s has %d MiB free, less than --mm-shm-cache-size-mib %d: images' "
                           "arrays travel inside messages (make it larger, e.g. docker run "
                           "--shm-size, or lower the flag)", shm_dir, free // 2**20, size_mib)
            return None
        try:
            return cls(name, capacity, num_readers)
        except OSError as error:
            logger.warning("cannot make shared-memory ring %s (%s): images' arrays travel "
                           "inside messages", name, error)
            return None

    def put(self, payload: bytes | memoryview) -> ShmSlot | None:
        """Copy ``payload`` in; its slot, or None when it does not fit (too large, or
        the space it needs is not yet acknowledged by every reader)."""
        mapped = self._mapped
        length = len(payload)
        size = _align(_ITEM_HEADER + length)
        if size > self.capacity:
            return None
        start = self._position
        if start % self.capacity + size > self.capacity:  # skip the ring's short tail
            start += self.capacity - start % self.capacity
        end = start + size
        # What lay at these bytes a lap ago (positions before end - capacity) must be taken.
        if mapped.num_readers and int(mapped.acks.min()) < end - self.capacity:
            return None
        mapped.header[_WRITE_POSITION] = end  # published before the bytes change
        offset = start % self.capacity
        mapped.data[offset:offset + _ITEM_HEADER].view(np.int64)[:] = (start, length)
        mapped.data[offset + _ITEM_HEADER:offset + _ITEM_HEADER + length] = \
            np.frombuffer(payload, dtype=np.uint8)
        self._position = end
        return ShmSlot(segment=self.name, start=start, length=length)

    def close(self) -> None:
        self._mapped.close()


class ShmRingReader:
    """A receiver's end: reader ``index`` of the ring named ``name``."""

    def __init__(self, name: str, index: int) -> None:
        self._mapped = _Mapped(attach_segment(name), owner=False)
        if not 0 <= index < self._mapped.num_readers:
            self._mapped.close()
            raise ValueError(f"ring {name} has {self._mapped.num_readers} readers, not {index + 1}")
        self.name, self.index = name, index

    def get(self, slot: ShmSlot) -> bytes:
        """The item's bytes (a copy), acknowledged. StaleSlotError if its space was
        reused before this call."""
        mapped = self._mapped
        capacity = mapped.capacity
        offset = slot.start % capacity
        start, length = (int(v) for v in mapped.data[offset:offset + _ITEM_HEADER].view(np.int64))
        payload = mapped.data[offset + _ITEM_HEADER:offset + _ITEM_HEADER + slot.length].tobytes()
        if (start, length) != (slot.start, slot.length) or \
                int(mapped.header[_WRITE_POSITION]) > slot.start + capacity:
            raise StaleSlotError(
                f"an image's array at position {slot.start} of shared-memory ring {slot.segment} "
                f"was overwritten before it was read; raise --mm-shm-cache-size-mib")
        end = slot.start + _align(_ITEM_HEADER + slot.length)
        if mapped.acks[self.index] < end:
            mapped.acks[self.index] = end
        return payload

    def close(self) -> None:
        self._mapped.close()


class SenderRing:
    """A sender's ring, created at its first large array (a text-only model never makes
    one), closed (unlinked) by ``close`` or, failing that, by the finalizer at exit."""

    def __init__(self, name: str, size_mib: int, num_readers: int) -> None:
        self.name, self.size_mib, self.num_readers = name, size_mib, num_readers
        self._ring: ShmRing | None | bool = False  # False: not tried yet

    def stage(self, features: list[MultiModalFeature]) -> list[MultiModalFeature]:
        """``features`` with their large arrays in the ring (``stage_features``); as
        they are when the ring is off or cannot be made."""
        if not any(len(t.data) >= INLINE_MAX_BYTES for f in features for t in f.data.values()):
            return features
        if self._ring is False:
            self._ring = ShmRing.create(self.name, self.size_mib, self.num_readers)
        return features if self._ring is None else stage_features(features, self._ring)

    def close(self) -> None:
        if self._ring:
            self._ring.close()
        self._ring = None


# ----------------------------------------------------------------- features


def stage_features(features: list[MultiModalFeature],
                   ring: ShmRing) -> list[MultiModalFeature]:
    """Copies of ``features`` whose large arrays are in ``ring`` (the originals stay as
    they are: the sender may send them again)."""
    staged = []
    for feature in features:
        data = {}
        for name, tensor in feature.data.items():
            slot = (ring.put(tensor.data)
                    if tensor.shm is None and len(tensor.data) >= INLINE_MAX_BYTES else None)
            data[name] = tensor if slot is None else TensorData(
                dtype=tensor.dtype, shape=tensor.shape, data=b"", shm=slot)
        staged.append(msgspec.structs.replace(feature, data=data))
    return staged


class FeatureFetcher:
    """A receiver's readers, one per ring it has seen (attached at first use)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._readers: dict[str, ShmRingReader] = {}

    def fetch(self, features: list[MultiModalFeature]) -> None:
        """Replace, in place, every array in shared memory by its bytes."""
        for feature in features:
            for tensor in feature.data.values():
                if tensor.shm is not None:
                    reader = self._readers.get(tensor.shm.segment)
                    if reader is None:
                        reader = self._readers[tensor.shm.segment] = ShmRingReader(
                            tensor.shm.segment, self.index)
                    tensor.data, tensor.shm = reader.get(tensor.shm), None

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
