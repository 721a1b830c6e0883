"""BlockPool: the fixed set of KV-cache blocks, their ref counts and the prefix-cache map.

A block is in exactly one of three states:

    in use      ref_cnt > 0, not in the free queue
    cached      ref_cnt == 0, in the free queue, still reachable by its hash
    free        ref_cnt == 0, in the free queue, no hash

The free queue is in eviction order: blocks are taken from the head (least recently
freed first) and returned to the tail. A cache hit on a block in the queue pulls it
out of the middle, which the doubly linked list does in O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of blocks with O(1) append, pop from the head and remove."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVBlock(-1)  # sentinels: head.next_free is the first real block
        self._tail = KVBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[int, Hashable], None] | None = None) -> None:
        """``on_evict(block_id, key)``: a cached block is being handed out again, and
        ``key`` leaves the prefix cache with it (the KV offload tier saves it first)."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.on_evict = on_evict
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # block hash -> block holding those tokens

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks but only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            key = self._evict(block)
            if key is not None and self.on_evict is not None:
                self.on_evict(block.block_id, key)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def get_cached_block(self, block_hash: int) -> KVBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling idle ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVBlock, block_hash: int) -> None:
        """Make a full block reachable by ``block_hash`` (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, block)

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the tail, in the
        order given (so pass a request's blocks tail first: its prefix is evicted last)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None or not self.enable_caching:
                    self._evict(block)
                self.free_queue.append(block)

    def uncache(self, block: KVBlock) -> None:
        """Take ``block`` out of the prefix cache (its K/V will not be what its hash says)."""
        self._evict(block)

    def _evict(self, block: KVBlock) -> Hashable | None:
        """Forget ``block``'s hash; the hash if it left the prefix cache with it (not when
        another block of equal contents is the one cached)."""
        key, block.block_hash = block.block_hash, None
        if key is not None and self.cached.get(key) is block:
            del self.cached[key]
            return key
        return None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        return True
