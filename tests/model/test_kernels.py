"""loom's native CPU kernels against the PyTorch ops they replace.

The kernels are built on first use (about a minute and a half on 2 cores, then
cached); these tests fail, rather than skip, when the build does: on a machine with a
compiler the native path is what serves."""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.nn.functional as F

from loom.envs import settings
from loom.kernels import native_ops
from loom.model.attention.metadata import AttentionMetadata
from loom.model.attention.torch_backend import TorchAttentionBackend
from loom.model.layers.rotary import RotaryEmbedding, _default_inv_freq

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops():
    module = native_ops()
    assert module is not None, "the native CPU kernels failed to build (see the log)"
    return module


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    # float32: summation order only; bf16: at most one unit in the last place
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(ops, dtype):
    torch.manual_seed(0)
    x, w = torch.randn(7, 576, dtype=dtype) * 3, torch.randn(576, dtype=dtype)
    expected = (w.float() * F.rms_norm(x.float(), (576,), eps=1e-5)).to(dtype)
    _close(ops.rms_norm(x, w, 1e-5), expected, dtype)
    # a strided view (a slice of q in Qwen3's q_norm) is read correctly
    wide = torch.randn(7, 2, 576, dtype=dtype)
    _close(ops.rms_norm(wide[:, 1], w, 1e-5),
           (w.float() * F.rms_norm(wide[:, 1].float(), (576,), eps=1e-5)).to(dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm(ops, dtype):
    torch.manual_seed(0)
    x, residual = torch.randn(5, 64, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    w = torch.randn(64, dtype=dtype)
    total = residual + x
    expected = (w.float() * F.rms_norm(total.float(), (64,), eps=1e-6)).to(dtype)
    ops.fused_add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(residual, total)  # the sum is rounded once, as `residual + x`
    _close(x, expected, dtype)


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_into_a_float32_residual_stream(ops, x_dtype):
    # a bfloat16 model's stream: residual float32, x a layer's float32 sums (or an MoE's
    # bf16 output), the norm out in bf16: the sum is exact float32, one rounding out
    torch.manual_seed(0)
    x = torch.randn(9, 96).to(x_dtype)
    residual = torch.randn(9, 96) * 3
    w = torch.randn(96, dtype=torch.bfloat16)
    total = residual + x.float()
    out = torch.empty(9, 96, dtype=torch.bfloat16)
    ops.add_rms_norm(out, x, residual, w, 1e-6)
    assert torch.equal(residual, total)
    expected = (w.float() * F.rms_norm(total, (96,), eps=1e-6)).bfloat16()
    _close(out, expected, torch.bfloat16)
    assert (out != expected).sum() <= 2  # only where float32 sums' order flips a rounding
    with pytest.raises(RuntimeError, match="weight's dtype"):
        ops.add_rms_norm(out.float(), x, residual, w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(ops, dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 2 * 1536, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    _close(ops.silu_and_mul(x), F.silu(gate) * up, dtype)
    big = torch.tensor([[-200.0, 90.0, 1.0, 2.0]], dtype=dtype)  # exp under/overflow
    _close(ops.silu_and_mul(big), F.silu(big[:, :2]) * big[:, 2:], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_in_place_matches_reference(ops, dtype, rotary_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, rotary_dim, 4096, _default_inv_freq(10000.0, rotary_dim))
    qkv = torch.randn(6, (4 + 2 * 2) * 64, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 4095, 17, 300])
    qk = qkv[:, :6 * 64].view(6, 6, 64)  # strided rows: a view of the fused qkv output
    expected = rope.apply(qk, *rope.cos_sin(positions, dtype))
    untouched = qkv[:, 6 * 64:].clone()
    ops.rotary_embedding(qk, positions, rope.cos_sin_cache)
    assert torch.equal(qk, expected)  # same roundings as the PyTorch ops, bit for bit
    assert torch.equal(qkv[:, 6 * 64:], untouched)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.rotary_embedding(qk, torch.tensor([0, 0, 0, 0, 0, 4096]), rope.cos_sin_cache)


def _paged_case(context_lens, query_lens, num_heads, num_kv_heads, head_dim, block_size,
                dtype, seed=0):
    """A shuffled paged cache holding every context, and the step's metadata."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 3
    cache = torch.randn(2, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, slots, starts = [], [], [0]
    for ctx, q in zip(context_lens, query_lens):
        table = [free.pop() for _ in range(-(-ctx // block_size))]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx - q, ctx)]
        starts.append(starts[-1] + q)
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_table=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        query_start_loc_cpu=starts, seq_lens_cpu=list(context_lens),
        max_query_len=max(query_lens), max_seq_len=max(context_lens), block_size=block_size)
    tokens = starts[-1]
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :num_heads * head_dim].view(tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        tokens, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(tokens, num_kv_heads, head_dim)
    return cache, metadata, q, k, v


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2-135M
    (4, 4, 32, 4),    # no GQA, tiny blocks
    (8, 2, 128, 32),  # wider heads
    (6, 2, 48, 8),    # a head_dim the AVX512 path does not take
])
def test_paged_attention_matches_torch_backend(ops, dtype, heads, kv_heads, head_dim,
                                               block_size):
    # decodes, a spec-decode style verify (4), a chunk over a cached prefix (50), a
    # prefill from scratch (40) and a query tile boundary (17), contexts crossing blocks
    context_lens = [1, 37, 300, 50 + 61, 40, 17 + 3, 129]
    query_lens = [1, 1, 4, 50, 40, 17, 1]
    cache, metadata, q, k, v = _paged_case(context_lens, query_lens, heads, kv_heads,
                                           head_dim, block_size, dtype)
    scale = head_dim ** -0.5
    reference_cache = cache.clone()
    expected = TorchAttentionBackend(heads, kv_heads, head_dim, scale).forward(
        q, k, v, reference_cache, metadata)
    ops.write_kv_cache(k, v, cache, metadata.slot_mapping)
    assert torch.equal(cache, reference_cache)
    out = torch.full(q.shape, float("nan"), dtype=dtype)
    ops.paged_attention(out, q, cache, metadata.block_table, metadata.seq_lens,
                        metadata.query_start_loc, scale, 1 << 30)
    # bf16: the reference rounds scores to bf16 before softmax (a bf16 matmul); the
    # kernel keeps them in float32, so results differ by a few bf16 units
    atol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("window", [0, 700])
def test_paged_attention_over_long_contexts(ops, window):
    """Contexts over several of the bf16 kernel's key blocks (512 keys, at fixed places;
    online softmax across them) and a window that starts inside one: equal to the torch
    backend within bf16 rounding, and each row the same bits whatever the step's split of
    the request into new tokens (one chunk of 300, or 299 then 1)."""
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    context_lens, query_lens = [1300, 1100, 530], [1, 300, 17]
    cache, metadata, q, k, v = _paged_case(context_lens, query_lens, heads, kv_heads,
                                           head_dim, block_size, torch.bfloat16)
    backend = TorchAttentionBackend(heads, kv_heads, head_dim, 0.125, window or None)
    expected = backend.forward(q, k, v, cache.clone(), metadata)
    ops.write_kv_cache(k, v, cache, metadata.slot_mapping)

    def attend(query, seq_lens, starts, table=metadata.block_table):
        out = torch.full(query.shape, float("nan"), dtype=torch.bfloat16)
        args = (out, query, cache, table, torch.tensor(seq_lens, dtype=torch.int32),
                torch.tensor(starts, dtype=torch.int32), 0.125, 1 << 30)
        if window:
            ops.paged_attention_windowed(*args, window)
        else:
            ops.paged_attention(*args)
        return out

    out = attend(q, context_lens, metadata.query_start_loc.tolist())
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=0)
    # request 1's 300 new tokens as 299 (its context ending one token earlier) and then 1
    first = attend(q[1:300], [1099], [0, 299], metadata.block_table[1:2])
    last = attend(q[300:301], [1100], [0, 1], metadata.block_table[1:2])
    assert torch.equal(torch.cat([first, last]), out[1:301])


def test_paged_attention_leaves_long_queries_to_the_caller(ops):
    cache, metadata, q, k, v = _paged_case([10, 30, 5], [1, 20, 5], 4, 2, 64, 16, torch.float32)
    ops.write_kv_cache(k, v, cache, metadata.slot_mapping)
    out = torch.full(q.shape, 7.0)
    ops.paged_attention(out, q, cache, metadata.block_table, metadata.seq_lens,
                        metadata.query_start_loc, 0.125, 5)
    assert torch.all(out[1:21] == 7.0)  # request 1 (20 new tokens) skipped
    assert not torch.any(out[0] == 7.0) and not torch.any(out[21:] == 7.0)


def test_bad_arguments_raise_not_crash(ops):
    cache, metadata, q, k, v = _paged_case([10], [1], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.write_kv_cache(k, v, cache, torch.tensor([10**6]))
    with pytest.raises(RuntimeError, match="block_table too narrow"):
        ops.paged_attention(torch.empty_like(q), q, cache, metadata.block_table,
                            torch.tensor([100], dtype=torch.int32), metadata.query_start_loc,
                            0.125, 1 << 30)
    with pytest.raises(RuntimeError, match="dtypes differ"):
        ops.paged_attention(torch.empty_like(q), q.bfloat16(), cache, metadata.block_table,
                            metadata.seq_lens, metadata.query_start_loc, 0.125, 1 << 30)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 40, 200])
def test_linear_fast_paths_match_f_linear(rows, monkeypatch):
    """Every CPU bf16 path of ``linear`` (loom's bf16_linear, packed oneDNN, ATen GEMV)
    gives F.linear's result; packed oneDNN bit for bit."""
    import loom.kernels
    from loom.model.layers.weight_forms import linear, pack_weight

    torch.manual_seed(rows)
    x = torch.randn(rows, 576, dtype=torch.bfloat16)
    weight = torch.randn(200, 576, dtype=torch.bfloat16)  # 200: a partial last panel
    bias = torch.randn(200, dtype=torch.bfloat16)
    expected = F.linear(x, weight, bias)
    packed = pack_weight(weight)
    if packed is None:
        # a CPU without AVX512-BF16 (loom's kernel) where oneDNN packs no bf16 either (it
        # needs AVX512-BW/VL/DQ or AVX-NE-CONVERT: AMD Zen 3, say): ATen's paths
        with pytest.raises(RuntimeError, match="bf16 path needs"):
            torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        torch.testing.assert_close(linear(x, weight, bias), expected, atol=0.1, rtol=1e-2)
        return
    # loom's kernel sums in another order than oneDNN: results differ by bf16 rounding
    torch.testing.assert_close(linear(x, weight, bias, packed), expected, atol=0.1, rtol=1e-2)
    torch.testing.assert_close(linear(x, weight, None, packed), F.linear(x, weight),
                               atol=0.1, rtol=1e-2)
    x3 = x.view(1, rows, 576)  # leading dims are flattened and restored
    assert linear(x3, weight, bias, packed).shape == (1, rows, 200)
    monkeypatch.setattr(loom.kernels, "_module", None)  # no native kernels: oneDNN's layout
    packed = pack_weight(weight)
    assert packed is not None
    torch.testing.assert_close(linear(x, weight, bias, packed), expected, atol=0.1, rtol=1e-2)
    if rows > 1:
        assert torch.equal(linear(x, weight, bias, packed), expected)
    torch.testing.assert_close(linear(x, weight, bias), expected, atol=0.1, rtol=1e-2)
    monkeypatch.setenv("LOOM_CPU_PACKED_WEIGHTS", "0")
    settings.cache_clear()  # loom.envs reads the environment once
    assert pack_weight(weight) is None


def test_bf16_linear_is_exact_on_exact_inputs(ops):
    """Small integers multiply and sum exactly in float32: the kernel must give exactly
    the integer matmul, for row counts around its 6-row blocks, its half-panel passes
    (7-12 rows) and 96-row chunks, and output counts around its 64-wide panels and
    their 32-wide halves."""
    if not ops.bf16_gemm_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    gen = torch.Generator().manual_seed(0)
    # with AMX (ops.bf16_amx_available()), 8 rows or more and K a multiple of 32 take
    # the tile path: 8-16 rows one block of a panel's 64 outputs, more 32-row blocks
    # (and their partial last block) of 32-output halves
    for rows, n, k in [(1, 64, 2), (5, 65, 576), (6, 127, 64), (13, 960, 34), (97, 200, 1536),
                       (200, 64, 576), (8, 64, 32), (16, 127, 64), (12, 200, 96),
                       (17, 100, 96), (33, 65, 2048), (7, 31, 64), (9, 33, 576),
                       (10, 96, 34), (11, 129, 96), (7, 70, 8960)]:
        x = torch.randint(-4, 5, (rows, k), generator=gen).bfloat16()
        weight = torch.randint(-4, 5, (n, k), generator=gen).bfloat16()
        bias = torch.randint(-8, 9, (n,), generator=gen).bfloat16()
        out = torch.full((rows, n), float("nan"), dtype=torch.bfloat16)
        ops.bf16_linear(out, x, ops.pack_bf16_weight(weight), bias)
        exact = x.double() @ weight.double().T + bias.double()
        assert torch.equal(out, exact.bfloat16()), (rows, n, k)
        out32 = torch.empty((rows, n), dtype=torch.float32)  # an LM head's unrounded logits
        ops.bf16_linear(out32, x, ops.pack_bf16_weight(weight), bias)
        assert torch.equal(out32, exact.float()), (rows, n, k)
    with pytest.raises(RuntimeError, match="even number"):
        ops.pack_bf16_weight(torch.zeros(8, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        ops.bf16_linear(torch.empty(2, 8, dtype=torch.bfloat16), torch.zeros(2, 6, dtype=torch.bfloat16),
                        ops.pack_bf16_weight(torch.zeros(8, 4, dtype=torch.bfloat16)), None)


def test_rows_gathered_from_bf16_panels(ops):
    """An embedding table held only as its LM head's panels: rows gathered from them
    (PackedWeight.rows) are the table's rows, for widths around the 64-row panels, and
    the panels' inverse view (plain) is the table; an id past the table is refused."""
    from loom.model.layers.weight_forms import PackedWeight

    gen = torch.Generator().manual_seed(3)
    for n, k in [(1, 2), (64, 2), (65, 576), (127, 34), (200, 64)]:
        weight = torch.randn(n, k, generator=gen).bfloat16()
        panels = PackedWeight.loom_panels(ops.pack_bf16_weight(weight), n)
        ids = torch.tensor([[0, n - 1, n // 2], [n - 1, 0, 0]])
        assert torch.equal(panels.rows(ids), weight[ids]), (n, k)
        assert torch.equal(panels.plain(), weight), (n, k)
        with pytest.raises(RuntimeError, match="outside"):
            panels.rows(torch.tensor([n]))


def test_bf16_linear_group_equals_one_call_each(ops):
    """Several matmuls in one parallel region (a MoE layer's experts): each result is
    bit for bit bf16_linear's on it alone, for row counts on either side of the tiles'
    minimum and the 96-row chunks, outputs around the 64-wide panels, and rows written
    into one shared output at offsets."""
    if not ops.bf16_gemm_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    gen = torch.Generator().manual_seed(2)
    shapes = [(1, 64, 256), (3, 130, 256), (8, 64, 512), (40, 200, 512), (100, 96, 64),
              (0, 64, 64), (1, 1024, 1024)]
    xs = [torch.randn(rows, k, generator=gen).bfloat16() for rows, _, k in shapes]
    packed = [ops.pack_bf16_weight(torch.randn(n, k, generator=gen).bfloat16() / k ** 0.5)
              for _, n, k in shapes]
    outs = [torch.full((rows, n), float("nan"), dtype=torch.bfloat16) for rows, n, _ in shapes]
    ops.bf16_linear_group(outs, xs, packed)
    for x, weight, out in zip(xs, packed, outs):
        alone = torch.empty_like(out)
        ops.bf16_linear(alone, x, weight)
        assert torch.equal(out, alone), tuple(out.shape)
    # one expert's rows after another into one (R, N) output, as mixture_of_experts does
    shared = torch.empty(5, 64, dtype=torch.bfloat16)
    ops.bf16_linear_group([shared[:2], shared[2:]], [xs[0].expand(2, -1), xs[1][:, :256]],
                          [packed[0], packed[0]])
    alone = torch.empty(5, 64, dtype=torch.bfloat16)
    ops.bf16_linear(alone, torch.cat([xs[0].expand(2, -1), xs[1]]), packed[0])
    assert torch.equal(shared, alone)
    with pytest.raises(RuntimeError, match="features"):
        ops.bf16_linear_group([outs[0]], [torch.zeros(1, 128, dtype=torch.bfloat16)],
                              [packed[0]])


def test_the_amx_switch_keeps_many_rows_on_the_avx512_kernel(ops):
    """LOOM_AMX=0 (loom/envs.py, handed to the module as set_bf16_amx): many rows take
    the AVX-512 micro-kernel, exact on exact inputs like the tiles."""
    invariant = ops.set_batch_invariant(False)  # (batch invariance keeps the tiles off)
    try:
        if not ops.bf16_amx_available():
            pytest.skip("no AMX granted here")
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(-4, 5, (33, 2048), generator=gen).bfloat16()
        weight = torch.randint(-4, 5, (65, 2048), generator=gen).bfloat16()
        exact = (x.double() @ weight.double().T).bfloat16()
        ops.set_bf16_amx(False)
        try:
            assert not ops.bf16_amx_available()
            out = torch.empty(33, 65, dtype=torch.bfloat16)
            ops.bf16_linear(out, x, ops.pack_bf16_weight(weight), None)
            assert torch.equal(out, exact)
        finally:
            ops.set_bf16_amx(True)
        assert ops.bf16_amx_available()
    finally:
        ops.set_batch_invariant(invariant)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_bf16_linear_gives_a_row_the_bits_it_has_alone(ops, out_dtype):
    """Batch invariance (the default): every row count takes the AVX-512 micro-kernel
    (the AMX tiles, whose sums round in another order, stay off), each row's sums added
    pair after pair from its bias; so a row's outputs are the same alone and among
    1..256 rows, K a multiple of 32 or not."""
    if not ops.bf16_gemm_available():
        pytest.skip("bf16_linear needs AVX512-BF16")
    assert ops.batch_invariant() and not ops.bf16_amx_available()
    gen = torch.Generator().manual_seed(2)
    for k in (576, 200):
        x = torch.randn(256, k, generator=gen).bfloat16()
        weight = (torch.randn(97, k, generator=gen) * 0.05).bfloat16()
        bias = torch.randn(97, generator=gen).bfloat16()
        packed = ops.pack_bf16_weight(weight)
        alone = torch.empty(256, 97, dtype=out_dtype)
        for r in range(256):
            ops.bf16_linear(alone[r:r + 1], x[r:r + 1], packed, bias)
        for rows in (2, 7, 8, 9, 16, 17, 33, 100, 256):
            out = torch.empty(rows, 97, dtype=out_dtype)
            ops.bf16_linear(out, x[:rows], packed, bias)
            assert torch.equal(out, alone[:rows]), (k, rows)


def test_cpu_backend_falls_back_where_the_kernels_do_not_apply(ops):
    """float16 (no native kernel) runs the torch backend's path and gives its result."""
    from loom.model.attention.cpu_backend import CpuAttentionBackend

    cache, metadata, q, k, v = _paged_case([20, 7], [1, 7], 4, 2, 64, 16, torch.float16)
    reference_cache = cache.clone()
    expected = TorchAttentionBackend(4, 2, 64, 0.125).forward(q, k, v, reference_cache, metadata)
    got = CpuAttentionBackend(4, 2, 64, 0.125).forward(q, k, v, cache, metadata)
    assert torch.equal(got, expected) and torch.equal(cache, reference_cache)


def test_kernels_release_the_gil(ops):
    """A long kernel call lets other Python threads run (the worker's heartbeat thread
    must keep writing through a step that is one native call): a thread ticking every
    millisecond ticks many times during one ~70 ms call; holding the GIL, at most once
    or twice at its edges."""
    import threading

    if not ops.bf16_gemm_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    packed = ops.pack_bf16_weight(torch.randn(8192, 4096).bfloat16())
    x = torch.randn(1024, 4096).bfloat16()
    out = torch.empty(1024, 8192, dtype=torch.bfloat16)
    ticks: list[float] = []
    done = threading.Event()

    def tick():
        while not done.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    time.sleep(0.01)
    start = time.perf_counter()
    ops.bf16_linear(out, x, packed)
    end = time.perf_counter()
    done.set()
    thread.join()
    assert sum(start < t < end for t in ticks) >= 5, (end - start, len(ticks))


def test_build_covers_every_source_and_header(tmp_path, monkeypatch):
    """Every .cpp in csrc/ is compiled, and a change to any source or header (or a new
    one) gives a new cache directory: a stale build is never loaded."""
    import shutil

    import loom.kernels

    csrc = tmp_path / "csrc"
    shutil.copytree(loom.kernels._CSRC, csrc)
    monkeypatch.setattr(loom.kernels, "_CSRC", csrc)
    files = sorted(csrc.glob("*.cpp")) + sorted(csrc.glob("*.h"))
    assert {path.name for path in files} >= {"common.h", "ops.h", "attention.cpp",
                                              "torch_bindings.cpp", "bf16_gemm.cpp"}
    assert set(loom.kernels._sources()) == set(csrc.glob("*.cpp"))
    assert loom.kernels._sources()[0].name == "torch_bindings.cpp"
    keys = {loom.kernels._build_dir()}
    for path in files:
        original = path.read_bytes()
        path.write_bytes(original + b"\n// edited\n")
        keys.add(loom.kernels._build_dir())
        path.write_bytes(original)
    assert loom.kernels._build_dir() in keys
    (csrc / "extra.h").write_text("#pragma once\n")
    keys.add(loom.kernels._build_dir())
    assert len(keys) == len(files) + 2


def test_segment_attention_matches_sdpa_within_each_segment(ops):
    """A vision tower's bidirectional attention (segment_attention.cpp): every row over
    every row of its own segment, q, k and v strided views of one fused projection,
    against SDPA in float32 per segment; a row's values do not depend on the segments
    beside it."""
    if not ops.segment_attention_available():
        pytest.skip("no AVX512-BF16 on this CPU")
    gen = torch.Generator().manual_seed(0)
    for head_dim, lengths in [(80, [64, 64, 64]), (16, [1]), (32, [5, 17, 64, 3]),
                              (128, [33, 100]), (64, [130])]:
        rows, heads = sum(lengths), 3
        q, k, v = torch.randn(rows, 3, heads, head_dim, generator=gen).bfloat16().unbind(1)
        out = torch.full((rows, heads, head_dim), float("nan"), dtype=torch.bfloat16)
        ops.segment_attention(out, q, k, v, torch.tensor(lengths), head_dim ** -0.5)
        start = 0
        for length in lengths:
            span = slice(start, start + length)
            expected = F.scaled_dot_product_attention(
                *(x[span].transpose(0, 1).float() for x in (q, k, v))).transpose(0, 1)
            torch.testing.assert_close(out[span].float(), expected, atol=1e-2, rtol=2e-2)
            alone = torch.empty((length, heads, head_dim), dtype=torch.bfloat16)
            ops.segment_attention(alone, q[span], k[span], v[span], torch.tensor([length]),
                                  head_dim ** -0.5)
            assert torch.equal(alone, out[span])
            start += length
    with pytest.raises(RuntimeError, match="sum to"):
        ops.segment_attention(out, q, k, v, torch.tensor([1]), 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        x = torch.zeros(4, 1, 24, dtype=torch.bfloat16)
        ops.segment_attention(x, x, x, x, torch.tensor([4]), 1.0)
