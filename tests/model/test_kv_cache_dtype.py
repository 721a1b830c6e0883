"""--kv-cache-dtype int8, fp8_e4m3 (fp8) and fp8_e5m2 (``LLM(kv_cache_dtype=...)``): K and
V quantized per token and head, each row's float32 scale beside it (kv_layout.py). The
native write kernel quantizes exactly as the torch reference does (fp8: rounding to
nearest even, ties included), the native attention reads a quantized cache exactly as it
reads that cache dequantized, greedy tokens of the two backends agree over chunked
prefill and prefix hits, the replayed forward equals the modules, the quantized cache
keeps the bf16 cache's top-1 token, and a KV budget holds about twice the tokens."""

from __future__ import annotations

import pytest
import torch

from loom import LLM, SamplingParams
from loom.kernels import native_ops
from loom.model.attention.kv_layout import KV_SCALE_BYTES, kv_cache_dtype
from loom.model.attention.torch_backend import (TorchAttentionBackend, dequantize_kv_rows,
                                                quantize_kv_rows)
from loom.model.loader import kv_cache_bytes_per_block, load_hf_config, load_model
from tokenizer_fixtures import make_tiny_tokenizer

from .checkpoints import make_tiny_checkpoint
from .paged import PagedDriver
from .test_kernels import _paged_case

DTYPES = [torch.float32, torch.bfloat16]
# the quantized row formats, as their cache tensors' dtypes
FORMATS = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A cache's bytes, to compare (torch.equal has no fp8 kernel)."""
    return cache.view(torch.int8)


@pytest.fixture(scope="module")
def ops():
    module = native_ops()
    if module is None:
        pytest.skip("native kernels unavailable")
    return module


def test_rows_hold_values_and_their_scale():
    x = torch.tensor([[0.0, 0.5, -2.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    rows = quantize_kv_rows(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 4 + KV_SCALE_BYTES)
    assert rows[0, :4].tolist() == [0, 32, -127, 64]  # 0.5 / (2 / 127) = 31.75 -> 32
    assert rows[0, 4:].view(torch.float32).item() == pytest.approx(2 / 127)
    assert rows[1, :4].tolist() == [0, 0, 0, 0]  # an all-zero row stays zero
    back = dequantize_kv_rows(rows, torch.float32)
    assert torch.all((back - x).abs() <= (2 / 127) / 2 + 1e-7)
    assert torch.equal(back[1], x[1])


@pytest.mark.parametrize("fmt,qmax", [(torch.float8_e4m3fn, 448), (torch.float8_e5m2, 57344)])
def test_fp8_rows_hold_values_and_their_scale(fmt, qmax):
    x = torch.tensor([[0.0, 0.5, -2.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    rows = quantize_kv_rows(x, fmt)
    assert rows.dtype == fmt and rows.shape == (2, 4 + KV_SCALE_BYTES)
    scale = torch.tensor(2.0) / qmax
    # max |x| lands on the format's largest value; 0.5 and 1.0 are exact in both
    assert rows[0, :4].float().tolist() == [0.0, qmax / 4, -qmax, qmax / 2]
    assert as_bytes(rows[0, 4:]).view(torch.float32).item() == scale.item()
    assert rows[1, :4].float().tolist() == [0.0] * 4  # an all-zero row stays zero
    torch.testing.assert_close(dequantize_kv_rows(rows, torch.float32), x, atol=0, rtol=1e-6)


# With max |x| = QMAX the scale is 1 and each value is rounded as it is: halfway cases
# go to the even neighbour (E4M3: 3 mantissa bits, E5M2: 2), subnormals included.
FP8_ROUNDING = {
    torch.float8_e4m3fn: (448.0, [(1.0625, 1.0), (1.1875, 1.25), (17.0, 16.0), (19.0, 20.0),
                                  (-1.0625, -1.0), (2.0 ** -10, 0.0), (3 * 2.0 ** -10, 2.0 ** -8),
                                  (1.06, 1.0), (1.07, 1.125), (440.0, 448.0)]),
    torch.float8_e5m2: (57344.0, [(1.125, 1.0), (1.375, 1.5), (-1.125, -1.0), (9.0, 8.0),
                                  (11.0, 12.0), (2.0 ** -17, 0.0), (3 * 2.0 ** -17, 2.0 ** -15),
                                  (1.13, 1.25), (53248.0, 49152.0), (55000.0, 57344.0)]),
}


@pytest.mark.parametrize("fmt", list(FP8_ROUNDING))
def test_fp8_rounds_to_nearest_even_in_the_kernel_and_the_reference(ops, fmt):
    """torch's .to(float8) (the reference) and c10's conversion (the write kernel) round
    alike: to nearest, ties to even, subnormals too."""
    qmax, cases = FP8_ROUNDING[fmt]
    x = torch.tensor([qmax] + [c for c, _ in cases])
    want = [qmax] + [r for _, r in cases]
    reference = quantize_kv_rows(x, fmt)
    assert reference[:-KV_SCALE_BYTES].float().tolist() == want
    assert as_bytes(reference[-KV_SCALE_BYTES:]).clone().view(torch.float32).item() == 1.0
    key = x.view(1, 1, -1)
    cache = torch.zeros(2, 1, 1, 1, x.numel() + KV_SCALE_BYTES, dtype=fmt)
    ops.write_kv_cache(key, key, cache, torch.tensor([0]))
    assert torch.equal(as_bytes(cache[0, 0, 0, 0]), as_bytes(reference))


@pytest.mark.parametrize("fmt", list(FP8_ROUNDING))
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_attention_reads_every_fp8_value_as_the_reference(ops, dtype, fmt):
    """Every finite code of the format (subnormals and -0 included) in V rows of 269
    (16-lane, 8-lane and scalar reads), each row rotated otherwise, one request per row
    over a one-token context: its softmax weight is 1, so the output is the row as the
    kernel dequantized it, which equals the reference's dequantization."""
    codes = torch.arange(256).to(torch.uint8)
    codes = codes[torch.isfinite(codes.view(fmt).float())]
    head_dim, batch = 269, 8
    row = codes.repeat(2)[:head_dim]
    cache = torch.zeros(2, 1, batch, 1, head_dim + KV_SCALE_BYTES, dtype=torch.uint8)
    for i in range(batch):
        cache[1, 0, i, 0, :head_dim] = row.roll(37 * i)
        cache[:, 0, i, 0, head_dim:] = torch.tensor([0.75]).view(torch.uint8)
    cache = cache.view(fmt)
    q = torch.randn(batch, 1, head_dim).to(dtype)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.paged_attention(out, q, cache, torch.arange(batch, dtype=torch.int32).view(batch, 1),
                        torch.ones(batch, dtype=torch.int32),
                        torch.arange(batch + 1, dtype=torch.int32), 0.125, 1 << 30)
    want = dequantize_kv_rows(cache[1, 0, :, 0], dtype)
    assert want.float().abs().amax() > 100 and (want.float().abs() < 1e-3).any()
    assert torch.equal(out[:, 0], want)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kernel_quantizes_as_the_reference(ops, dtype, fmt):
    torch.manual_seed(0)
    key = torch.randn(9, 3, 64).to(dtype)
    value = (torch.randn(9, 3, 64) * 40).to(dtype)
    key[4, 1] = 0  # a zero vector: scale FLT_MIN, values 0
    value[2, 0, 5] = 1e4  # an outlier takes its row's scale
    slots = torch.tensor([3, 17, 0, 9, 30, 4, 22, 11, 8])
    shape = TorchAttentionBackend(6, 3, 64, 0.125).kv_cache_shape(8, 4, quantized=True)
    assert shape == (2, 3, 8, 4, 64 + KV_SCALE_BYTES)
    native, reference = torch.zeros(shape, dtype=fmt), torch.zeros(shape, dtype=fmt)
    ops.write_kv_cache(key, value, native, slots)
    TorchAttentionBackend._write_kv(key, value, reference, slots)
    assert torch.equal(as_bytes(native), as_bytes(reference))
    assert as_bytes(native).any()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window", [
    (9, 3, 64, 16, 0),   # SmolLM2-135M's heads: the bf16 kernel's AVX-512 path
    (4, 2, 16, 4, 0),    # the tiny checkpoints' heads
    (4, 2, 32, 4, 7),    # a sliding window
    (6, 2, 48, 8, 0),    # a head_dim the AVX-512 path does not take
])
def test_native_attention_reads_a_quantized_cache_as_the_dequantized_cache(
        ops, dtype, heads, kv_heads, head_dim, block_size, window, fmt):
    """Decodes, a verify of 4, a chunk over a cached prefix, a prefill from scratch: the
    kernel over the quantized cache gives the bits it gives over that cache dequantized
    to the model's dtype, and the torch backend over the quantized cache agrees as it
    does over a cache in the model's dtype (tests/model/test_kernels.py's tolerances)."""
    context_lens, query_lens = [1, 37, 120, 50 + 31, 40, 20], [1, 1, 4, 31, 40, 1]
    cache, metadata, q, k, v = _paged_case(context_lens, query_lens, heads, kv_heads,
                                           head_dim, block_size, dtype)
    cache = quantize_kv_rows(cache, fmt)
    scale = head_dim ** -0.5
    reference_cache = cache.clone()
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, scale, window or None)
    expected = backend.forward(q, k, v, reference_cache, metadata)
    ops.write_kv_cache(k, v, cache, metadata.slot_mapping)
    assert torch.equal(as_bytes(cache), as_bytes(reference_cache))
    dequantized = dequantize_kv_rows(cache, dtype)
    out, out_dequantized = (torch.full(q.shape, float("nan"), dtype=dtype) for _ in range(2))
    for result, kv_cache in ((out, cache), (out_dequantized, dequantized)):
        ops.paged_attention_windowed(result, q, kv_cache, metadata.block_table,
                                     metadata.seq_lens, metadata.query_start_loc, scale,
                                     1 << 30, window)
    assert torch.equal(out, out_dequantized)
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


def test_bfloat16_cache_under_a_float32_model(ops):
    """--kv-cache-dtype bfloat16 with a float32 model: rows rounded to bf16 on write and
    read back as float32, alike in both backends."""
    context_lens, query_lens = [1, 37, 50 + 31], [1, 1, 31]
    cache, metadata, q, k, v = _paged_case(context_lens, query_lens, 4, 2, 32, 4,
                                           torch.float32)
    cache = cache.to(torch.bfloat16)
    reference_cache = cache.clone()
    expected = TorchAttentionBackend(4, 2, 32, 0.2).forward(q, k, v, reference_cache, metadata)
    ops.write_kv_cache(k, v, cache, metadata.slot_mapping)
    assert torch.equal(cache, reference_cache)
    out = torch.empty_like(q)
    ops.paged_attention(out, q, cache, metadata.block_table, metadata.seq_lens,
                        metadata.query_start_loc, 0.2, 1 << 30)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


# Chunked prefill (16 tokens a step), mixed steps, batched decodes; the last prompt
# repeats the first's 32-token prefix, so it starts from a prefix-cache hit.
PROMPTS = [list(range(3, 40)), [7, 8, 9], list(range(100, 130)), list(range(3, 35)) + [5] * 9]
MAX_TOKENS = 10
ENGINE_KWARGS = dict(max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
                     num_gpu_blocks_override=64, enable_warm_up=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {family: make_tiny_tokenizer(make_tiny_checkpoint(
        family, tmp_path_factory.mktemp(family))) for family in ("llama", "gemma3")}


def greedy(path: str, **kwargs) -> tuple[list[list[int]], int]:
    """Greedy tokens of PROMPTS (the last one after the others), and the prefix-cache
    hits in tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(path, **ENGINE_KWARGS, **kwargs) as llm:
        worker = getattr(llm.engine.engine_core.executor, "worker", None)  # one rank
        if worker is not None:
            runner = worker.model_runner
            assert runner.kv_caches[0].dtype == kv_cache_dtype(kwargs["kv_cache_dtype"],
                                                               runner.dtype)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:-1]], params,
                               use_tqdm=False)
        outputs += llm.generate([{"prompt_token_ids": PROMPTS[-1]}], params, use_tqdm=False)
        hits = outputs[-1].num_cached_tokens
    return [list(o.outputs[0].token_ids) for o in outputs], hits


@pytest.mark.parametrize("family,cache_dtype", [
    ("llama", "int8"), ("gemma3", "int8"), ("llama", "bfloat16"), ("llama", "fp8_e4m3"),
    ("gemma3", "fp8"), ("llama", "fp8_e5m2")])
def test_float32_greedy_tokens_equal_under_torch_and_cpu(checkpoints, family, cache_dtype):
    """Gemma 3: sliding-window layers in their own KV cache groups (hybrid cache). A
    bfloat16 cache under a float32 model: rows rounded on write, read as float32."""
    torch_tokens, torch_hits = greedy(checkpoints[family], dtype="float32",
                                      attention_backend="torch", kv_cache_dtype=cache_dtype)
    cpu_tokens, cpu_hits = greedy(checkpoints[family], dtype="float32",
                                  attention_backend="cpu", kv_cache_dtype=cache_dtype)
    assert torch_hits == cpu_hits == 32
    assert cpu_tokens == torch_tokens


def test_bfloat16_int8_greedy_tokens_under_torch_and_cpu(checkpoints):
    """bf16 matmuls round differently along the two paths (as with a bf16 cache,
    tests/model/test_attention_backends.py), the cache's values do not: at least 90% of
    positions agree (a divergence counts for every later position)."""
    torch_tokens, _ = greedy(checkpoints["llama"], dtype="bfloat16", attention_backend="torch",
                             kv_cache_dtype="int8")
    cpu_tokens, _ = greedy(checkpoints["llama"], dtype="bfloat16", attention_backend="cpu",
                           kv_cache_dtype="int8")
    same = sum(a == b for x, y in zip(torch_tokens, cpu_tokens) for a, b in zip(x, y))
    assert same >= 0.9 * len(PROMPTS) * MAX_TOKENS, (torch_tokens, cpu_tokens)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3"])
def test_tensor_parallel_and_ngram_speculation_over_a_quantized_cache(checkpoints,
                                                                     cache_dtype):
    """Each of 2 ranks quantizes and reads its own KV head; an ngram speculation's
    verify reads several new tokens at once: both give one rank's plain greedy tokens."""
    path = checkpoints["llama"]
    plain, _ = greedy(path, dtype="float32", kv_cache_dtype=cache_dtype)
    tp2, hits = greedy(path, dtype="float32", kv_cache_dtype=cache_dtype,
                       tensor_parallel_size=2)
    speculated, _ = greedy(path, dtype="float32", kv_cache_dtype=cache_dtype,
                           speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert hits == 32
    assert tp2 == plain and speculated == plain


@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn])
def test_replayed_forward_over_a_quantized_cache_equals_the_modules(checkpoints, monkeypatch,
                                                                    fmt):
    """bf16 on the CPU: the same steps with the forward run by its modules and replayed
    from loom's kernels (kernel_replay.py) give the same logits, bit for bit."""
    from loom.envs import settings
    from loom.model import kernel_replay

    ops = native_ops()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("no native bf16 kernels on this CPU")
    monkeypatch.setattr(kernel_replay, "RECORD_AFTER", 0)
    path = checkpoints["llama"]
    config = load_hf_config(path)
    results = {}
    for setting in ("0", "1"):
        prompts = [[5, 9, 11, 3, 7], list(range(20, 31))]
        monkeypatch.setenv("LOOM_NATIVE_LAYERS", setting)
        settings.cache_clear()  # loom.envs reads the environment once
        model = load_model(path, config, dtype=torch.bfloat16)
        driver = PagedDriver(model, num_blocks=32, block_size=4, dtype=fmt)
        # request 1 prefilled in two chunks, the first beside request 0's prompt
        logits = [driver.step([(0, prompts[0], 5), (1, prompts[1][:6], 6)])]
        prompts[0].append(int(logits[-1][4].argmax()))
        logits.append(driver.step([(1, prompts[1], 5)]))
        prompts[1].append(int(logits[-1][-1].argmax()))
        for _ in range(4):
            step = driver.step([(0, prompts[0], 1), (1, prompts[1], 1)])
            logits.append(step)
            for tokens, row in zip(prompts, step):
                tokens.append(int(row.argmax()))
        results[setting] = logits
        replay = getattr(model, "kernel_replay", None)
        assert (replay is not None) == (setting == "1")
        if replay is not None:
            assert replay.refusal is None and replay.stats.replayed >= 3
    for python, native in zip(results["0"], results["1"]):
        assert torch.equal(python, native)
    settings.cache_clear()


@pytest.mark.parametrize("fmt,floor", [(torch.int8, 0.97), (torch.float8_e4m3fn, 0.94),
                                       (torch.float8_e5m2, 0.88)])
def test_quantized_cache_keeps_the_bf16_caches_top1(checkpoints, fmt, floor):
    """A few hundred positions of a bf16 model, one prefill each, over a bf16 cache and
    a quantized one (torch backend): the top-1 token agrees at nearly every position
    (E5M2's 2 mantissa bits round coarsest)."""
    path = checkpoints["llama"]
    config = load_hf_config(path)
    model = load_model(path, config, dtype=torch.bfloat16, attention_backend="torch")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, config.vocab_size, (100,), generator=gen).tolist()
               for _ in range(4)]
    top1 = {}
    for cache_dtype in (torch.bfloat16, fmt):
        driver = PagedDriver(model, num_blocks=128, block_size=4, dtype=cache_dtype)
        # in chunks of 25, so that each chunk reads the earlier ones from the cache
        top1[cache_dtype] = torch.cat([
            driver.step([(i, prompt[:end], 25)]).argmax(-1)
            for i, prompt in enumerate(prompts) for end in range(25, 101, 25)])
    agreement = (top1[torch.bfloat16] == top1[fmt]).float().mean().item()
    assert top1[fmt].numel() == 400
    assert agreement >= floor, agreement


def test_a_kv_budget_holds_about_twice_the_tokens_in_int8_and_fp8(checkpoints):
    config = load_hf_config(checkpoints["llama"])
    # 2 layers x K,V x 4 tokens x 2 KV heads x (16 values + a 4-byte scale)
    for name in ("int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert kv_cache_bytes_per_block(config, 4, "bfloat16", 1, name) == 2 * 2 * 4 * 2 * 20
    # SmolLM2-135M's head_dim of 64: 68 bytes a row instead of 128
    bf16 = 2 * 64
    assert bf16 / (64 + KV_SCALE_BYTES) == pytest.approx(1.88, abs=0.01)
    blocks = {}
    for cache_dtype in ("auto", "int8", "fp8_e5m2"):  # 1 MiB: 256 blocks of 16 bf16 tokens
        with LLM(checkpoints["llama"], dtype="bfloat16", max_model_len=64, max_num_seqs=256,
                 kv_cache_memory_bytes=2**20, enable_warm_up=False,
                 kv_cache_dtype=cache_dtype) as llm:
            blocks[cache_dtype] = llm.engine.engine_core.executor.worker.num_blocks
    assert blocks["auto"] == 256
    assert blocks["int8"] / blocks["auto"] == pytest.approx(32 / 20, rel=0.01)
    assert blocks["fp8_e5m2"] == blocks["int8"]
