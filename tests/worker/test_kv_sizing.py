"""The CPU's default KV cache is lean: what max_num_seqs sequences of max_model_len can
use, under a fixed cap, without a profiling run; explicit budgets are honoured; a
budget the machine cannot hold fails at start-up naming the knob; the cache's pages
are populated in the background; the start-up log states its size and concurrency."""

from __future__ import annotations

import ctypes
import mmap
import re
import subprocess
import sys

import pytest

from loom.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loom.engine_args import make_engine_config
from loom.core import kv_sizing
from loom.core.kv_sizing import kv_cache_summary, lean_cpu_kv_cache_bytes
from loom.executor.multiproc import MultiProcExecutor
from loom.executor.uniproc import UniProcExecutor
from loom.worker import memory

from .helpers import make_model_dir

# The tiny llama: 2 layers x (K, V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes
BYTES_PER_BLOCK = 8192
BLOCKS_PER_SEQ = 128 // 16  # max_model_len=128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir("llama", tmp_path_factory.mktemp("llama"))


def start(model_dir: str, **kwargs) -> UniProcExecutor:
    config = make_engine_config(model_dir, max_model_len=128, dtype="float32",
                                enable_warm_up=False, **kwargs)
    executor = UniProcExecutor(config)
    executor.initialize()
    return executor


def smollm2_config(max_num_seqs: int = 64, max_model_len: int = 4096) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model="SmolLM2-135M-Instruct.Q4_1.gguf",
                                          max_model_len=max_model_len, dtype="bfloat16"),
                        cache=CacheConfig(),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_model_len=max_model_len))


SMOLLM2_BYTES_PER_BLOCK = 30 * 2 * 16 * 3 * 64 * 2  # layers, K/V, tokens, KV heads, dims, bf16


def test_the_cap_wins_over_what_the_default_concurrency_could_fill():
    # 64 x 4,096 tokens would be 5.6 GiB of SmolLM2's cache: the 512 MiB cap wins
    config = smollm2_config()
    assert lean_cpu_kv_cache_bytes(config, SMOLLM2_BYTES_PER_BLOCK) == 512 * 2**20
    num_blocks = 512 * 2**20 // SMOLLM2_BYTES_PER_BLOCK
    assert kv_cache_summary(config, num_blocks, SMOLLM2_BYTES_PER_BLOCK) == (
        "KV cache 0.50 GiB in bfloat16, 23,296 tokens (1,456 blocks of 16); maximum concurrency for "
        "4,096 tokens per request: 5.69x")
    # two sequences of 1,024 need 45 MiB: no more is taken
    small = smollm2_config(max_num_seqs=2, max_model_len=1024)
    assert lean_cpu_kv_cache_bytes(small, SMOLLM2_BYTES_PER_BLOCK) == \
        2 * 64 * SMOLLM2_BYTES_PER_BLOCK


def test_one_long_sequence_always_fits_even_past_the_cap(monkeypatch):
    monkeypatch.setattr(kv_sizing, "DEFAULT_CPU_KV_CACHE_BYTES", 2**20)
    config = smollm2_config(max_num_seqs=8, max_model_len=8192)
    assert lean_cpu_kv_cache_bytes(config, SMOLLM2_BYTES_PER_BLOCK) == \
        512 * SMOLLM2_BYTES_PER_BLOCK


def test_cpu_default_is_sized_to_the_concurrency_without_profiling(model_dir, monkeypatch,
                                                                    capfd):
    def no_profiling(self):
        raise AssertionError("the lean default must not run the profiling step")

    monkeypatch.setattr("loom.worker.model_runner.ModelRunner.profile_run", no_profiling)
    executor = start(model_dir, max_num_seqs=4)
    try:
        assert executor.profiled_num_blocks == 4 * BLOCKS_PER_SEQ
        assert executor.worker.num_blocks == 4 * BLOCKS_PER_SEQ
    finally:
        executor.shutdown()
    err = capfd.readouterr().err
    assert ("loom: KV cache 0.00 GiB in float32, 512 tokens (32 blocks of 16); maximum concurrency for "
            "128 tokens per request: 4.00x") in err
    # the resident weight bytes, on stderr whatever the log level
    assert re.search(r"loom: weights read in [0-9.]+ s; resident: [0-9.]+ MiB float32", err), err


def test_worker_processes_report_the_bytes_of_a_block_for_the_summary(model_dir, capfd):
    """Ranks publish their block size with their ready signal; the engine prints the
    summary from it (it imports no torch and reads no checkpoint config for it)."""
    executor = MultiProcExecutor(_config(model_dir, max_num_seqs=4, enable_warm_up=False,
                                         distributed_executor_backend="mp"))
    try:
        assert executor.initialize() == 4 * BLOCKS_PER_SEQ
        assert executor.kv_cache_bytes_per_block == BYTES_PER_BLOCK
        assert list(executor.signals.kv_cache_bytes_per_block) == [BYTES_PER_BLOCK]
    finally:
        executor.shutdown()
    assert ("loom: KV cache 0.00 GiB in float32, 512 tokens (32 blocks of 16); maximum concurrency for "
            "128 tokens per request: 4.00x") in capfd.readouterr().err


def test_the_engine_core_with_worker_processes_imports_no_torch():
    code = ("import sys; sys.modules['torch'] = None; import loom.core.engine_core_proc, "
            "loom.core.engine_core, loom.executor.multiproc")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cpu_default_is_capped(model_dir, monkeypatch):
    monkeypatch.setattr(kv_sizing, "DEFAULT_CPU_KV_CACHE_BYTES", 12 * BYTES_PER_BLOCK)
    executor = start(model_dir, max_num_seqs=64)
    try:
        assert executor.profiled_num_blocks == 12
    finally:
        executor.shutdown()


def test_explicit_budgets_are_honoured(model_dir):
    executor = start(model_dir, max_num_seqs=64, kv_cache_memory_bytes=100 * BYTES_PER_BLOCK)
    try:
        assert executor.profiled_num_blocks == 100
    finally:
        executor.shutdown()
    executor = start(model_dir, max_num_seqs=64, memory_utilization=0.2)
    try:  # profiled: a share of the machine, then capped to what 64 sequences can fill
        assert executor.worker.profile["activation_peak"] >= 0
        assert executor.profiled_num_blocks > 64 * BLOCKS_PER_SEQ
        assert executor.worker.num_blocks == 64 * BLOCKS_PER_SEQ
    finally:
        executor.shutdown()


def test_a_budget_the_machine_cannot_hold_fails_naming_the_knob(model_dir, monkeypatch):
    monkeypatch.setattr(memory, "cpu_available_memory", lambda: 300 * 2**20)
    with pytest.raises(ValueError, match=r"need more than the 0\.29 GiB of memory available; "
                                         r"lower --kv-cache-memory"):
        start(model_dir, kv_cache_memory_bytes=2**30)
    # the default shrinks to what is there while one sequence fits ...
    reserve = memory.activation_bytes_estimate(_tiny_hf_config(model_dir),
                                               _config(model_dir, max_num_seqs=64))
    monkeypatch.setattr(memory, "cpu_available_memory",
                        lambda: reserve + 20 * BYTES_PER_BLOCK)
    executor = start(model_dir, max_num_seqs=64)
    try:
        assert executor.profiled_num_blocks == 20
    finally:
        executor.shutdown()
    # ... and fails when not even one does
    monkeypatch.setattr(memory, "cpu_available_memory", lambda: reserve + BYTES_PER_BLOCK)
    with pytest.raises(ValueError, match="lower --max-model-len"):
        start(model_dir, max_num_seqs=64)


def test_kv_cache_pages_are_populated_in_the_background(model_dir):
    executor = start(model_dir)
    try:
        worker = executor.worker
        worker.initialize_kv_cache(8192)  # 64 MiB: fresh mmap'd memory, as a real cache
        storage = worker.model_runner.kv_cache_storage
        thread = worker.populate_thread
        assert thread is not None, "madvise(MADV_POPULATE_WRITE) needs Linux >= 5.14"
        thread.join(timeout=30)
        assert not thread.is_alive()
        assert _resident_fraction(storage.data_ptr(), storage.numel() * 4) > 0.99
        # Contents are not asserted: torch.empty may hand back recycled heap memory, and
        # no kernel reads a slot before writing it (tests/model/test_kv_layout.py fills
        # the cache with NaN to prove that).
    finally:
        executor.shutdown()


def _resident_fraction(address: int, size: int) -> float:
    """Share of the whole pages in [address, address + size) that are in memory (mincore)."""
    page = mmap.PAGESIZE
    start, end = -(-address // page) * page, (address + size) // page * page
    num_pages = (end - start) // page
    vector = (ctypes.c_ubyte * num_pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    assert libc.mincore(start, end - start, vector) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vector) / num_pages


def _config(model_dir: str, **kwargs) -> EngineConfig:
    return make_engine_config(model_dir, max_model_len=128, dtype="float32", **kwargs)


def _tiny_hf_config(model_dir: str):
    from loom.model.loader import load_hf_config

    return load_hf_config(model_dir)
