"""Attention backends behind one interface, chosen by name.

``get_attn_backend("torch")`` returns the backend class; each attention layer
builds one instance with its head counts and scale."""

from __future__ import annotations

import importlib

from loom.model.attention.backend import AttentionBackend
from loom.model.attention.metadata import (AttentionMetadata, get_forward_context,
                                           set_forward_context)

# name -> "module:Class", imported on first use so optional kernels cost nothing.
_BACKENDS: dict[str, str] = {
    "torch": "loom.model.attention.torch_backend:TorchAttentionBackend",
    "cpu": "loom.model.attention.cpu_backend:CpuAttentionBackend",
}


def get_attn_backend(name: str = "torch") -> type[AttentionBackend]:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; supported: "
                         f"{', '.join(sorted(_BACKENDS))}")
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["AttentionBackend", "AttentionMetadata", "get_attn_backend",
           "get_forward_context", "set_forward_context"]
