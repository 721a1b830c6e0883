"""A GGUF tensor's blocks as the typed ``QuantizedTensor`` the layers hold, for the
formats loom keeps quantized (``GGUF_KEPT``): the values and scales as the file has
them, unpacked from its byte layout (``gguf_dequant`` documents each block), never
re-quantized. The layers see only the ``QuantizedTensor``; every GGUF byte layout is
read in this package.
"""

from __future__ import annotations

import numpy as np
import torch

from loom.model.layers.quantization import KERNEL_BLOCK, SUPER_BLOCK, QuantizedTensor
from loom.model.loader import gguf_dequant as gd

# ggml types (gguf_file.py) kept quantized
_GGML_Q4_0, _GGML_Q4_1, _GGML_Q5_0, _GGML_Q8_0 = 2, 3, 6, 8
_GGML_Q4_K, _GGML_Q5_K, _GGML_Q6_K = 12, 13, 14
GGUF_KEPT = {_GGML_Q4_0: "Q4_0", _GGML_Q4_1: "Q4_1", _GGML_Q5_0: "Q5_0", _GGML_Q8_0: "Q8_0",
             _GGML_Q4_K: "Q4_K", _GGML_Q5_K: "Q5_K", _GGML_Q6_K: "Q6_K"}


def gguf_quantized(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]
                   ) -> QuantizedTensor | None:
    """A GGUF tensor's bytes as a ``QuantizedTensor`` if loom keeps its format
    (``GGUF_KEPT``) and it is 2-d, else None (dequantize it)."""
    if ggml_type not in GGUF_KEPT or len(shape) != 2 or shape[1] % KERNEL_BLOCK:
        return None
    n, k = shape
    raw = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if ggml_type in (_GGML_Q4_K, _GGML_Q5_K, _GGML_Q6_K):
        return _k_quantized(raw, ggml_type, n, k)
    if ggml_type == _GGML_Q5_0:  # d | 32 high bits | 16 B nibbles: w = d * (q - 16)
        blocks = raw.reshape(-1, 22)
        d = blocks[:, 0:2].copy().view(np.float16).reshape(n, k // 32)
        q = gd.unpack_nibbles(blocks[:, 6:], 16).reshape(-1, 32) | (
            gd.unpack_high_bits(blocks[:, 2:6]) << np.uint8(4))
        return QuantizedTensor(torch.from_numpy(np.ascontiguousarray(q).reshape(n, k)),
                               torch.from_numpy(d), None, 5, "Q5_0")
    if ggml_type == _GGML_Q8_0:
        blocks = raw.reshape(n, k // 32, 34)
        d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
        values = (blocks[:, :, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return QuantizedTensor(torch.from_numpy(values.reshape(n, k)), torch.from_numpy(d),
                               None, 8, "Q8_0")
    size = 18 if ggml_type == _GGML_Q4_0 else 20
    blocks = raw.reshape(n, k // 32, size)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0]
    packed = blocks[:, :, size - 16:]
    values = np.concatenate([packed & 0x0F, packed >> 4], axis=2)  # values 0-15, 16-31
    if ggml_type == _GGML_Q4_0:
        return QuantizedTensor(torch.from_numpy(values.reshape(n, k)), torch.from_numpy(d),
                               None, 4, "Q4_0")
    m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0]
    return QuantizedTensor(torch.from_numpy(values.reshape(n, k)), torch.from_numpy(d),
                           torch.from_numpy(m), 4, "Q4_1")


def _k_quantized(raw: np.ndarray, ggml_type: int, n: int, k: int) -> QuantizedTensor:
    """Q4_K, Q5_K or Q6_K blocks (layouts in ``gguf_dequant``) as values with their
    two-level scales as the file has them: int8 scales (and offsets) per group, float16
    d (and -dmin) per 256 values; dequantizing as ``gguf.quants`` does."""
    blocks = raw.reshape(-1, {_GGML_Q4_K: 144, _GGML_Q5_K: 176, _GGML_Q6_K: 210}[ggml_type])
    count = blocks.shape[0]

    def tensor(array: np.ndarray, columns: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array).reshape(n, columns))

    if ggml_type == _GGML_Q6_K:  # w = (d * sc) * (q - 32), q 6-bit, groups of 16
        ql = gd.unpack_nibbles(blocks[:, :128], 64).reshape(count, 8, 32)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        qh = ((blocks[:, 128:192].reshape(count, 2, 1, 32) >> shifts) & np.uint8(3))
        q = ql | (qh.reshape(count, 8, 32) << np.uint8(4))
        return QuantizedTensor(tensor(q, k), tensor(blocks[:, 192:208].view(np.int8), k // 16),
                               None, 6, "Q6_K",
                               super_scales=tensor(blocks[:, 208:210].copy().view(np.float16),
                                                   k // SUPER_BLOCK))
    # w = (d * sc) * q - dmin * m = q * (d * sc) + (-dmin) * m
    sc, mn = gd.unpack_k_scale_min(blocks[:, 4:16])
    if ggml_type == _GGML_Q4_K:
        values, bits = gd.unpack_nibbles(blocks[:, 16:], 32), 4
    else:
        shifts = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)
        qh = (blocks[:, 16:48].reshape(count, 1, 1, 32) >> shifts) & np.uint8(1)
        values = gd.unpack_nibbles(blocks[:, 48:], 32).reshape(count, 8, 32) | (
            qh.reshape(count, 8, 32) << np.uint8(4))
        bits = 5
    d = blocks[:, 0:2].copy().view(np.float16)
    return QuantizedTensor(tensor(values, k), tensor(sc.view(np.int8), k // 32),
                           tensor(mn.view(np.int8), k // 32), bits, GGUF_KEPT[ggml_type],
                           super_scales=tensor(d, k // SUPER_BLOCK),
                           super_offsets=tensor(-blocks[:, 2:4].copy().view(np.float16),
                                                k // SUPER_BLOCK))
