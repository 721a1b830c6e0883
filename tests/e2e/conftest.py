from __future__ import annotations

import pytest
from checkpoints import make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """A tiny random Llama (vocab 256) with the tiny byte-level tokenizer beside it."""
    path = make_tiny_checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"))
    make_tiny_tokenizer(path)
    return path
