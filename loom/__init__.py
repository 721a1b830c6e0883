"""loom: an LLM inference serving engine in plain PyTorch."""

from loom.config import EngineConfig
from loom.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch and transformers; import it only when asked for.
    if name == "LLM":
        from loom.llm import LLM

        return LLM
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
