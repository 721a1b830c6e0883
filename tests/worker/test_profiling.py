"""The KV cache is sized by measuring: more memory_utilization, more blocks; a bigger
model, fewer; an impossible configuration fails at start-up naming the knob."""

from __future__ import annotations

import os

import pytest
import torch

from loom import LLM
from loom.engine_args import make_engine_config
from loom.executor.multiproc import MultiProcExecutor
from loom.executor.uniproc import UniProcExecutor

from .helpers import leftovers, make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return make_model_dir("llama", tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="module")
def bigger_model_dir(tmp_path_factory) -> str:
    """The tiny llama's shape with 4x the layers and 8x the MLP: ~8 MiB more weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = str(tmp_path_factory.mktemp("bigger"))
    config = LlamaConfig(hidden_size=64, intermediate_size=1024, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=512)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def profiled_blocks(path: str, **kwargs) -> int:
    config = make_engine_config(path, max_model_len=128, dtype="float32", **kwargs)
    executor = UniProcExecutor(config)
    try:
        executor.initialize()
        return executor.profiled_num_blocks
    finally:
        executor.shutdown()


def test_blocks_follow_memory_utilization_and_model_size(model_dir, bigger_model_dir):
    low = profiled_blocks(model_dir, memory_utilization=0.1)
    high = profiled_blocks(model_dir, memory_utilization=0.3)
    assert high > 2 * low > 0  # (0.3 T - used) / (0.1 T - used) > 3 while used < 0.1 T
    bigger = profiled_blocks(bigger_model_dir, memory_utilization=0.1,
                             tokenizer=model_dir)  # the tiny tokenizer: same vocabulary
    assert bigger < low / 3  # 4x the layers: 4x the bytes per block, and more weights


def test_explicit_budgets_take_precedence(model_dir):
    assert profiled_blocks(model_dir, num_gpu_blocks_override=40) == 40
    # 2 layers * (K, V) * 16 tokens * 2 KV heads * 16 dims * 4 bytes = 8 KiB per block
    assert profiled_blocks(model_dir, kv_cache_memory_bytes=100 * 8192) == 100


@pytest.mark.parametrize("kwargs, knob", [
    (dict(memory_utilization=1e-4), "--memory-utilization"),
    (dict(kv_cache_memory_bytes=8192), "--kv-cache-memory"),
])
def test_impossible_configuration_fails_at_start_up(model_dir, kwargs, knob):
    with pytest.raises(ValueError, match=knob):
        LLM(model_dir, max_model_len=128, dtype="float32", **kwargs)


def test_impossible_configuration_in_worker_processes(model_dir):
    config = make_engine_config(model_dir, max_model_len=128, dtype="float32",
                                tensor_parallel_size=2, memory_utilization=1e-4)
    executor = MultiProcExecutor(config)
    with pytest.raises(ValueError, match="max-model-len.*--memory-utilization"):
        executor.initialize()
    assert leftovers(executor.worker_pids, executor.shm_names) == []
    assert not os.path.exists(
        os.path.dirname(executor.queue.addresses.broadcast.removeprefix("ipc://")))
