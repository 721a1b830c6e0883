from __future__ import annotations

import os
import sys

import pytest
from tokenizer_fixtures import make_tiny_tokenizer

from loom.tokenizer import load_tokenizer

# fake_runner.py (the stand-in workers) lives beside the scheduler tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "core"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The byte-level tokenizer of the tiny models (vocab 256, eos [2, 0])."""
    return load_tokenizer(make_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny-tokenizer"))))
