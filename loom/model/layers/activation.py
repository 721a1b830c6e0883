"""Gated activations: SiLU (Llama and most families) and GELU-tanh (Gemma)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loom.kernels import native_ops_for


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` along the last dim (one native
    kernel on the CPU, with the same roundings)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``SiluAndMul``'s function (the MoE experts call it without a module)."""
    ops = native_ops_for(x.device, x.dtype)
    if ops is not None:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


class GeluTanhAndMul(nn.Module):
    """``gelu_tanh(gate) * up`` for ``x = [gate | up]`` (Gemma's gelu_pytorch_tanh)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
