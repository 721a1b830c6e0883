"""Signal: a small named numpy array in shared memory, one slot per rank.

The engine creates (owns) each signal and always unlinks it; workers attach by
name and only read and write slots. Names carry the owning process's PID and the
engine instance's id, so two engines on one host never share a segment, and a
segment whose owner is gone can be recognised as debris:

    loom-<owner pid>-<instance id>-<field>        e.g. loom-4242-1f2e3d4c5b6a-ready

    ready = Signal.create(f"loom-{pid}-{instance_id}-ready", (world_size,), np.int32)
    ready = Signal.attach(name, (world_size,), np.int32)  # in a worker
    ready.array[rank] = 1

A whole process group killed at once (the OOM killer, ``docker kill``) leaves its
segments behind, since no process lives to unlink them; ``loom.ipc.debris`` (run by
every new engine) removes those whose owner PID no longer runs.
"""

from __future__ import annotations

import enum
import os
import weakref
from multiprocessing import resource_tracker, shared_memory

import numpy as np


class Signal:
    def __init__(self, shm: shared_memory.SharedMemory, shape: tuple[int, ...],
                 dtype: np.dtype, owner: bool) -> None:
        self.name = shm.name
        self.owner = owner
        self._shm = shm
        self.array = np.ndarray(shape, dtype=dtype, buffer=shm.buf)
        # The owner unlinks even if close() is never called (an exception, a GC, exit).
        self._finalizer = weakref.finalize(self, release_segment, shm, owner)

    @classmethod
    def create(cls, name: str, shape: tuple[int, ...], dtype=np.int64) -> Signal:
        dtype = np.dtype(dtype)
        size = max(1, int(np.prod(shape)) * dtype.itemsize)
        shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        signal = cls(shm, shape, dtype, owner=True)
        signal.array[...] = 0
        return signal

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype=np.int64) -> Signal:
        return cls(attach_segment(name), shape, np.dtype(dtype), owner=False)

    def close(self) -> None:
        """Detach; the owner also unlinks. Idempotent."""
        self.array = None
        self._finalizer()


def attach_segment(name: str) -> shared_memory.SharedMemory:
    """Open an existing segment without adopting it.

    On Python < 3.13 attaching registers the segment with this process's resource
    tracker, which unlinks it (and warns) when the process exits: undo that. A child
    spawned by the owner shares the owner's tracker (its fd is inherited) and must leave
    the owner's registration alone."""
    shares_owner_tracker = getattr(resource_tracker._resource_tracker, "_fd", None) is not None
    shm = shared_memory.SharedMemory(name=name, create=False)
    if not shares_owner_tracker:
        try:
            resource_tracker.unregister(shm._name, "shared_memory")
        except Exception:  # the tracker is best effort; never fail an attach on it
            pass
    return shm


def release_segment(shm: shared_memory.SharedMemory, unlink: bool) -> None:
    """Unmap ``shm``; with ``unlink`` (its owner) also remove it."""
    try:
        shm.close()
    except BufferError:  # a view of the buffer is still alive; the unlink still counts
        pass
    if unlink:
        try:
            shm.unlink()
        except FileNotFoundError:  # an orphaned worker got there first
            resource_tracker.unregister(shm._name, "shared_memory")


def unlink_segment(name: str) -> None:
    """Remove a segment by name if it still exists (an orphaned worker's last duty)."""
    try:
        shm = shared_memory.SharedMemory(name=name, create=False)
    except FileNotFoundError:
        return
    try:
        shm.close()
        shm.unlink()  # also unregisters it from this process's resource tracker
    except FileNotFoundError:
        pass


def segment_name(owner_pid: int, instance_id: str, field: str) -> str:
    return f"loom-{owner_pid}-{instance_id}-{field}"


class WeightsStatus(enum.IntEnum):
    """Where a rank's weights are, as the seed's ``model_weights_status`` counts them.
    Every change of weights moves every rank through the same states:

        NORMAL -> CLEARING -> CLEARED -> UPDATING -> NORMAL     an update
        NORMAL -> CLEARING -> CLEARED                            weights freed (sleep 2,
                                                                 /clear_load_weight)
        CLEARED -> UPDATING -> NORMAL                            reloaded (wake_up)

    CLEARING drops what was planned on the old weights (recorded forwards) and frees
    them if asked (with their packed copies); UPDATING copies the new ones in and makes
    what derives from them again. A rank steps only in NORMAL."""

    NORMAL = 0
    UPDATING = 1
    CLEARING = -1
    CLEARED = -2


class WorkerSignals:
    """The signals between an engine and its ranks, one slot per rank:

    loaded[rank] = 1          weights in place, after a barrier over the ranks
    profiled_blocks[rank] = n KV blocks every rank can hold (already MIN-reduced)
    kv_cache_bytes_per_block[rank] = b
                              bytes of one KV block on this rank (written with
                              profiled_blocks, so the engine never computes it)
    kv_cache_window[rank] = w the model runner's kv_cache_window (0: none), with them
    kv_cache_num_groups[rank], kv_cache_num_full_groups[rank]
                              its KV cache groups, and how many read every position
                              (kv_cache_group_counts), with them
    ready[rank] = 1           KV cache allocated, warmed up, in the event loop
    heartbeat[rank] = time    written by the event loop each iteration (so it means
                              the loop runs, not merely that the process lives)
    step[rank] = s            the last step the rank began
    step_started[rank] = time when it began step[rank]; 0.0 once it finished it
    weights_status[rank] = w  WeightsStatus: the rank's weights normal, being cleared,
                              cleared, or being updated (written by the rank as it moves)

    From ``step`` and ``step_started`` the engine judges progress: a rank inside one
    step for longer than that step's bound is hung, whatever its process does.
    """

    FIELDS = {"loaded": np.int32, "profiled_blocks": np.int64,
              "kv_cache_bytes_per_block": np.int64, "kv_cache_window": np.int64,
              "kv_cache_num_groups": np.int64, "kv_cache_num_full_groups": np.int64,
              "ready": np.int32,
              "heartbeat": np.float64, "step": np.int64, "step_started": np.float64,
              "weights_status": np.int32}

    def __init__(self, signals: dict[str, Signal]) -> None:
        self._signals = signals
        self.loaded = signals["loaded"].array
        self.profiled_blocks = signals["profiled_blocks"].array
        self.kv_cache_bytes_per_block = signals["kv_cache_bytes_per_block"].array
        self.kv_cache_window = signals["kv_cache_window"].array
        self.kv_cache_num_groups = signals["kv_cache_num_groups"].array
        self.kv_cache_num_full_groups = signals["kv_cache_num_full_groups"].array
        self.ready = signals["ready"].array
        self.heartbeat = signals["heartbeat"].array
        self.step = signals["step"].array
        self.step_started = signals["step_started"].array
        self.weights_status = signals["weights_status"].array

    @staticmethod
    def names(instance_id: str, owner_pid: int) -> dict[str, str]:
        return {field: segment_name(owner_pid, instance_id, field)
                for field in WorkerSignals.FIELDS}

    @classmethod
    def create(cls, instance_id: str, world_size: int) -> WorkerSignals:
        """Create this instance's segments, owned by this process."""
        signals: dict[str, Signal] = {}
        try:
            for field, name in cls.names(instance_id, os.getpid()).items():
                signals[field] = Signal.create(name, (world_size,), cls.FIELDS[field])
        except BaseException:
            for signal in signals.values():
                signal.close()
            raise
        return cls(signals)

    @classmethod
    def attach(cls, instance_id: str, world_size: int, owner_pid: int) -> WorkerSignals:
        return cls({field: Signal.attach(name, (world_size,), cls.FIELDS[field])
                    for field, name in cls.names(instance_id, owner_pid).items()})

    @property
    def segment_names(self) -> list[str]:
        return [signal.name for signal in self._signals.values()]

    def close(self) -> None:
        self.loaded = self.profiled_blocks = self.kv_cache_bytes_per_block = None
        self.kv_cache_window = self.kv_cache_num_groups = self.kv_cache_num_full_groups = None
        self.ready = self.heartbeat = None
        self.step = self.step_started = self.weights_status = None
        for signal in self._signals.values():
            signal.close()
