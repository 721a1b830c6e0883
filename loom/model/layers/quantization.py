"""Weight-only quantization of the decoder's linear layers, made at load.

``--quantization`` (``ModelConfig.quantization``) names it: ``auto`` and ``none`` keep
the weights as the checkpoint stores them (a GGUF file dequantized to the model's
dtype); ``wint8`` turns each decoder linear weight (qkv, o, gate_up, down) into
per-output-channel symmetric int8 once every weight is in place
(``LinearBase.process_weights_after_loading``)::

    scale[n] = max_k |W[n, k]| / 127   (float32; a zero row gets scale 1)
    q[n, k]  = round(W[n, k] / scale[n]), clamped to [-127, 127]   (int8)

and drops the full-precision weight: a layer holds q (N, K) and scale (N,), one byte
per weight and four per output. The embedding and the LM head (often tied to the
embedding) stay in the model's dtype in this step. ``wint4`` and GGUF formats kept
quantized are not built yet and are refused by name.

The matmul here is the PyTorch reference, correct and not fast: ``x @ q^T`` in float32
(q is exact in float32), times the scale, plus the bias, rounded once to the
activation's dtype. Against dequantize-then-matmul in float32 it differs only by the
order of the float32 rounding steps.
"""

from __future__ import annotations

import torch

from loom.config import check_quantization_name

INT8_MAX = 127


def linear_weight_quantization(name: str) -> str:
    """What the decoder's linear layers hold under ``--quantization name``: ``none``
    (as loaded) or ``wint8``."""
    check_quantization_name(name)
    return "none" if name == "auto" else name


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (q int8 (N, K), scale float32 (N,)), per output row, symmetric."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1) / INT8_MAX  # (N,)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(weight / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8), scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(N, K) ``q * scale[n]``, computed in float32 and rounded once to ``dtype``."""
    return (q.float() * scale[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, q * scale, bias)`` for int8 ``q`` (N, K) and float32 ``scale`` (N,):
    sums in float32, one rounding to ``x.dtype`` at the end. (..., K) -> (..., N)."""
    out = torch.matmul(x.float(), q.float().t()) * scale  # (..., N) float32
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
