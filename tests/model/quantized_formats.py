"""A weight in each format loom keeps quantized, as loom loads it (a byte per value):
for tests/model/test_triton_matmuls.py and its cases."""

from __future__ import annotations

import numpy as np
import torch

from loom.model.layers.quantization import QuantizedTensor, quantize_wint4, quantize_wint8
from loom.model.loader.gguf_quantized import gguf_quantized

# ggml type, (values, bytes) per block, float16 fields' byte offsets in a block
_GGUF = {"Q4_0": (2, (32, 18), (0,)), "Q4_1": (3, (32, 20), (0, 2)),
         "Q5_0": (6, (32, 22), (0,)), "Q8_0": (8, (32, 34), (0,)),
         "Q4_K": (12, (256, 144), (0, 2)), "Q5_K": (13, (256, 176), (0, 2)),
         "Q6_K": (14, (256, 210), (208,))}
FORMATS = ["wint8", "wint4-g32", "wint4-g128", *_GGUF]


def make_weight(fmt: str, n: int, k: int, seed: int) -> QuantizedTensor:
    """A (n, k) weight in ``fmt`` as loom loads it (a byte per value): GGUF formats from
    random blocks (finite float16 scales) through loom's own reader, wint8/wint4
    quantized from random rows of very different magnitudes."""
    if fmt in _GGUF:
        ggml_type, (per_block, size), scale_at = _GGUF[fmt]
        rng = np.random.default_rng(seed)
        raw = rng.integers(0, 256, (n, k // per_block, size), dtype=np.uint8)
        for offset in scale_at:
            scales = (rng.standard_normal((n, k // per_block)) * 0.05).astype(np.float16)
            raw[..., offset:offset + 2] = scales.view(np.uint8).reshape(n, k // per_block, 2)
        return gguf_quantized(raw.reshape(n, -1), ggml_type, (n, k))
    gen = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, n)[:, None]
    weight = torch.randn(n, k, generator=gen) * rows
    if fmt == "wint8":
        return quantize_wint8(weight)
    return quantize_wint4(weight, int(fmt.split("-g")[1]))
