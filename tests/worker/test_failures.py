"""Fail fast, leave nothing behind: a killed worker, a normal shutdown, a dropped
engine, two engines side by side, a parent killed by a signal."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from loom import LLM, SamplingParams
from loom.errors import EngineDeadError, WorkerDiedError

from .helpers import executor_of, leftovers, make_model_dir

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE_KWARGS = dict(max_model_len=128, num_gpu_blocks_override=64, dtype="float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def expected(model_dir) -> list[list[int]]:
    with LLM(model_dir, **ENGINE_KWARGS) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_sigkill_of_a_worker_fails_generate_fast_and_cleans_up(model_dir):
    llm = LLM(model_dir, tensor_parallel_size=2, **ENGINE_KWARGS)
    executor = executor_of(llm)
    pids, shm_names = executor.worker_pids, executor.shm_names
    ipc_dir = os.path.dirname(executor.queue.addresses.broadcast.removeprefix("ipc://"))
    assert len(pids) == 2 and not leftovers([], []) and all(
        os.path.exists(f"/dev/shm/{n}") for n in shm_names)

    execute_model, steps, killed_at = executor.execute_model, [0], []

    def execute_and_kill(scheduler_output):
        steps[0] += 1
        if steps[0] == 4:  # mid-generation: prompts done, decoding
            os.kill(pids[1], signal.SIGKILL)
            killed_at.append(time.monotonic())
        return execute_model(scheduler_output)

    executor.execute_model = execute_and_kill
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    with pytest.raises(WorkerDiedError, match="rank 1.*SIGKILL") as error:
        llm.generate(PROMPTS, params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 10
    assert error.value.rank == 1
    assert leftovers(pids, shm_names) == []
    assert not os.path.exists(ipc_dir)
    started = time.monotonic()  # later calls fail at once
    with pytest.raises(EngineDeadError):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - started < 1
    assert not llm.engine.has_unfinished_requests()
    llm.shutdown()  # idempotent


def test_two_engines_side_by_side_then_shutdown_and_gc(model_dir, expected):
    first = LLM(model_dir, distributed_executor_backend="mp", **ENGINE_KWARGS)
    second = LLM(model_dir, distributed_executor_backend="mp", **ENGINE_KWARGS)
    a, b = executor_of(first), executor_of(second)
    assert a.instance_id != b.instance_id
    assert not set(a.shm_names) & set(b.shm_names)
    assert a.queue.addresses != b.queue.addresses
    for _ in range(2):  # interleaved use
        for llm in (first, second):
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outputs] == expected
    a.check_health()
    pids, names = a.worker_pids + b.worker_pids, a.shm_names + b.shm_names
    first.shutdown()  # a normal shutdown
    assert leftovers(a.worker_pids, a.shm_names) == []
    assert b.check_health() is None  # the other engine is untouched
    del second, b, llm  # a dropped engine is collected and cleans up too
    gc.collect()
    assert leftovers(pids, names) == []


PARENT_SCRIPT = textwrap.dedent("""
    import sys, time
    from loom import LLM
    if __name__ == "__main__":
        llm = LLM(sys.argv[1], tensor_parallel_size=2, max_model_len=128,
                  num_gpu_blocks_override=64, dtype="float32")
        executor = llm.engine.engine_core.executor
        print(" ".join(map(str, executor.worker_pids)), " ".join(executor.shm_names), flush=True)
        time.sleep(120)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_parent_killed_leaves_nothing_behind(model_dir, tmp_path, signum):
    script = tmp_path / "parent.py"
    script.write_text(PARENT_SCRIPT)
    parent = subprocess.Popen([sys.executable, str(script), model_dir], stdout=subprocess.PIPE,
                              text=True)
    try:
        pids, names = _split(parent.stdout.readline())
        assert len(pids) == 2 and leftovers(pids, names) != []
        parent.send_signal(signum)
        parent.wait(timeout=20)
        deadline = time.monotonic() + 10  # workers die with it; the tracker unlinks
        while leftovers(pids, names) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert leftovers(pids, names) == []
        assert parent.returncode == -signum  # a library installs no signal handler
    finally:
        parent.kill()


def _split(line: str) -> tuple[list[int], list[str]]:
    fields = line.split()
    return [int(f) for f in fields if f.isdigit()], [f for f in fields if not f.isdigit()]
