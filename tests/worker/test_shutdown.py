"""Leaving torch.distributed in order: rank 0, whose process hosts the TCP store,
leaves last; a rank that never arrives delays teardown only by the timeout; a TP=2
engine's shutdown leaves every worker with exit code 0."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time

import pytest
import torch

from loom import LLM, SamplingParams

from .helpers import executor_of, leftovers, make_model_dir


def _rank(rank: int, port: int, scenario: str, times) -> None:
    from loom.distributed.parallel_state import destroy_distributed, init_distributed

    group = init_distributed(rank, 2, "127.0.0.1", port, "cpu", timeout_s=60)
    assert group.all_reduce(torch.ones(2)).tolist() == [2.0, 2.0]
    if rank == 1:
        if scenario == "rank 1 dies":
            os._exit(0)  # without leaving the group
        time.sleep(1.0)  # rank 0 is ready to leave long before rank 1
    times[f"{rank} starts"] = time.monotonic()
    destroy_distributed(timeout_s=2.0)
    times[f"{rank} done"] = time.monotonic()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("scenario", ["rank 1 is late", "rank 1 dies"])
def test_rank_0_leaves_last_and_exits_cleanly(scenario):
    context = multiprocessing.get_context("spawn")
    port = _free_port()
    with context.Manager() as manager:
        times = manager.dict()
        processes = [context.Process(target=_rank, args=(rank, port, scenario, times))
                     for rank in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        times = dict(times)
    assert [p.exitcode for p in processes] == [0, 0]
    if scenario == "rank 1 is late":
        assert times["0 done"] >= times["1 starts"]  # waited for rank 1 to leave first
    else:
        assert times["0 done"] - times["0 starts"] < 2 * 2.0 + 2  # two timed-out waits


def test_tp2_shutdown_leaves_every_worker_exit_code_0(tmp_path):
    path = make_model_dir("qwen3", tmp_path / "qwen3")
    llm = LLM(path, tensor_parallel_size=2, max_model_len=128, num_gpu_blocks_override=64,
              dtype="float32")
    executor = executor_of(llm)
    processes = executor._resources.processes
    outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}],
                           SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 4
    llm.shutdown()
    assert [p.exitcode for p in processes] == [0, 0]
    assert leftovers(executor.worker_pids, executor.shm_names) == []
