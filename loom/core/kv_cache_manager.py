"""KVCacheManager: which blocks each request owns, and the prefix cache over them.

A full block is identified by a chained hash, so equal hashes mean equal prefixes:

    hash_i = hash((hash_{i-1}, tokens of block i, extra_keys))      hash_{-1} = None

A new request looks up its hashes in order and stops at the first miss; those hits
are its computed prefix. The last prompt token is always recomputed, because its
logits are what the first sampled token comes from.

Sliding windows. When every attention layer of the model reads only the last
``sliding_window`` W positions (Mistral with a window; the workers report it), a query
at position p never reads keys before p - W + 1, and every query still to come sits at
``num_computed_tokens`` or later. So before each allocation the request's blocks that
lie wholly before ``num_computed_tokens - W + 1`` go back to the pool (cached, if
caching is on: they still hold a valid prefix). Their places in the request's block
list stay, as None, so block indices keep meaning token positions; the workers keep
the old ids in their block tables and never read them (the kernels mask keys outside
the window, and a reused block holds another request's finite values):

    positions   0 ....... 15 16 ...... 31 32 ...... 47 48 .. 53     W = 20, 54 computed
    blocks      [  None   ] [   None   ]  [    b2     ] [  b3  ]    first needed: 35

A model with any full-attention layer (Gemma 3 interleaves them) needs every block,
so nothing is freed: that would take a block table per layer group (vLLM's hybrid
KV cache manager), which loom does not have.
"""

from __future__ import annotations

from loom.core.block_pool import BlockPool, KVBlock
from loom.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...],
                      extra_keys: tuple | None = None) -> int:
    return hash((parent_hash, token_ids, extra_keys))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be positive or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_blocks, enable_caching)
        # A request's blocks by position; None where a block left every window (freed).
        self.req_to_blocks: dict[str, list[KVBlock | None]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # How many leading blocks of each request were freed as outside the window.
        self._num_skipped_blocks: dict[str, int] = {}
        self.num_blocks_freed_early = 0  # total over the pool's life, for stats and tests

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of ``request``: its blocks and its token count.

        None for a request that wants prompt logprobs: it computes its whole prompt,
        since a hit would skip the logits those need (as in vLLM)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        # Hits may cover at most num_tokens - 1 tokens: the last one is recomputed.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None,
                       num_lookahead_tokens: int = 0,
                       cache_blocks: bool = True) -> list[KVBlock] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens this step.

        ``new_computed_blocks`` are prefix-cache hits of a request being scheduled
        from waiting. ``num_lookahead_tokens`` more slots are booked but not computed
        (a draft model writes its drafts' K/V there). ``cache_blocks=False``: the new
        blocks' K/V comes from elsewhere later (a KV transfer), so they enter the prefix
        cache only when it has arrived (``cache_blocks``). Returns the newly allocated
        blocks, or None (and changes nothing) when the pool cannot hold them.

            | computed (incl. hits) | new this step | lookahead | ... rest of the last block |
        """
        new_computed_blocks = new_computed_blocks or []
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        if self.sliding_window is not None:
            self._free_blocks_outside_window(request.request_id, blocks,
                                             request.num_computed_tokens)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
        num_to_allocate = num_required - len(blocks) - len(new_computed_blocks)
        # Hits sitting idle in the free queue are not free for this allocation.
        num_idle_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_to_allocate + num_idle_hits > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_to_allocate, 0))
        blocks.extend(new_blocks)
        if self.enable_caching and cache_blocks:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        if self.sliding_window is not None and new_computed_blocks:
            # hits wholly behind the window were taken only to be let go
            self._free_blocks_outside_window(request.request_id, blocks, num_computed)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks full of its first ``num_tokens`` tokens."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def take_blocks(self, request: Request) -> list[KVBlock | None]:
        """The request's blocks, which it gives up without freeing them: the caller now
        holds their references (a prefill instance keeps them for a KV transfer). None
        where a block already left the sliding window."""
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_skipped_blocks.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [])

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its prefix stays cached longest."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_skipped_blocks.pop(request.request_id, None)
        self.pool.free_blocks(block for block in reversed(blocks) if block is not None)

    def free_leading_blocks(self, request: Request, num_blocks: int) -> None:
        """Free the request's first ``num_blocks`` blocks now, as if a sliding window had
        passed them (a KV transfer whose prefill side had already freed them: nothing
        will fill them, so they must not enter the prefix cache either)."""
        self._skip_blocks(request.request_id, self.req_to_blocks[request.request_id],
                          num_blocks)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table. A freed block's entry is never sent (the workers
        got its id when it was allocated), but a table has no holes: it reads 0."""
        return [0 if block is None else block.block_id
                for block in self.req_to_blocks.get(request_id, [])]

    def num_blocks_held(self, request_id: str) -> int:
        return sum(block is not None for block in self.req_to_blocks.get(request_id, []))

    def _free_blocks_outside_window(self, request_id: str, blocks: list[KVBlock | None],
                                    num_computed: int) -> None:
        """Return the blocks wholly before the first key any query still to come reads
        (position ``num_computed - W + 1``) to the pool, oldest first, so that with
        caching on they are evicted first."""
        first_needed = num_computed - self.sliding_window + 1
        self._skip_blocks(request_id, blocks, max(first_needed, 0) // self.block_size)

    def _skip_blocks(self, request_id: str, blocks: list[KVBlock | None],
                     num_skipped: int) -> None:
        """Free the request's first ``num_skipped`` blocks, keeping their places as None."""
        num_skipped = min(num_skipped, len(blocks))
        start = self._num_skipped_blocks.get(request_id, 0)
        if num_skipped <= start:
            return
        freed = [block for block in blocks[start:num_skipped] if block is not None]
        blocks[start:num_skipped] = [None] * (num_skipped - start)
        self._num_skipped_blocks[request_id] = num_skipped
        self.pool.free_blocks(freed)
        self.num_blocks_freed_early += len(freed)

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Register every block that will be full of known tokens after this step.

        Safe before the step runs: within one forward each layer writes all new K/V
        before any attention reads, so a later request in the same batch may hit them.
        """
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for i in range(start, num_full):
            if blocks[i] is not None:
                self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else None
            chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            hashes.append(hash_block_tokens(parent, chunk))
