"""KVCacheManager: which blocks each request owns, and the prefix cache over them.

A full block is identified by a chained hash, so equal hashes mean equal prefixes:

    hash_i = hash((hash_{i-1}, tokens of block i, extra_keys))      hash_{-1} = None

where extra_keys name the images whose placeholder tokens the block holds (their
content hashes): two images of one size have the same placeholder tokens, not the same
K/V. A LoRA adapter's name seeds hash_{-1}: its blocks are its own.

A new request looks up its hashes in order and stops at the first miss; those hits
are its computed prefix. The last prompt token is always recomputed, because its
logits are what the first sampled token comes from.

KV cache groups (vLLM's hybrid KV cache). The workers split the model's attention
layers into groups of equally many layers, each group reading either every position
(full attention) or only the last W (a sliding window), and report one window per
group (None: full). A request holds one block list per group, all covering the same
positions; a block of the one pool holds one position range of every layer of the
group that owns it (the workers' layer i of each group shares one cache tensor, so
the pool's blocks are interchangeable between groups). One group of full layers is
the plain case; Mistral with a window is one sliding group; Gemma 3 is one or more
full groups and five times as many sliding ones.

Sliding groups. A query at position p never reads keys before p - W + 1, and every
query still to come sits at ``num_computed_tokens`` or later. So before each
allocation a sliding group's blocks that lie wholly before ``num_computed_tokens -
W + 1`` go back to the pool (cached, if caching is on: they still hold a valid
prefix). Their places in the list stay, as None, so block indices keep meaning token
positions; the workers keep the old ids in their block tables and never read them
(the kernels mask keys outside the window, and a reused block holds another
request's finite values):

    positions   0 ....... 15 16 ...... 31 32 ...... 47 48 .. 53     W = 20, 54 computed
    full group  [   b0    ] [    b1    ]  [    b2     ] [  b3  ]
    window grp  [  None   ] [   None   ]  [    b6     ] [  b7  ]    first needed: 35

A prefix-cache hit of n blocks needs, in each full group, its first n blocks cached,
and in each sliding group only the blocks the first query to come reads (those
covering n * block_size - W + 1 onwards): the hit is the longest n all groups agree
on (vLLM's HybridKVCacheCoordinator over FullAttentionManager and
SlidingWindowManager).

The KV offload tier (core/kv_tier.py) sits under the pool: a cached block the pool
hands out again is saved there under its key, and a lookup that asks for it
(``with_tier``) counts the tier's blocks as hits, as ``TierBlock``s, which
``fetch_from_tier`` brings back into the pool before the request is admitted.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from dataclasses import dataclass
from functools import partial

from loom.core.block_pool import BlockPool, KVBlock
from loom.core.kv_tier import KVTier, TierBlock
from loom.request import Request


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...],
                      extra_keys: tuple | None = None) -> int:
    return hash((parent_hash, token_ids, extra_keys))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None,
                 group_windows: Sequence[int | None] | None = None,
                 tier: KVTier | None = None) -> None:
        """``group_windows``: each KV cache group's window (None: full attention);
        ``sliding_window`` is the one-group shorthand (every layer reads only the last
        W positions; None: every layer reads all). ``tier``: the KV offload tier under
        the pool (prefix caching on), or None."""
        if group_windows is None:
            group_windows = (sliding_window,)
        elif sliding_window is not None:
            raise ValueError("give sliding_window or group_windows, not both")
        if not group_windows:
            raise ValueError("a KV cache needs at least one group")
        for window in group_windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be positive or None, got {window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.group_windows: tuple[int | None, ...] = tuple(group_windows)
        if tier is not None and not enable_caching:
            raise ValueError("the KV offload tier keeps prefix-cache blocks: it needs prefix "
                             "caching on (drop --no-enable-prefix-caching or --kv-offload-size)")
        self.tier = tier
        self.pool = BlockPool(num_blocks, enable_caching,
                              on_evict=tier.save if tier is not None else None)
        # Blocks brought back from the tier this step, with the hits held meanwhile:
        # each fetch's blocks per group (fetch_from_tier, finish_tier_fetches).
        self._fetches: list[_TierFetch] = []
        # A request's blocks per group, by position; None where a block left every
        # window of its group (freed).
        self.req_to_blocks: dict[str, list[list[KVBlock | None]]] = {}
        # How many leading blocks of each request are already registered in the cache.
        self._num_cached_blocks: dict[str, int] = {}
        # How many leading blocks of each request's groups were freed as outside the window.
        self._num_skipped_blocks: dict[str, list[int]] = {}
        self.num_blocks_freed_early = 0  # total over the pool's life, for stats and tests

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def sliding_window(self) -> int | None:
        """The window of a one-group cache (None: full attention, or several groups)."""
        return self.group_windows[0] if self.num_groups == 1 else None

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request, with_tier: bool = False
                            ) -> tuple[list[list[KVBlock | TierBlock | None]], int]:
        """The longest cached prefix of ``request``: each group's blocks for it (None
        where a sliding group needs none) and its token count. ``with_tier``: blocks the
        offload tier holds count too, as ``TierBlock``s (``fetch_from_tier`` brings them
        back into the pool before they can be used).

        None for a request that wants prompt logprobs: it computes its whole prompt,
        since a hit would skip the logits those need (as in vLLM)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [[] for _ in self.group_windows], 0
        self._update_block_hashes(request)
        # Hits may cover at most num_tokens - 1 tokens: the last one is recomputed.
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        tier = self.tier if with_tier else None
        cached = [[self._lookup(_cache_key(h, group), tier) for h in hashes]
                  for group in range(self.num_groups)]
        # Each group's longest hit no longer than the others' agreed one, until all
        # agree (a full group's hits are prefix-closed; a sliding group's are not).
        num_hit, changed = len(hashes), True
        while changed:
            changed = False
            for group, window in enumerate(self.group_windows):
                longest = (_longest_prefix(cached[group], num_hit) if window is None else
                           _longest_window_hit(cached[group], num_hit, partial(
                               self._first_needed_block, window)))
                if longest < num_hit:
                    num_hit, changed = longest, True
        hits = []
        for group, window in enumerate(self.group_windows):
            first = 0 if window is None else self._first_needed_block(window, num_hit)
            hits.append([None] * first + cached[group][first:num_hit])
        return hits, num_hit * self.block_size

    def _lookup(self, key: Hashable, tier: KVTier | None) -> KVBlock | TierBlock | None:
        block = self.pool.get_cached_block(key)
        if block is None and tier is not None and key in tier:
            return TierBlock(key)
        return block

    def fetch_from_tier(self, hits: list[list[KVBlock | TierBlock | None]]) -> bool:
        """Bring the ``TierBlock``s among a lookup's ``hits`` into the pool: a fresh block
        each, which every rank fills from the tier before this step (``KVTier``); the
        other hits are held meanwhile, so that taking the fresh blocks cannot evict them.
        After the step (``finish_tier_fetches``) all of them are let go, cached, and the
        request's next lookup finds them in the pool. True: the request waits for the
        step (its loads are booked, or an earlier request's load of the same blocks is);
        False: the pool has no room for them now, and nothing was done."""
        wanted = [(group, block) for group, blocks in enumerate(hits) for block in blocks
                  if isinstance(block, TierBlock)]
        if any(self.tier.is_loading(block.key) for _, block in wanted):
            return True
        held = [block for blocks in hits for block in blocks if isinstance(block, KVBlock)]
        num_idle = sum(1 for block in held if block.ref_cnt == 0)
        if len(wanted) + num_idle > self.pool.num_free_blocks:
            return False
        # Pinned before any block is taken: the evictions that taking causes are saved
        # to the tier, and must not land on the slots read here.
        self.tier.pin(block.key for _, block in wanted)
        self.pool.touch(held)
        fresh = iter(self.pool.get_new_blocks(len(wanted)))
        fetch = _TierFetch(groups=[[] for _ in hits], loads=[])
        for group, blocks in enumerate(hits):
            for block in blocks:
                if isinstance(block, TierBlock):
                    new = next(fresh)
                    fetch.loads.append((self.tier.add_load(new.block_id, block.key), new,
                                        block.key))
                    block = new
                if block is not None:
                    fetch.groups[group].append(block)
        self._fetches.append(fetch)
        return True

    def finish_tier_fetches(self, failed: Collection[int] = ()) -> None:
        """After the step that ran this step's loads: each loaded block enters the prefix
        cache, unless a rank refused its record (``failed``: indices of the step's loads),
        whose key then leaves the tier; every block of the fetch is let go, tail first."""
        for fetch in self._fetches:
            for index, block, key in fetch.loads:
                if index in failed:
                    self.tier.forget(key)
                else:
                    self.pool.cache_block(block, key)
            for group in sorted(range(len(fetch.groups)),
                                key=lambda g: self.group_windows[g] is None):
                self.pool.free_blocks(reversed(fetch.groups[group]))
        self._fetches.clear()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the offload tier's too; False (nothing done) while
        a request holds blocks."""
        if not self.pool.reset_prefix_cache():
            return False
        if self.tier is not None:
            self.tier.clear()
        return True

    def forget_unwritten_blocks(self, request: Request) -> None:
        """The step that was to fill the request's blocks past ``num_computed_tokens``
        no longer runs it (it was scheduled, then preempted in the same step): they were
        registered in the prefix cache when allocated, before their K/V exists, so they
        leave it."""
        start = request.num_computed_tokens // self.block_size
        for blocks in self.req_to_blocks.get(request.request_id, []):
            for block in blocks[start:]:
                if block is not None and block.block_hash is not None:
                    self.pool.uncache(block)
        if request.request_id in self._num_cached_blocks:
            self._num_cached_blocks[request.request_id] = min(
                self._num_cached_blocks[request.request_id], start)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[list[KVBlock | None]] | None = None,
                       num_lookahead_tokens: int = 0, cache_blocks: bool = True,
                       num_absent_blocks: int = 0) -> list[KVBlock] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens this step.

        ``new_computed_blocks`` are prefix-cache hits of a request being scheduled
        from waiting, per group. ``num_lookahead_tokens`` more slots are booked but not
        computed (a draft model writes its drafts' K/V there). ``cache_blocks=False``: the
        new blocks' K/V comes from elsewhere later (a KV transfer), so they enter the
        prefix cache only when it has arrived (``cache_blocks``); its first
        ``num_absent_blocks`` blocks never will (a sliding window left them behind on
        the sending side), so they are neither allocated nor counted, only placed as
        None. Returns the newly allocated blocks, or None (and changes nothing) when
        the pool cannot hold them.

            | computed (incl. hits) | new this step | lookahead | ... rest of the last block |
        """
        hits = new_computed_blocks or [[] for _ in self.group_windows]
        num_hit_blocks = len(hits[0])
        request_id = request.request_id
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            groups = [[] for _ in self.group_windows]
        for group, window in enumerate(self.group_windows):
            if window is not None:
                self._free_blocks_outside_window(request_id, group, groups[group],
                                                 request.num_computed_tokens, window)
        num_computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens + num_lookahead_tokens)
        num_absent = max(0, min(num_absent_blocks, num_required)
                         - len(groups[0]) - num_hit_blocks)
        num_to_allocate = max(num_required - len(groups[0]) - num_hit_blocks - num_absent, 0)
        # Hits sitting idle in the free queue are not free for this allocation.
        num_idle_hits = sum(1 for group_hits in hits for block in group_hits
                            if block is not None and block.ref_cnt == 0)
        if num_to_allocate * self.num_groups + num_idle_hits > self.pool.num_free_blocks:
            return None
        self.req_to_blocks[request_id] = groups
        # Every group's hits leave the free queue before any group takes new blocks from
        # it: one group's idle hit handed out as another's new block would be one block
        # in two groups' tables (layer i of every group shares slot i: one group's K/V
        # written over the other's).
        for group_hits in hits:
            self.pool.touch(block for block in group_hits if block is not None)
        new_blocks = []
        for group, blocks in enumerate(groups):
            blocks.extend(hits[group])
            blocks.extend([None] * num_absent)
            allocated = self.pool.get_new_blocks(num_to_allocate)
            blocks.extend(allocated)
            new_blocks += allocated
        if num_absent:
            for group, blocks in enumerate(groups):
                self._skip_blocks(request_id, group, blocks, num_hit_blocks + num_absent)
        if self.enable_caching and cache_blocks:
            self._cache_full_blocks(request, groups, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks full of its first ``num_tokens`` tokens."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks[request.request_id], num_tokens)

    def take_blocks(self, request: Request) -> list[KVBlock | None]:
        """The request's blocks (one group's: a KV transfer takes one-group caches only),
        which it gives up without freeing them: the caller now holds their references
        (a prefill instance keeps them for a KV transfer). None where a block already
        left the sliding window."""
        assert self.num_groups == 1, "a KV transfer moves one-group caches only"
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_skipped_blocks.pop(request.request_id, None)
        return self.req_to_blocks.pop(request.request_id, [[]])[0]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first so its prefix stays cached longest;
        the sliding groups' before the full ones', which a later hit needs whole (the
        free queue evicts what was freed first)."""
        groups = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_skipped_blocks.pop(request.request_id, None)
        order = sorted(range(len(groups)), key=lambda g: self.group_windows[g] is None)
        for group in order:
            self.pool.free_blocks(block for block in reversed(groups[group])
                                  if block is not None)

    def get_block_ids(self, request_id: str, group: int = 0, start: int = 0) -> list[int]:
        """The request's block table in ``group``, from block ``start`` on. A freed
        block's entry is never sent (the workers got its id when it was allocated), but a
        table has no holes: it reads 0."""
        groups = self.req_to_blocks.get(request_id)
        if groups is None:
            return []
        return [0 if block is None else block.block_id for block in groups[group][start:]]

    def num_blocks(self, request_id: str) -> int:
        """The length of the request's block tables (held blocks and freed places)."""
        groups = self.req_to_blocks.get(request_id)
        return len(groups[0]) if groups else 0

    def num_blocks_held(self, request_id: str) -> int:
        return sum(block is not None for blocks in self.req_to_blocks.get(request_id, [])
                   for block in blocks)

    def _first_needed_block(self, window: int, num_blocks: int) -> int:
        """The first block a query at position ``num_blocks * block_size`` reads."""
        return max(num_blocks * self.block_size - window + 1, 0) // self.block_size

    def _free_blocks_outside_window(self, request_id: str, group: int,
                                    blocks: list[KVBlock | None], num_computed: int,
                                    window: int) -> None:
        """Return ``group``'s blocks wholly before the first key any query still to
        come reads (position ``num_computed - W + 1``) to the pool, oldest first, so
        that with caching on they are evicted first."""
        first_needed = max(num_computed - window + 1, 0) // self.block_size
        self._skip_blocks(request_id, group, blocks, first_needed)

    def _skip_blocks(self, request_id: str, group: int, blocks: list[KVBlock | None],
                     num_skipped: int) -> None:
        """Free the first ``num_skipped`` of ``group``'s ``blocks``, keeping their
        places as None."""
        num_skipped = min(num_skipped, len(blocks))
        skipped = self._num_skipped_blocks.get(request_id)
        start = skipped[group] if skipped is not None else 0
        if num_skipped <= start:
            return
        if skipped is None:
            skipped = self._num_skipped_blocks[request_id] = [0] * self.num_groups
        freed = [block for block in blocks[start:num_skipped] if block is not None]
        blocks[start:num_skipped] = [None] * (num_skipped - start)
        skipped[group] = num_skipped
        self.pool.free_blocks(freed)
        self.num_blocks_freed_early += len(freed)

    def _cache_full_blocks(self, request: Request, groups: list[list[KVBlock | None]],
                           num_tokens: int) -> None:
        """Register every block that will be full of known tokens after this step.

        Safe before the step runs: within one forward each layer writes all new K/V
        before any attention reads, so a later request in the same batch may hit them.
        """
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        for group, blocks in enumerate(groups):
            for i in range(start, num_full):
                if blocks[i] is not None:
                    self.pool.cache_block(blocks[i], _cache_key(request.block_hashes[i], group))
        self._num_cached_blocks[request.request_id] = num_full

    def _update_block_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        num_full = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else _chain_seed(request)
            start, end = i * self.block_size, (i + 1) * self.block_size
            images = tuple(feature.identifier for feature in request.mm_features
                           if feature.overlaps(start, end)) or None
            hashes.append(hash_block_tokens(parent, tuple(tokens[start:end]), images))


@dataclass
class _TierFetch:
    groups: list[list[KVBlock]]  # per group, in block order: hits held and blocks loaded
    loads: list[tuple[int, KVBlock, Hashable]]  # (index in the step's loads, block, key)


def _chain_seed(request: Request) -> int | None:
    params = request.sampling_params
    return None if params.lora_name is None else hash(("lora", params.lora_name,
                                                        params.lora_id))


def _cache_key(block_hash: int, group: int) -> Hashable:
    """A block's key in the pool's cache: group 0's is its hash, another group's the
    pair (its blocks hold other layers' K/V for the same tokens)."""
    return block_hash if group == 0 else (block_hash, group)


def _longest_prefix(cached: list[KVBlock | None], limit: int) -> int:
    """How many of the first ``limit`` blocks are cached, counting from the start."""
    for i in range(limit):
        if cached[i] is None:
            return i
    return limit


def _longest_window_hit(cached: list[KVBlock | None], limit: int, first_needed) -> int:
    """The largest n <= ``limit`` whose blocks ``first_needed(n) .. n - 1`` are all
    cached (0 always qualifies: nothing is read)."""
    # run[i]: how many cached blocks end at block i, counting back from it
    run, count = [], 0
    for block in cached[:limit]:
        count = count + 1 if block is not None else 0
        run.append(count)
    for n in range(limit, 0, -1):
        if run[n - 1] >= n - first_needed(n):
            return n
    return 0
