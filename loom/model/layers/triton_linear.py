"""Quantized matmuls in Triton for CUDA that read the weight as the PyTorch path holds it
(``QuantizedTensor.held()``: values bit-packed at their format's width, scales per
group) and dequantize it in registers, instead of dequantizing the whole weight to
float32 at every call (``reference_linear``). Opt-in: ``LOOM_TRITON_MATMULS=1``
(``loom/envs.py``), which ``select_form`` reads (``TritonQuantized``, weight_forms.py).

Every format loom keeps is one layout (quantization.py): ``bits``-wide values q, a
scale d per group of input features, an offset m per group (asymmetric) or the zero
point z = 2^(bits-1), and for the K-quants int8 scales (and offsets) times a float16
factor per super-block of 256::

    format   bits  group      d, m                       w
    wint8    8     the row    float32 d                  d * (q - 128)
    wint4    4     32..128    float16 d, m               d * q + m
    Q8_0     8     32         float16 d                  d * (q - 128)
    Q4_0     4     32         float16 d                  d * (q - 8)
    Q5_0     5     32         float16 d                  d * (q - 16)
    Q4_1     4     32         float16 d, m               d * q + m
    Q4_K     4     32         int8 x float16 d, m        d * q + m
    Q5_K     5     32         int8 x float16 d, m        d * q + m
    Q6_K     6     16         int8 x float16 d           d * (q - 32)

    values of one row, bytes (``pack_bits``):
    | low nibbles: value 2j in byte j's bits 0-3, 2j+1 in 4-7 | 5/6-bit: the bits above |
    8-bit values are their bytes; Q5's bit 4 of value 8j+i is bit i of plane byte j,
    Q6_K's bits 4-5 of value 4j+i are bits 2i, 2i+1 of plane byte j

The kernels take a tile of ``BLOCK_K`` input features inside one group (``BLOCK_K``
divides the group) and multiply the activations by the *integers* q - z (or q), which
bf16 and float16 hold exactly, then apply the group's scale to the tile's float32 sums
and, asymmetric, add m times the tile's sum of x::

    sum_k x_k w_k over a group = d * sum_k x_k (q_k - z)        (symmetric)
                               = d * sum_k x_k q_k + m * sum_k x_k   (asymmetric)

So, as loom's CPU kernel, the products are exact (bf16/float16 x) and only float32 sums
differ from the reference's order: the result is within ``kernel_error_bound`` of
``reference_linear`` (float32 sums rounded once to the output dtype).

Two kernels: ``_quant_gemv_kernel`` for up to ``GEMV_MAX_ROWS`` rows (decode steps:
each program reads a strip of ``BLOCK_N`` weight rows once for all rows of x, products
and sums in float32 registers, no matrix unit), and ``_quant_gemm_kernel`` for more
(tiles of x and dequantized integers through ``tl.dot``, float32 accumulation).

What is proven (tests/model/test_triton_matmuls.py): every format against the reference
under Triton's interpreter on the CPU, and a compile to cubin for sm_90 and sm_80 with
Triton's own ptxas. Not proven: nothing has run on a GPU; speed is unmeasured; the tile
sizes are first guesses.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from loom.model.attention import triton_interpreter_requested
from loom.model.layers.quantization import SUPER_BLOCK, QuantizedTensor


def _interpreted() -> bool:
    """Whether ``@triton.jit`` made interpreted functions (Triton decides when it
    decorates, from TRITON_INTERPRET)."""
    knobs = getattr(triton, "knobs", None)  # Triton 3.3 and later
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return triton_interpreter_requested()


INTERPRETED = _interpreted()
GEMV_MAX_ROWS = 8  # up to this many rows of x: the GEMV kernel; more: the tiled GEMM
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16}


@triton.jit
def load_quantized_values(values_ptr, row_start, k, mask, half_k, BITS: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) int32 values q of rows starting at byte ``row_start``
    (BLOCK_N,) and input features ``k`` (BLOCK_K,), unpacked from ``pack_bits``'s bytes;
    ``half_k`` (K / 2) is where a 5- or 6-bit row's plane of high bits starts."""
    if BITS == 8:
        q = tl.load(values_ptr + row_start[:, None] + k[None, :], mask=mask, other=0)
        q = q.to(tl.int32)
    else:
        low = tl.load(values_ptr + row_start[:, None] + (k // 2)[None, :], mask=mask, other=0)
        q = (low.to(tl.int32) >> ((k % 2) * 4)[None, :]) & 15
        if BITS > 4:
            WIDTH: tl.constexpr = BITS - 4
            PER_BYTE: tl.constexpr = 8 // WIDTH
            plane = tl.load(values_ptr + row_start[:, None] + half_k + (k // PER_BYTE)[None, :],
                            mask=mask, other=0)
            high = (plane.to(tl.int32) >> ((k % PER_BYTE) * WIDTH)[None, :]) & ((1 << WIDTH) - 1)
            q = q | (high << 4)
    return q


@triton.jit
def load_group_scales(scales_ptr, offsets_ptr, super_scales_ptr, super_offsets_ptr, n,
                      n_valid, k0, group_size, stride_sn, stride_ssn,
                      ASYMMETRIC: tl.constexpr, TWO_LEVEL: tl.constexpr):
    """The float32 d (and m, zeros if symmetric) of rows ``n`` for the group holding
    input feature ``k0``: two-level ones multiplied out, exactly as
    ``QuantizedTensor.scales_and_offsets``."""
    n64 = n.to(tl.int64)
    group = k0 // group_size
    d = tl.load(scales_ptr + n64 * stride_sn + group, mask=n_valid, other=0).to(tl.float32)
    m = tl.zeros_like(d)
    if ASYMMETRIC:
        m = tl.load(offsets_ptr + n64 * stride_sn + group, mask=n_valid, other=0).to(tl.float32)
    if TWO_LEVEL:
        at = n64 * stride_ssn + k0 // 256
        d = tl.load(super_scales_ptr + at, mask=n_valid, other=0).to(tl.float32) * d
        if ASYMMETRIC:
            m = tl.load(super_offsets_ptr + at, mask=n_valid, other=0).to(tl.float32) * m
    return d, m


@triton.jit
def _quant_gemv_kernel(
        out_ptr, x_ptr, values_ptr, scales_ptr, offsets_ptr, super_scales_ptr,
        super_offsets_ptr, bias_ptr,
        M, N, K, group_size, stride_xm, stride_om, stride_vn, stride_sn, stride_ssn,
        M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BITS: tl.constexpr, ASYMMETRIC: tl.constexpr, TWO_LEVEL: tl.constexpr,
        HAS_BIAS: tl.constexpr):
    """Program i: output features i*BLOCK_N .. for every row of x (at most M_PAD),
    each weight tile read once: (M_PAD, 1, BLOCK_K) x (1, BLOCK_N, BLOCK_K), summed."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    rows = tl.arange(0, M_PAD)
    row_valid = rows < M
    row_start = n.to(tl.int64) * stride_vn
    half_k = K // 2
    ZERO: tl.constexpr = 0 if ASYMMETRIC else 1 << (BITS - 1)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        q = load_quantized_values(values_ptr, row_start, k, n_valid[:, None] & k_valid[None, :],
                                  half_k, BITS)
        w = (q - ZERO).to(tl.float32)  # (BLOCK_N, BLOCK_K) exact integers
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0).to(tl.float32)
        sums = tl.sum(x[:, None, :] * w[None, :, :], 2)  # (M_PAD, BLOCK_N)
        d, m = load_group_scales(scales_ptr, offsets_ptr, super_scales_ptr, super_offsets_ptr,
                                 n, n_valid, k0, group_size, stride_sn, stride_ssn,
                                 ASYMMETRIC, TWO_LEVEL)
        acc += sums * d[None, :]
        if ASYMMETRIC:
            acc += tl.sum(x, 1)[:, None] * m[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & n_valid[None, :])


@triton.jit
def _quant_gemm_kernel(
        out_ptr, x_ptr, values_ptr, scales_ptr, offsets_ptr, super_scales_ptr,
        super_offsets_ptr, bias_ptr,
        M, N, K, group_size, stride_xm, stride_om, stride_vn, stride_sn, stride_ssn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BITS: tl.constexpr, ASYMMETRIC: tl.constexpr, TWO_LEVEL: tl.constexpr,
        HAS_BIAS: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """Program (i, j): the (BLOCK_M, BLOCK_N) output tile, one group's tile of K at a
    time through ``tl.dot`` in DOT_DTYPE (x's; the integers are exact in it)."""
    m_idx = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_valid = m_idx < M
    n_valid = n < N
    row_start = n.to(tl.int64) * stride_vn
    half_k = K // 2
    ZERO: tl.constexpr = 0 if ASYMMETRIC else 1 << (BITS - 1)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        x = tl.load(x_ptr + m_idx.to(tl.int64)[:, None] * stride_xm + k[None, :],
                    mask=m_valid[:, None] & k_valid[None, :], other=0.0)
        q = load_quantized_values(values_ptr, row_start, k, n_valid[:, None] & k_valid[None, :],
                                  half_k, BITS)
        w = (q - ZERO).to(DOT_DTYPE)
        sums = tl.dot(x.to(DOT_DTYPE), tl.trans(w), input_precision=PRECISION)
        d, m = load_group_scales(scales_ptr, offsets_ptr, super_scales_ptr, super_offsets_ptr,
                                 n, n_valid, k0, group_size, stride_sn, stride_ssn,
                                 ASYMMETRIC, TWO_LEVEL)
        acc += sums * d[None, :]
        if ASYMMETRIC:
            acc += tl.sum(x.to(tl.float32), 1)[:, None] * m[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m_idx.to(tl.int64)[:, None] * stride_om + n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])


def check_supported(weight: QuantizedTensor) -> str | None:
    """Why the kernels cannot multiply by ``weight``, or None: they take the layouts of
    quantization.py's table (bit-packed values, at 4, 5, 6 or 8 bits)."""
    if not weight.packed:
        return "its values are not bit-packed (QuantizedTensor.held())"
    if weight.bits not in (4, 5, 6, 8):
        return f"{weight.bits}-bit values"
    if weight.scales.shape[1] > 1 and block_k(weight) < 16:
        return f"groups of {weight.group_size} input features (the kernels take 16 or more)"
    return None


def block_k(weight: QuantizedTensor) -> int:
    """Input features per tile: inside one group (the largest power of two dividing it,
    at most 128); 64 for a weight with one scale per row (wint8)."""
    if weight.scales.shape[1] == 1:
        return 64
    group = weight.group_size
    return min(128, group & -group)


def quantized_matmul(x: torch.Tensor, weight: QuantizedTensor,
                     bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``x (..., K) @ weight^T (+ bias)`` with float32 sums rounded once to
    ``out_dtype`` (x's by default), as ``reference_linear``, reading ``weight``
    (``QuantizedTensor.held()``, on x's device) packed. ``out``: a (rows, N) tensor to
    write (its rows may be strided: columns of a wider output)."""
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"loom's Triton quantized matmul needs a CUDA device, not "
                           f"{x.device} (or TRITON_INTERPRET=1, Triton's interpreter, set "
                           "before loom starts)")
    why = check_supported(weight)
    if why is not None:
        raise ValueError(f"the Triton quantized matmul cannot take a {weight.format} weight: "
                         f"{why}")
    n, k = weight.shape
    flat = x.reshape(-1, k)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    rows = flat.shape[0]
    if out is None:
        out = torch.empty(rows, n, dtype=out_dtype or x.dtype, device=x.device)
        result = out.view(*x.shape[:-1], n)
    else:
        result = out
    if rows == 0:
        return result
    values, scales = weight.values, weight.scales
    offsets = weight.offsets if weight.offsets is not None else scales
    super_scales = weight.super_scales if weight.super_scales is not None else scales
    super_offsets = weight.super_offsets if weight.super_offsets is not None else super_scales
    group_size = k if scales.shape[1] == 1 else weight.group_size
    args = (out, flat, values, scales, offsets, super_scales, super_offsets,
            bias if bias is not None else scales,
            rows, n, k, group_size, flat.stride(0), out.stride(0), values.stride(0),
            scales.stride(0), super_scales.stride(0))
    if rows <= GEMV_MAX_ROWS:
        constants = gemv_constants(weight, rows, bias is not None)
        _quant_gemv_kernel[(triton.cdiv(n, constants["BLOCK_N"]),)](*args, **constants)
    else:
        constants = gemm_constants(weight, x.dtype, bias is not None)
        grid = (triton.cdiv(rows, constants["BLOCK_M"]), triton.cdiv(n, constants["BLOCK_N"]))
        _quant_gemm_kernel[grid](*args, **constants)
    return result


def _format_constants(weight: QuantizedTensor, has_bias: bool) -> dict[str, Any]:
    if weight.two_level and weight.super_scales.shape[1] * SUPER_BLOCK != weight.shape[1]:
        raise ValueError(f"a {weight.format} weight's super-blocks are {SUPER_BLOCK} input "
                         "features each")
    return dict(BLOCK_K=block_k(weight), BITS=weight.bits,
                ASYMMETRIC=weight.offsets is not None, TWO_LEVEL=weight.two_level,
                HAS_BIAS=has_bias)


def gemv_constants(weight: QuantizedTensor, rows: int, has_bias: bool) -> dict[str, Any]:
    """The GEMV kernel's compile-time constants: rows padded to a power of two, 32
    output features per program, the (M_PAD, BLOCK_N, BLOCK_K) products at most 4,096
    values (first guesses; a smaller power of two still divides the group)."""
    constants = _format_constants(weight, has_bias)
    m_pad = max(1, triton.next_power_of_2(rows))
    constants["BLOCK_K"] = min(constants["BLOCK_K"], max(16, 4096 // (m_pad * 32)))
    return dict(M_PAD=m_pad, BLOCK_N=32, **constants)


def gemm_constants(weight: QuantizedTensor, dtype: torch.dtype, has_bias: bool,
                   interpreted: bool = INTERPRETED) -> dict[str, Any]:
    """The GEMM kernel's compile-time constants: 64x64 output tiles (first guesses), the
    dot in x's dtype (float32 under the interpreter, which has no bf16 matmul; the
    operands are exact in it), float32 as IEEE, not TF32."""
    dot_dtype = tl.float32 if interpreted else _TL_DTYPES[dtype]
    return dict(BLOCK_M=64, BLOCK_N=64, DOT_DTYPE=dot_dtype,
                PRECISION="ieee" if dot_dtype == tl.float32 else None,
                **_format_constants(weight, has_bias))
