"""Model loading: config, architecture lookup, weights from safetensors or GGUF."""

from loom.model.loader.model_loader import (kv_cache_bytes_per_block, load_hf_config,
                                            load_model, model_hf_config)
from loom.model.models.registry import get_model_architecture

__all__ = ["get_model_architecture", "kv_cache_bytes_per_block", "load_hf_config",
           "load_model", "model_hf_config"]
