"""Scheduler with speculative decoding, early stop and prompt logprobs, driven by a fake
runner carrying drafts; every test ends with the empty check."""

from __future__ import annotations

from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, EarlyStopConfig, SchedulerConfig, SpeculativeConfig
from loom.core.scheduler import Scheduler
from loom.request import Request, RequestStatus
from loom.sampling_params import SamplingParams

EOS = 2


def make_scheduler(num_blocks=64, block_size=4, max_num_seqs=8, budget=64, max_model_len=256,
                   caching=True, spec=None, early_stop=None) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_model_len),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching),
                     num_blocks=num_blocks, speculative_config=spec, early_stop_config=early_stop)


def make_request(req_id: str, num_prompt: int, max_tokens=8, first_token=10, **params) -> Request:
    prompt = list(range(first_token, first_token + num_prompt))
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids={EOS})


def script(req_id: str, n: int) -> int:
    """The 'model': token at position n."""
    return 500 + n % 7


def propose_k(k: int, wrong_at: int | None = None):
    """Drafts the next k scripted tokens, the one at index ``wrong_at`` spoiled."""
    def propose(req_id: str, tokens: list[int]) -> list[int]:
        drafts = [script(req_id, len(tokens) + j) for j in range(k)]
        if wrong_at is not None:
            drafts[wrong_at] = 3
        return drafts
    return propose


def step(scheduler, runner):
    out = scheduler.schedule()
    return out, scheduler.update_from_output(out, runner.execute(out, scheduler))


def run_to_completion(scheduler, runner, max_steps=1000):
    outputs = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, outs = step(scheduler, runner)
        for o in outs:
            outputs.setdefault(o.req_id, []).append(o)
    assert not scheduler.has_unfinished_requests()
    return outputs


def tokens_of(outputs, req_id):
    return [t for o in outputs[req_id] for t in o.new_token_ids]


def test_drafts_are_booked_verified_and_rolled_back():
    scheduler = make_scheduler(spec=SpeculativeConfig(num_speculative_tokens=3))
    runner = FakeRunner(next_token=script, propose=propose_k(3, wrong_at=2))
    scheduler.add_request(make_request("a", 6, max_tokens=20))
    out, outs = step(scheduler, runner)  # prefill, first token, drafts proposed
    request = scheduler.requests["a"]
    assert out.num_scheduled_tokens == {"a": 6} and not out.scheduled_spec_decode_tokens
    assert request.spec_token_ids == [script("a", 7), script("a", 8), 3]

    out, outs = step(scheduler, runner)
    # last token + 3 drafts in one step; KV slots for all of them
    assert out.num_scheduled_tokens == {"a": 4}
    assert out.scheduled_spec_decode_tokens == {"a": [script("a", 7), script("a", 8), 3]}
    assert len(scheduler.kv_cache.get_block_ids("a")) * 4 >= 6 + 4
    # two accepted, the third rejected and replaced by the scripted token
    assert outs[0].new_token_ids == [script("a", n) for n in (7, 8, 9)]
    assert request.num_tokens == 10
    assert request.num_computed_tokens == 9  # the rejected draft's slot is recomputed
    stats = scheduler.get_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens) == (1, 3, 2)
    outputs = run_to_completion(scheduler, runner)
    assert request.output_token_ids == [script("a", n) for n in range(6, 26)]
    assert outputs["a"][-1].finish_reason == "length"
    assert_empty(scheduler)


def test_output_equals_run_without_drafts_with_chunking_and_preemption():
    def run(spec, propose):
        scheduler = make_scheduler(num_blocks=12, block_size=4, budget=16, spec=spec)
        runner = FakeRunner(next_token=script, propose=propose)
        for i, n in enumerate([3, 9, 14, 5, 21]):
            scheduler.add_request(make_request(f"r{i}", n, max_tokens=12, first_token=20 + i))
        outputs = run_to_completion(scheduler, runner)
        result = {r: tokens_of(outputs, r) for r in outputs}
        assert_empty(scheduler)
        return result, scheduler.get_stats()

    expected, _ = run(None, None)
    got, stats = run(SpeculativeConfig(num_speculative_tokens=4), propose_k(4, wrong_at=3))
    assert got == expected
    assert stats.num_preemptions > 0 and stats.spec_decode_num_accepted_tokens > 0


def test_stop_token_inside_accepted_drafts_ends_the_request():
    def next_token(req_id, n):
        return EOS if n == 8 else 500 + n

    def propose(req_id, tokens):
        return [next_token(req_id, len(tokens) + j) for j in range(4)]

    scheduler = make_scheduler(spec=SpeculativeConfig(num_speculative_tokens=4))
    runner = FakeRunner(next_token=next_token, propose=propose)
    scheduler.add_request(make_request("a", 5, max_tokens=20))
    scheduler.add_request(make_request("b", 5, max_tokens=20, ignore_eos=True, first_token=50))
    outputs = run_to_completion(scheduler, runner)
    assert tokens_of(outputs, "a") == [505, 506, 507, EOS]  # the drafts after eos are dropped
    assert outputs["a"][-1].finish_reason == "stop"
    assert tokens_of(outputs, "b") == [next_token("b", n) for n in range(5, 25)]
    assert_empty(scheduler)


def test_drafts_cut_to_max_tokens_max_model_len_and_budget():
    scheduler = make_scheduler(spec=SpeculativeConfig(num_speculative_tokens=5),
                               max_model_len=16, budget=64)
    runner = FakeRunner(next_token=script, propose=propose_k(5))
    scheduler.add_request(make_request("short", 3, max_tokens=4))
    scheduler.add_request(make_request("long", 12, max_tokens=100, first_token=40))
    step(scheduler, runner)
    # short: 1 of 4 tokens out, so at most 2 drafts (+ 1 bonus); long: 13 of 16 tokens,
    # so at most 16 - 13 - 1 = 2 drafts.
    assert scheduler.requests["short"].spec_token_ids == [script("short", n) for n in (4, 5)]
    assert len(scheduler.requests["long"].spec_token_ids) == 2
    outputs = run_to_completion(scheduler, runner)
    # after the first token each: 3 more for short (max_tokens), 3 more for long (16 in all)
    assert len(tokens_of(outputs, "short")) == 3 and len(tokens_of(outputs, "long")) == 3
    assert_empty(scheduler)

    scheduler = make_scheduler(spec=SpeculativeConfig(num_speculative_tokens=5), budget=4)
    runner = FakeRunner(next_token=script, propose=propose_k(5))
    scheduler.add_request(make_request("a", 4, max_tokens=30))
    step(scheduler, runner)
    out, _ = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"a": 4}  # the budget keeps 3 of the 5 drafts
    assert len(out.scheduled_spec_decode_tokens["a"]) == 3
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)


def test_draft_model_books_lookahead_slots():
    spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=3)
    scheduler = make_scheduler(block_size=4, spec=spec)
    runner = FakeRunner(next_token=script, propose=propose_k(3))
    scheduler.add_request(make_request("a", 8, max_tokens=12))
    step(scheduler, runner)
    # 8 prompt tokens computed + 3 lookahead slots for the draft model's own drafts
    assert len(scheduler.kv_cache.get_block_ids("a")) == 3
    out, _ = step(scheduler, runner)
    # 8 computed + 4 scheduled + 3 lookahead = 15 slots
    assert len(scheduler.kv_cache.get_block_ids("a")) == 4
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)


def test_early_stop_after_window_of_confident_tokens():
    config = EarlyStopConfig(enable_early_stop=True, window_size=5, threshold=0.9)

    def token_prob(req_id, n):
        return 0.95 if req_id.startswith("sure") else (0.95 if n % 3 else 0.5)

    for spec, propose in ((None, None), (SpeculativeConfig(num_speculative_tokens=3),
                                         propose_k(3))):
        scheduler = make_scheduler(early_stop=config, spec=spec)
        runner = FakeRunner(next_token=script, token_prob=token_prob, propose=propose)
        scheduler.add_request(make_request("sure", 4, max_tokens=50))
        scheduler.add_request(make_request("sure-min", 4, max_tokens=50, min_tokens=8))
        scheduler.add_request(make_request("unsure", 4, max_tokens=20, first_token=60))
        outputs = run_to_completion(scheduler, runner)
        assert len(tokens_of(outputs, "sure")) == 5
        assert (outputs["sure"][-1].finish_reason, outputs["sure"][-1].stop_reason) == \
            ("stop", "early_stop")
        assert len(tokens_of(outputs, "sure-min")) == 8
        assert len(tokens_of(outputs, "unsure")) == 20
        assert outputs["unsure"][-1].finish_reason == "length"
        assert_empty(scheduler)


def test_prompt_logprobs_once_per_token_across_chunks_and_preemption():
    scheduler = make_scheduler(num_blocks=10, block_size=4, budget=7)
    runner = FakeRunner(next_token=script)
    # fills the pool so that "lp" is preempted mid-way
    scheduler.add_request(make_request("hog", 13, max_tokens=20, first_token=100))
    scheduler.add_request(make_request("lp", 17, max_tokens=6, prompt_logprobs=2))
    outputs = run_to_completion(scheduler, runner)
    assert scheduler.num_preemptions > 0
    entries = [e for o in outputs["lp"] if o.prompt_logprobs for e in o.prompt_logprobs.logprobs]
    assert entries == [[-float(t)] for t in range(1, 17)]  # prompt tokens 1..16, once each
    assert_empty(scheduler)


def test_prompt_logprobs_request_takes_no_prefix_cache_hit():
    scheduler = make_scheduler()
    runner = FakeRunner(next_token=script)
    scheduler.add_request(make_request("first", 12, max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("again", 12, max_tokens=2))
    scheduler.add_request(make_request("lp", 12, max_tokens=2, prompt_logprobs=0))
    out = scheduler.schedule()
    assert out.num_scheduled_tokens == {"again": 4, "lp": 12}  # 8 tokens hit for "again"
    scheduler.update_from_output(out, runner.execute(out, scheduler))
    run_to_completion(scheduler, runner)
    assert_empty(scheduler)


def test_n_children_report_prompt_logprobs_once():
    params = SamplingParams(prompt_logprobs=1, seed=3, n=2)
    first = Request("0_x", [5, 6, 7], params, index=0)
    second = Request("1_x", [5, 6, 7], params, index=1)
    assert first.sampling_params.prompt_logprobs == 1
    assert second.sampling_params.prompt_logprobs is None and second.sampling_params.seed == 4
    assert second.status == RequestStatus.WAITING
