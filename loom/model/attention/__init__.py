"""Attention backends behind one interface, chosen by name (``--attention-backend``).

``torch`` is the reference in plain PyTorch (CPU and CUDA); ``cpu`` runs loom's native
CPU kernels; ``triton`` runs loom's Triton kernels on CUDA (opt-in: proven against the
reference only under Triton's interpreter on the CPU so far). ``auto``, the default, is
``cpu`` where the native kernels apply to the model's device and dtype, else ``torch``
(on CUDA too, until a GPU run proves the Triton kernels); ``select_attn_backend``
resolves it once, when the model is built. ``get_attn_backend(name)`` returns the class;
each attention layer builds one instance with its head counts and scale. Every backend
reads and writes the cache layout of ``kv_layout.py``.

Backends are imported on first use, so this module imports no torch: the config
checks a name against the registry before anything loads.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loom.model.attention.backend import AttentionBackend

logger = logging.getLogger(__name__)

AUTO = "auto"
# name -> "module:Class", imported on first use so optional kernels cost nothing.
_BACKENDS: dict[str, str] = {
    "torch": "loom.model.attention.torch_backend:TorchAttentionBackend",
    "cpu": "loom.model.attention.cpu_backend:CpuAttentionBackend",
    "triton": "loom.model.attention.triton_backend:TritonAttentionBackend",
}


def check_attn_backend_name(name: str) -> None:
    """A ValueError naming the registered backends unless ``name`` is one, or auto."""
    if name != AUTO and name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of "
                         f"{', '.join([AUTO, *sorted(_BACKENDS)])} (--attention-backend)")


def check_attn_backend_device(name: str, device: str) -> None:
    """A ValueError where backend ``name`` cannot run on ``device`` (``cpu`` or ``cuda``):
    triton needs the triton package and CUDA, or Triton's interpreter (TRITON_INTERPRET=1
    in the environment, which runs the kernels on the CPU, slowly: for tests)."""
    if name != "triton":
        return
    if importlib.util.find_spec("triton") is None:
        raise ValueError("--attention-backend triton needs the triton package (pip install "
                         "triton); or use --attention-backend auto or torch")
    if device != "cuda" and not triton_interpreter_requested():
        raise ValueError(f"--attention-backend triton needs CUDA (its Triton kernels run on "
                         f"the GPU), but the model runs on {device}; use --attention-backend "
                         "auto, cpu or torch")


def triton_interpreter_requested() -> bool:
    """Whether Triton's own switch, TRITON_INTERPRET, asks it to interpret kernels (Triton
    reads it when it decorates one; this reads it without importing triton)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on")


def select_attn_backend(name: str, device: Any, dtype: Any) -> str:
    """The registered backend that ``name`` means for a model on ``device`` in ``dtype``:
    ``auto`` is ``cpu`` where loom's native kernels apply (the CPU, float32 or
    bfloat16, kernels built), else ``torch``; any other name is itself."""
    check_attn_backend_name(name)
    import torch

    check_attn_backend_device(name, torch.device(device).type)

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


__all__ = ["AUTO", "check_attn_backend_device", "check_attn_backend_name", "get_attn_backend",
           "select_attn_backend", "triton_interpreter_requested"]
