"""RMSNorm, computed in float32 and cast back, as Hugging Face Llama does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
        residual stream and ``(norm(x + residual), x + residual)`` is returned."""
        if residual is None:
            return self._norm(x)
        x = residual + x
        return self._norm(x), x
