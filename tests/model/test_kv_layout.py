"""The KV cache layout of loom/model/attention/kv_layout.py is the one in use: the model
runner allocates that shape, and every backend's KV write (the torch reference's
index_copy, the cpu backend's native kernel) puts token t of sequence s at the index the
layout declares, and nowhere else."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from loom.engine_args import make_engine_config
from loom.core.wire import NewRequestData, SchedulerOutput
from loom.kernels import native_ops_for
from loom.model.attention import get_attn_backend
from loom.model.attention.kv_layout import (KEY, KV_SCALE_BYTES, VALUE, kv_cache_index,
                                           kv_cache_shape)
from loom.model.attention.metadata import AttentionMetadata
from loom.sampling_params import SamplingParams
from loom.worker.model_runner import ModelRunner

from .checkpoints import make_tiny_checkpoint

BACKENDS = ("torch", "cpu")
BLOCK_SIZE = 4


def require_kernels(backend: str, dtype: torch.dtype) -> None:
    """The cpu backend is only itself with the native kernels (else it runs torch's code)."""
    if backend == "cpu":
        assert native_ops_for(torch.device("cpu"), dtype) is not None


def test_declared_index_is_the_documented_map():
    # block_size 4: slot 13 is block 3, offset 1
    assert kv_cache_shape(num_blocks=5, block_size=4, num_kv_heads=2, head_dim=8) == \
        (2, 2, 5, 4, 8)
    assert kv_cache_index(VALUE, 1, 13, 4) == (1, 1, 3, 1)
    # the flat offset the native kernels use: ((kind * Hkv + h) * num_slots + s) * D
    cache = torch.arange(2 * 2 * 5 * 4 * 8).view(kv_cache_shape(5, 4, 2, 8))
    for kind in (KEY, VALUE):
        for head in range(2):
            for slot in range(20):
                assert cache[kv_cache_index(kind, head, slot, 4)][0] == \
                    ((kind * 2 + head) * 20 + slot) * 8


def test_an_int8_row_holds_its_scale_after_the_values():
    # head_dim 8: 8 int8 values, then the float32 scale's 4 bytes
    assert kv_cache_shape(5, 4, 2, 8, quantized=True) == (2, 2, 5, 4, 8 + KV_SCALE_BYTES)


# ---------------------------------------------------------------- a backend's KV write

def run_step(impl, kv_cache, requests, dtype, generator):
    """One forward of ``impl`` for ``requests``: (block ids, tokens cached, new tokens).
    Returns the step's key and value (T, Hkv, D) and each new token's (request, position)."""
    slots, positions_of, query_start_loc, seq_lens = [], [], [0], []
    for req, (blocks, cached, new) in enumerate(requests):
        for pos in range(cached, cached + new):
            slots.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            positions_of.append((req, pos))
        query_start_loc.append(query_start_loc[-1] + new)
        seq_lens.append(cached + new)
    width = max(len(blocks) for blocks, _, _ in requests)
    block_table = np.array([blocks + [0] * (width - len(blocks)) for blocks, _, _ in requests])
    metadata = AttentionMetadata.from_numpy(np.array(slots), np.array(query_start_loc),
                                            np.array(seq_lens), block_table, BLOCK_SIZE,
                                            torch.device("cpu"))
    num_tokens = len(slots)
    query = torch.randn(num_tokens, impl.num_heads, impl.head_dim, generator=generator)
    key = torch.randn(num_tokens, impl.num_kv_heads, impl.head_dim, generator=generator)
    value = torch.randn(num_tokens, impl.num_kv_heads, impl.head_dim, generator=generator)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    with torch.inference_mode():
        out = impl.forward(query, key, value, kv_cache, metadata)
    assert not out.isnan().any()  # attention read only written slots
    return key, value, positions_of


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_writes_token_t_of_sequence_s_at_the_declared_index(backend, dtype):
    require_kernels(backend, dtype)
    num_heads, num_kv_heads, head_dim, num_blocks = 4, 2, 16, 12
    impl = get_attn_backend(backend)(num_heads, num_kv_heads, head_dim, head_dim ** -0.5)
    kv_cache = torch.full(impl.kv_cache_shape(num_blocks, BLOCK_SIZE), float("nan"),
                          dtype=dtype)
    assert kv_cache.shape == kv_cache_shape(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)  # a sequence's blocks are scattered and out of order
    lengths = [7, 1, 10]  # prompts; then two decode steps
    blocks = [[free.pop() for _ in range(-(-(n + 2) // BLOCK_SIZE))] for n in lengths]
    generator = torch.Generator().manual_seed(0)
    written: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    steps = [[(blocks[s], 0, n) for s, n in enumerate(lengths)],       # prefill all
             [(blocks[s], n, 1) for s, n in enumerate(lengths)],       # decode
             [(blocks[s], n + 1, 1) for s, n in enumerate(lengths)]]   # decode
    for requests in steps:
        key, value, positions_of = run_step(impl, kv_cache, requests, dtype, generator)
        for row, (seq, pos) in enumerate(positions_of):
            written[seq, pos] = key[row], value[row]
        for (seq, pos), (k, v) in written.items():
            slot = blocks[seq][pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            for head in range(num_kv_heads):
                assert torch.equal(kv_cache[kv_cache_index(KEY, head, slot, BLOCK_SIZE)], k[head])
                assert torch.equal(kv_cache[kv_cache_index(VALUE, head, slot, BLOCK_SIZE)],
                                   v[head])
        # nothing else was written: every other (kind, head, slot) row is still NaN
        untouched = kv_cache.isnan().all(-1).sum().item()
        assert untouched == 2 * num_kv_heads * (num_blocks * BLOCK_SIZE - len(written))


# ---------------------------------------------------------------- the model runner's allocation

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"))  # head_dim 32


def make_runner(path: str, backend: str, dtype: str, **kwargs) -> ModelRunner:
    config = make_engine_config(path, dtype=dtype, max_model_len=64, max_num_seqs=4,
                                block_size=BLOCK_SIZE, num_gpu_blocks_override=16,
                                skip_tokenizer_init=True, attention_backend=backend, **kwargs)
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_allocates_the_declared_shape_and_writes_there(checkpoint, backend, dtype):
    """The runner's cache tensors have the declared shape and are what each layer reads;
    after a real step, layer 0's V of token t of sequence s (the v rows of its qkv
    projection: no rope) is at the declared index."""
    require_kernels(backend, getattr(torch, dtype))
    runner = make_runner(checkpoint, backend, dtype)
    model = runner.model
    assert model.attention_layers[0].impl.name == backend
    runner.initialize_kv_cache(16)
    attn = model.model.layers[0].self_attn
    declared = kv_cache_shape(16, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
    assert declared == (2, 2, 16, BLOCK_SIZE, 32)
    assert len(runner.kv_caches) == model.num_attention_layers
    for layer, kv_cache in zip(model.attention_layers, runner.kv_caches):
        assert kv_cache.shape == declared and kv_cache.is_contiguous()
        assert layer.kv_cache is kv_cache

    prompts = [list(range(5, 14)), list(range(40, 46))]  # 9 and 6 tokens
    block_ids = [[11, 2, 7], [4, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    runner.execute_model(SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req_id=str(s), prompt_token_ids=prompt,
                                           output_token_ids=[], sampling_params=params,
                                           eos_token_ids=[], block_ids=block_ids[s],
                                           num_computed_tokens=0)
                            for s, prompt in enumerate(prompts)],
        scheduled_cached_reqs=[], num_scheduled_tokens={"0": 9, "1": 6},
        total_num_scheduled_tokens=15, finished_req_ids=[]))

    layer = model.model.layers[0]
    with torch.inference_mode():
        for s, prompt in enumerate(prompts):
            hidden = layer.input_layernorm.forward(model.model.embed_tokens(torch.tensor(prompt)))
            qkv = layer.self_attn.qkv_proj.forward(hidden)
            v = qkv[:, attn.q_size + attn.kv_size:].view(len(prompt), attn.num_kv_heads,
                                                         attn.head_dim)
            for t in range(len(prompt)):
                slot = block_ids[s][t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE
                for head in range(attn.num_kv_heads):
                    stored = runner.kv_caches[0][kv_cache_index(VALUE, head, slot, BLOCK_SIZE)]
                    torch.testing.assert_close(stored, v[t, head], atol=1e-5, rtol=0)


def test_runner_allocates_int8_rows_with_their_scales(checkpoint):
    runner = make_runner(checkpoint, "torch", "bfloat16", kv_cache_dtype="int8")
    runner.initialize_kv_cache(16)
    attn = runner.model.model.layers[0].self_attn
    declared = kv_cache_shape(16, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim, quantized=True)
    assert declared == (2, 2, 16, BLOCK_SIZE, 32 + KV_SCALE_BYTES)
    for layer, kv_cache in zip(runner.model.attention_layers, runner.kv_caches):
        assert kv_cache.shape == declared and kv_cache.dtype == torch.int8
        assert layer.kv_cache is kv_cache
