"""Attention backends behind one interface, chosen by name (``--attention-backend``).

``torch`` is the reference in plain PyTorch (CPU and CUDA); ``cpu`` runs loom's native
CPU kernels. ``auto``, the default, is ``cpu`` where those kernels apply to the model's
device and dtype, else ``torch``; ``select_attn_backend`` resolves it once, when the
model is built. ``get_attn_backend(name)`` returns the class; each attention layer
builds one instance with its head counts and scale. Every backend reads and writes the
cache layout of ``kv_layout.py``.

Backends are imported on first use, so this module imports no torch: the config
checks a name against the registry before anything loads.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.model.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

AUTO = "auto"
# name -> "module:Class", imported on first use so optional kernels cost nothing.
_BACKENDS: dict[str, str] = {
    "torch": "loom.model.attention.torch_backend:TorchAttentionBackend",
    "cpu": "loom.model.attention.cpu_backend:CpuAttentionBackend",
}


def check_attn_backend_name(name: str) -> None:
    """A ValueError naming the registered backends unless ``name`` is one, or auto."""
    if name != AUTO and name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{', '.join([AUTO, *sorted(_BACKENDS)])} (--attention-backend)")


def select_attn_backend(name: str, device: Any, dtype: Any) -> str:
    """The registered backend that ``name`` means for a model on ``device`` in ``dtype``:
    ``auto`` is ``cpu`` where loom's native kernels apply (the CPU, float32 or
    bfloat16, kernels built), else ``torch``; any other name is itself."""
    check_attn_backend_name(name)
    import torch

    from loom.kernels import native_ops_for

    native = native_ops_for(torch.device(device), dtype) is not None
    if name == "cpu" and not native:
        logger.warning("attention backend cpu: loom's native kernels do not apply on %s in "
                       "%s (or are off), so it runs the torch backend's code", device, dtype)
    if name != AUTO:
        return name
    return "cpu" if native else "torch"


def get_attn_backend(name: str) -> type[AttentionBackend]:
    if name not in _BACKENDS:
        check_attn_backend_name(name)
        raise ValueError(f"attention backend {name!r} must be resolved first "
                         "(select_attn_backend)")
    module_name, class_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


__all__ = ["AUTO", "check_attn_backend_name", "get_attn_backend", "select_attn_backend"]
