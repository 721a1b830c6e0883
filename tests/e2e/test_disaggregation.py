"""Prefill/decode disaggregation end to end on real workers (docs/disaggregation.md):
greedy tokens through a prefill instance and a decode instance equal one mixed
instance's, for mixed-length prompts with shared prefixes, over both transports, with
one rank and with two on each side. Both instances run in this process's host (the
TP=1 engines in this process, the TP=2 ones with worker processes); each test ends
with both sides empty: no request, no held block, every block free."""

from __future__ import annotations

import time

import pytest

from loom.config import EngineConfig
from loom.core.engine_core import EngineCore
from loom.request import Request
from loom.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Mixed lengths (one to four blocks of 16, one of exactly a block) sharing prefixes:
# the third and fourth extend the second, the last repeats the first's first block.
_BASE = [(7 * i) % 200 + 3 for i in range(60)]
PROMPTS = [_BASE[:5], _BASE[:33], _BASE[:33] + [9, 8, 7], _BASE[:50], _BASE[:16],
           _BASE[:16] + [5] * 20]


def make_core(model: str, role: str, tp: int = 1, transport: str = "tcp") -> EngineCore:
    config = EngineConfig.from_args(
        model, dtype="float32", max_model_len=256, num_gpu_blocks_override=96,
        tensor_parallel_size=tp, enable_warm_up=False, splitwise_role=role,
        kv_transfer_config={"kv_transport": transport} if role != "mixed" else None)
    return EngineCore.from_config(config)


def run(core: EngineCore, requests: list[Request], timeout: float = 60.0):
    """Step until every request finished; (tokens, kv_transfer_params, errors) by id."""
    for request in requests:
        core.add_request(request)
    tokens, params, errors = {}, {}, {}
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, f"requests left: {core.scheduler.requests}"
        for output in core.step():
            tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
            if output.kv_transfer_params is not None:
                params[output.req_id] = output.kv_transfer_params
            if output.finish_reason == "error":
                errors[output.req_id] = output.stop_reason
        if core.scheduler.only_loading:
            time.sleep(0.005)
    return tokens, params, errors


def disaggregated(prefill: EngineCore, decode: EngineCore, prompts, params=GREEDY):
    ids = [f"r{i}" for i in range(len(prompts))]
    first, handoff, errors = run(prefill, [
        Request(i, p, params.clone(kv_transfer_params={"do_remote_decode": True}))
        for i, p in zip(ids, prompts)])
    assert not errors and all(len(first[i]) == 1 for i in ids)
    tokens, _, errors = run(decode, [Request(i, p, params.clone(kv_transfer_params=handoff[i]))
                                     for i, p in zip(ids, prompts)])
    assert not errors
    assert all(tokens[i][0] == first[i][0] for i in ids)  # continued from the first token
    return tokens, handoff


def assert_empty(core: EngineCore, timeout: float = 10.0) -> None:
    """The empty-state check on a live engine: its last transfer reports may still be on
    the way, so poll them for a while."""
    deadline = time.monotonic() + timeout
    while True:
        core.step()
        stats = core.get_stats()
        if (stats.num_requests, stats.num_blocks_in_use) == (0, 0) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert (stats.num_requests, stats.num_blocks_in_use) == (0, 0)
    assert core.kv_transfer_stats in ({}, {"num_held_blocks": 0, "num_loading": 0})
    pool = core.scheduler.kv_cache.pool
    assert all(block.ref_cnt == 0 for block in pool.blocks)


@pytest.fixture(scope="module")
def reference(tiny_llama):
    core = make_core(tiny_llama, "mixed")
    try:
        tokens, _, _ = run(core, [Request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        assert_empty(core)
    finally:
        core.shutdown()
    return tokens


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_prefill_then_decode_equals_mixed(tiny_llama, reference, transport):
    prefill = make_core(tiny_llama, "prefill", transport=transport)
    decode = make_core(tiny_llama, "decode", transport=transport)
    try:
        tokens, handoff = disaggregated(prefill, decode, PROMPTS)
        assert tokens == reference
        # The prefill side shared prefixes: the third prompt's first two blocks are the
        # second's; the decode side pulled them once and hit its own cache after.
        assert handoff["r2"]["remote_block_ids"][:2] == handoff["r1"]["remote_block_ids"][:2]
        # Again: now every shared prefix is in the decode instance's cache.
        again, _ = disaggregated(prefill, decode, PROMPTS[1:4])
        assert [again[f"r{i}"] for i in range(3)] == [reference[f"r{i}"] for i in range(1, 4)]
        assert decode.get_stats().prefix_cache_hits > 0
        assert_empty(prefill)
        assert_empty(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_prefill_then_decode_with_two_ranks_each(tiny_llama, reference, transport):
    """Rank i of the prefill instance ships to rank i of the decode instance; a decode
    instance with another tensor-parallel size refuses the transfer by name."""
    prefill = make_core(tiny_llama, "prefill", tp=2, transport=transport)
    decode = make_core(tiny_llama, "decode", tp=2, transport=transport)
    try:
        handoff_ranks = prefill.scheduler.kv_transfer.rank_addresses
        assert len(set(handoff_ranks)) == 2
        tokens, handoff = disaggregated(prefill, decode, PROMPTS)
        assert tokens == reference
        assert all(p["remote_addresses"] == handoff_ranks for p in handoff.values())
        if transport == "tcp":
            _, handoff, _ = run(prefill, [Request("a", PROMPTS[1], GREEDY.clone(
                kv_transfer_params={"do_remote_decode": True}))])
            single = make_core(tiny_llama, "decode", tp=1)
            try:
                with pytest.raises(ValueError, match="tensor_parallel_size 2 but this decode "
                                                     "instance has 1"):
                    single.add_request(Request("a", PROMPTS[1], GREEDY.clone(
                        kv_transfer_params=handoff["a"])))
                assert_empty(single)
            finally:
                single.shutdown()
            decode.add_request(Request("a", PROMPTS[1], GREEDY.clone(
                kv_transfer_params=handoff["a"])))
            assert run(decode, [])[0]["a"] == reference["r1"]
        assert_empty(prefill)
        assert_empty(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
