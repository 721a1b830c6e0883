"""Paged attention kernels in Triton, reading the cache of ``kv_layout.py`` in place.

One kernel serves every step, decode, prefill and mixed alike (the shape of vLLM's
unified Triton attention). A program takes one *query block* of one request and one KV
head: ``BLOCK_Q`` consecutive new tokens of the request times the ``G = H / Hkv`` query
heads that share the KV head, as the ``BLOCK_M`` rows of one matrix, so that GQA reads
each K/V tile once for all G heads:

    row r: token first_q + r // G of the request, query head kv_head * G + r % G
    G = 4, BLOCK_M = 16, BLOCK_Q = 4: rows 0-3 are token 0's heads, rows 4-7 token 1's, ...

It walks the keys its queries see, ``TILE_N`` positions at a time, each position's slot
read through the request's ``block_table`` row (block ``pos // block_size``, offset
``pos % block_size``), with the online softmax of FlashAttention: a running maximum and
sum per row, float32 throughout, the probabilities rounded to the model's dtype before
they weigh V (as the torch reference rounds them).

    request i: | cached (already in the cache) | new q_len tokens |   seq_len positions
    query j of the request sits at position seq_len - q_len + j and sees keys
    max(0, p - W + 1) .. p   (p its position; W the sliding window, else no lower bound)

Query blocks are numbered over the whole step: request i's first is
``query_start_loc[i] // BLOCK_Q + i``, a bound on how many blocks the requests before it
have (``_find_request`` inverts it by binary search), so the grid is
``num_tokens // BLOCK_Q + num_reqs`` and a block past its request's tokens exits at
once. Where every request has one new token (``BLOCK_Q`` 1), block i is request i.

Long contexts split (flash-decoding): with ``num_splits`` S > 1 the grid's third axis
cuts each block's key range into S runs of whole tiles; each program leaves its
unnormalised output, maximum and sum in float32 scratch, and ``_reduce_splits_kernel``
rescales and adds them. A decode step (one query row per head) splits where the batch
alone would leave the GPU idle (``decode_splits``).

Cache rows. A plain cache (the model's dtype, or bfloat16) is read and converted to the
model's dtype. A quantized one (int8, fp8_e4m3, fp8_e5m2: ``| values: one byte each |
float32 scale |``) is read as bytes and dequantized in the kernel, bit for bit as
``dequantize_kv_rows``: the byte decoded exactly to float32 (fp8 by its bit fields), times
the row's scale, rounded to the model's dtype. New K/V are written by the torch
reference's ``_write_kv`` (one ``index_copy_`` each), not here.

Matrix products run in the model's dtype with float32 accumulation (float32: IEEE, not
TF32). Under Triton's interpreter (``TRITON_INTERPRET=1``, which runs the kernels on the
CPU with numpy and has no bfloat16 matmul) the operands go to float32 first; a product of
two bf16 or fp16 values is exact in float32, so only the order of the sums differs.

What is proven (tests/model/test_triton_attention.py): results equal the torch reference
within rounding under the interpreter, and the kernels compile to cubin for sm_90 and
sm_80 through Triton's own compiler and ptxas, with no GPU. What is not: nothing here has
run on a GPU yet, and its speed is unmeasured; the tile sizes and the split rule are first
guesses.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from loom.model.attention import triton_interpreter_requested


def _interpreted() -> bool:
    """Whether ``@triton.jit`` made interpreted functions of this module's kernels: Triton
    decides when it decorates, from its TRITON_INTERPRET switch."""
    knobs = getattr(triton, "knobs", None)  # Triton 3.3 and later
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return triton_interpreter_requested()


INTERPRETED = _interpreted()

# KV_FORMAT: how a cache row's elements are stored
PLAIN, INT8, FP8_E4M3, FP8_E5M2 = 0, 1, 2, 3
_QUANTIZED_FORMATS = {torch.int8: INT8, torch.float8_e4m3fn: FP8_E4M3,
                      torch.float8_e5m2: FP8_E5M2}
MAX_SPLITS = 16
MIN_SPLIT_TOKENS = 256  # the fewest keys a decode split is given
TARGET_PROGRAMS = 256  # about two programs per streaming multiprocessor on an H100


@triton.jit
def _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q: tl.constexpr):
    """The request whose query blocks include ``q_block``: the last i whose first block,
    query_start_loc[i] // BLOCK_Q + i, is at most ``q_block``."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_reqs  # a tensor even where Triton passes 1 as a constant
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _exp2_int(k):
    """2.0 ** k for an int32 k in float32's normal range, exactly (its bits)."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_rows(cache_ptr, row_start, dims, pos_valid, dim_valid, HEAD_DIM: tl.constexpr,
               KV_FORMAT: tl.constexpr, OUT_DTYPE: tl.constexpr):
    """The (TILE_N, HEAD_DIM_PAD) vectors whose rows start at element ``row_start`` of
    the cache, in ``OUT_DTYPE``; masked positions and dimensions read 0."""
    mask = pos_valid[:, None] & dim_valid[None, :]
    raw = tl.load(cache_ptr + row_start[:, None] + dims[None, :], mask=mask, other=0)
    if KV_FORMAT == 0:
        rows = raw.to(OUT_DTYPE)
    else:
        # quantized (bytes, as uint8): values, then the float32 scale's 4 bytes, little-endian
        bits = raw.to(tl.int32)
        if KV_FORMAT == 1:  # int8, two's complement
            values = tl.where(bits >= 128, bits - 256, bits).to(tl.float32)
        else:
            sign = tl.where(bits >= 128, -1.0, 1.0)
            if KV_FORMAT == 2:  # e4m3fn: exponent bits 6-3 (bias 7), mantissa bits 2-0
                exponent = (bits >> 3) & 15
                mantissa = bits & 7
                # normal (8 + m) * 2^(e - 10), subnormal (e = 0) m * 2^-9
                magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125,
                                     (mantissa + 8).to(tl.float32)
                                     * _exp2_int(tl.maximum(exponent, 1) - 10))
            else:  # e5m2: exponent bits 6-2 (bias 15), mantissa bits 1-0
                exponent = (bits >> 2) & 31
                mantissa = bits & 3
                # normal (4 + m) * 2^(e - 17), subnormal m * 2^-16
                magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.0000152587890625,
                                     (mantissa + 4).to(tl.float32)
                                     * _exp2_int(tl.maximum(exponent, 1) - 17))
            values = sign * magnitude
        scale_bits = tl.zeros(row_start.shape, tl.uint32)
        for byte in tl.static_range(4):
            b = tl.load(cache_ptr + row_start + HEAD_DIM + byte, mask=pos_valid, other=0)
            scale_bits = scale_bits | (b.to(tl.uint32) << (8 * byte))
        scale = scale_bits.to(tl.float32, bitcast=True)
        rows = (values * scale[:, None]).to(OUT_DTYPE)
    return rows


@triton.jit
def _paged_attention_kernel(
        out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr,
        query_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
        num_reqs, scale, sliding_window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
        head_stride, value_offset, row,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
        NUM_SPLITS: tl.constexpr, ONE_QUERY_EACH: tl.constexpr, WINDOWED: tl.constexpr,
        KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if ONE_QUERY_EACH:
        req = q_block
        first_q = 0
    else:
        req = _find_request(query_start_loc_ptr, num_reqs, q_block, BLOCK_Q)
        first_q = (q_block - tl.load(query_start_loc_ptr + req) // BLOCK_Q - req) * BLOCK_Q
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if first_q >= q_len:
        return
    context = tl.load(seq_lens_ptr + req) - q_len  # the position of the request's query 0

    rows = tl.arange(0, BLOCK_M)
    q_index = first_q + rows // GROUP  # (BLOCK_M,) query within the request
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < q_len)
    q_pos = context + q_index
    token = (q_start + q_index).to(tl.int64)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                + dims[None, :], mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    q = q.to(DOT_DTYPE)

    # the keys any query of the block sees, [kv_lo, kv_hi), and this split's run of them
    kv_hi = context + tl.minimum(first_q + BLOCK_Q, q_len)
    kv_lo = 0
    if WINDOWED:
        kv_lo = tl.maximum(context + first_q - sliding_window + 1, 0)
    tiles_per_split = tl.cdiv(tl.cdiv(kv_hi - kv_lo, TILE_N), NUM_SPLITS)
    split_lo = kv_lo + split * tiles_per_split * TILE_N
    split_hi = tl.minimum(split_lo + tiles_per_split * TILE_N, kv_hi)

    key_base = kv_head.to(tl.int64) * head_stride
    value_base = key_base + value_offset
    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    for tile_lo in range(split_lo, split_hi, TILE_N):
        pos = tile_lo + tl.arange(0, TILE_N)
        pos_valid = pos < split_hi
        block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=pos_valid,
                        other=0)
        row_start = (block.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE) * row
        k = _load_rows(cache_ptr, key_base + row_start, dims, pos_valid, dim_valid, HEAD_DIM,
                       KV_FORMAT, query_ptr.dtype.element_ty)
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        # a row that has seen no key yet keeps -inf: subtract 0 there, not -inf
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - shift[:, None])
        rescale = tl.exp(running_max - shift)
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        v = _load_rows(cache_ptr, value_base + row_start, dims, pos_valid, dim_valid, HEAD_DIM,
                       KV_FORMAT, query_ptr.dtype.element_ty)
        probs = probs.to(query_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = acc * rescale[:, None] + tl.dot(probs, v.to(DOT_DTYPE), input_precision=PRECISION)
        running_max = new_max

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(running_sum == 0.0, 1.0, running_sum)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # scratch (T, H, NUM_SPLITS[, HEAD_DIM_PAD]), float32
        at = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(split_acc_ptr + at[:, None] * HEAD_DIM_PAD + dims[None, :], acc,
                 mask=store_mask)
        tl.store(split_max_ptr + at, running_max, mask=row_valid)
        tl.store(split_sum_ptr + at, running_sum, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(out_ptr, split_acc_ptr, split_max_ptr, split_sum_ptr,
                          stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                          HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """One (token, head): its splits' partial outputs, each rescaled to the largest
    maximum, added, divided by the rescaled sums' total."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    at = (token * NUM_HEADS + head) * NUM_SPLITS + splits
    split_max = tl.load(split_max_ptr + at, mask=split_valid, other=float("-inf"))
    split_sum = tl.load(split_sum_ptr + at, mask=split_valid, other=0.0)
    overall = tl.max(split_max, 0)
    # a split that saw no key has maximum -inf and weight 0
    weight = tl.where(split_max == float("-inf"), 0.0,
                      tl.exp(split_max - tl.where(overall == float("-inf"), 0.0, overall)))
    total = tl.sum(weight * split_sum, 0)
    dims = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(split_acc_ptr + at[:, None] * HEAD_DIM_PAD + dims[None, :],
                  mask=split_valid[:, None] & (dims[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int) -> int:
    """How many runs a decode step cuts each context into: enough that the step has about
    TARGET_PROGRAMS programs, each run at least MIN_SPLIT_TOKENS keys, at most MAX_SPLITS.
    A first guess, unmeasured."""
    wanted = -(-TARGET_PROGRAMS // (num_reqs * num_kv_heads))
    return max(1, min(wanted, max_seq_len // MIN_SPLIT_TOKENS, MAX_SPLITS))


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                    max_query_len: int, max_seq_len: int, sliding_window: int | None = None,
                    num_splits: int | None = None,
                    output: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the step's new queries over each request's context in the
    paged ``kv_cache`` (``kv_layout.py``; the new tokens' K/V already written).

    ``query`` (T, H, D) (rows may be strided); ``block_table`` (B, max_blocks) int32;
    ``seq_lens`` (B,) and ``query_start_loc`` (B + 1,) int32, as AttentionMetadata holds
    them; ``max_query_len`` and ``max_seq_len`` their host-side maxima (they choose the
    launch, never a result). ``num_splits``: runs per context (None: ``decode_splits``
    for a decode step, else 1). Returns ``output`` (T, H, D), allocated if None."""
    if query.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"the Triton attention kernels need a CUDA device, not "
                           f"{query.device}; use --attention-backend torch or cpu (or "
                           "TRITON_INTERPRET=1, Triton's interpreter, set before loom starts)")
    if query.stride(-1) != 1 or not kv_cache.is_contiguous():
        raise ValueError("paged_attention needs the head dimension of query contiguous "
                         "and the KV cache in kv_layout.py's contiguous layout")
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, num_blocks, block_size, row = kv_cache.shape
    num_reqs = seq_lens.shape[0]
    if output is None:
        output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or num_reqs == 0:
        return output
    one_query_each = max_query_len == 1
    if num_splits is None:
        num_splits = decode_splits(num_reqs, num_kv_heads, max_seq_len) if one_query_each else 1
    constants = kernel_constants(num_heads, num_kv_heads, head_dim, block_size, query.dtype,
                                 kv_cache.dtype, one_query_each, num_splits,
                                 sliding_window is not None)
    # query blocks: one per request in a decode step, else the bound _find_request inverts
    grid_blocks = num_reqs if one_query_each else num_tokens // constants["BLOCK_Q"] + num_reqs
    head_dim_pad = constants["HEAD_DIM_PAD"]
    if num_splits > 1:
        split_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim_pad),
                                dtype=torch.float32, device=query.device)
        split_max = torch.empty((num_tokens, num_heads, num_splits), dtype=torch.float32,
                                device=query.device)
        split_sum = torch.empty_like(split_max)
    else:
        split_acc = split_max = split_sum = output  # not read
    cache = kv_cache.view(torch.uint8) if constants["KV_FORMAT"] != PLAIN else kv_cache
    num_slots = num_blocks * block_size
    _paged_attention_kernel[(grid_blocks, num_kv_heads, num_splits)](
        output, split_acc, split_max, split_sum,
        query, cache, block_table, seq_lens, query_start_loc,
        num_reqs, scale, sliding_window or 0,
        query.stride(0), query.stride(1), output.stride(0), output.stride(1),
        block_table.stride(0),
        num_slots * row, num_kv_heads * num_slots * row, row, **constants)
    if num_splits > 1:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            output, split_acc, split_max, split_sum, output.stride(0), output.stride(1),
            **reduce_constants(num_heads, head_dim, num_splits))
    return output


def kernel_constants(num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                     dtype: torch.dtype, cache_dtype: torch.dtype, one_query_each: bool,
                     num_splits: int, windowed: bool,
                     interpreted: bool = INTERPRETED) -> dict[str, Any]:
    """The attention kernel's compile-time constants for a step of this shape: a decode
    step (``one_query_each``) takes one token's G heads, padded to a 16-row matmul;
    other steps 64 rows, as many tokens as fill them. Tile sizes are first guesses."""
    group = num_heads // num_kv_heads
    if one_query_each:
        block_m, tile_n = max(16, triton.next_power_of_2(group)), 64
    else:
        block_m, tile_n = max(64, triton.next_power_of_2(group)), 64 if head_dim <= 128 else 32
    dot_dtype = tl.float32 if interpreted else _TL_DTYPES[dtype]
    return dict(
        NUM_HEADS=num_heads, GROUP=group, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=1 if one_query_each else block_m // group, TILE_N=tile_n,
        NUM_SPLITS=num_splits, ONE_QUERY_EACH=one_query_each, WINDOWED=windowed,
        KV_FORMAT=_QUANTIZED_FORMATS.get(cache_dtype, PLAIN), DOT_DTYPE=dot_dtype,
        PRECISION="ieee" if dot_dtype == tl.float32 else None)


def reduce_constants(num_heads: int, head_dim: int, num_splits: int) -> dict[str, Any]:
    """The reduce kernel's compile-time constants."""
    return dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim,
                HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
                NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)))


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16}
