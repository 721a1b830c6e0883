"""RoutingPolicy: which replica (or backend) serves a request, by load and prefix affinity.

Used twice with the same rules: inside ``loom serve --data-parallel-size N``
(``loom/dp_async_llm.py``, keys are prompt token ids) and by the standalone
``loom router`` (``loom/router/server.py``, keys are prompt characters, since the
router does not tokenize). Pure Python, no I/O, no clock, no torch.

Affinity. A prompt is cut into chunks of ``chunk_size`` keys (tokens or characters);
chunk i is named by a chained hash ``h_i = hash((h_{i-1}, chunk_i))``, as the engine's
prefix cache names its KV blocks, so ``h_i`` stands for the whole prefix up to chunk
i. Each target remembers the hashes of the prompts it was sent, in LRU order, at most
``capacity_chunks`` of them (roughly what its KV cache can hold): a model of what its
prefix cache still holds, not a copy of it.

    prompt  | c0 | c1 | c2 | c3 | c4 |tail|     tail (< chunk_size) is never hashed
    hashes   h0   h1   h2   h3   h4
    target A knows h0 h1 h2         -> matched 3 chunks
    target B knows h0               -> matched 1 chunk

Choice, in order (SGLang's cache-aware rule):
  1. Balance first: if the loads are out of balance (the busiest has more than
     ``balance_abs_threshold`` in-flight requests over the idlest AND more than
     ``balance_rel_threshold`` times its load), the least loaded target wins.
  2. Affinity (unless ``affinity`` is off: load only): else, if some target matches at least ``min_match_chunks`` chunks and
     that is at least ``min_match_ratio`` of the prompt's chunks, the longest match wins
     (ties: the least loaded).
  3. Load: else the least loaded target (in-flight requests, then in-flight tokens;
     among equals, the next one after the target chosen last: idle targets take turns).

The chosen target learns the prompt's hashes. Load is counted here: ``route`` returns
a ``Ticket`` that the caller gives back with ``release`` when the request ends, however
it ends.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PolicyConfig:
    chunk_size: int = 16  # keys per hashed chunk (a KV block of tokens; more for characters)
    capacity_chunks: int = 65536  # hashes remembered per target (LRU)
    min_match_chunks: int = 1
    # matched chunks / the prompt's chunks: a short shared head (a chat template, a
    # one-line system prompt) on a long prompt is not worth piling requests on one target
    min_match_ratio: float = 0.3
    balance_abs_threshold: int = 8  # in-flight requests
    balance_rel_threshold: float = 1.5
    # False: load only (--routing-policy load), for comparison (benchmarks/router.py)
    affinity: bool = True

    def __post_init__(self) -> None:
        if self.chunk_size < 1 or self.capacity_chunks < 1 or self.min_match_chunks < 1:
            raise ValueError("chunk_size, capacity_chunks and min_match_chunks must be positive")
        if not 0.0 <= self.min_match_ratio <= 1.0:
            raise ValueError(f"min_match_ratio must be in [0, 1], got {self.min_match_ratio}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("balance_abs_threshold must be >= 0 and balance_rel_threshold >= 1")


@dataclass
class TargetLoad:
    requests: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class Ticket:
    """One routed request: give it back to ``RoutingPolicy.release`` when it ends."""

    target: int
    num_tokens: int
    reason: str  # "balance", "affinity" or "load": which rule chose (for logs and tests)
    matched_chunks: int


def chunk_hashes(keys: Sequence, chunk_size: int) -> list[int]:
    """Chained hashes of the full chunks of ``keys`` (token ids or a string).

    # "abcdefg", chunk 3 -> [hash((0, "abc")), hash((h0, "def"))]; "g" is not hashed
    """
    hashes, parent = [], 0
    for start in range(0, len(keys) - chunk_size + 1, chunk_size):
        chunk = keys[start:start + chunk_size]
        parent = hash((parent, chunk if isinstance(chunk, str) else tuple(chunk)))
        hashes.append(parent)
    return hashes


class _PrefixMemory:
    """The chunk hashes one target was sent, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def matched(self, hashes: Sequence[int]) -> int:
        """How many leading chunks this target holds (hashes are chained, so the first
        miss ends the match)."""
        count = 0
        for value in hashes:
            if value not in self._hashes:
                break
            count += 1
        return count

    def learn(self, hashes: Iterable[int]) -> None:
        for value in hashes:
            self._hashes[value] = None
            self._hashes.move_to_end(value)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()


class RoutingPolicy:
    """Chooses among ``num_targets`` targets; targets can be taken out (dead, unhealthy)
    and put back (``set_available``). Not thread-safe: call it from one event loop."""

    def __init__(self, num_targets: int, config: PolicyConfig | None = None) -> None:
        if num_targets < 1:
            raise ValueError(f"need at least one target, got {num_targets}")
        self.config = config or PolicyConfig()
        self.loads = [TargetLoad() for _ in range(num_targets)]
        self._memories = [_PrefixMemory(self.config.capacity_chunks) for _ in range(num_targets)]
        self._available = [True] * num_targets
        self._next = 0  # ties go to the first target from here on (round robin)

    @property
    def num_targets(self) -> int:
        return len(self.loads)

    def is_available(self, target: int) -> bool:
        return self._available[target]

    def set_available(self, target: int, available: bool) -> None:
        """Take a target out of (or back into) the choice. Taking it out forgets what it
        cached: a backend that comes back has restarted with an empty cache."""
        if not available:
            self._memories[target].clear()
        self._available[target] = available

    def route(self, keys: Sequence, num_tokens: int | None = None,
              exclude: Iterable[int] = ()) -> Ticket:
        """Choose a target for a prompt (token ids or text) and count the request on it.

        ``num_tokens`` is the request's weight in tokens (default: ``len(keys)``).
        ``exclude`` leaves targets out for this choice (e.g. one that just refused the
        connection). Raises LookupError if no target is available.
        """
        excluded = set(exclude)
        candidates = [t for t in range(self.num_targets)
                      if self._available[t] and t not in excluded]
        if not candidates:
            raise LookupError("no target is available")
        hashes = chunk_hashes(keys, self.config.chunk_size)
        target, reason, matched = self._choose(candidates, hashes)
        self._next = (target + 1) % self.num_targets
        self._memories[target].learn(hashes)
        weight = len(keys) if num_tokens is None else num_tokens
        self.loads[target].requests += 1
        self.loads[target].tokens += weight
        return Ticket(target, weight, reason, matched)

    def release(self, ticket: Ticket) -> None:
        load = self.loads[ticket.target]
        load.requests -= 1
        load.tokens -= ticket.num_tokens
        if load.requests < 0 or load.tokens < 0:
            raise RuntimeError(f"target {ticket.target} released more than it was given: "
                               "a ticket was released twice")

    def _choose(self, candidates: list[int], hashes: list[int]) -> tuple[int, str, int]:
        def load_key(target: int) -> tuple[int, int, int]:
            load = self.loads[target]
            return load.requests, load.tokens, (target - self._next) % self.num_targets

        idlest = min(candidates, key=load_key)
        busiest = max(self.loads[t].requests for t in candidates)
        least = self.loads[idlest].requests
        cfg = self.config
        if (busiest - least > cfg.balance_abs_threshold
                and busiest > cfg.balance_rel_threshold * least):
            return idlest, "balance", self._memories[idlest].matched(hashes)
        if hashes and cfg.affinity:
            matches = {t: self._memories[t].matched(hashes) for t in candidates}
            best = min(candidates, key=lambda t: (-matches[t], *load_key(t)))
            matched = matches[best]
            if (matched >= cfg.min_match_chunks
                    and matched / len(hashes) >= cfg.min_match_ratio):
                return best, "affinity", matched
        return idlest, "load", self._memories[idlest].matched(hashes)
