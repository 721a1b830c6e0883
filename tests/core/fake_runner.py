"""A stand-in for the workers: mirrors requests from SchedulerOutput diffs, samples
scripted tokens, and checks the diffs are consistent with the scheduler's own state.

Speculative decoding: ``propose(req_id, tokens)`` drafts the next step's tokens; a
scheduled draft is accepted while it equals the scripted ``next_token``, then one more
scripted token follows (greedy verification). ``token_prob(req_id, n)`` reports each
sampled token's probability (early stop). Requests with prompt_logprobs get fake
entries: prompt token t has logprob -t (its position) and rank 1."""

from __future__ import annotations

from collections.abc import Callable

from loom.core.wire import ModelRunnerOutput, SampleLogprobs, SchedulerOutput
from loom.core.scheduler import Scheduler


class FakeRunner:
    def __init__(self, next_token: Callable[[str, int], int] | None = None,
                 propose: Callable[[str, list[int]], list[int]] | None = None,
                 token_prob: Callable[[str, int], float] | None = None) -> None:
        # next_token(req_id, num_tokens_so_far) -> the token "sampled" next
        self.next_token = next_token or (lambda req_id, n: 1000 + n)
        self.propose = propose
        self.token_prob = token_prob
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[list[int]]] = {}  # per KV cache group
        self.num_computed: dict[str, int] = {}
        self.num_prompt: dict[str, int] = {}
        self.prompt_logprobs: dict[str, int | None] = {}

    def execute(self, out: SchedulerOutput, scheduler: Scheduler | None = None) -> ModelRunnerOutput:
        for req_id in out.finished_req_ids:
            self.tokens.pop(req_id, None)
            self.block_ids.pop(req_id, None)
            self.num_computed.pop(req_id, None)
            self.num_prompt.pop(req_id, None)
            self.prompt_logprobs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in self.tokens, f"{new.req_id} sent as new twice"
            self.tokens[new.req_id] = new.prompt_token_ids + new.output_token_ids
            self.block_ids[new.req_id] = [list(new.block_ids)] + [
                list(ids) for ids in new.group_block_ids]
            self.num_computed[new.req_id] = new.num_computed_tokens
            self.num_prompt[new.req_id] = len(new.prompt_token_ids)
            self.prompt_logprobs[new.req_id] = new.sampling_params.prompt_logprobs
        for cached in out.scheduled_cached_reqs:
            assert cached.req_id in self.tokens, f"{cached.req_id} cached but never sent as new"
            self.tokens[cached.req_id] += cached.new_token_ids
            for ours, new_ids in zip(self.block_ids[cached.req_id],
                                     [cached.new_block_ids] + cached.new_group_block_ids):
                ours += new_ids
            assert cached.num_computed_tokens == self.num_computed[cached.req_id]
        req_ids, sampled, proposals, probs, prompt_logprobs = [], [], [], [], []
        for req_id, num_tokens in out.num_scheduled_tokens.items():
            tokens = self.tokens[req_id]
            drafts = out.scheduled_spec_decode_tokens.get(req_id, [])
            start = self.num_computed[req_id]
            end = start + num_tokens
            assert end <= len(tokens) + len(drafts), f"{req_id} scheduled past its known tokens"
            assert not drafts or end == len(tokens) + len(drafts), f"{req_id}: drafts cut"
            block_size = scheduler.kv_cache.block_size if scheduler else 1
            assert all(len(ids) * block_size >= end for ids in self.block_ids[req_id]), \
                f"{req_id} lacks blocks"
            if scheduler is not None:
                request = scheduler.requests[req_id]
                assert tokens == request.all_token_ids, f"{req_id} tokens diverged"
                self._check_blocks(scheduler, req_id, start, end)
            req_ids.append(req_id)
            new_tokens = []
            if end >= len(tokens):
                for draft in drafts:
                    if draft != self.next_token(req_id, len(tokens) + len(new_tokens)):
                        break
                    new_tokens.append(draft)
                new_tokens.append(self.next_token(req_id, len(tokens) + len(new_tokens)))
            # Rejected drafts are computed again: | computed | accepted | rejected |
            self.num_computed[req_id] = end - (len(drafts) - len(new_tokens) + 1
                                               if new_tokens and drafts else 0)
            sampled.append(new_tokens)
            proposals.append(self.propose(req_id, tokens + new_tokens)
                             if self.propose and new_tokens else [])
            probs.append([self.token_prob(req_id, len(tokens) + j) for j in range(len(new_tokens))]
                         if self.token_prob else [])
            k = self.prompt_logprobs[req_id]
            last = min(end, self.num_prompt[req_id] - 1)
            prompt_logprobs.append(SampleLogprobs(
                token_ids=[[tokens[t]] for t in range(start + 1, last + 1)],
                logprobs=[[-float(t)] for t in range(start + 1, last + 1)],
                ranks=[1] * (last - start)) if k is not None and last > start else None)
        return ModelRunnerOutput(
            req_ids=req_ids, sampled_token_ids=sampled,
            spec_token_ids=proposals if self.propose else None,
            sampled_token_probs=probs if self.token_prob else None,
            prompt_logprobs=prompt_logprobs if any(e is not None for e in prompt_logprobs)
            else None)

    def _check_blocks(self, scheduler: Scheduler, req_id: str, start: int, end: int) -> None:
        """Our block tables are the scheduler's, except where it freed a block every
        window of its group has left behind (we keep the old id; a real worker never
        reads it). Every position this step's queries may read is in a block the
        request holds, in each group."""
        kv_cache = scheduler.kv_cache
        groups = kv_cache.req_to_blocks[req_id]
        assert len(self.block_ids[req_id]) == len(groups) == kv_cache.num_groups
        for ours, held, window in zip(self.block_ids[req_id], groups, kv_cache.group_windows):
            assert len(ours) == len(held)
            assert all(our_id == block.block_id for our_id, block in zip(ours, held)
                       if block is not None), f"{req_id}: block tables diverged"
            first_read = 0 if window is None else max(0, start - window + 1)
            for position in range(first_read, end):
                assert held[position // kv_cache.block_size] is not None, (
                    f"{req_id}: position {position} is read this step but its block was freed")


def assert_empty(scheduler: Scheduler) -> None:
    """No request left, every block free, every ref count 0."""
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert not scheduler.loading  # no request waits for its K/V
    if scheduler.kv_transfer is not None:  # no blocks held for a decode instance
        assert scheduler.kv_transfer.num_held_blocks == 0
        assert scheduler.kv_transfer.num_loading == 0
        assert scheduler.kv_transfer.num_pending_transfers == 0
    pool = scheduler.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert not scheduler.kv_cache.req_to_blocks
    assert len(list(pool.free_queue)) == pool.num_blocks
