"""A checkpoint's Hugging Face config, read without torch: from a directory's config.json
(``transformers.AutoConfig``) or from a GGUF file's metadata, and what the KV cache of
one block costs under it.

The API server process reads the config here (``resolve_against_checkpoint``,
loom/checkpoint_defaults.py) and never imports torch (loom/torch_free.py): nothing in this
module does, and the ``transformers`` config classes need it only to turn a dtype name
into a ``torch.dtype``. transformers' GGUF reader does import it: a GGUF file whose config
loom does not build from the metadata itself is read by transformers in a child process
there.
"""

from __future__ import annotations

import copy
import functools
import os
from typing import Any

from loom.model.attention.kv_layout import KV_ROW_FORMATS, kv_cache_row
from loom.model.loader.gguf_configs import config_from_metadata
from loom.model.loader.gguf_file import GGUFFile
from loom.model.loader.gguf_mmproj import multimodal_config, open_mmproj
from loom.model.loader.hf_config_values import HFConfigView, hf_config_values
from loom.torch_free import call_with_torch, torch_forbidden

# Bytes per element of each dtype loom runs (config.py's _DTYPES)
_ELEMENT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


def is_gguf(model_path: str) -> bool:
    return os.path.isfile(model_path) and model_path.endswith(".gguf")


def load_hf_config(model_path: str, mmproj: str | None = None) -> Any:
    """A ``transformers`` config from an HF checkpoint dir or a ``.gguf`` file; with
    ``mmproj`` (a llama.cpp vision projector beside a .gguf file), the multimodal config
    the two make (gguf_mmproj.py)."""
    if mmproj is not None:
        projector = open_mmproj(model_path, mmproj)
        return with_text_fields(multimodal_config(load_gguf_config(model_path),
                                                  open_gguf(model_path), projector))
    if is_gguf(model_path):
        return load_gguf_config(model_path)
    if not os.path.isdir(model_path):
        raise FileNotFoundError(f"model path {model_path!r} is neither a checkpoint "
                                "directory nor a .gguf file")
    from transformers import AutoConfig

    return with_text_fields(AutoConfig.from_pretrained(model_path))


def with_text_fields(config: Any) -> Any:
    """A multimodal config (``text_config`` beside a ``vision_config``) answering its
    language model's fields itself, as vLLM's ``hf_text_config``: the engine sizes the KV
    cache, the vocabulary and the context from ``num_hidden_layers``, ``vocab_size``,
    ``max_position_embeddings`` and the like, wherever the checkpoint keeps them. A
    field the top level has itself (``tie_word_embeddings``) is its own."""
    text = getattr(config, "text_config", None)
    if text is None or getattr(config, "vision_config", None) is None:
        return config
    for name in dir(text):
        if name.startswith("_") or hasattr(config, name):
            continue
        try:
            value = getattr(text, name)
        except Exception:  # noqa: BLE001 — a property that does not apply
            continue
        if not callable(value):
            setattr(config, name, value)
    return config


def kv_cache_bytes_per_block(hf_config: Any, block_size: int, dtype: Any,
                             tp_size: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes of K and V for one block of ``block_size`` tokens over all layers, per rank;
    ``dtype`` (the model's) a ``torch.dtype`` or its name, ``kv_cache_dtype`` the
    cache's (``--kv-cache-dtype``; quantized rows carry their scale, kv_layout.py)."""
    head_dim = getattr(hf_config, "head_dim", None) or \
        hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads_per_rank = max(1, hf_config.num_key_value_heads // tp_size)
    if kv_cache_dtype in KV_ROW_FORMATS:
        row_bytes = kv_cache_row(head_dim, quantized=True)
    else:
        name = dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        row_bytes = head_dim * (_ELEMENT_SIZES[name] if isinstance(name, str) else name.itemsize)
    return hf_config.num_hidden_layers * 2 * block_size * kv_heads_per_rank * row_bytes


def load_gguf_config(path: str) -> Any:
    """The ``transformers`` config of a GGUF model, memoized per file version.

    Llama-architecture files are read from their metadata alone (milliseconds), and so
    are qwen3moe, ernie4_5 and ernie4_5-moe ones (gguf_configs.py); any other
    architecture, or a llama file with keys loom does not map (rope scaling, experts),
    goes through ``transformers``, which also parses the tokenizer (seconds).
    """
    stat = os.stat(path)
    return copy.deepcopy(_load_gguf_config(os.path.abspath(path), stat.st_size,
                                           stat.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _load_gguf_config(path: str, size: int, mtime_ns: int) -> Any:
    gguf_file = open_gguf(path)
    config = llama_config_from_metadata(gguf_file) or config_from_metadata(gguf_file)
    if config is None and torch_forbidden():
        # transformers' GGUF reader imports torch: read in a child, kept as plain values
        config = HFConfigView.from_values(
            call_with_torch("loom.model.loader.hf_config:transformers_gguf_config_values", path))
    elif config is None:
        config = _transformers_gguf_config(path)
    if not getattr(config, "architectures", None):
        from loom.model.models.registry import get_model_architecture

        config.architectures = [get_model_architecture(config)]
    return config


def _transformers_gguf_config(path: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def transformers_gguf_config_values(path: str) -> dict[str, Any]:
    """The config transformers reads from a GGUF file, as plain values (what a process
    that forbade torch asks a child for, loom/torch_free.py)."""
    return hf_config_values(_transformers_gguf_config(path))


def open_gguf(path: str) -> GGUFFile:
    """A parsed GGUF header, shared by the config and the weight loader of one file."""
    stat = os.stat(path)
    return _open_gguf(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, size: int, mtime_ns: int) -> GGUFFile:
    return GGUFFile(path)


# llama.cpp metadata key (after "llama.") -> LlamaConfig field, as transformers maps them
_LLAMA_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.dimension_count": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_LLAMA_HEAD_DIM_KEYS = ("attention.key_length", "attention.value_length")
_TOKENIZER_KEYS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id",
    "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id",
}


def llama_config_from_metadata(gguf_file: GGUFFile) -> Any | None:
    """A ``LlamaConfig`` equal to the one transformers builds for this file, or None
    when the file is not plain llama (other architecture, Mistral by name, or a
    ``llama.*`` key outside :data:`_LLAMA_KEYS` such as rope scaling or experts)."""
    metadata = gguf_file.metadata
    if metadata.get("general.architecture") != "llama" or \
            "mistral" in str(metadata.get("general.name", "")).lower():
        return None
    arch_keys = {key[len("llama."):] for key in metadata if key.startswith("llama.")}
    if not arch_keys <= set(_LLAMA_KEYS) | set(_LLAMA_HEAD_DIM_KEYS):
        return None
    # newer convert_hf_to_gguf.py writes the head size as key/value lengths, which
    # transformers does not read for llama: the same file, if they say what it derives
    head_dim = metadata.get("llama.rope.dimension_count")
    if head_dim is None and "llama.attention.head_count" in metadata \
            and "llama.embedding_length" in metadata:
        head_dim = (int(metadata["llama.embedding_length"])
                    // int(metadata["llama.attention.head_count"]))
    if any(int(metadata[f"llama.{key}"]) != head_dim
           for key in _LLAMA_HEAD_DIM_KEYS if f"llama.{key}" in metadata):
        return None
    from transformers import LlamaConfig

    fields = {field: metadata[f"llama.{key}"] for key, field in _LLAMA_KEYS.items()
              if f"llama.{key}" in metadata}
    fields.update({field: metadata[key] for key, field in _TOKENIZER_KEYS.items()
                   if key in metadata})
    if "vocab_size" not in fields and "tokenizer.ggml.tokens" in metadata:
        fields["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    fields["tie_word_embeddings"] = "output.weight" not in gguf_file.tensors
    for int_field in ("max_position_embeddings", "num_hidden_layers", "intermediate_size",
                      "hidden_size", "head_dim", "num_attention_heads",
                      "num_key_value_heads", "vocab_size"):
        if int_field in fields:
            fields[int_field] = int(fields[int_field])
    if "general.name" in metadata:
        fields["_model_name_or_path"] = metadata["general.name"]
    config = LlamaConfig(architectures=["LlamaForCausalLM"], **fields)
    config._name_or_path = os.path.dirname(gguf_file.path)
    return config


def close_gguf_files() -> None:
    """Unmap every GGUF file :func:`open_gguf` holds (the pages read so far leave the
    resident set); the next :func:`open_gguf` maps its file again."""
    _open_gguf.cache_clear()
