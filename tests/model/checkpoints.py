"""Tiny random Hugging Face checkpoints for tests, deterministic and offline.

``make_tiny_checkpoint(family, path)`` writes ``config.json`` and
``model.safetensors`` into ``path`` and returns ``path``. Families: ``llama``,
``qwen2``, ``qwen3``, ``llama_tied_rope3`` (tied embeddings, llama3 rope scaling).
The final norm weight is scaled up so that logits are decisive for greedy tests.
"""

from __future__ import annotations

import os

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "llama_tied_rope3")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def make_tiny_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**_COMMON, vocab_size=256, rope_theta=10000.0,
                           tie_word_embeddings=False)
    if family == "llama_tied_rope3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}
        return LlamaConfig(**_COMMON, vocab_size=320, rope_scaling=rope,
                           tie_word_embeddings=True)
    if family == "qwen2":
        return Qwen2Config(**_COMMON, vocab_size=384, rope_theta=1000000.0,
                           tie_word_embeddings=False, use_sliding_window=False)
    if family == "qwen3":
        return Qwen3Config(**_COMMON, vocab_size=512, head_dim=32, rope_theta=1000000.0,
                           tie_word_embeddings=False, use_sliding_window=False)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def make_tiny_checkpoint(family: str, path: str | os.PathLike) -> str:
    """Write a tiny random float32 checkpoint of ``family`` to ``path``."""
    from transformers import AutoModelForCausalLM

    path = str(path)
    config = make_tiny_config(family)
    torch.manual_seed(FAMILIES.index(family) + 1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                # random norm weights exercise the loaders; the final one makes logits sharp
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
        model.model.norm.weight.mul_(8.0)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    return path
