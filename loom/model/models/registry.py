"""Architecture name -> model class, imported lazily."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the API server process looks architectures up without torch
    from torch import nn

# architecture -> (module under loom.model.models, class name)
_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "Ernie4_5ForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    # multimodal: images in (loom/multimodal)
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3", "Gemma3ForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "Qwen3VLForConditionalGeneration"),
    "Ernie4_5_VLMoeForConditionalGeneration": ("ernie4_5_vl",
                                               "Ernie4_5_VLMoeForConditionalGeneration"),
    "PaddleOCRVLForConditionalGeneration": ("paddleocr_vl", "PaddleOCRVLForConditionalGeneration"),
    "SmolVLMForConditionalGeneration": ("smolvlm", "SmolVLMForConditionalGeneration"),
    # --task classify (models/classification.py)
    "LlamaForSequenceClassification": ("classification", "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("classification", "Qwen2ForSequenceClassification"),
    "Qwen3ForSequenceClassification": ("classification", "Qwen3ForSequenceClassification"),
    # encoders (--task embed; *ForSequenceClassification: score, a cross-encoder, or classify)
    "BertModel": ("bert", "BertModel"),
    "BertForSequenceClassification": ("bert", "BertForSequenceClassification"),
    "ModernBertModel": ("modernbert", "ModernBertModel"),
    "ModernBertForSequenceClassification": ("modernbert",
                                            "ModernBertForSequenceClassification"),
    "RobertaModel": ("roberta", "RobertaModel"),
    "RobertaForSequenceClassification": ("roberta", "RobertaForSequenceClassification"),
    "XLMRobertaModel": ("roberta", "RobertaModel"),  # RoBERTa with another vocabulary
    "XLMRobertaForSequenceClassification": ("roberta", "RobertaForSequenceClassification"),
    "ElectraModel": ("electra", "ElectraModel"),
    "ElectraForSequenceClassification": ("electra", "ElectraForSequenceClassification"),
}

# Architectures whose attention runs both ways over the whole prompt and keeps no KV
# cache (their classes say ``is_encoder_only``): each prompt runs whole in one step, with
# no prefix cache (checkpoint_defaults.py).
_ENCODER_ONLY = frozenset({"BertModel", "BertForSequenceClassification", "ModernBertModel",
                           "ModernBertForSequenceClassification", "RobertaModel",
                           "RobertaForSequenceClassification", "XLMRobertaModel",
                           "XLMRobertaForSequenceClassification", "ElectraModel",
                           "ElectraForSequenceClassification"})

# Configs read from GGUF carry no ``architectures``; fall back on ``model_type``.
_MODEL_TYPE_TO_ARCH: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_architecture(hf_config: Any) -> str:
    """The first of the config's ``architectures`` that loom supports."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    model_type = getattr(hf_config, "model_type", None)
    if not architectures and model_type in _MODEL_TYPE_TO_ARCH:
        architectures = [_MODEL_TYPE_TO_ARCH[model_type]]
    for arch in architectures:
        if arch in _MODELS:
            return arch
    raise ValueError(f"model architecture {architectures or model_type!r} is not supported; "
                     f"supported: {', '.join(supported_architectures())}")


def is_encoder_only(architecture: str) -> bool:
    """An encoder model (BERT, ModernBERT, RoBERTa, ELECTRA), known without importing torch."""
    return architecture in _ENCODER_ONLY


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"model architecture {architecture!r} is not supported; "
                         f"supported: {', '.join(supported_architectures())}")
    module_name, class_name = _MODELS[architecture]
    module = importlib.import_module(f"loom.model.models.{module_name}")
    return getattr(module, class_name)
