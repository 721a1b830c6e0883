"""RoutingPolicy: load, prefix affinity, the balance override, availability."""

from __future__ import annotations

import pytest

from loom.router.policy import PolicyConfig, RoutingPolicy, chunk_hashes


def test_chunk_hashes_are_chained_and_skip_the_tail():
    a = chunk_hashes(list(range(10)), 4)
    assert len(a) == 2  # 8 keys hashed, the tail of 2 not
    b = chunk_hashes(list(range(8)) + [99, 98], 4)
    assert a == b
    # the second chunk's hash names the whole prefix: same chunk after a different one differs
    c = chunk_hashes([7, 7, 7, 7] + list(range(4, 8)), 4)
    assert c[1] != a[1]
    assert chunk_hashes("abcdefg", 3) == chunk_hashes("abcdefX", 3)
    assert chunk_hashes("ab", 3) == []


def test_idle_targets_take_turns_by_load():
    policy = RoutingPolicy(3, PolicyConfig(chunk_size=4))
    tickets = [policy.route([i] * 3) for i in range(6)]  # shorter than a chunk: no affinity
    assert [t.target for t in tickets] == [0, 1, 2, 0, 1, 2]
    assert all(t.reason == "load" for t in tickets)
    assert [load.requests for load in policy.loads] == [2, 2, 2]
    for ticket in tickets:
        policy.release(ticket)
    assert [(load.requests, load.tokens) for load in policy.loads] == [(0, 0)] * 3


def test_tokens_break_ties_between_equal_request_counts():
    policy = RoutingPolicy(2, PolicyConfig(chunk_size=100))
    policy.route([1] * 50)  # target 0, 50 tokens
    policy.route([2] * 10)  # target 1
    policy.route([3] * 10)  # both have one request; target 1 has fewer tokens
    assert [load.tokens for load in policy.loads] == [50, 20]


def test_shared_prefix_goes_where_it_was_sent():
    policy = RoutingPolicy(2, PolicyConfig(chunk_size=4, min_match_ratio=0.5))
    system = list(range(100, 116))  # 4 chunks
    first = policy.route(system + [1, 2, 3, 4])
    other = policy.route(list(range(200, 220)))  # unrelated: the idle target
    assert (first.target, other.target) == (0, 1)
    # target 0 is busier now (2 requests to 1 after this) yet holds the prefix
    again = policy.route(system + [5, 6, 7, 8])
    assert (again.target, again.reason, again.matched_chunks) == (0, "affinity", 4)
    other_again = policy.route(list(range(200, 216)) + [9, 9, 9, 9])
    assert (other_again.target, other_again.reason) == (1, "affinity")


def test_short_shared_head_does_not_pin_requests():
    policy = RoutingPolicy(2, PolicyConfig(chunk_size=4, min_match_ratio=0.5))
    head = [1, 2, 3, 4]
    a = policy.route(head + list(range(10, 30)))
    b = policy.route(head + list(range(40, 60)))  # 1 of 6 chunks matched: below the ratio
    assert (a.target, b.target, b.reason) == (0, 1, "load")


def test_imbalance_overrides_affinity():
    policy = RoutingPolicy(2, PolicyConfig(chunk_size=4, balance_abs_threshold=2,
                                           balance_rel_threshold=1.5))
    prompt = list(range(16))
    routed = [policy.route(prompt) for _ in range(5)]
    # 0 learns the prefix and keeps it until it has 3 more requests than target 1; then
    # target 1 takes one, learns the prefix too, and wins the ties on load
    assert [(t.target, t.reason) for t in routed] == [
        (0, "load"), (0, "affinity"), (0, "affinity"), (1, "balance"), (1, "affinity")]


def test_unavailable_targets_are_skipped_and_forget_their_prefixes():
    policy = RoutingPolicy(2, PolicyConfig(chunk_size=4))
    prompt = list(range(16))
    assert policy.route(prompt).target == 0
    policy.set_available(0, False)
    assert policy.route(prompt).target == 1
    policy.set_available(0, True)
    # target 0 came back with an empty cache; target 1 learned the prefix meanwhile
    ticket = policy.route(prompt)
    assert (ticket.target, ticket.reason) == (1, "affinity")
    assert policy.route(prompt, exclude=[1]).target == 0
    policy.set_available(0, False)
    with pytest.raises(LookupError):
        policy.route(prompt, exclude=[1])


def test_memory_is_bounded_least_recently_used_first():
    policy = RoutingPolicy(1, PolicyConfig(chunk_size=2, capacity_chunks=4))
    policy.route([1, 2, 3, 4])  # 2 chunks
    policy.route([5, 6, 7, 8])  # 2 more: full
    policy.route([1, 2, 9, 9])  # touches [1, 2], adds one: [3, 4] (oldest) goes
    memory = policy._memories[0]
    assert len(memory) == 4
    assert memory.matched(chunk_hashes([1, 2, 3, 4], 2)) == 1
    assert memory.matched(chunk_hashes([5, 6, 7, 8], 2)) == 2


def test_double_release_is_an_error():
    policy = RoutingPolicy(1)
    ticket = policy.route([1, 2, 3])
    policy.release(ticket)
    with pytest.raises(RuntimeError, match="released twice"):
        policy.release(ticket)


@pytest.mark.parametrize("kwargs", [dict(chunk_size=0), dict(min_match_ratio=2.0),
                                    dict(balance_rel_threshold=0.5)])
def test_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        PolicyConfig(**kwargs)


def test_idle_targets_take_turns_even_one_request_at_a_time():
    policy = RoutingPolicy(2, PolicyConfig(chunk_size=4))
    targets = []
    for i in range(4):
        ticket = policy.route([i])
        targets.append(ticket.target)
        policy.release(ticket)
    assert targets == [0, 1, 0, 1]


def test_load_only_policy_ignores_prefixes():
    """--routing-policy load: a shared prefix does not pull requests to one target."""
    shared = list(range(64))
    affinity, load = RoutingPolicy(2, PolicyConfig(chunk_size=16)), RoutingPolicy(
        2, PolicyConfig(chunk_size=16, affinity=False))
    for policy in (affinity, load):
        first = policy.route(shared + [1000])
        policy.release(first)
    # the same prefix again, with its first target now as idle as the other
    again = [affinity.route(shared + [1000 + i]) for i in range(1, 3)]
    assert [t.target for t in again] == [0, 0] and again[0].reason == "affinity"
    spread = [load.route(shared + [1000 + i]) for i in range(1, 3)]
    assert sorted(t.target for t in spread) == [0, 1]
    assert {t.reason for t in spread} == {"load"}
