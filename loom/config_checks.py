"""Checks of user arguments against the checkpoint that ``resolve_against_checkpoint``
(loom/checkpoint_defaults.py) runs before any weight is read or any process starts, so
that a bad argument is one line naming it and the fix: the architecture (before the
tokenizer is looked for), the tokenizer files, the tensor-parallel split of the heads, an
explicit KV budget, the quantization asked for and the checkpoint's own.
"""

from __future__ import annotations

import json
import logging
import os

from loom.config import CacheConfig, check_quantization_name

logger = logging.getLogger("loom.config")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_architecture_before_loading(model: str) -> None:
    """A checkpoint directory whose config.json names only architectures loom does not
    implement fails here, before transformers parses it (an unknown model_type is a
    long transformers error) and before the tokenizer is looked for."""
    from loom.model.models.registry import supported_architectures

    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        if os.path.isdir(model):
            raise ValueError(f"model directory {model} has no config.json; give a Hugging Face "
                             "checkpoint directory or a .gguf file")
        return
    try:
        with open(config_path) as f:
            architectures = json.load(f).get("architectures") or []
    except (OSError, ValueError, AttributeError) as error:
        raise ValueError(f"cannot read {config_path}: {error}; is it a Hugging Face "
                         "config.json?") from None
    supported = supported_architectures()
    if architectures and not set(architectures) & set(supported):
        raise ValueError(f"model architecture {', '.join(architectures)} ({config_path}) is not "
                         f"supported; supported: {', '.join(supported)}")


def check_quantization(hf_config, quantization: str, path: str | None = None) -> None:
    """``--quantization`` must name a method loom runs, and the checkpoint must not be
    stored quantized (its config's ``quantization_config``): loom runs no pre-quantized
    Hugging Face format yet."""
    check_quantization_name(quantization)
    check_stored_quantization(hf_config, path)


def check_stored_quantization(hf_config, path: str | None = None,
                              what: str = "the checkpoint") -> None:
    """A ValueError naming the method if ``hf_config`` (a transformers config or
    config.json's dict) says its weights are stored quantized, or the directory ``path``
    holds AutoGPTQ's ``quantize_config.json``: loom runs no pre-quantized Hugging Face
    format yet (its weights would be missing, not dequantized)."""
    stored = (hf_config.get("quantization_config") if isinstance(hf_config, dict)
              else getattr(hf_config, "quantization_config", None))
    where = "config.json quantization_config.quant_method"
    if stored is None and path is not None and os.path.isdir(path):
        legacy = os.path.join(path, "quantize_config.json")
        if os.path.isfile(legacy):
            stored, where = {"quant_method": "gptq"}, "its quantize_config.json"
    if stored is None:
        return
    method = (stored.get("quant_method") if isinstance(stored, dict)
              else getattr(stored, "quant_method", None))
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    if method is None and isinstance(stored, dict) and (
            stored.get("load_in_4bit") or stored.get("load_in_8bit")):
        method = "bitsandbytes"  # transformers' older configs name it only by its flags
    raise ValueError(f"{what} is stored quantized with {method or 'an unnamed method'} "
                     f"({where}), which loom cannot run; use an unquantized checkpoint, with "
                     f"--quantization wint8 or wint4 for quantized weights")


def check_tokenizer_files(model: str, tokenizer: str | None) -> None:
    """A checkpoint directory without a tokenizer fails before any weight is read."""
    source = tokenizer or model
    if not os.path.exists(source):
        raise ValueError(f"tokenizer path {source} does not exist; pass --tokenizer with a "
                         "Hugging Face model directory or a .gguf file")
    if os.path.isdir(source) and not any(os.path.isfile(os.path.join(source, name))
                                         for name in _TOKENIZER_FILES):
        flag = "--tokenizer" if tokenizer is None else "another --tokenizer"
        raise ValueError(f"{source} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); "
                         f"pass {flag} with the directory that holds the model's tokenizer")


def check_tensor_parallel(hf_config, tensor_parallel_size: int, nnodes: int,
                           device: str) -> None:
    """The heads must split evenly over the ranks; checked before any rank starts."""
    tp = tensor_parallel_size
    num_heads = getattr(hf_config, "num_attention_heads", None)
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
    if num_heads and num_heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp} does not divide the model's {num_heads} "
                         f"attention heads; use one of {_divisors(num_heads)}")
    if num_kv_heads and (num_kv_heads % tp if tp < num_kv_heads else tp % num_kv_heads):
        valid = [d for d in _divisors(num_heads or tp)
                 if (num_kv_heads % d == 0 if d < num_kv_heads else d % num_kv_heads == 0)]
        raise ValueError(f"--tensor-parallel-size {tp} does not fit the model's {num_kv_heads} "
                         f"KV heads (it must divide them, or be a multiple of them); use one "
                         f"of {valid}")
    if device == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1
        ranks_here = tp // max(nnodes, 1)
        if ranks_here > cores:
            logger.warning("%d tensor-parallel ranks on this host but only %d CPU cores: the "
                           "ranks will share cores and run slower than fewer ranks would",
                           ranks_here, cores)


# The extra that installs Ray (pyproject.toml's `ray`), named by the error below.
RAY_EXTRA_HINT = "pip install 'loom[ray]' (ray==2.60.0)"


def check_ray_installed() -> None:
    """--distributed-executor-backend ray without Ray: one line naming the extra. Finds
    the package without importing it (Ray is imported only by the executor)."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        raise ValueError("--distributed-executor-backend ray needs Ray, which is not "
                         f"installed; {RAY_EXTRA_HINT}, or use --distributed-executor-backend mp")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_kv_budget(hf_config, cache: CacheConfig, dtype: str, tensor_parallel_size: int,
                     max_model_len: int) -> None:
    """An explicit KV budget (--kv-cache-memory or --num-gpu-blocks-override) that cannot
    hold one sequence of max_model_len fails before the weights load. A budget profiled
    from free memory is checked by the executor once it is known."""
    if cache.kv_cache_memory_bytes is None and cache.num_gpu_blocks_override is None:
        return
    from loom.model.models.registry import get_model_architecture, is_encoder_only

    if is_encoder_only(get_model_architecture(hf_config)):
        return  # no KV cache: its blocks only count the scheduler's tokens
    from loom.model.loader.hf_config import kv_cache_bytes_per_block

    bytes_per_block = kv_cache_bytes_per_block(hf_config, cache.block_size, dtype,
                                               tensor_parallel_size, cache.kv_cache_dtype)
    needed = -(-max_model_len // cache.block_size)
    if cache.num_gpu_blocks_override is not None:
        num_blocks, flag = cache.num_gpu_blocks_override, "--num-gpu-blocks-override"
        have = f"{num_blocks} blocks"
    else:
        num_blocks = cache.kv_cache_memory_bytes // bytes_per_block
        flag = "--kv-cache-memory"
        have = f"{_format_bytes(cache.kv_cache_memory_bytes)} ({num_blocks} blocks)"
    if num_blocks < needed:
        raise ValueError(
            f"{flag}: {have} of {cache.block_size} tokens ({_format_bytes(bytes_per_block)} "
            f"each per rank) cannot hold one sequence of max_model_len={max_model_len}, which "
            f"needs {needed} blocks ({_format_bytes(needed * bytes_per_block)}); raise {flag} "
            f"or lower --max-model-len to at most {num_blocks * cache.block_size}")


def check_kv_offload(hf_config, cache: CacheConfig, dtype: str,
                     tensor_parallel_size: int, device: str = "cpu") -> None:
    """--kv-offload-size and --kv-offload-path, before the weights load: the size must
    hold one block; files need a directory that takes a new file (less free space there
    than the size is a warning: the tier writes only what it keeps, and drops a block it
    cannot write); host memory (a CUDA cache's tier) must be there to hold the size."""
    if cache.kv_offload_size is None:
        return
    import shutil
    import tempfile

    from loom.core.kv_tier import tier_num_slots
    from loom.model.loader.hf_config import kv_cache_bytes_per_block

    bytes_per_block = kv_cache_bytes_per_block(hf_config, cache.block_size, dtype,
                                               tensor_parallel_size, cache.kv_cache_dtype)
    if tier_num_slots(cache.kv_offload_size, bytes_per_block) < 1:
        raise ValueError(f"--kv-offload-size {_format_bytes(cache.kv_offload_size)} holds no "
                         f"KV block ({_format_bytes(bytes_per_block)} each per rank); raise it")
    directory = cache.kv_offload_dir_on(device)
    if directory is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if cache.kv_offload_size * tensor_parallel_size > available:
            raise ValueError(
                f"--kv-offload-size {_format_bytes(cache.kv_offload_size)} per rank x "
                f"{tensor_parallel_size} ranks of pinned host memory, but the host has "
                f"{_format_bytes(available)} available; lower it, or give --kv-offload-path "
                "for a tier in files")
        return
    flag = "--kv-offload-path" if cache.kv_offload_path else "the temporary directory"
    if not os.path.isdir(directory):
        raise ValueError(f"--kv-offload-path {directory} is not a directory; create it or "
                         "give another")
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        raise ValueError(f"{flag} {directory} is not writable ({error.strerror}); give "
                         "--kv-offload-path a directory loom may write to") from None
    free = shutil.disk_usage(directory).free
    if free < cache.kv_offload_size:
        logger.warning("--kv-offload-size is %s per rank but %s has %s free: the tier drops "
                       "blocks it cannot write", _format_bytes(cache.kv_offload_size),
                       directory, _format_bytes(free))


def _format_bytes(num_bytes: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes} B"
