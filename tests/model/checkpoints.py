"""Tiny random Hugging Face checkpoints for tests, deterministic and offline.

``make_tiny_checkpoint(family, path)`` writes ``config.json`` and
``model.safetensors`` into ``path`` and returns ``path``. Families: ``llama``,
``qwen2``, ``qwen3``, ``llama_tied_rope3`` (tied embeddings, llama3 rope scaling),
``mistral_sliding`` and ``gemma3`` (sliding windows of ``SLIDING_WINDOW`` tokens, shorter
than most test prompts), ``ernie4_5`` (interleaved rope, biases), and the mixtures of
experts ``qwen3_moe``, ``mixtral``, ``ernie4_5_moe`` (shared experts, a dense first
layer, a score-correction bias). The final norm weight is scaled up so that logits are
decisive for greedy tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import torch

DENSE_FAMILIES = ("llama", "qwen2", "qwen3", "llama_tied_rope3")
NEW_DENSE_FAMILIES = ("mistral_sliding", "gemma3", "ernie4_5")
MOE_FAMILIES = ("qwen3_moe", "mixtral", "ernie4_5_moe")
FAMILIES = DENSE_FAMILIES + NEW_DENSE_FAMILIES + MOE_FAMILIES
# the families whose bf16 forward is replayed from loom's kernels (kernel_replay.py):
# all but Gemma 3, whose GELU has no native kernel
NATIVE_FAMILIES = DENSE_FAMILIES + ("mistral_sliding", "ernie4_5") + MOE_FAMILIES
SLIDING_WINDOW = 12
FAVOURED = (1, 2)  # the experts bias_router sends most tokens to

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
    from transformers import (Ernie4_5Config, Ernie4_5_MoeConfig, Gemma3TextConfig,
                              LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config,
                              Qwen3Config, Qwen3MoeConfig)

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
    if family == "mistral_sliding":
        return MistralConfig(**_COMMON, vocab_size=288, rope_theta=10000.0,
                             sliding_window=SLIDING_WINDOW, tie_word_embeddings=False)
    if family == "gemma3":
        common = _COMMON | dict(num_hidden_layers=3)
        return Gemma3TextConfig(**common, vocab_size=300, head_dim=16,
                                query_pre_attn_scalar=24, sliding_window=SLIDING_WINDOW,
                                layer_types=["sliding_attention", "full_attention",
                                             "sliding_attention"],
                                rope_parameters={
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default",
                                                       "rope_theta": 1000000.0}},
                                tie_word_embeddings=True)
    if family == "ernie4_5":
        return Ernie4_5Config(**_COMMON, vocab_size=272, head_dim=16, use_bias=True,
                              tie_word_embeddings=True)
    if family == "qwen3_moe":
        return Qwen3MoeConfig(**_COMMON, vocab_size=320, head_dim=16, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=48,
                              norm_topk_prob=True, tie_word_embeddings=False)
    if family == "mixtral":
        return MixtralConfig(**_COMMON | dict(intermediate_size=48), vocab_size=304,
                             num_local_experts=4, num_experts_per_tok=2,
                             tie_word_embeddings=False)
    if family == "ernie4_5_moe":
        common = _COMMON | dict(num_hidden_layers=3)
        return Ernie4_5_MoeConfig(**common, vocab_size=336, moe_num_experts=8, moe_k=3,
                                  moe_intermediate_size=32, moe_num_shared_experts=2,
                                  moe_layer_start_index=1, moe_layer_end_index=2,
                                  moe_layer_interval=1, tie_word_embeddings=True)
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


# (family, overrides) -> (a private directory with that checkpoint's files, the CPU RNG
# state right after its weights were drawn): each is built once per process, then copied.
_BUILT: dict[tuple[str, str], tuple[str, torch.Tensor]] = {}


def make_tiny_checkpoint(family: str, path: str | os.PathLike, **overrides) -> str:
    """Write a tiny random float32 checkpoint of ``family`` to ``path`` (``overrides``:
    config fields to change, e.g. ``moe_intermediate_size=64``).

    Deterministic: the first such checkpoint in this process is built (seeded) in a
    private directory, and every call copies its files, leaving torch's RNG as building
    it does (seeded, then advanced by the draws). A test may rewrite its copy."""
    path = str(path)
    key = (family, repr(sorted(overrides.items())))
    if key not in _BUILT:
        _BUILT[key] = _build(family, overrides)
    built, rng_after = _BUILT[key]
    torch.manual_seed(FAMILIES.index(family) + 1234)  # every device's generator, as _build
    torch.set_rng_state(rng_after)
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(built):
        shutil.copyfile(os.path.join(built, name), os.path.join(path, name))
    return path


def _build(family: str, overrides: dict) -> tuple[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    path = tempfile.mkdtemp(prefix=f"loom-tiny-{family}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    config = make_tiny_config(family)
    for field, value in overrides.items():
        setattr(config, field, value)
    torch.manual_seed(FAMILIES.index(family) + 1234)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize_weights(model)
    model.save_pretrained(path, safe_serialization=True)
    return path, torch.get_rng_state()


def randomize_weights(model) -> None:
    """The tiny checkpoints' weights, drawn from torch's RNG: random norm weights exercise
    the loaders, and the final norm scaled by 8 makes logits sharp (decisive greedy
    comparisons)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            else:
                param.normal_(0.0, 0.08)
        model.model.norm.weight.mul_(8.0)


def bias_router(path: str) -> str:
    """Rewrite the checkpoint so that most tokens go to the FAVOURED experts: every
    token's embedding gets a large constant in dim 0, which stays positive through the
    layers, and the routers weigh dim 0 heavily for those experts only (Ernie's
    correction bias favours them too)."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["model.embed_tokens.weight"][:, 0] = 3.0
    for name, tensor in tensors.items():
        if name.endswith("gate.weight") and tensor.dim() == 2 and "experts" not in name:
            tensor[list(FAVOURED), 0] = 1.0
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = torch.zeros_like(tensor)
            tensors[name][..., list(FAVOURED)] = 0.5
    save_file(tensors, file, metadata={"format": "pt"})
    return path
