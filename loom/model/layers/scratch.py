"""Persistent scratch tensors for a step's large temporaries on the CPU.

glibc serves allocations over 32 MiB with fresh mmap'd pages and the first write to
each 4 KiB page faults: a fresh (256, 49152) float32 logits tensor costs about 15 ms of
page faults, as long as the LM-head matmul that fills it, and every full-vocabulary
temporary of the sampler (scaled logits, probabilities) as much again. Those live
instead in buffers kept from step to step (grown when a larger batch comes, never
shrunk). A buffer belongs to one ``owner`` key; its view is valid until that owner asks
again. Buffers at least double when they grow. On other devices (CUDA's caching allocator has no such cost) it is a plain
``torch.empty``.
"""

from __future__ import annotations

import math

import torch

_buffers: dict[tuple[object, torch.dtype, bool], torch.Tensor] = {}


def scratch(owner: object, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape``, reusing ``owner``'s buffer."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    # an inference-mode tensor cannot be written outside inference mode: one buffer each
    key = (owner, dtype, torch.is_inference_mode_enabled())
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        # at least doubled: batches grow step by step as requests arrive
        grown = max(numel, 2 * buffer.numel()) if buffer is not None else numel
        buffer = _buffers[key] = torch.empty(grown, dtype=dtype)
    return buffer[:numel].view(shape)
