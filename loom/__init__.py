"""loom: an LLM inference serving engine in plain PyTorch."""

from loom.config import EngineConfig
from loom.lora import LoRARequest
from loom.sampling_params import PoolingParams, SamplingParams

__all__ = ["LLM", "EngineConfig", "LoRARequest", "PoolingParams", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from loom.llm import LLM

        return LLM
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
