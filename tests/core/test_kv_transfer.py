"""The scheduler's half of prefill/decode disaggregation (loom/core/kv_transfer.py),
driven by a fake runner and hand-made rank reports; every test ends with the empty
check on both sides: no request, no held block, no load, every block free."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, KVTransferConfig, SchedulerConfig
from loom.core.scheduler import Scheduler
from loom.core.wire import KVTransferEvent
from loom.request import Request, RequestStatus
from loom.sampling_params import SamplingParams

BLOCK = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler(role: str, tp_size: int = 1, num_blocks: int = 32, budget: int = 64,
                   sliding_window: int | None = None, **kv) -> Scheduler:
    config = KVTransferConfig.from_args(role, kv or None)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                          max_model_len=256),
                          CacheConfig(block_size=BLOCK), num_blocks=num_blocks,
                          kv_cache_groups=(sliding_window,), kv_transfer_config=config,
                          tp_size=tp_size)
    scheduler.kv_transfer.rank_addresses = [f"127.0.0.1:{9000 + r}" for r in range(tp_size)]
    return scheduler


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def step(scheduler: Scheduler, runner: FakeRunner):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.execute(out, scheduler))


def prefill(scheduler: Scheduler, req_id: str, tokens: list[int], max_tokens: int = 6,
            **params):
    """Run one request on a prefill scheduler to its end; its last output."""
    scheduler.add_request(Request(req_id, tokens, SamplingParams(
        max_tokens=max_tokens, kv_transfer_params={"do_remote_decode": True}, **params)))
    runner, metadata, last = FakeRunner(), [], None
    while scheduler.has_unfinished_requests():
        out, outputs = step(scheduler, runner)
        metadata.append(out.kv_connector_metadata)
        last = outputs[-1] if outputs else last
    return last, metadata


def report(scheduler: Scheduler, transfer_id: str, kind: str, ranks=(0,), error=None):
    return scheduler.process_kv_events(
        [KVTransferEvent(rank, transfer_id, kind, error) for rank in ranks])


def test_prefill_holds_blocks_until_every_rank_has_sent():
    scheduler = make_scheduler("prefill", tp_size=2, budget=8)
    last, metadata = prefill(scheduler, "a", prompt(18))  # three chunks of 8
    assert last.new_token_ids == [1018] and last.finish_reason == "length"  # max_tokens 1 here
    params = last.kv_transfer_params
    assert params["remote_num_tokens"] == 18 and params["prompt_logprobs"] is None
    assert len(params["remote_block_ids"]) == 5  # ceil(18 / 4)
    assert params["remote_addresses"] == ["127.0.0.1:9000", "127.0.0.1:9001"]
    # The hold reached the ranks with the step of the last chunk, not before.
    assert [m is not None and bool(m.holds) for m in metadata] == [False, False, True]
    assert metadata[-1].holds[0].block_ids == params["remote_block_ids"]
    assert not scheduler.requests and scheduler.kv_transfer.num_held_blocks == 5
    report(scheduler, params["transfer_id"], "send_done", ranks=(0,))
    assert scheduler.kv_transfer.num_held_blocks == 5  # rank 1 still sending
    report(scheduler, params["transfer_id"], "send_done", ranks=(1,))
    assert scheduler.kv_transfer.num_held_blocks == 0
    # The ranks stop serving it before the next step runs.
    assert scheduler.schedule().kv_connector_metadata.releases == [params["transfer_id"]]
    assert_empty(scheduler)


def test_prefill_frees_held_blocks_after_the_timeout():
    """A decode instance that died never pulls: the blocks come back after the deadline."""
    scheduler = make_scheduler("prefill", kv_hold_timeout_s=5.0)
    clock = scheduler.kv_transfer.clock = Clock()
    last, _ = prefill(scheduler, "a", prompt(9))
    report(scheduler, last.kv_transfer_params["transfer_id"], "send_failed", ranks=())
    clock.now = 4.9
    scheduler.process_kv_events([])
    assert scheduler.kv_transfer.num_held_blocks == 3
    clock.now = 5.0
    scheduler.process_kv_events([])
    # A late report changes nothing.
    report(scheduler, last.kv_transfer_params["transfer_id"], "send_done")
    assert scheduler.schedule().kv_connector_metadata.releases == [
        last.kv_transfer_params["transfer_id"]]
    assert_empty(scheduler)


def test_prefill_abort_after_the_last_chunk_releases_its_hold():
    scheduler = make_scheduler("prefill")
    scheduler.add_request(Request("a", prompt(6), SamplingParams(
        max_tokens=4, kv_transfer_params={"do_remote_decode": True})))
    out = scheduler.schedule()
    transfer_id = out.kv_connector_metadata.holds[0].transfer_id
    runner_output = FakeRunner().execute(out, scheduler)
    scheduler.abort_requests("a")  # while the step runs
    scheduler.update_from_output(out, runner_output)
    assert scheduler.schedule().kv_connector_metadata.releases == [transfer_id]
    assert_empty(scheduler)


def remote_params(tokens: list[int], tp_size: int = 1, **changes) -> dict:
    num_blocks = -(-len(tokens) // BLOCK)
    params = {"do_remote_prefill": True, "transfer_id": "t-" + str(len(tokens)),
              "remote_engine_id": "p", "remote_addresses": ["10.0.0.1:1"] * tp_size,
              "remote_block_ids": list(range(100, 100 + num_blocks)),
              "remote_num_tokens": len(tokens), "remote_tp_size": tp_size,
              "remote_block_size": BLOCK}
    return {**params, **changes}


def decode_request(req_id: str, tokens: list[int], max_tokens: int = 4, index: int = 0,
                   params: dict | None = None, **changes) -> Request:
    return Request(req_id, tokens, SamplingParams(
        max_tokens=max_tokens, **(params or {}),
        kv_transfer_params=remote_params(tokens, **changes)), index=index)


def test_decode_pulls_then_computes_the_last_prompt_token():
    """The prompt's K/V arrives; the last prompt position runs here and its logits give
    the first token, as on a mixed instance (the prefill instance's is not used)."""
    scheduler = make_scheduler("decode", tp_size=2)
    runner = FakeRunner()
    scheduler.add_request(decode_request("a", prompt(10), max_tokens=4, tp_size=2))
    out, outputs = step(scheduler, runner)
    assert out.num_scheduled_tokens == {} and outputs == []
    (load,) = out.kv_connector_metadata.loads
    assert load.remote_block_ids == [100, 101, 102]
    assert load.local_block_ids == scheduler.kv_cache.get_block_ids("a")
    assert scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler.only_loading
    assert report(scheduler, load.transfer_id, "recv_done", ranks=(0,)) == []
    assert report(scheduler, load.transfer_id, "recv_done", ranks=(1,)) == []
    out, outputs = step(scheduler, runner)
    # Sent as new with all but its last prompt token computed: that one runs.
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 9 and new.output_token_ids == []
    assert out.num_scheduled_tokens == {"a": 1} and not out.kv_connector_metadata
    assert outputs[0].new_token_ids == [1010]
    outputs = [o for _ in range(3) for o in step(scheduler, runner)[1]]
    assert [o.new_token_ids for o in outputs] == [[1011], [1012], [1013]]
    assert outputs[-1].finished
    assert_empty(scheduler)


def test_decode_registers_pulled_blocks_and_pulls_only_what_it_lacks():
    """The pulled prompt enters this instance's prefix cache; a second request with the
    same first blocks pulls only the rest."""
    scheduler = make_scheduler("decode")
    runner = FakeRunner()
    shared = prompt(8)
    scheduler.add_request(decode_request("a", shared + prompt(3, 50), max_tokens=1))
    out, _ = step(scheduler, runner)
    report(scheduler, out.kv_connector_metadata.loads[0].transfer_id, "recv_done")
    assert step(scheduler, runner)[1][0].finished  # max_tokens 1
    scheduler.add_request(decode_request("b", shared + prompt(5, 70), max_tokens=2))
    out, _ = step(scheduler, runner)
    (load,) = out.kv_connector_metadata.loads
    assert load.remote_block_ids == [102, 103]  # blocks 0 and 1 were cache hits
    assert scheduler.requests["b"].num_cached_tokens == 8
    report(scheduler, load.transfer_id, "recv_done")
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_empty(scheduler)


def test_decode_fails_only_the_request_whose_transfer_failed():
    scheduler = make_scheduler("decode", tp_size=2)
    runner = FakeRunner()
    scheduler.add_request(decode_request("a", prompt(9), tp_size=2))
    scheduler.add_request(decode_request("b", prompt(7), max_tokens=2, tp_size=2))
    out, _ = step(scheduler, runner)
    loads = {load.transfer_id: load for load in out.kv_connector_metadata.loads}
    # Rank 0 of "a" failed; until rank 1 reports, it may still write the blocks.
    assert report(scheduler, "t-9", "recv_failed", ranks=(0,), error="peer closed") == []
    assert scheduler.kv_cache.get_block_ids("a")
    (failed,) = report(scheduler, "t-9", "recv_done", ranks=(1,))
    assert failed.finish_reason == "error" and "rank 0: peer closed" in failed.stop_reason
    assert "a" not in scheduler.requests and not scheduler.kv_cache.get_block_ids("a")
    report(scheduler, "t-7", "recv_done", ranks=(0, 1))
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert set(loads) == {"t-9", "t-7"}
    assert_empty(scheduler)


def test_decode_abort_while_loading_frees_once_every_rank_reported():
    scheduler = make_scheduler("decode", tp_size=2)
    scheduler.add_request(decode_request("a", prompt(9), tp_size=2))
    step(scheduler, FakeRunner())
    scheduler.abort_requests("a")
    assert scheduler.kv_cache.get_block_ids("a")  # rank threads may still write them
    assert report(scheduler, "t-9", "recv_done", ranks=(0, 1)) == []
    assert_empty(scheduler)


def test_decode_waits_for_blocks_like_any_request():
    """A load that does not fit waits at the head of the queue, as any request would."""
    scheduler = make_scheduler("decode", num_blocks=4)
    scheduler.add_request(decode_request("a", prompt(13)))  # 4 blocks
    scheduler.add_request(decode_request("b", prompt(3)))
    out = scheduler.schedule()
    assert [load.transfer_id for load in out.kv_connector_metadata.loads] == ["t-13"]
    assert scheduler.schedule().kv_connector_metadata is None  # b does not fit yet
    report(scheduler, "t-13", "recv_done")
    runner = FakeRunner()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out, scheduler))
        if out.kv_connector_metadata and out.kv_connector_metadata.loads:
            report(scheduler, "t-3", "recv_done")
    assert_empty(scheduler)


def test_decode_samples_of_one_request_share_one_pull():
    """n = 2: sample 0 pulls the prompt; sample 1 waits for it, then takes its full
    blocks from the prefix cache and computes the rest, as on a mixed instance."""
    scheduler = make_scheduler("decode")
    runner = FakeRunner()
    tokens = prompt(10)
    for index in range(2):
        scheduler.add_request(decode_request(f"{index}_x", tokens, max_tokens=2, index=index))
    out, _ = step(scheduler, runner)
    assert [load.transfer_id for load in out.kv_connector_metadata.loads] == ["t-10"]
    assert scheduler.only_loading and "1_x" not in scheduler.kv_cache.req_to_blocks
    assert not scheduler.schedule().num_scheduled_tokens  # still waiting for it
    report(scheduler, "t-10", "recv_done")
    out, outputs = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"0_x": 1, "1_x": 2}  # 8 of 10 from the cache
    assert scheduler.requests["1_x"].num_cached_tokens == 8
    assert [o.new_token_ids for o in outputs] == [[1010], [1010]]
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_empty(scheduler)


def test_decode_failed_pull_fails_the_samples_waiting_for_it():
    scheduler = make_scheduler("decode")
    for index in range(3):
        scheduler.add_request(decode_request(f"{index}_x", prompt(6), index=index))
    scheduler.add_request(decode_request("other", prompt(5)))
    step(scheduler, FakeRunner())
    failed = report(scheduler, "t-6", "recv_failed", error="peer closed")
    assert sorted(o.req_id for o in failed) == ["0_x", "1_x", "2_x"]
    assert all(o.finish_reason == "error" and "peer closed" in o.stop_reason for o in failed)
    report(scheduler, "t-5", "recv_done")
    runner = FakeRunner()
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    assert_empty(scheduler)


def test_prompt_logprobs_travel_with_the_blocks():
    """Computed on the prefill side chunk by chunk, reported by the decode side once,
    its workers computing none of them."""
    source = make_scheduler("prefill", budget=4)
    last, _ = prefill(source, "a", prompt(10), prompt_logprobs=0)
    shipped = last.kv_transfer_params["prompt_logprobs"]
    assert shipped == [[[t] for t in prompt(10)[1:]], [[-float(t)] for t in range(1, 10)],
                       [1] * 9]  # SampleLogprobs, array-like
    report(source, last.kv_transfer_params["transfer_id"], "send_done")
    assert_empty(source)
    scheduler = make_scheduler("decode")
    runner = FakeRunner()
    params = {**last.kv_transfer_params, "transfer_id": "t-10"}
    scheduler.add_request(decode_request("a", prompt(10), max_tokens=2,
                                         params={"prompt_logprobs": 0}, **params))
    step(scheduler, runner)
    (output,) = report(scheduler, "t-10", "recv_done")
    assert output.new_token_ids == [] and output.prompt_logprobs.logprobs[-1] == [-9.0]
    outputs = step(scheduler, runner)[1] + step(scheduler, runner)[1]
    assert [o.prompt_logprobs for o in outputs] == [None, None]
    assert_empty(scheduler)
    with pytest.raises(ValueError, match="prefill instance computed none"):
        scheduler.add_request(decode_request("b", prompt(10), params={"prompt_logprobs": 1}))
    with pytest.raises(ValueError, match="send n = 1 with do_remote_decode"):
        source.add_request(Request("c", prompt(5), SamplingParams(
            n=2, kv_transfer_params={"do_remote_decode": True})))


def test_sliding_window_blocks_freed_on_the_prefill_side_are_neither_pulled_nor_cached():
    """Window 8, blocks of 4, chunks of 8: by the last chunk of a 20-token prompt the
    prefill side freed the blocks no query reads any more (-1 in its answer). The
    decode side allocates none there (a pool of the 3 pulled blocks is enough), pulls
    the rest, and never puts the blocks it did not fill in its prefix cache."""
    source = make_scheduler("prefill", budget=8, sliding_window=8)
    last, metadata = prefill(source, "a", prompt(20))
    params = last.kv_transfer_params
    assert params["remote_block_ids"][:2] == [-1, -1] and min(params["remote_block_ids"][2:]) >= 0
    assert metadata[-1].holds[0].block_ids == params["remote_block_ids"][2:]
    assert source.kv_transfer.num_held_blocks == 3
    report(source, params["transfer_id"], "send_done")
    assert_empty(source)
    scheduler = make_scheduler("decode", sliding_window=8, num_blocks=3)
    runner = FakeRunner()
    scheduler.add_request(decode_request("a", prompt(20), max_tokens=2,
                                         **{**params, "transfer_id": "t-20"}))
    out, _ = step(scheduler, runner)
    (load,) = out.kv_connector_metadata.loads
    assert load.remote_block_ids == params["remote_block_ids"][2:]
    assert scheduler.kv_cache.num_blocks_held("a") == 3
    report(scheduler, "t-20", "recv_done")
    while scheduler.has_unfinished_requests():
        step(scheduler, runner)
    # The pulled blocks are cached; the first two are not: a prompt sharing the first
    # eight tokens only hits nothing, and computes them here.
    scheduler.add_request(Request("b", prompt(8) + [7, 7, 7], SamplingParams(max_tokens=1)))
    step(scheduler, runner)
    assert_empty(scheduler)
    assert scheduler.prefix_cache_hits == 0


@pytest.mark.parametrize("change, message", [
    ({"remote_tp_size": 2}, "tensor_parallel_size 2 but this decode instance has 1"),
    ({"remote_block_size": 16}, "block_size 16"),
    ({"remote_num_tokens": 5}, "computed 5 prompt tokens"),
    ({"remote_block_ids": [1]}, "has 1 block ids for 9 tokens"),
])
def test_decode_refuses_params_it_cannot_serve(change, message):
    scheduler = make_scheduler("decode")
    with pytest.raises(ValueError, match=message):
        scheduler.add_request(decode_request("a", prompt(9), **change))
    assert_empty(scheduler)


def test_roles_refuse_the_other_side_and_plain_instances_refuse_both():
    with pytest.raises(ValueError, match="do_remote_prefill but this is a prefill instance"):
        make_scheduler("prefill").add_request(decode_request("a", prompt(9)))
    with pytest.raises(ValueError, match="do_remote_decode but this is a decode instance"):
        make_scheduler("decode").add_request(Request("a", prompt(5), SamplingParams(
            kv_transfer_params={"do_remote_decode": True})))
    plain = Scheduler(SchedulerConfig(), CacheConfig(), num_blocks=8)
    with pytest.raises(ValueError, match="--splitwise-role"):
        plain.add_request(decode_request("a", prompt(9)))


def test_kv_transfer_config_forms():
    assert KVTransferConfig.from_args(None, None) is None
    assert KVTransferConfig.from_args("mixed", None) is None
    assert KVTransferConfig.from_args("prefill", None).kv_role == "kv_producer"
    config = KVTransferConfig.from_args(None, '{"kv_connector": "NixlConnector", '
                                              '"kv_role": "kv_consumer"}')
    assert config.splitwise_role == "decode" and config.is_consumer and not config.is_producer
    assert KVTransferConfig.from_args("decode", {"kv_transport": "shm"}).kv_transport == "shm"
    with pytest.raises(ValueError, match="contradicts kv_role"):
        KVTransferConfig.from_args("prefill", {"kv_role": "kv_consumer"})
    with pytest.raises(ValueError, match="kv_role must be one of"):
        KVTransferConfig.from_args(None, {"kv_role": "producer"})
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig.from_args(None, {"kv_rol": "kv_producer"})


def test_a_hybrid_kv_cache_is_refused():
    """A KV transfer moves one block table per request; a hybrid cache has one per
    group (the workers keep Gemma 3 in one group when a transfer is configured)."""
    with pytest.raises(ValueError, match="moves a KV cache of one group, but this "
                                         "model's has 3"):
        Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                  max_model_len=256),
                  CacheConfig(block_size=BLOCK), num_blocks=32,
                  kv_transfer_config=KVTransferConfig.from_args("decode", None),
                  kv_cache_groups=(None, 8, 8))
