"""The cases of tests/model/test_triton_attention.py that run loom's Triton attention
kernels (loom/model/attention/triton_attention.py) on the CPU, under Triton's interpreter.
That test runs this file in a fresh process with TRITON_INTERPRET=1: Triton reads the
switch when it decorates, its own library's functions at its import included, so the
switch must be set before anything imports triton, and must not reach the other tests'
process (which imports triton through torch and xgrammar, for a GPU).
On a GPU (``LOOM_TEST_DEVICE=cuda``, ``benchmarks/cuda_check.sh``) the same cases run the
compiled kernels on CUDA tensors.

Each case gives the torch reference backend's results: decodes of requests of different
lengths over scattered blocks, the split (flash-decoding) decode, prefill chunks over
cached prefixes mixed with decodes, GQA groups of 1, 2 and 4, sliding windows (the blocks
before a window unreadable), a head size that is no power of two, strided queries, a
float16 model, a bfloat16 cache under a float32 model, and the int8 / fp8 caches
dequantized in the kernel; then greedy tokens through the engine with
``--attention-backend triton`` equal the torch backend's on a tiny Llama and on Gemma 3's
hybrid sliding-window layout.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

# the CPU under the interpreter, or a GPU: benchmarks/cuda_check.sh runs this file with
# LOOM_TEST_DEVICE=cuda, the kernels compiled
DEVICE = os.environ.get("LOOM_TEST_DEVICE", "cpu")
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run by tests/model/test_triton_attention.py, under TRITON_INTERPRET=1",
                allow_module_level=True)

from loom.model.attention import triton_attention  # noqa: E402
from loom.model.attention.kv_layout import is_quantized_kv, kv_row_qmax  # noqa: E402
from loom.model.attention.metadata import AttentionMetadata  # noqa: E402
from loom.model.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from loom.model.attention import triton_backend  # noqa: E402
from loom.model.attention.triton_backend import TritonAttentionBackend  # noqa: E402

BLOCK_SIZE = 4
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=4e-3, rtol=4e-3)}


def test_the_kernels_are_interpreted_on_the_cpu_only():
    assert triton_attention.INTERPRETED == (DEVICE == "cpu")


class Scenario:
    """A step of requests ``(cached, new)``: every position's K/V drawn at random, the
    cached ones already in a cache of scattered blocks, every other row unreadable (NaN;
    a quantized row's scale bytes 0xFF, a NaN scale), the new tokens' queries, K and V."""

    def __init__(self, requests: list[tuple[int, int]], num_heads: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, cache_dtype: torch.dtype | None = None,
                 seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.dtype, self.cache_dtype = dtype, cache_dtype or dtype
        num_blocks = 2 + sum(-(-(c + n) // BLOCK_SIZE) for c, n in requests)
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)  # a request's blocks scattered, out of order
        self.tables = [[free.pop() for _ in range(-(-(c + n) // BLOCK_SIZE))]
                       for c, n in requests]
        self.requests = requests
        shape = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, 1.0).kv_cache_shape(
            num_blocks, BLOCK_SIZE, is_quantized_kv(self.cache_dtype))
        if is_quantized_kv(self.cache_dtype):
            self.cache = torch.full(shape, -1, dtype=torch.int8, device=DEVICE).view(
                self.cache_dtype)
        else:
            self.cache = torch.full(shape, float("nan"), dtype=self.cache_dtype, device=DEVICE)

        def draw(n: int, heads: int) -> torch.Tensor:
            return torch.randn(n, heads, head_dim, generator=generator).to(DEVICE, dtype)

        cached_slots = [self.slot(i, p) for i, (c, _) in enumerate(requests) for p in range(c)]
        if cached_slots:
            n = len(cached_slots)
            TorchAttentionBackend._write_kv(draw(n, num_kv_heads), draw(n, num_kv_heads),
                                            self.cache, torch.tensor(cached_slots, device=DEVICE))
        num_new = sum(n for _, n in requests)
        self.query = draw(num_new, num_heads)
        self.key, self.value = draw(num_new, num_kv_heads), draw(num_new, num_kv_heads)
        starts = [0]
        for _, n in requests:
            starts.append(starts[-1] + n)
        lens = [c + n for c, n in requests]
        width = max(map(len, self.tables))
        self.metadata = AttentionMetadata(
            slot_mapping=torch.tensor([self.slot(i, p) for i, (c, n) in enumerate(requests)
                                       for p in range(c, c + n)], device=DEVICE),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEVICE),
            block_table=torch.tensor([t + [0] * (width - len(t)) for t in self.tables],
                                     dtype=torch.int32, device=DEVICE),
            query_start_loc_cpu=starts, seq_lens_cpu=lens,
            max_query_len=max(n for _, n in requests), max_seq_len=max(lens),
            block_size=BLOCK_SIZE)

    def slot(self, request: int, position: int) -> int:
        return self.tables[request][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE

    def hide_blocks_before_windows(self, window: int) -> None:
        """Make unreadable every block no new query of its request sees (KVCacheManager
        may have handed it to another request)."""
        rows = self.cache.view(torch.int8) if is_quantized_kv(self.cache_dtype) else self.cache
        for table, (cached, _) in zip(self.tables, self.requests):
            first_seen = max(0, cached - window + 1)
            for block in table[:first_seen // BLOCK_SIZE]:
                rows[:, :, block] = -1 if rows.dtype == torch.int8 else float("nan")

    def run(self, backend_cls, num_heads: int, num_kv_heads: int, head_dim: int,
            window: int | None = None) -> torch.Tensor:
        """One forward of a fresh ``backend_cls`` layer on a copy of the cache."""
        impl = backend_cls(num_heads, num_kv_heads, head_dim, head_dim ** -0.5, window)
        cache = self.cache.clone()
        with torch.inference_mode():
            return impl.forward(self.query, self.key, self.value, cache, self.metadata)


def check(requests, num_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.float32,
          cache_dtype=None, window=None, seed=0):
    scenario = Scenario(requests, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, seed)
    if window is not None:
        scenario.hide_blocks_before_windows(window)
    expected = scenario.run(TorchAttentionBackend, num_heads, num_kv_heads, head_dim, window)
    got = scenario.run(TritonAttentionBackend, num_heads, num_kv_heads, head_dim, window)
    assert not expected.isnan().any()
    torch.testing.assert_close(got, expected, **TOLERANCE[dtype])
    return scenario


# ---------------------------------------------------------------- decode

DECODES = [(0, 1), (4, 1), (16, 1), (70, 1)]  # a fresh token, a block, several, a long one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # GQA groups of 1, 2 and 4 query heads
def test_decode_of_requests_of_different_lengths_over_scattered_blocks(dtype, num_kv_heads):
    check(DECODES, num_heads=4, num_kv_heads=num_kv_heads, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_decode_reduces_to_the_unsplit_result(dtype, monkeypatch):
    """Contexts cut into runs (flash-decoding), some runs empty for the short ones."""
    scenario = Scenario([(2, 1), (41, 1), (130, 1)], 4, 2, 16, dtype)
    expected = scenario.run(TorchAttentionBackend, 4, 2, 16)
    for splits in (3, 16):
        monkeypatch.setattr(triton_attention, "decode_splits", lambda *_, n=splits: n)
        got = scenario.run(TritonAttentionBackend, 4, 2, 16)
        torch.testing.assert_close(got, expected, **TOLERANCE[dtype])


def test_decode_splits_grow_with_the_context_and_shrink_with_the_batch():
    assert triton_attention.decode_splits(1, 8, 200) == 1  # too short to cut
    assert triton_attention.decode_splits(1, 8, 4096) == 16
    assert triton_attention.decode_splits(2, 8, 1024) == 4
    assert triton_attention.decode_splits(64, 8, 32768) == 1  # the batch fills the GPU


# ---------------------------------------------------------------- prefill and mixed steps

# fresh prompts, chunks over cached prefixes (one crossing query blocks), decodes between
MIXED = [(0, 7), (5, 9), (20, 1), (3, 40), (0, 1), (11, 2)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_prefill_over_cached_prefixes_mixed_with_decodes(dtype, num_kv_heads):
    check(MIXED, num_heads=4, num_kv_heads=num_kv_heads, dtype=dtype)


def test_a_split_mixed_step_equals_the_reference(monkeypatch):
    """Splitting is not only for decodes: every query block's key range cuts alike."""
    scenario = Scenario(MIXED, 4, 2, 16, torch.float32)
    expected = scenario.run(TorchAttentionBackend, 4, 2, 16)
    real = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention",
                        lambda *args, **kwargs: real(*args, **kwargs, num_splits=4))
    monkeypatch.setattr(triton_backend, "paged_attention", triton_attention.paged_attention)
    got = scenario.run(TritonAttentionBackend, 4, 2, 16)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_head_size_that_is_no_power_of_two_and_strided_queries():
    scenario = Scenario(MIXED, 4, 2, 24, torch.float32)
    # the query as a view into a fused projection's rows, as the model hands it over
    fused = torch.randn(scenario.query.shape[0], 4 * 24 + 2 * 2 * 24, device=DEVICE)
    fused[:, :96] = scenario.query.flatten(1)
    scenario.query = fused[:, :96].view(-1, 4, 24)
    assert not scenario.query.is_contiguous()
    expected = scenario.run(TorchAttentionBackend, 4, 2, 24)
    got = scenario.run(TritonAttentionBackend, 4, 2, 24)
    torch.testing.assert_close(got, expected, **TOLERANCE[torch.float32])


def test_float16_model_and_a_bfloat16_cache_under_a_float32_model():
    check(MIXED, dtype=torch.float16)
    check(MIXED, dtype=torch.float32, cache_dtype=torch.bfloat16)


# ---------------------------------------------------------------- sliding window

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_never_reads_the_blocks_before_it(dtype, monkeypatch):
    """W 6 over prompts longer than it, chunks and decodes; the blocks wholly before each
    request's first query's window are NaN. Split decodes too."""
    steps = [[(0, 13), (9, 5), (30, 1), (2, 1)], [(17, 1), (25, 1), (6, 1)]]
    for requests in steps:
        check(requests, dtype=dtype, window=6)
    monkeypatch.setattr(triton_attention, "decode_splits", lambda *_: 3)
    check(steps[1], dtype=dtype, window=6)


# ---------------------------------------------------------------- quantized cache

@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantized_cache_rows_are_dequantized_in_the_kernel(cache_dtype):
    """Dequantization is the reference's bit for bit, so float32 agrees as tightly as an
    unquantized cache; bf16 within its rounding; with a window, its blocks unreadable."""
    check(MIXED, dtype=torch.float32, cache_dtype=cache_dtype)
    check(DECODES, dtype=torch.bfloat16, cache_dtype=cache_dtype)
    check([(0, 13), (9, 5), (30, 1)], dtype=torch.float32, cache_dtype=cache_dtype, window=6)


def test_fp8_decoding_covers_every_byte():
    """Every e4m3fn and e5m2 byte but NaN and infinity decodes as torch converts it."""
    for cache_dtype, qmax in ((torch.float8_e4m3fn, 448.0), (torch.float8_e5m2, 57344.0)):
        assert kv_row_qmax(cache_dtype) == qmax
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache_dtype)
        finite = values.float().isfinite()
        values = values[finite]
        head_dim = values.numel()
        # one row holding every value, scale 1.0, as K and V of a lone token
        row = torch.cat([values.view(torch.int8),
                         torch.tensor([1.0]).view(torch.int8)]).view(cache_dtype)
        cache = torch.empty((2, 1, 1, BLOCK_SIZE, head_dim + 4), dtype=torch.int8)
        cache[:, 0, 0, 0] = row.view(torch.int8)  # (as bytes: CUDA has no fp8 copy kernel)
        cache = cache.view(cache_dtype).to(DEVICE)
        # a query that picks out nothing but the value: one key, weight 1, out = V's row
        out = triton_attention.paged_attention(
            torch.zeros(1, 1, head_dim, device=DEVICE), cache,
            torch.zeros(1, 1, dtype=torch.int32, device=DEVICE),
            torch.tensor([1], dtype=torch.int32, device=DEVICE),
            torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
            1.0, max_query_len=1, max_seq_len=1)
        torch.testing.assert_close(out[0, 0].cpu(), values.float(), atol=0, rtol=0)


# ---------------------------------------------------------------- through the engine

# Chunked prefill (16 tokens a step) over prompts longer than Gemma 3's window of 12,
# mixed prefill + decode steps, batched decodes.
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 130)), [5] * 12]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_tokens_equal_the_torch_backend(family, tmp_path):
    """float32, so that the two backends agree token for token; Gemma 3's layers are a
    hybrid cache (kv_cache_groups.py): a full group and two sliding ones, whose blocks
    leave the window and go back to the pool while their requests run."""
    from loom import LLM, SamplingParams
    from tokenizer_fixtures import make_tiny_tokenizer

    from checkpoints import make_tiny_checkpoint

    path = make_tiny_tokenizer(make_tiny_checkpoint(family, tmp_path))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        with LLM(path, device=DEVICE, dtype="float32", attention_backend=backend,
                 max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
                 num_gpu_blocks_override=48, enable_warm_up=False) as llm:
            runner = llm.engine.engine_core.executor.worker.model_runner
            assert {layer.impl.name for layer in runner.model.attention_layers} == {backend}
            groups = runner.kv_cache_groups.windows
            outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                   use_tqdm=False)
        results[backend] = [list(o.outputs[0].token_ids) for o in outputs]
    if family == "gemma3":
        assert len(groups) == 3 and groups[0] is None and groups[1] is not None
    assert all(len(tokens) == 8 for tokens in results["torch"])
    assert results["triton"] == results["torch"]
