"""glibc's heap thresholds (``memory.keep_freed_memory``) are process-wide: set only at
the entry of a process that runs a CPU worker, never by a library call."""

from __future__ import annotations

import pytest

from loom import cli
from loom.engine_args import make_engine_config
from loom.executor.uniproc import UniProcExecutor
from loom.worker import memory

from .helpers import make_model_dir


@pytest.fixture
def calls(monkeypatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(memory, "keep_freed_memory", lambda: calls.append("mallopt"))
    return calls


def test_an_in_process_worker_leaves_the_callers_heap_alone(tmp_path, calls):
    config = make_engine_config(make_model_dir("llama", tmp_path), max_model_len=64,
                                dtype="float32", enable_warm_up=False)
    executor = UniProcExecutor(config)
    try:
        executor.initialize()
    finally:
        executor.shutdown()
    assert calls == []


@pytest.mark.parametrize("argv, in_process", [
    (["generate", "--prompt", "hi", "--device", "cpu"], True),
    (["chat", "--prompt", "hi", "--device", "cpu"], True),
    (["bench", "throughput", "--device", "cpu"], True),
    (["generate", "--prompt", "hi", "--device", "cpu", "-tp", "2"], False),
    (["generate", "--prompt", "hi", "--distributed-executor-backend", "mp"], False),
    (["bench", "serve"], False),
])
def test_the_cli_sets_them_only_where_the_worker_runs_in_its_process(argv, in_process, calls):
    args = cli.build_parser().parse_args(argv)
    cli._configure_in_process_worker(args)
    assert calls == (["mallopt"] if in_process else [])
