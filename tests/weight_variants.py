"""Checkpoints of one architecture with other weights, for weight-update tests.

``make_variant(a, b, seed)`` copies checkpoint ``a`` (config, tokenizer) to ``b`` and
writes new random weights of the same names and shapes, drawn as
``checkpoints.make_tiny_checkpoint`` draws them, from ``seed``."""

from __future__ import annotations

import os
import shutil

import torch


def variant_tensors(a: str, seed: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in load_file(os.path.join(a, "model.safetensors")).items():
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.2 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith(".bias"):
            tensors[name] = 0.1 * torch.randn(tensor.shape, generator=generator)
        else:
            tensors[name] = 0.08 * torch.randn(tensor.shape, generator=generator)
    tensors["model.norm.weight"] *= 8.0  # decisive logits, as the tiny checkpoints have
    return tensors


def make_variant(a: str, b: str, seed: int,
                 edit: dict[str, torch.Tensor | None] | None = None) -> str:
    """Copy ``a`` to ``b`` with new weights; ``edit`` replaces (or, with None, drops)
    tensors by name, to make a checkpoint that does not fit."""
    from loom.weight_sync import save_snapshot

    shutil.copytree(a, b, dirs_exist_ok=True)
    tensors = variant_tensors(a, seed)
    for name, tensor in (edit or {}).items():
        if tensor is None:
            tensors.pop(name)
        else:
            tensors[name] = tensor
    save_snapshot(tensors.items(), b)
    return b


def _trainer(a: str, seed: int) -> None:
    """A trainer in its own process: publish ``variant_tensors(a, seed)`` through shared
    memory (the ``ipc`` strategy), print the manifest's path, keep the segment until a
    line arrives on stdin, then close it."""
    import sys

    from loom.weight_sync import WeightPublisher

    with WeightPublisher() as publisher:
        print(publisher.publish(variant_tensors(a, seed).items()), flush=True)
        sys.stdin.readline()


if __name__ == "__main__":
    import sys

    _trainer(sys.argv[1], int(sys.argv[2]))
