"""Shared by the worker tests: tiny checkpoints with a tokenizer, leftover checks."""

from __future__ import annotations

import os
import shutil

import psutil

from checkpoints import make_tiny_checkpoint
from tokenizer_fixtures import make_tiny_tokenizer


def make_model_dir(family: str, path) -> str:
    """A tiny checkpoint of ``family`` with the tiny tokenizer beside it."""
    path = make_tiny_checkpoint(family, path)
    tokenizer_dir = os.path.join(path, "_tokenizer")
    make_tiny_tokenizer(tokenizer_dir)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


def executor_of(llm):
    return llm.engine.engine_core.executor


def leftovers(pids: list[int], shm_names: list[str]) -> list[str]:
    """Worker processes still running and shared-memory segments still present."""
    found = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                found.append(f"process {pid}")
        except psutil.NoSuchProcess:
            pass
    found += [f"/dev/shm/{name}" for name in shm_names if os.path.exists(f"/dev/shm/{name}")]
    return found
