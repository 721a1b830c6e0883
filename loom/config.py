"""Frozen, composed configuration. Validated on construction; no I/O except in ``from_*``.

Runtime results (the profiled KV block count) live in runtime objects, never here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face directory or a .gguf file
    tokenizer: str | None = None
    dtype: str = "auto"  # resolved to a concrete name by EngineConfig.from_args
    max_model_len: int = 2048
    seed: int = 0
    served_model_name: str | None = None
    chat_template: str | None = None
    vocab_size: int | None = None  # read from the checkpoint by from_args
    # Dummy steps at start-up so the first real step at each batch size is not slower
    # (Worker.warm_up; benchmarks/warm_up.md). Off: start faster.
    enable_warm_up: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(self.model.rstrip("/"))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # for tests: a fixed pool size
    kv_cache_memory_bytes: int | None = None  # an explicit KV budget instead of a fraction
    memory_utilization: float = 0.5  # share of device (CPU: available) memory loom may use

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be positive, "
                             f"got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # "mp": worker processes, "uni": the worker in the engine's process (TP=1 only),
    # None: "uni" for one rank, "mp" for more.
    distributed_executor_backend: str | None = None
    nnodes: int = 1  # hosts the ranks are spread over, tensor_parallel_size / nnodes each
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # where node 0's engine binds the store and task queue
    master_port: int | None = None  # None: a free port (one host only)
    worker_health_timeout_s: float = 30.0  # a busy or idle worker silent this long is dead
    worker_start_timeout_s: float = 900.0  # load + profile + warm-up must finish in this

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "mp", "uni"):
            raise ValueError("distributed_executor_backend must be 'mp' or 'uni', got "
                             f"{self.distributed_executor_backend!r}")
        if self.nnodes < 1 or self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes} must be positive and divide "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("with --nnodes > 1 every node needs the same --master-port")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError("distributed_executor_backend='uni' runs one rank; use 'mp' for "
                             f"tensor_parallel_size={self.tensor_parallel_size}")
        if self.worker_health_timeout_s <= 0 or self.worker_start_timeout_s <= 0:
            raise ValueError("worker timeouts must be positive")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def use_worker_processes(self) -> bool:
        if self.distributed_executor_backend is None:
            return self.world_size > 1
        return self.distributed_executor_backend == "mp"


_STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance", "llguidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding (loom/structured_output/). One engine, llguidance,
    behind the names vLLM uses for it ("auto", "guidance")."""

    backend: str = "auto"
    disable_any_whitespace: bool = False  # JSON without free whitespace (default per request)
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured outputs backend must be one of "
                             f"{', '.join(_STRUCTURED_OUTPUTS_BACKENDS)}, got {self.backend!r} "
                             "(see docs/structured_outputs.md for why xgrammar is not offered)")


_SPECULATIVE_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (docs/speculative_decoding.md): each step a proposer drafts up
    to ``num_speculative_tokens`` tokens per request, the target model verifies them in
    its next forward and rejection sampling keeps the output distribution exact.

    ``ngram``: prompt lookup over the request's own tokens (the longest suffix of
    ``prompt_lookup_min..prompt_lookup_max`` tokens seen before proposes what followed).
    ``draft_model``: ``model``, a smaller checkpoint with the same tokenizer, run greedily.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    model: str | None = None  # the draft checkpoint (draft_model only)

    def __post_init__(self) -> None:
        if self.method not in _SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(_SPECULATIVE_METHODS)},"
                             f" got {self.method!r}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be positive, "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative method 'draft_model' needs 'model': the path of a "
                             "smaller checkpoint with the same tokenizer")
        if self.method == "ngram" and self.model:
            raise ValueError("speculative method 'ngram' takes no 'model'; use 'draft_model'")

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots booked past a request's scheduled tokens for the proposer to write:
        a draft model computes K/V for its own drafts; n-gram lookup needs none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        return _config_from_value(cls, value, "speculative_config")


@dataclass(frozen=True)
class EarlyStopConfig:
    """FastDeploy's early stop, ``repetition`` strategy: a request stops (finish_reason
    "stop", stop_reason "early_stop") once the probability of its sampled token has been
    above ``threshold`` for ``window_size`` consecutive tokens. The probability is the
    token's under the request's sampling distribution before top-k/top-p/min-p
    truncation (after bias, penalties and temperature; temperature 1 for greedy)."""

    enable_early_stop: bool = False
    strategy: str = "repetition"
    window_size: int = 3000
    threshold: float = 0.99

    def __post_init__(self) -> None:
        if self.strategy != "repetition":
            raise ValueError(f"early stop strategy must be 'repetition', got {self.strategy!r}")
        if self.window_size < 1:
            raise ValueError(f"early stop window_size must be positive, got {self.window_size}")
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"early stop threshold must be in [0, 1), got {self.threshold}")

    @classmethod
    def from_value(cls, value: EarlyStopConfig | dict | str | None) -> EarlyStopConfig | None:
        return _config_from_value(cls, value, "early_stop_config")


def _config_from_value(cls, value, name: str):
    """A sub-config from itself, a dict, or its JSON text (as ``--speculative-config``)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"{name} has unknown keys {unknown}; known: {sorted(known)}")
    return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None
    early_stop: EarlyStopConfig | None = None
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.scheduler.max_model_len != self.model.max_model_len:
            raise ValueError("scheduler.max_model_len must equal model.max_model_len "
                             f"({self.scheduler.max_model_len} != {self.model.max_model_len})")

    @classmethod
    def from_args(
        cls,
        model: str,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        num_gpu_blocks_override: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        memory_utilization: float = 0.5,
        tensor_parallel_size: int = 1,
        distributed_executor_backend: str | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        worker_health_timeout_s: float = 30.0,
        seed: int = 0,
        served_model_name: str | None = None,
        chat_template: str | None = None,
        device: str = "auto",
        structured_outputs_backend: str = "auto",
        structured_outputs_disable_any_whitespace: bool = False,
        structured_outputs_disable_additional_properties: bool = False,
        speculative_config: SpeculativeConfig | dict | str | None = None,
        early_stop_config: EarlyStopConfig | dict | str | None = None,
        enable_warm_up: bool = True,
    ) -> EngineConfig:
        """Build a config from user arguments, reading the checkpoint's config for defaults."""
        from loom.model.loader import load_hf_config

        if not os.path.exists(model):
            raise ValueError(f"model {model!r} does not exist; give a Hugging Face directory "
                             "or a .gguf file")
        hf_config = load_hf_config(model)
        device = resolve_device(device)
        limit = _max_position_embeddings(hf_config)
        if max_model_len is None:
            max_model_len = min(limit, 4096) if limit else 4096
        elif limit and max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}; lower --max-model-len")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, min(max_model_len, 8192))
        speculative = SpeculativeConfig.from_value(speculative_config)
        if speculative is not None and speculative.model is not None:
            _check_draft_model(speculative.model, hf_config)
        return cls(
            model=ModelConfig(model=model, tokenizer=tokenizer,
                              dtype=resolve_dtype(dtype, hf_config, model, device),
                              max_model_len=max_model_len, seed=seed,
                              served_model_name=served_model_name, chat_template=chat_template,
                              vocab_size=getattr(hf_config, "vocab_size", None),
                              enable_warm_up=enable_warm_up),
            cache=CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                              num_gpu_blocks_override=num_gpu_blocks_override,
                              kv_cache_memory_bytes=kv_cache_memory_bytes,
                              memory_utilization=memory_utilization),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    distributed_executor_backend=distributed_executor_backend,
                                    nnodes=nnodes, node_rank=node_rank, master_addr=master_addr,
                                    master_port=master_port,
                                    worker_health_timeout_s=worker_health_timeout_s),
            structured_outputs=StructuredOutputsConfig(
                backend=structured_outputs_backend,
                disable_any_whitespace=structured_outputs_disable_any_whitespace,
                disable_additional_properties=structured_outputs_disable_additional_properties),
            speculative=speculative,
            early_stop=EarlyStopConfig.from_value(early_stop_config),
            device=device,
        )


def resolve_device(device: str) -> str:
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    return device


def resolve_dtype(dtype: str, hf_config, model: str, device: str) -> str:
    """``auto`` follows the checkpoint, except where that dtype is slow on the device.

    GGUF files are dequantized to bfloat16. On CPU float16 matmuls are a slow
    fallback, so float16 checkpoints run in bfloat16 there.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if dtype == "auto":
        if model.endswith(".gguf"):
            dtype = "bfloat16"
        else:
            raw = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
            dtype = str(raw).removeprefix("torch.") if raw else "float32"
            if dtype not in _DTYPES:
                dtype = "float32"
    if device == "cpu" and dtype == "float16":
        dtype = "bfloat16"
    return dtype


def _check_draft_model(path: str, target_hf_config) -> None:
    from loom.model.loader import load_hf_config

    if not os.path.exists(path):
        raise ValueError(f"draft model {path!r} does not exist; give a Hugging Face directory "
                         "or a .gguf file")
    draft_vocab = getattr(load_hf_config(path), "vocab_size", None)
    target_vocab = getattr(target_hf_config, "vocab_size", None)
    if draft_vocab is not None and target_vocab is not None and draft_vocab < target_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is smaller than the "
                         f"target's ({target_vocab}); the draft must share the target's tokenizer")


def _max_position_embeddings(hf_config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
