"""RMSNorm, computed in float32 and cast back, as Hugging Face Llama does.

On the CPU (float32, bfloat16) one native kernel does the residual add and the
norm in place (``loom.kernels``); elsewhere, PyTorch ops with the same roundings."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels import native_ops_for


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # == weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), in float32, bit for bit
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual``: ``norm(x)``. With it: ``x + residual`` becomes the new
        residual stream and ``(norm(x + residual), x + residual)`` is returned; the
        native path writes them into ``x`` and ``residual``, which must not be views
        of anything the caller still needs."""
        ops = native_ops_for(x.device, x.dtype)
        if ops is not None and self.weight.dtype == x.dtype:
            if residual is None:
                return ops.rms_norm(x, self.weight, self.eps)
            if x.is_contiguous() and residual.is_contiguous():
                ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
                return x, residual
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
