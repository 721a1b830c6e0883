"""A stand-in for the workers: mirrors requests from SchedulerOutput diffs, samples
scripted tokens, and checks the diffs are consistent with the scheduler's own state."""

from __future__ import annotations

from collections.abc import Callable

from loom.core.outputs import ModelRunnerOutput, SchedulerOutput
from loom.core.scheduler import Scheduler


class FakeRunner:
    def __init__(self, next_token: Callable[[str, int], int] | None = None) -> None:
        # next_token(req_id, num_tokens_so_far) -> the token "sampled" next
        self.next_token = next_token or (lambda req_id, n: 1000 + n)
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}

    def execute(self, out: SchedulerOutput, scheduler: Scheduler | None = None) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.block_ids.pop(req_id, None)
            self.num_computed.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
            self.block_ids[new.req_id] = list(new.block_ids)
            self.num_computed[new.req_id] = new.num_computed_tokens
        for cached in out.scheduled_cached_reqs:
            assert cached.req_id in self.tokens, f"{cached.req_id} cached but never sent as new"
            self.tokens[cached.req_id] += cached.new_token_ids
            self.block_ids[cached.req_id] += cached.new_block_ids
            assert cached.num_computed_tokens == self.num_computed[cached.req_id]
        req_ids, sampled = [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            end = self.num_computed[req_id] + num_tokens
            assert end <= len(tokens), f"{req_id} scheduled past its known tokens"
            block_size = scheduler.kv_cache.block_size if scheduler else 1
            assert len(self.block_ids[req_id]) * block_size >= end, f"{req_id} lacks blocks"
            if scheduler is not None:
                request = scheduler.requests[req_id]
                assert tokens == request.all_token_ids, f"{req_id} tokens diverged"
                assert self.block_ids[req_id] == scheduler.kv_cache.get_block_ids(req_id)
            self.num_computed[req_id] = end
            req_ids.append(req_id)
            sampled.append([self.next_token(req_id, len(tokens))] if end == len(tokens) else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def assert_empty(scheduler: Scheduler) -> None:
    """No request left, every block free, every ref count 0."""
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not scheduler.kv_cache.req_to_blocks
    assert len(list(pool.free_queue)) == pool.num_blocks
