"""Stream tensors from a Hugging Face checkpoint directory of ``*.safetensors``."""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open


def safetensors_weights_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time, on CPU, in checkpoint dtype."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        if glob.glob(os.path.join(model_dir, "*.bin")) or glob.glob(os.path.join(model_dir, "*.pt")):
            raise ValueError(f"{model_dir} holds only PyTorch pickle weights (*.bin / *.pt); "
                             "loom loads safetensors only (no pickle). Convert with "
                             "model.save_pretrained(dir, safe_serialization=True)")
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
