"""The model runner's per-step shortcuts give the step it would compute without them.

A runner is driven by hand-made SchedulerOutputs over many decode steps (as the
scheduler sends them: the new requests once, then each step's sampled token), with
requests whose sampling reads the output so far (penalties, min_tokens) beside ones
whose does not (greedy, seeded), and its tokens compared with the same steps run with
the shortcuts bypassed.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_tiny_checkpoint

from loom.engine_args import make_engine_config
from loom.core.wire import CachedRequestData, NewRequestData, SchedulerOutput
from loom.sampling_params import SamplingParams
from loom.worker.model_runner import ModelRunner

BLOCK_SIZE = 16
STEPS = 10


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> ModelRunner:
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))
    config = make_engine_config(path, dtype="float32", max_model_len=128, max_num_seqs=8,
                                block_size=BLOCK_SIZE, skip_tokenizer_init=True)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    runner.initialize_kv_cache(64)
    return runner


def decode(runner: ModelRunner, tag: str, requests: list[tuple[list[int], SamplingParams]],
           eos: list[int], replace_at: int | None = None) -> tuple[list[list[int]], list]:
    """Prefill ``requests`` together, then STEPS decode steps; their tokens, and the
    sampling metadata each step used. ``replace_at``: at that step request 0 is
    forgotten and sent again as new (a preemption's recompute)."""
    ids = [f"{tag}-{i}" for i in range(len(requests))]
    blocks = {req_id: list(range(8 * i, 8 * i + 8)) for i, req_id in enumerate(ids)}
    tokens = {req_id: list(prompt) for req_id, (prompt, _) in zip(ids, requests)}
    used = []
    build = runner._sampling_metadata

    def recording(*args):
        used.append(build(*args))
        return used[-1]

    runner._sampling_metadata = recording
    try:
        def new(req_id: str, params: SamplingParams) -> NewRequestData:
            return NewRequestData(req_id=req_id, prompt_token_ids=tokens[req_id],
                                  output_token_ids=[], sampling_params=params,
                                  eos_token_ids=eos, block_ids=blocks[req_id],
                                  num_computed_tokens=0)

        output = runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[new(r, p) for r, (_, p) in zip(ids, requests)],
            scheduled_cached_reqs=[],
            num_scheduled_tokens={r: len(tokens[r]) for r in ids},
            total_num_scheduled_tokens=sum(len(tokens[r]) for r in ids), finished_req_ids=[]))
        for step in range(STEPS):
            for req_id, sampled in zip(output.req_ids, output.sampled_token_ids):
                tokens[req_id] += sampled
            replaced = ids[:1] if step == replace_at else []
            cached = [CachedRequestData(req_id=r, new_token_ids=tokens[r][-1:], new_block_ids=[],
                                        num_computed_tokens=len(tokens[r]) - 1)
                      for r in ids if r not in replaced]
            news = [NewRequestData(req_id=r, prompt_token_ids=requests[0][0],
                                   output_token_ids=tokens[r][len(requests[0][0]):],
                                   sampling_params=requests[0][1], eos_token_ids=eos,
                                   block_ids=blocks[r], num_computed_tokens=0)
                    for r in replaced]
            scheduled = {r: len(tokens[r]) if r in replaced else 1 for r in ids}
            output = runner.execute_model(SchedulerOutput(
                scheduled_new_reqs=news, scheduled_cached_reqs=cached,
                num_scheduled_tokens=scheduled,
                total_num_scheduled_tokens=sum(scheduled.values()), finished_req_ids=replaced))
        for req_id, sampled in zip(output.req_ids, output.sampled_token_ids):
            tokens[req_id] += sampled
        runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=[], num_scheduled_tokens={},
            total_num_scheduled_tokens=0, finished_req_ids=ids))
    finally:
        del runner._sampling_metadata
    return [tokens[r][len(prompt):] for r, (prompt, _) in zip(ids, requests)], used


PROMPTS = [[5, 9, 14, 3, 77, 21], [100, 4, 4, 8], [60, 61, 62, 63, 64, 65, 66], [7, 200]]


@pytest.mark.parametrize("case", ["plain", "penalties", "min_tokens"])
def test_reused_sampling_metadata_gives_the_same_tokens(runner, case):
    """Greedy and seeded rows reuse the last step's metadata; penalties (which read the
    output so far) and min_tokens (whose mask lifts after min_tokens outputs) are built
    every step while they matter; the tokens equal those of a runner that builds the
    metadata afresh every step, also across a request's recompute."""
    eos = []
    extra = {}
    if case == "penalties":
        extra = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.3)
    elif case == "min_tokens":
        eos = list(range(0, 256, 2))  # half the vocabulary masked for the first outputs
        extra = dict(min_tokens=4)
    params = [SamplingParams(temperature=0.0, ignore_eos=False, **extra),
              SamplingParams(temperature=0.9, seed=3, **extra),
              SamplingParams(temperature=0.0, top_k=1),
              SamplingParams(temperature=1.2, top_p=0.8, seed=11, **extra)]
    requests = list(zip(PROMPTS, params))
    for replace_at in (None, 4):
        tokens, used = decode(runner, f"{case}-{replace_at}", requests, eos, replace_at)
        with pytest.MonkeyPatch.context() as patch:
            build = ModelRunner._sampling_metadata

            def fresh(self, *args):
                self._last_sampling = None
                return build(self, *args)

            patch.setattr(ModelRunner, "_sampling_metadata", fresh)
            reference, _ = decode(runner, f"{case}-{replace_at}-fresh", requests, eos,
                                  replace_at)
        assert tokens == reference
        assert all(len(t) == STEPS + 1 for t in tokens)
        reused = [a is b for a, b in zip(used, used[1:])]
        # reused[i]: decode step i took the metadata of the step before it
        if case == "plain":  # always, but where request 0 came back as a new state
            assert reused == [step != replace_at for step in range(STEPS)]
        elif case == "penalties":
            assert not any(reused)
        else:  # built while a row is under min_tokens (4 outputs), then reused
            assert not any(reused[:4])
            assert reused[4:] == [step != replace_at for step in range(4, STEPS)]
    if case == "min_tokens":
        # the mask held: no masked (even) token among a masked request's first 4 outputs
        assert all(t % 2 for t in tokens[0][:4])
