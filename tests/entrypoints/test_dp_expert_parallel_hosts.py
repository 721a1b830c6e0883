"""Expert parallel across data-parallel replicas on several hosts: the head (here
``DPAsyncLLM``, the engine of ``loom serve --data-parallel-size-local 1
--data-parallel-address 127.0.0.1 --data-parallel-rpc-port P``, in this process) runs
replica 0 and ``loom serve --headless --data-parallel-start-rank 1`` (a process) runs
replica 1, over 127.0.0.1 as two hosts would over their network: both replicas' ranks
join one process group at the head's address and port (DPWelcome carries the port), and
the engine cores' lock-step flags go through the head's relay (core/dp_lockstep.py:
LockstepRelay). Greedy tokens equal one rank's (every expert), one request at a time
(one replica works, the other host takes dummy steps) and all at once; a headless host
without the head's expert layout is refused by name; the head's clean shutdown ends the
headless host with exit 0."""

from __future__ import annotations

import asyncio
import socket

import psutil
from dp_greedy import one_then_all
from checkpoints import make_tiny_checkpoint
from loom_server import headless_log, start_headless
from tokenizer_fixtures import make_tiny_tokenizer

from loom import LLM, SamplingParams
from loom.engine_args import EngineArgs

MAX_TOKENS = 6
PROMPTS = [[5, 6, 7], list(range(3, 20)), list(range(40, 90)), [9] * 30]
FLAGS = ("--dtype", "float32", "--max-model-len", "128", "--num-gpu-blocks-override", "32",
         "--cpu-threads-per-rank", "1")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _head_greedy(path: str, port: int) -> tuple[list, list, list]:
    from loom.dp_async_llm import DPAsyncLLM

    config = EngineArgs(model=path, data_parallel_size=2, data_parallel_size_local=1,
                        data_parallel_address="127.0.0.1", data_parallel_rpc_port=port,
                        enable_expert_parallel=True, dtype="float32", max_model_len=128,
                        num_gpu_blocks_override=32, cpu_threads_per_rank=1,
                        watchdog_timeout_s=15.0).create_engine_config()
    assert config.parallel.experts_across_replicas
    llm = DPAsyncLLM(config, log_requests=False)
    relayed = llm.config.parallel.data_parallel_lockstep_addresses
    assert relayed and all(a.startswith("tcp://127.0.0.1:") for pair in relayed for a in pair)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    await llm.start()
    try:
        one_at_a_time, all_at_once, replicas = await one_then_all(llm, PROMPTS, params)
        return one_at_a_time, list(all_at_once), replicas
    finally:
        await llm.shutdown()


def test_head_and_headless_host_share_the_experts(tmp_path):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "qwen3_moe")
    make_tiny_tokenizer(path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, dtype="float32", max_model_len=128, enable_warm_up=False) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(
            [{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)]

    port = _free_port()
    # a host without the head's expert layout is refused by name, starting nothing
    wrong = start_headless(path, port, 1, 2, *FLAGS)
    host = start_headless(path, port, 1, 2, *FLAGS, "--enable-expert-parallel")
    try:
        one_at_a_time, all_at_once, replicas = asyncio.run(_head_greedy(path, port))
        assert wrong.wait(60) == 2, headless_log(wrong)
        assert "--expert-parallel-size is 1 there, 2 on the head" in headless_log(wrong), headless_log(wrong)
        assert one_at_a_time == expected
        assert all_at_once == expected
        assert set(replicas) == {0, 1}, replicas  # each host alone, the other in dummy steps
        assert host.wait(60) == 0, headless_log(host)  # the head's goodbye
        assert "the head shut down; engine core exit codes {1: 0}" in headless_log(host)
    finally:
        for proc in (wrong, host):
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                proc.kill()
                proc.wait(10)
