"""Model loading: config, architecture lookup, weights from safetensors or GGUF.

The names below are imported when first asked for: reading a checkpoint's config
(``hf_config.py``) imports no torch, and the API server process never does
(loom/torch_free.py); building a model (``model_loader.py``) does.
"""

import importlib

# name -> the module under loom.model.loader (or loom.model) that defines it
_EXPORTS = {
    "get_model_architecture": "loom.model.models.registry",
    "kv_cache_bytes_per_block": "loom.model.loader.hf_config",
    "load_hf_config": "loom.model.loader.hf_config",
    "load_model": "loom.model.loader.model_loader",
    "model_hf_config": "loom.model.loader.model_loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
