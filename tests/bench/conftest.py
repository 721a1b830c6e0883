from __future__ import annotations

import pytest
from entrypoints.loom_server import make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama (vocab 256) with its tokenizer, for `loom serve` and `LLM`."""
    return make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny-llama-bench")))
