"""Persistent scratch tensors for a step's large temporaries on the CPU.

glibc serves allocations over 32 MiB with fresh mmap'd pages, and the first write to
each 4 KiB page faults: a fresh (256, 49152) float32 logits tensor costs about 15 ms of
page faults, as long as the LM-head matmul that fills it, and every full-vocabulary
temporary of the sampler (scaled logits, probabilities) as much again. Those live
instead in buffers kept from step to step.

An owner is an object (the LM head: its buffers go with it) or a name (the sampler's
workspaces, one per process); its view is valid until that owner asks again. A buffer
grows to at least twice its size when a larger batch comes (batches grow step by step
as requests arrive) and never shrinks; ``reserve`` sizes it up front and commits its
pages, so that the memory profiler counts it. On other devices (CUDA's caching
allocator has no such cost) ``scratch`` is a plain ``torch.empty``.
"""

from __future__ import annotations

import math
import weakref

import torch

_Key = tuple[torch.dtype, bool]  # dtype, made in inference mode
_named: dict[str, dict[_Key, torch.Tensor]] = {}
_owned: weakref.WeakKeyDictionary[object, dict[_Key, torch.Tensor]] = weakref.WeakKeyDictionary()


def scratch(owner: object, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor of ``shape``, reusing ``owner``'s buffer."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    numel = math.prod(shape)
    buffers = (_named.setdefault(owner, {}) if isinstance(owner, str)
               else _owned.setdefault(owner, {}))
    # an inference-mode tensor cannot be written outside inference mode: one buffer each
    key = (dtype, torch.is_inference_mode_enabled())
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        grown = max(numel, 2 * buffer.numel()) if buffer is not None else numel
        buffer = buffers[key] = torch.empty(grown, dtype=dtype)
    return buffer[:numel].view(shape)


def reserve(owner: object, shape: tuple[int, ...], dtype: torch.dtype,
            device: torch.device) -> None:
    """Size ``owner``'s buffer for ``shape`` now and touch its pages."""
    scratch(owner, shape, dtype, device).zero_()
