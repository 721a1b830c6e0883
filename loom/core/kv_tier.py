"""KVTier: the scheduler's half of the KV offload tier (``--kv-offload-size``,
``--kv-offload-path``), a second, larger prefix cache under the block pool.

    block pool (the KV cache)  ──a cached block evicted: save──▶  tier slots (bounded, LRU)
                               ◀──the prefix continues in the tier: load──

Save. When the pool hands out a block whose hash is still in its prefix-cache map
(``BlockPool.get_new_blocks``), that hash leaves the pool: every rank copies the block's
K/V (each layer of its KV cache group, the rank's own heads) into a tier slot under the
block's key, before the step that reuses the block runs.

Load. A waiting request whose prefix goes on in the tier past the pool's hit
(``KVCacheManager.get_computed_blocks(..., with_tier=True)``) gets fresh blocks for the
tier's blocks (``KVCacheManager.fetch_from_tier``) and waits one step: every rank copies
the slots into those blocks before that step, checking each record (its key, the
weights version, a checksum: worker/kv_tier_io.py). After the step the loaded blocks
enter the prefix cache and are let go, cached, with the request's other hits, and the
next step finds the whole prefix in the pool: a prefix-cache hit. A record any rank
refused is a miss: its key leaves the tier and the request computes those tokens.

    step N    schedule: R's prefix: pool b0 b1 | tier t2 t3 -> fresh blocks b7 b9
              ranks:    saves (of the blocks this step reuses), loads t2->b7 t3->b9, forward
              update:   b7 b9 cached under t2's and t3's keys; b0 b1 b7 b9 let go, cached
    step N+1  schedule: R's prefix: pool b0 b1 b7 b9: admitted as any prefix-cache hit

A step's saves run before its loads (a block saved in a step may be the one a load of
that step fills). A slot a load reads is pinned until the step's copies are taken, so no
save of the same step lands on it. A full tier evicts its least recently used unpinned
slot; with none, the save is dropped (those tokens are computed if asked for again).
Nothing here fails a request.

A preempted request needs nothing more (swap instead of recompute): its full blocks
are in the prefix cache, so as the pool reuses them they are saved, and when it
resumes its prefix is found in the pool or the tier; only its last, partial block is
computed again.

Imports no torch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from loom.core.wire import KVTierCopy, KVTierOps

# Each slot's record begins with a header of this many bytes (worker/kv_tier_io.py);
# counted in the tier's size beside the block's K/V.
TIER_RECORD_HEADER_BYTES = 64


def tier_num_slots(size_bytes: int, bytes_per_block: int) -> int:
    """The blocks a tier of ``size_bytes`` holds (per rank, as the pool's bytes per block)."""
    return size_bytes // (bytes_per_block + TIER_RECORD_HEADER_BYTES)


def split_key(key: Hashable) -> tuple[int, int]:
    """A pool cache key as (block hash, KV cache group): group 0's key is the hash itself,
    another group's the pair (kv_cache_manager.py: ``_cache_key``)."""
    return (key, 0) if isinstance(key, int) else key


class TierBlock:
    """A block of a prefix that the tier holds and the pool does not: where a lookup with
    the tier (``get_computed_blocks(..., with_tier=True)``) puts a pool block."""

    __slots__ = ("key",)

    def __init__(self, key: Hashable) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"TierBlock({self.key})"


@dataclass
class KVTierStats:
    saves: int = 0  # blocks copied to the tier
    saves_dropped: int = 0  # evicted blocks the tier had no unpinned slot for
    loads: int = 0  # blocks copied back into the pool
    load_failures: int = 0  # records a rank refused (wrong key or version, bad checksum)
    evictions: int = 0  # slots given to another block


class KVTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"the KV offload tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()  # least recently used first
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._pinned: set[int] = set()  # slots this step's loads read
        self._loading: set[Hashable] = set()  # keys this step's loads bring back
        self._saves: list[KVTierCopy] = []
        self._loads: list[KVTierCopy] = []
        self.stats = KVTierStats()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def is_loading(self, key: Hashable) -> bool:
        return key in self._loading

    def save(self, block_id: int, key: Hashable) -> None:
        """The pool reuses ``block_id``, whose hash ``key`` is leaving its prefix cache:
        keep its K/V (equal keys hold equal K/V: one copy is enough)."""
        if key in self._slot_of:
            self._slot_of.move_to_end(key)
            return
        slot = self._take_slot()
        if slot is None:
            self.stats.saves_dropped += 1
            return
        self._slot_of[key] = slot
        self._saves.append(KVTierCopy(block_id, slot, *split_key(key)))
        self.stats.saves += 1

    def pin(self, keys: Iterable[Hashable]) -> None:
        """These keys are loaded this step: their slots keep them until the step's copies
        are taken (``take_ops``)."""
        for key in keys:
            self._pinned.add(self._slot_of[key])
            self._loading.add(key)
            self._slot_of.move_to_end(key)

    def add_load(self, block_id: int, key: Hashable) -> int:
        """Copy pinned ``key``'s slot into ``block_id`` before this step; the load's index
        in the step's ``KVTierOps.loads`` (what a rank's refusal names)."""
        assert key in self._loading, f"load of {key} without pinning it"
        self._loads.append(KVTierCopy(block_id, self._slot_of[key], *split_key(key)))
        self.stats.loads += 1
        return len(self._loads) - 1

    def forget(self, key: Hashable) -> None:
        """A rank refused ``key``'s record: it is a miss from now on."""
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._free_slots.append(slot)
            self.stats.load_failures += 1

    def take_ops(self) -> KVTierOps | None:
        """This step's copies for the ranks (None: none); the pins end with it."""
        self._pinned.clear()
        self._loading.clear()
        if not self._saves and not self._loads:
            return None
        ops = KVTierOps(saves=self._saves, loads=self._loads)
        self._saves, self._loads = [], []
        return ops

    def clear(self) -> None:
        """Forget every block (the weights changed, or the prefix cache was reset);
        between steps only."""
        assert not (self._saves or self._loads), "tier cleared with a step's copies pending"
        self._slot_of.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))

    def _take_slot(self) -> int | None:
        if self._free_slots:
            return self._free_slots.pop()
        for key, slot in self._slot_of.items():  # least recently used first
            if slot not in self._pinned:
                del self._slot_of[key]
                self.stats.evictions += 1
                return slot
        return None
