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
                   **kv) -> Scheduler:
    config = KVTransferConfig.from_args(role, kv or None)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                          max_model_len=256),
                          CacheConfig(block_size=BLOCK), num_blocks=num_blocks,
                          kv_transfer_config=config, tp_size=tp_size)
    scheduler.kv_transfer.rank_addresses = [f"127.0.0.1:{9000 + r}" for r in range(tp_size)]
    return scheduler


def prompt(n: int, start: int = 10) -> list[int]:
    return list(range(start, start + n))


def step(scheduler: Scheduler, runner: FakeRunner):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.execute(out, scheduler))


def prefill(scheduler: Scheduler, req_id: str, tokens: list[int], max_tokens: int = 6):
    """Run one request on a prefill scheduler to its end; its last output."""
    scheduler.add_request(Request(req_id, tokens, SamplingParams(
        max_tokens=max_tokens, kv_transfer_params={"do_remote_decode": True})))
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
    assert params["remote_num_tokens"] == 18 and params["first_token_id"] == 1018
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


def remote_params(tokens: list[int], first_token: int, tp_size: int = 1, **changes) -> dict:
    num_blocks = -(-len(tokens) // BLOCK)
    params = {"do_remote_prefill": True, "transfer_id": "t-" + str(len(tokens)),
              "remote_engine_id": "p", "remote_addresses": ["10.0.0.1:1"] * tp_size,
              "remote_block_ids": list(range(100, 100 + num_blocks)),
              "remote_num_tokens": len(tokens), "remote_tp_size": tp_size,
              "remote_block_size": BLOCK, "first_token_id": first_token}
    return {**params, **changes}


def decode_request(req_id: str, tokens: list[int], max_tokens: int = 4, **changes) -> Request:
    first = 1000 + len(tokens)  # what FakeRunner samples there
    return Request(req_id, tokens, SamplingParams(
        max_tokens=max_tokens, kv_transfer_params=remote_params(tokens, first, **changes)))


def test_decode_pulls_then_continues_from_the_first_token():
    scheduler = make_scheduler("decode", tp_size=2)
    runner = FakeRunner()
    scheduler.add_request(decode_request("a", prompt(10), max_tokens=4, tp_size=2))
    out, outputs = step(scheduler, runner)
    assert out.num_scheduled_tokens == {} and outputs == []
    (load,) = out.kv_connector_metadata.loads
    assert load.remote_block_ids == [100, 101, 102]
    assert load.local_block_ids == scheduler.kv_cache.get_block_ids("a")[:3]
    assert scheduler.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert scheduler.only_loading
    assert report(scheduler, load.transfer_id, "recv_done", ranks=(0,)) == []
    (first,) = report(scheduler, load.transfer_id, "recv_done", ranks=(1,))
    assert first.new_token_ids == [1010] and not first.finished
    out, outputs = step(scheduler, runner)
    # Sent as new with its prompt computed: one token (the first) runs.
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 10 and new.output_token_ids == [1010]
    assert out.num_scheduled_tokens == {"a": 1}
    assert outputs[0].new_token_ids == [1011]
    outputs = [o for _ in range(2) for o in step(scheduler, runner)[1]]
    assert [o.new_token_ids for o in outputs] == [[1012], [1013]] and outputs[-1].finished
    assert_empty(scheduler)


def test_decode_registers_pulled_blocks_and_pulls_only_what_it_lacks():
    """The pulled prompt enters this instance's prefix cache; a second request with the
    same first blocks pulls only the rest."""
    scheduler = make_scheduler("decode")
    runner = FakeRunner()
    shared = prompt(8)
    scheduler.add_request(decode_request("a", shared + prompt(3, 50), max_tokens=1))
    out, _ = step(scheduler, runner)
    (first,) = report(scheduler, out.kv_connector_metadata.loads[0].transfer_id, "recv_done")
    assert first.finished  # max_tokens 1: the prefill instance's token was all
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
    scheduler.add_request(decode_request("a", prompt(12)))  # 13 tokens: 4 blocks
    scheduler.add_request(decode_request("b", prompt(3)))
    out = scheduler.schedule()
    assert [load.transfer_id for load in out.kv_connector_metadata.loads] == ["t-12"]
    assert scheduler.schedule().kv_connector_metadata is None  # b does not fit yet
    report(scheduler, "t-12", "recv_done")
    runner = FakeRunner()
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        scheduler.update_from_output(out, runner.execute(out, scheduler))
        if out.kv_connector_metadata and out.kv_connector_metadata.loads:
            report(scheduler, "t-3", "recv_done")
    assert_empty(scheduler)


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
