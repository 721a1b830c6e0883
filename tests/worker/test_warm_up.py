"""Warm-up runs one dummy decode step per batch size, leaves no request behind in the
model runner, and the engine's greedy output afterwards is still transformers'."""

from __future__ import annotations

import pytest

from loom import LLM, SamplingParams
from loom.engine_args import make_engine_config
from loom.worker.worker import Worker

from .helpers import executor_of, make_model_dir
from .test_tensor_parallel import ENGINE_KWARGS, MAX_TOKENS, PROMPTS, transformers_greedy


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir("llama", tmp_path_factory.mktemp("llama"))


def ready_worker(model_dir: str, **kwargs) -> tuple[Worker, list]:
    """A worker with its KV cache, and the list its runner's steps are recorded in."""
    config = make_engine_config(model_dir, max_model_len=128, max_num_seqs=8,
                                num_gpu_blocks_override=16, dtype="float32", **kwargs)
    worker = Worker(config)
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache(16)
    runner, steps = worker.model_runner, []
    execute_model = runner.execute_model

    def record(scheduler_output):
        output = execute_model(scheduler_output)
        steps.append((scheduler_output.total_num_scheduled_tokens, output.req_ids,
                      output.sampled_token_ids))
        return output

    runner.execute_model = record
    return worker, steps


def test_warm_up_decodes_each_batch_size_and_leaves_the_runner_empty(model_dir):
    worker, steps = ready_worker(model_dir)
    worker.warm_up()
    # a one-token prefill, decode steps of 1, 2, 4 .. max_num_seqs tokens, a step that forgets
    assert [num_tokens for num_tokens, _, _ in steps] == [1, 1, 2, 4, 8, 0]
    assert all(len(sampled) == len(req_ids) and all(len(t) == 1 for t in sampled)
               for _, req_ids, sampled in steps)
    assert worker.model_runner.requests == {}


def test_warm_up_stops_at_its_time_budget_and_still_leaves_the_runner_empty(model_dir,
                                                                           monkeypatch):
    monkeypatch.setattr("loom.worker.worker.WARM_UP_BUDGET_S", 0.0)
    worker, steps = ready_worker(model_dir)
    worker.warm_up()
    assert [num_tokens for num_tokens, _, _ in steps] == [1, 0]
    assert worker.model_runner.requests == {}


def test_warm_up_can_be_turned_off(model_dir):
    worker, steps = ready_worker(model_dir, enable_warm_up=False)
    worker.warm_up()
    assert steps == []


@pytest.mark.parametrize("enable_warm_up", [True, False])
def test_greedy_output_after_warm_up_matches_transformers(model_dir, enable_warm_up):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    # Prefix caching and chunked prefill on; the first requests get the blocks the
    # dummy steps wrote in.
    with LLM(model_dir, enable_warm_up=enable_warm_up, **ENGINE_KWARGS) as llm:
        assert executor_of(llm).worker.model_runner.requests == {}
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == transformers_greedy(model_dir)
