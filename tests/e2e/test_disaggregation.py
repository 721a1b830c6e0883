"""Prefill/decode disaggregation end to end on real workers (docs/disaggregation.md):
greedy tokens through a prefill instance and a decode instance equal one mixed
instance's, for mixed-length prompts with shared prefixes, over both transports, with
one rank and with two on each side; so do logprobs (the first token's included),
seeded n = 2 samples and prompt logprobs; and a sliding-window model's, with the
blocks the prefill side freed behind the window never pulled nor read. Both instances
run in this process's host (the TP=1 engines in this process, the TP=2 ones with worker
processes); each test ends with both sides empty: no request, no held block, every
block free."""

from __future__ import annotations

import socket
import time

import pytest
import torch
from checkpoints import SLIDING_WINDOW, make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer

from loom.config import KVTransferConfig
from loom.engine_args import make_engine_config
from loom.core.engine_core import EngineCore
from loom.ipc.kv_events import KVEventReceiver
from loom.request import Request
from loom.sampling_params import SamplingParams
from loom.worker.kv_connector import KVConnectorWorker

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
# Mixed lengths (one to four blocks of 16, one of exactly a block) sharing prefixes:
# the third and fourth extend the second, the last repeats the first's first block.
_BASE = [(7 * i) % 200 + 3 for i in range(60)]
PROMPTS = [_BASE[:5], _BASE[:33], _BASE[:33] + [9, 8, 7], _BASE[:50], _BASE[:16],
           _BASE[:16] + [5] * 20]
# What else a client may ask, each compared with the mixed instance: (id, prompt,
# params). "s" is one request with n = 2: its samples 0_s and 1_s, seeds 7 and 8.
EXTRAS = [
    ("lp", PROMPTS[3], GREEDY.clone(logprobs=3, max_tokens=5)),
    ("s", PROMPTS[2], SamplingParams(n=2, temperature=1.0, top_p=0.95, seed=7, logprobs=1,
                                     max_tokens=6, ignore_eos=True)),
    ("pl", PROMPTS[5], GREEDY.clone(prompt_logprobs=2, logprobs=0, max_tokens=3)),
]


def make_core(model: str, role: str, tp: int = 1, transport: str = "tcp",
              **kwargs) -> EngineCore:
    config = make_engine_config(
        model, dtype="float32", max_model_len=256, num_gpu_blocks_override=96,
        tensor_parallel_size=tp, enable_warm_up=False, splitwise_role=role,
        kv_transfer_config={"kv_transport": transport} if role != "mixed" else None, **kwargs)
    return EngineCore.from_config(config)


def samples(req_id: str, prompt: list[int], params: SamplingParams) -> list[Request]:
    """The engine requests of one client request: n of them, as the output side makes."""
    if params.n == 1:
        return [Request(req_id, prompt, params)]
    return [Request(f"{i}_{req_id}", prompt, params, index=i) for i in range(params.n)]


class Results(dict):
    """By engine request id: its tokens, logprobs and prompt logprobs, each a flat list."""

    def add(self, output) -> None:
        entry = self.setdefault(output.req_id, {"tokens": [], "logprobs": [],
                                                "prompt_logprobs": []})
        entry["tokens"] += output.new_token_ids
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(output, name)
            if value is not None:
                entry[name] += list(zip(value.token_ids, value.logprobs, value.ranks))

    def tokens(self) -> dict[str, list[int]]:
        return {req_id: entry["tokens"] for req_id, entry in self.items()}


def run(core: EngineCore, requests: list[Request], timeout: float = 60.0):
    """Step until every request finished; (Results, kv_transfer_params, errors) by id."""
    for request in requests:
        core.add_request(request)
    results, params, errors = Results(), {}, {}
    deadline = time.monotonic() + timeout
    while core.has_unfinished_requests():
        assert time.monotonic() < deadline, f"requests left: {core.scheduler.requests}"
        for output in core.step():
            results.add(output)
            if output.kv_transfer_params is not None:
                params[output.req_id] = output.kv_transfer_params
            if output.finish_reason == "error":
                errors[output.req_id] = output.stop_reason
        if core.scheduler.only_loading:
            time.sleep(0.005)
    return results, params, errors


def disaggregated(prefill: EngineCore, decode: EngineCore, prompts, params=GREEDY,
                  extras=()):
    """Each request through the prefill instance (once, n = 1), then its n samples on
    the decode instance; the decode side's Results and the prefill side's answers."""
    cases = [(f"r{i}", p, params) for i, p in enumerate(prompts)] + list(extras)
    first, handoff, errors = run(prefill, [
        Request(i, p, case.clone(n=1, kv_transfer_params={"do_remote_decode": True}))
        for i, p, case in cases])
    assert not errors and all(len(first[i]["tokens"]) == 1 for i, _, _ in cases)
    results, _, errors = run(decode, [
        request for i, p, case in cases
        for request in samples(i, p, case.clone(kv_transfer_params=handoff[i]))])
    assert not errors
    for i, _, case in cases:  # greedy: the decode side's first token is the prefill's
        assert not case.is_greedy or results[i]["tokens"][0] == first[i]["tokens"][0]
    return results, handoff


def assert_same_results(got: Results, want: Results) -> None:
    """Tokens, logprob token ids and ranks equal; logprob values within float32 noise
    (the decode side computes the last prompt position alone, the mixed one in a batch)."""
    assert got.tokens() == want.tokens()
    for req_id, entry in want.items():
        for name in ("logprobs", "prompt_logprobs"):
            assert len(got[req_id][name]) == len(entry[name]), (req_id, name)
            for (ids, values, rank), (want_ids, want_values, want_rank) in zip(
                    got[req_id][name], entry[name]):
                assert (ids, rank) == (want_ids, want_rank), (req_id, name)
                assert values == pytest.approx(want_values, abs=1e-4), (req_id, name)


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
    """The mixed instance's Results: PROMPTS greedy (r0..r5), then EXTRAS."""
    core = make_core(tiny_llama, "mixed")
    try:
        results, _, _ = run(core, [Request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
        extras, _, _ = run(core, [request for case in EXTRAS for request in samples(*case)])
        assert_empty(core)
    finally:
        core.shutdown()
    assert extras["0_s"]["tokens"] != extras["1_s"]["tokens"]  # two seeds, two samples
    assert len(extras["pl"]["prompt_logprobs"]) == len(PROMPTS[5]) - 1
    return Results(results | extras)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_prefill_then_decode_equals_mixed(tiny_llama, reference, transport):
    """Greedy tokens, then logprobs, seeded n = 2 samples and prompt logprobs."""
    prefill = make_core(tiny_llama, "prefill", transport=transport)
    decode = make_core(tiny_llama, "decode", transport=transport)
    try:
        results, handoff = disaggregated(prefill, decode, PROMPTS, extras=EXTRAS)
        assert_same_results(results, reference)
        # The prefill side shared prefixes: the third prompt's first two blocks are the
        # second's; the decode side pulled them once and hit its own cache after.
        assert handoff["r2"]["remote_block_ids"][:2] == handoff["r1"]["remote_block_ids"][:2]
        assert handoff["pl"]["prompt_logprobs"] is not None  # computed there
        # Again: now every shared prefix is in the decode instance's cache.
        again, _ = disaggregated(prefill, decode, PROMPTS[1:4])
        assert [again.tokens()[f"r{i}"] for i in range(3)] == [
            reference.tokens()[f"r{i}"] for i in range(1, 4)]
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
        results, handoff = disaggregated(prefill, decode, PROMPTS)
        assert results.tokens() == {f"r{i}": reference[f"r{i}"]["tokens"]
                                    for i in range(len(PROMPTS))}
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
            assert run(decode, [])[0]["a"]["tokens"] == reference["r1"]["tokens"]
        assert_empty(prefill)
        assert_empty(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3"])
def test_a_quantized_kv_cache_ships_its_rows_with_their_scales(tiny_llama, cache_dtype):
    """--kv-cache-dtype int8 (or fp8_e4m3) on both sides: a block's bytes are its
    quantized rows, each with its scale after the values, so the decode instance reads
    what the prefill instance wrote: greedy tokens equal a mixed instance's with that
    cache. A decode instance with the other dtype (rows of the same bytes) is refused
    by name."""
    mixed = make_core(tiny_llama, "mixed", kv_cache_dtype=cache_dtype)
    try:
        want, _, _ = run(mixed, [Request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)])
    finally:
        mixed.shutdown()
    prefill = make_core(tiny_llama, "prefill", kv_cache_dtype=cache_dtype)
    decode = make_core(tiny_llama, "decode", kv_cache_dtype=cache_dtype)
    try:
        results, _ = disaggregated(prefill, decode, PROMPTS)
        assert results.tokens() == want.tokens()
        other = make_core(tiny_llama, "decode",
                          kv_cache_dtype="int8" if cache_dtype != "int8" else "fp8_e4m3")
        try:
            _, handoff, _ = run(prefill, [Request("a", PROMPTS[1], GREEDY.clone(
                kv_transfer_params={"do_remote_decode": True}))])
            _, _, errors = run(other, [Request("a", PROMPTS[1], GREEDY.clone(
                kv_transfer_params=handoff["a"]))])
            assert "refused" in errors["a"] and "--kv-cache-dtype" in errors["a"], errors
            assert_empty(other)
        finally:
            other.shutdown()
        # the prefill side still holds the blocks: the right decode instance takes them
        taken, _, errors = run(decode, [Request("a", PROMPTS[1], GREEDY.clone(
            kv_transfer_params=handoff["a"]))])
        assert not errors and taken["a"]["tokens"] == want["r1"]["tokens"]
        assert_empty(prefill)
        assert_empty(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_sliding_window_model(tmp_path_factory):
    """Mistral with a 12-token window, blocks of 4, prompts chunked by 16: the prefill
    side frees the blocks behind the window before the last chunk and answers -1 for
    them; the decode side frees its own there at once and pulls the rest, its cache NaN
    until written (a read of a block it did not fill would show). Tokens equal a mixed
    instance's; after, a local prompt sharing only the first 8 tokens on the decode side
    finds none of the blocks it did not fill in its prefix cache."""
    path = make_tiny_checkpoint("mistral_sliding", tmp_path_factory.mktemp("mistral"))
    make_tiny_tokenizer(path)
    options = dict(block_size=4, max_num_batched_tokens=16)
    prompts = [_BASE[:10], _BASE[:30], _BASE[3:48]]
    local = [Request("local", _BASE[3:11] + [9, 9, 9, 9, 9, 9], GREEDY)]
    mixed = make_core(path, "mixed", **options)
    try:
        want, _, _ = run(mixed, [Request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)])
        want_local, _, _ = run(mixed, local)
        assert_empty(mixed)
    finally:
        mixed.shutdown()
    prefill = make_core(path, "prefill", **options)
    decode = make_core(path, "decode", **options)
    try:
        assert decode.executor.kv_cache_window == SLIDING_WINDOW
        # Every slot NaN until written: a read of anything not pulled or computed here
        # (a freed block, or one that entered the prefix cache unfilled) shows.
        decode.executor.worker.model_runner.kv_cache_storage.fill_(float("nan"))
        results, handoff = disaggregated(prefill, decode, prompts)
        assert results.tokens() == want.tokens()
        # 45 tokens, its last chunk from 32 or later: the 5 blocks before position 21 freed
        assert handoff["r2"]["remote_block_ids"][:5] == [-1] * 5
        assert min(handoff["r2"]["remote_block_ids"][5:]) >= 0
        # the blocks the prefill side had freed are neither pulled nor allocated here
        # (tests/core/test_kv_transfer.py: a decode pool of the pulled blocks is enough)
        got_local, _, _ = run(decode, [Request("local", local[0].prompt_token_ids, GREEDY)])
        assert got_local.tokens() == want_local.tokens()
        assert_empty(prefill)
        assert_empty(decode)
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_data_parallel_replicas_listen_on_ports_of_their_own():
    """A fixed kv_port: rank i of replica r listens on kv_port + r * tp + i; a port
    taken is an error that names kv_port."""
    probe = socket.create_server(("127.0.0.1", 0))
    base = probe.getsockname()[1]
    probe.close()
    config = KVTransferConfig.from_args("prefill", {"kv_port": base})
    storage = torch.zeros(1, 2, 1, 2, 4, 8)  # (layers, 2, heads, blocks, block size, dim)
    receiver = KVEventReceiver("127.0.0.1")
    workers = []
    try:
        for replica in (0, 1):
            for rank in (0, 1):
                workers.append(KVConnectorWorker(config, rank, 2, storage, receiver.address,
                                                 data_parallel_rank=replica))
        assert [int(w.address.rsplit(":", 1)[1]) for w in workers] == [
            base, base + 1, base + 2, base + 3]
        with pytest.raises(RuntimeError, match=r"replica 1\) cannot listen .* kv_port"):
            KVConnectorWorker(config, 0, 2, storage, receiver.address, data_parallel_rank=1)
    finally:
        for worker in workers:
            worker.close()
        receiver.close()
