"""Expert parallel in worker processes: LLM(tensor_parallel_size=2,
enable_expert_parallel=True) splits each MoE layer's experts over the two ranks and
gives the greedy tokens of one rank and of transformers, with a router biased toward
two experts (both on rank 0), chunked prefill and prefix caching on."""

from __future__ import annotations

import os
import signal
import time

import pytest

from checkpoints import MOE_FAMILIES, bias_router
from loom import LLM, SamplingParams
from loom.errors import WorkerDiedError

from .helpers import executor_of, leftovers, make_model_dir
from .test_tensor_parallel import loom_greedy, transformers_greedy


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_ep2_matches_one_rank_and_transformers(tmp_path, family):
    path = bias_router(make_model_dir(family, tmp_path / family))
    expected = transformers_greedy(path)
    one_cold, _, _ = loom_greedy(path)
    ep_cold, ep_warm, cached = loom_greedy(path, tensor_parallel_size=2,
                                           enable_expert_parallel=True)
    assert one_cold == expected
    assert ep_cold == expected
    assert ep_warm == expected
    assert cached[0] >= 32


def test_rank_killed_between_expert_steps_fails_fast(tmp_path):
    """A rank SIGKILLed while the ranks exchange expert results: generate raises
    WorkerDiedError naming it within seconds, and no process or segment is left."""
    path = make_model_dir("qwen3_moe", tmp_path / "qwen3_moe")
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=True, max_model_len=128,
              num_gpu_blocks_override=64, dtype="float32")
    executor = executor_of(llm)
    pids, shm_names = executor.worker_pids, executor.shm_names
    execute_model, steps, killed_at = executor.execute_model, [0], []

    def execute_and_kill(scheduler_output):
        steps[0] += 1
        if steps[0] == 4:  # decoding: every step all-reduces each MoE layer's experts
            os.kill(pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())
        return execute_model(scheduler_output)

    executor.execute_model = execute_and_kill
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    with pytest.raises(WorkerDiedError, match="rank 1.*SIGKILL"):
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 10
    assert leftovers(pids, shm_names) == []
    llm.shutdown()
