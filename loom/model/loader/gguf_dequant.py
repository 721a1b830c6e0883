"""Dequantize GGUF tensors with vectorized numpy, bit-exact with ``gguf.quants``.

Each block type is decoded exactly as ``gguf.quants.<Type>.dequantize_blocks`` does,
in float32 and with the same order of operations (``d * q + m`` as two roundings, no
fused multiply-add), so the results equal ``gguf.quants.dequantize`` bit for bit
(``tests/model/test_gguf_dequant.py``). Types not listed here fall back to
``gguf.quants``.

Block layouts (bytes; ``d``, ``m``, ``dmin`` are float16)::

    Q4_0 (32 values, 18 B):  d | 16 B nibbles: values 0-15 low, 16-31 high
    Q4_1 (32 values, 20 B):  d | m | 16 B nibbles           -> d * q + m
    Q5_0 (32 values, 22 B):  d | 4 B high bits | 16 B nibbles -> d * (q - 16)
    Q5_1 (32 values, 24 B):  d | m | 4 B high bits | 16 B nibbles
    Q8_0 (32 values, 34 B):  d | 32 x int8                   -> q * d
    Q4_K (256 values, 144 B): d | dmin | 12 B 6-bit scales/mins | 128 B nibbles
    Q5_K (256 values, 176 B): d | dmin | 12 B scales/mins | 32 B high bits | 128 B nibbles
    Q6_K (256 values, 210 B): 128 B low nibbles | 64 B 2-bit highs | 16 x int8 scales | d
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

# numpy, not torch: these are byte-wise ops on small arrays, where numpy's
# single-threaded SIMD loops are 10x faster than torch's and do not stall when other
# processes hold the CPU cores.


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at bytes ``start:start+2`` of each block, as float32, (n, 1)."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def unpack_nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """(n, k * group) bytes -> (n, k, 2, group): per group of ``group`` bytes, the
    low nibbles, then the high nibbles."""
    qs = qs.reshape(qs.shape[0], -1, 1, group)
    out = np.empty((qs.shape[0], qs.shape[1], 2, group), np.uint8)
    np.bitwise_and(qs[:, :, 0], 0x0F, out=out[:, :, 0])
    np.right_shift(qs[:, :, 0], 4, out=out[:, :, 1])
    return out


def unpack_high_bits(qh: np.ndarray) -> np.ndarray:
    """(n, 4) bytes = one little-endian uint32 per block -> (n, 32) bits 0..31."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0)
    q = unpack_nibbles(blocks[:, 2:], 16).reshape(blocks.shape[0], 32)
    q = q.view(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    out = unpack_nibbles(blocks[:, 4:], 16).reshape(blocks.shape[0], 32).astype(np.float32)
    out *= d
    out += m
    return out


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0)
    qh = unpack_high_bits(blocks[:, 2:6])
    ql = unpack_nibbles(blocks[:, 6:], 16).reshape(blocks.shape[0], 32)
    q = (ql | (qh << np.uint8(4))).view(np.int8) - np.int8(16)
    return d * q.astype(np.float32)


def _q5_1(blocks: np.ndarray) -> np.ndarray:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    qh = unpack_high_bits(blocks[:, 4:8])
    ql = unpack_nibbles(blocks[:, 8:], 16).reshape(blocks.shape[0], 32)
    out = (ql | (qh << np.uint8(4))).astype(np.float32)
    out *= d
    out += m
    return out


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _f16(blocks, 0)
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= d
    return out


def unpack_k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins, (n, 8) each::

        0-3  EEAAAAAA ..   4-7  eeaaaaaa ..   8-11  eeeeEEEE ..
        scales = A.. then E..E (low 4 of bytes 8-11, high 2 of bytes 0-3);
        mins   = a.. then e..e (high 4 of bytes 8-11, high 2 of bytes 4-7)."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc, mn


def _k_scale_offset(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K per-32-value ``d * scale`` and ``dmin * min``, (n, 8, 1) each."""
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = unpack_k_scale_min(blocks[:, 4:16])
    n = blocks.shape[0]
    return ((d * sc.astype(np.float32)).reshape(n, 8, 1),
            (dmin * mn.astype(np.float32)).reshape(n, 8, 1))


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scale, offset = _k_scale_offset(blocks)
    out = unpack_nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).astype(np.float32)
    out *= scale
    out -= offset
    return out.reshape(n, 256)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scale, offset = _k_scale_offset(blocks)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
    qh = ((blocks[:, 16:48].reshape(n, 1, 1, 32) >> shifts) & np.uint8(1)).reshape(n, 8, 32)
    ql = unpack_nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    out = (ql | (qh << np.uint8(4))).astype(np.float32)
    out *= scale
    out -= offset
    return out.reshape(n, 256)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(np.int8).astype(np.float32)
    scale = (_f16(blocks, 208) * scales).reshape(n, 16, 1)
    ql = unpack_nibbles(blocks[:, :128], 64).reshape(n, 8, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = ((blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & np.uint8(3)).reshape(n, 8, 32)
    q = ((ql | (qh << np.uint8(4))).view(np.int8) - np.int8(32)).reshape(n, 16, 16)
    out = q.astype(np.float32)
    out *= scale
    return out.reshape(n, 256)


# ggml type id -> (values per block, bytes per block, decoder)
_DECODERS: dict[int, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    2: (32, 18, _q4_0),
    3: (32, 20, _q4_1),
    6: (32, 22, _q5_0),
    7: (32, 24, _q5_1),
    8: (32, 34, _q8_0),
    12: (256, 144, _q4_k),
    13: (256, 176, _q5_k),
    14: (256, 210, _q6_k),
}
_F32, _F16, _BF16 = 0, 1, 30
# Blocks decoded per call: bounds the float32 temporaries to a few MiB.
_BLOCKS_PER_CHUNK = 1 << 13


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw GGUF tensor bytes (any shape, uint8) -> a new float32 tensor of ``shape``.

    Float32, not the model dtype: the weight loader's ``copy_`` into the parameter
    casts in the same pass, with the same rounding as ``.to(dtype)``."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if ggml_type == _F32:
        return torch.from_numpy(raw.copy().view(np.float32).reshape(shape))
    if ggml_type in (_F16, _BF16):
        half = torch.float16 if ggml_type == _F16 else torch.bfloat16
        return torch.from_numpy(raw.copy()).view(half).float().reshape(shape)
    if ggml_type not in _DECODERS:
        from gguf.constants import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        kind = GGMLQuantizationType(ggml_type)
        try:
            values = gguf_dequantize(raw.reshape(-1, data.shape[-1]), kind)
        except NotImplementedError:  # Q8_1, Q8_K, the integer types: not weights
            raise ValueError(f"GGML type {kind.name} cannot be dequantized (gguf-py "
                             f"has no decoder for it)") from None
        return torch.from_numpy(np.ascontiguousarray(values, np.float32).reshape(shape))
    block_values, block_bytes, decode = _DECODERS[ggml_type]
    blocks = raw.reshape(-1, block_bytes)
    out = np.empty((blocks.shape[0], block_values), np.float32)
    for start in range(0, blocks.shape[0], _BLOCKS_PER_CHUNK):
        end = start + _BLOCKS_PER_CHUNK
        out[start:end] = decode(blocks[start:end])
    return torch.from_numpy(out.reshape(shape))
