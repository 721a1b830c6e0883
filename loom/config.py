"""Frozen, composed configuration. Validated on construction; this module reads no
file. The config is made from the user's arguments by ``EngineArgs.create_engine_config``
(loom/engine_args.py), after loom/checkpoint_defaults.py has read the checkpoint.

Runtime results (the profiled KV block count) live in runtime objects, never here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from loom.pooling import TASKS, PoolerConfig

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's (and torch's) short names
DTYPE_CHOICES = (*DTYPES, *DTYPE_ALIASES)
# --kv-cache-dtype: auto (the model's dtype), bfloat16, or int8, fp8_e4m3, fp8_e5m2 (per
# token and head quantized, loom/model/attention/kv_layout.py); fp8 is vLLM's alias for
# fp8_e4m3 (CacheConfig resolves it)
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
STEP_BOUND_S_PER_TOKEN = 0.02  # see ParallelConfig.step_bound_s
STEP_BOUND_S_PER_IMAGE_TOKEN = 0.08  # the same, for a placeholder token a tower makes
LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")
# --quantization (loom/model/layers/quantization.py); "auto" keeps the checkpoint's weights.
QUANTIZATION_CHOICES = ("auto", "none", "wint8", "wint4")
# GGUF formats are a file's, not a flag: --quantization auto keeps them
_QUANTIZATION_NOT_BUILT = ("q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k")


@dataclass(frozen=True)
class ModelConfig:
    model: str  # a Hugging Face directory or a .gguf file
    tokenizer: str | None = None
    # A GGUF model's llama.cpp vision projector (loom/model/loader/gguf_mmproj.py): the
    # multimodal config is the two files', the vision tower's weights are the projector's.
    mmproj: str | None = None
    dtype: str = "auto"  # resolved to a concrete name (checkpoint_defaults.py)
    max_model_len: int = 2048
    seed: int = 0
    served_model_name: str | None = None
    chat_template: str | None = None
    vocab_size: int | None = None  # read from the checkpoint (checkpoint_defaults.py)
    # Dummy steps at start-up so the first real step at each batch size is not slower
    # (Worker.warm_up; benchmarks/warm_up.md). Off: start faster.
    enable_warm_up: bool = True
    # Sampling defaults for what a request leaves out, as (name, value) pairs in
    # SamplingParams' names: the checkpoint's generation_config.json under
    # --generation-config auto, then --override-generation-config (read by
    # checkpoint_defaults.py).
    sampling_defaults: tuple[tuple[str, Any], ...] = ()
    # Token ids in, token ids out: no tokenizer is loaded, outputs have empty text.
    skip_tokenizer_init: bool = False
    # A registered name (loom.model.attention) or auto: cpu where loom's native kernels
    # apply, else torch; resolved when the model is built.
    attention_backend: str = "auto"
    # Weight-only quantization (loom/model/layers/quantization.py): auto keeps the
    # checkpoint's weights as stored (a GGUF file's Q4_0/Q4_1/Q5_0/Q8_0 and K-quant
    # linears, embedding and LM head quantized; other GGUF formats dequantized),
    # none dequantizes everything, wint8/wint4 quantize the decoder's linears at load.
    quantization: str = "auto"
    # wint4's input features per scale and offset (32, 64 or 128; a layer whose shard of
    # input features it does not divide takes the largest smaller one that does).
    quantization_group_size: int = 128
    # The seed's --lm-head-fp32: logits from a float32 copy of the LM head's weight
    # (dequantized if it is quantized) and float32 hidden states.
    lm_head_fp32: bool = False
    # On CUDA, no decode step is captured as a CUDA graph (worker/cuda_graphs.py): every
    # step runs eagerly. Changes nothing elsewhere.
    enforce_eager: bool = False
    # The most logprobs (and prompt_logprobs) a request may ask for (vLLM's
    # --max-logprobs); more is a 400 naming the field.
    max_logprobs: int = 20
    # What logprobs report (vLLM's --logprobs-mode): raw_logprobs (the model's output),
    # raw_logits, processed_logprobs or processed_logits (after logit bias, masks,
    # penalties and, for sampled rows, temperature, min_p, top-k and top-p: what the token
    # is drawn from). Prompt logprobs are raw (logits under raw_logits).
    logprobs_mode: str = "raw_logprobs"
    # Custom logits processors by class name (layers/logits_processors.py), applied in
    # that order before logit bias, masks and penalties.
    logits_processors: tuple[str, ...] = ()
    # A thinking model's reasoning budget for requests that set none (llama-server's
    # --reasoning-budget): -1 unlimited, 0 no thinking, N tokens; then </think> is forced,
    # after ``reasoning_budget_message``'s tokens if set. Applies where the tokenizer has
    # <think> and </think> (sampling_params.forced_thinking_token).
    reasoning_budget: int = -1
    reasoning_budget_message: str | None = None
    # OpenAI's reasoning_effort -> a budget (-1: unlimited)
    reasoning_effort_budgets: dict[str, int] = field(
        default_factory=lambda: {"low": 1024, "medium": 4096, "high": -1}, hash=False)
    # LoRA adapters (loom/lora.py): served beside the base when enabled; (name, path) of
    # those loaded at start-up; max_loras in the ranks' slots at once (and in the running
    # requests), of rank <= max_lora_rank; max_cpu_loras kept read in host memory (None:
    # max_loras).
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Images in (loom/multimodal): at most this many items of a modality in one prompt
    # (vLLM's --limit-mm-per-prompt; none given: no limit but the context); the hosts a
    # server may fetch image URLs from (none: data: URLs only), and the directory local
    # files may be read from (None: none).
    limit_mm_per_prompt: dict[str, int] | None = field(default=None, hash=False)
    allowed_media_domains: tuple[str, ...] = ()
    allowed_local_media_path: str | None = None
    # How media are read (vLLM's --media-io-kwargs): {"video": {"num_frames": N}}, the
    # frames sampled from a video_url (None: 32)
    media_io_kwargs: dict[str, dict[str, Any]] | None = field(default=None, hash=False)
    # MiB of each shared-memory ring that carries images' arrays to the next process of
    # this host (loom/ipc/shm_ring.py; vLLM's --mm-processor-cache-type shm); 0: inside
    # the messages.
    mm_shm_cache_size_mib: int = 256
    # What the engine answers (loom/pooling.py): generate (completions, chat), embed
    # (embeddings) or score (rerank, score); a request for another task is a 400.
    task: str = "generate"
    # How an embed or score model pools: the checkpoint's sentence-transformers files, then
    # --pooler-config (checkpoint_defaults.py); None for generate.
    pooler: PoolerConfig | None = field(default=None, compare=False)
    # The checkpoint's Hugging Face config as plain values (loom/model/loader/
    # hf_config_values.py), read once (checkpoint_defaults.py), so that the engine core and
    # the ranks build the model without importing transformers; None: each rank reads it.
    hf_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def is_pooling(self) -> bool:
        return self.task != "generate"

    @property
    def takes_images(self) -> bool:
        """The checkpoint has a vision tower (its config a ``vision_config``, or a GGUF
        file's projector beside it); unknown (no ``hf_config``) counts as no."""
        return self.mmproj is not None or "vision_config" in (self.hf_config or {})

    def __post_init__(self) -> None:
        from loom.model.attention import check_attn_backend_name  # imports no torch

        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        check_attn_backend_name(self.attention_backend)
        check_quantization_name(self.quantization)
        if type(self.quantization_group_size) is not int \
                or self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be 32, 64 or 128, got "
                             f"{self.quantization_group_size!r}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if type(self.reasoning_budget) is not int or self.reasoning_budget < -1:
            raise ValueError(f"reasoning_budget must be -1 (unlimited), 0 or positive, got "
                             f"{self.reasoning_budget!r}")
        limits = self.limit_mm_per_prompt
        if limits is not None and (not isinstance(limits, dict) or not set(limits) <= {
                "image", "video"} or not all(type(v) is int and v >= 0 for v in limits.values())):
            raise ValueError('limit_mm_per_prompt gives "image" (and "video") a count of 0 or '
                             f'more, e.g. {{"image": 2}}; got {limits!r}')
        media = self.media_io_kwargs
        if media is not None:
            frames = media.get("video", {}).get("num_frames", 1) \
                if isinstance(media, dict) and isinstance(media.get("video", {}), dict) else None
            if not isinstance(media, dict) or not set(media) <= {"video"} \
                    or not set(media.get("video", {})) <= {"num_frames"} \
                    or type(frames) is not int or frames < 1:
                raise ValueError('media_io_kwargs takes {"video": {"num_frames": N}} (N >= 1, '
                                 f"the frames sampled from a video_url); got {media!r}")
        efforts = self.reasoning_effort_budgets
        if not isinstance(efforts, dict) or set(efforts) != {"low", "medium", "high"} or not all(
                type(v) is int and v >= -1 for v in efforts.values()):
            raise ValueError('reasoning_effort_budgets must give "low", "medium" and "high" '
                             f"each a budget (-1 or more), got {efforts!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got "
                             f"{self.logprobs_mode!r}")
        if type(self.max_logprobs) is not int or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be a non-negative integer, got "
                             f"{self.max_logprobs!r}")

    @property
    def name(self) -> str:
        return self.served_model_name or os.path.basename(self.model.rstrip("/"))

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """SamplingParams fields for a request that does not set them (vLLM's
        ``get_diff_sampling_param``): the offline ``LLM`` when no SamplingParams is given,
        the server for every field a request omits."""
        return dict(self.sampling_defaults)


def check_quantization_name(name: str) -> None:
    """A one-line ValueError for a --quantization value loom does not run."""
    if name in QUANTIZATION_CHOICES:
        return
    if str(name).lower() in _QUANTIZATION_NOT_BUILT:
        raise ValueError(f"quantization {name} is a GGUF file's format, not a flag: "
                         f"--quantization auto keeps a GGUF file's formats; use one of "
                         f"{', '.join(QUANTIZATION_CHOICES)}")
    raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                     f"got {name!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None  # for tests: a fixed pool size
    kv_cache_memory_bytes: int | None = None  # an explicit KV budget instead of a fraction
    # Share of device (CPU: available) memory loom may use; None: 0.5 on CUDA, and on
    # the CPU a KV cache sized to max_num_seqs x max_model_len under a cap (Worker).
    memory_utilization: float | None = None
    kv_cache_dtype: str = "auto"  # one of KV_CACHE_DTYPES
    # The KV offload tier (core/kv_tier.py): bytes per rank for prefix-cache blocks the
    # pool evicts, kept in memory-mapped files under kv_offload_path (None: the system's
    # temporary directory; on CUDA, pinned host memory) and loaded back on a prefix hit;
    # None: no tier.
    kv_offload_size: int | None = None
    kv_offload_path: str | None = None

    def __post_init__(self) -> None:
        if self.kv_offload_size is not None and self.kv_offload_size < 1:
            raise ValueError(f"--kv-offload-size must be positive, got {self.kv_offload_size}")
        if self.kv_offload_path is not None and self.kv_offload_size is None:
            raise ValueError("--kv-offload-path needs --kv-offload-size (the tier's bytes per "
                             "rank, e.g. 8GiB)")
        if self.kv_offload_size is not None and not self.enable_prefix_caching:
            raise ValueError("--kv-offload-size keeps prefix-cache blocks: it needs prefix "
                             "caching on (drop --no-enable-prefix-caching)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype} is not supported; choose "
                             f"one of {', '.join(KV_CACHE_DTYPES)}")
        if self.kv_cache_dtype == "fp8":
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.memory_utilization is not None and not 0.0 < self.memory_utilization <= 1.0:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError("num_gpu_blocks_override must be positive, "
                             f"got {self.num_gpu_blocks_override}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError(f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}")

    @property
    def kv_offload_dir(self) -> str:
        """Where the KV offload tier's files go."""
        import tempfile

        return self.kv_offload_path or tempfile.gettempdir()

    def kv_offload_dir_on(self, device: str) -> str | None:
        """The tier's directory beside a cache on ``device``; None: host memory, the tier
        of a CUDA cache unless --kv-offload-path asks for files."""
        if device == "cuda" and self.kv_offload_path is None:
            return None
        return self.kv_offload_dir


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # Off: a prompt runs whole in one step or waits; a step never holds part of one.
    enable_chunked_prefill: bool = True
    # "fcfs": requests run in arrival order and the newest is preempted first; "priority":
    # by each request's priority (lower first), then arrival, and the lowest-priority
    # running request is preempted first (vLLM's --scheduling-policy).
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be fcfs or priority, got {self.policy!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill off, so a long "
                "prompt could never run; raise --max-num-batched-tokens, lower "
                "--max-model-len or keep --enable-chunked-prefill")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    # "mp": worker processes, "uni": the worker in the engine's process (TP=1 only),
    # "ray": one Ray actor per rank (loom.executor.ray_executor),
    # None: "uni" for one rank, "mp" for more.
    distributed_executor_backend: str | None = None
    # "ray": the cluster to join (`ray start --head`'s address); None: RAY_ADDRESS, else
    # the cluster last started on this host, else a new local one (as ray.init() does).
    ray_address: str | None = None
    nnodes: int = 1  # hosts the ranks are spread over, tensor_parallel_size / nnodes each
    node_rank: int = 0
    master_addr: str = "127.0.0.1"  # where node 0's engine binds the store and task queue
    master_port: int | None = None  # None: a free port (one host only)
    # An idle rank whose event loop has not run for this long is hung (or its host gone).
    worker_health_timeout_s: float = 30.0
    worker_start_timeout_s: float = 900.0  # load + profile + warm-up must finish in this
    # The floor of a step's time bound (``step_bound_s``): a step that runs longer than
    # its bound is a hang, handled as a dead worker. The engine core is judged the same
    # way from the API process.
    watchdog_timeout_s: float = 60.0

    # Mixture-of-experts layers split their experts, whole, over this many ranks (the
    # seed's --expert-parallel-size) instead of splitting every expert's matrices; the
    # expert-parallel ranks are the tensor-parallel ones (1 or tensor_parallel_size), or
    # every rank of every data-parallel replica (tensor_parallel_size x
    # data_parallel_size: tokens travel to their experts by all-to-all and the replicas
    # step in lock-step, docs/architecture.md). --enable-expert-parallel means the
    # largest of these.
    expert_parallel_size: int = 1
    # Experts over every replica's ranks: the port of the store through which all of
    # them form one process group (on data_parallel_address, hosted by replica 0's rank
    # 0), chosen by whoever launches the replicas (DPAsyncLLM) and passed down here.
    data_parallel_master_port: int | None = None
    # ... and with replicas on several hosts, each replica rank's lock-step inbox as the
    # head relays it (core/dp_lockstep.py: LockstepRelay): (the address its peers send
    # to, the address it receives from), both TCP on the head, chosen by the head and
    # passed down here; None: ipc sockets on this host.
    data_parallel_lockstep_addresses: tuple[tuple[str, str], ...] | None = None
    # Expert-parallel load balancing (vLLM's EPLB; layers/fused_moe.py): each MoE layer
    # holds num_experts + num_redundant_experts expert slots over the EP ranks and every
    # eplb_window_size steps places its experts anew from the window's loads.
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_window_size: int = 1000

    # Data parallel (``loom serve --data-parallel-size``, docs/architecture.md): replicas
    # of the whole engine, each with its own engine core, workers and KV cache, behind
    # one API server that routes each request (loom/dp_async_llm.py). Every replica's
    # config is this one with its own ``data_parallel_rank``.
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Replicas on several hosts (vLLM's flags): this host runs ranks start_rank ..
    # start_rank + size_local - 1 (None: every rank). The head (start rank 0) serves the
    # API and listens for the other hosts' ``loom serve --headless`` on
    # address:rpc_port (loom/ipc/dp_handshake.py).
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int = 0
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = 29550
    # Torch threads of each worker rank on the CPU; None: the host's cores shared evenly
    # by every rank of every replica (cores // (tensor-parallel ranks on this host x
    # data-parallel replicas)).
    cpu_threads_per_rank: int | None = None

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be positive, got {self.data_parallel_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank}")
        local = self.data_parallel_size_local
        if local is not None and not 0 <= local <= self.data_parallel_size:
            raise ValueError(f"--data-parallel-size-local {local} must be in [0, "
                             f"--data-parallel-size {self.data_parallel_size}]")
        if not 0 <= self.data_parallel_start_rank < self.data_parallel_size:
            raise ValueError(f"--data-parallel-start-rank {self.data_parallel_start_rank} must "
                             f"be in [0, --data-parallel-size {self.data_parallel_size})")
        if self.data_parallel_start_rank + self.num_local_replicas > self.data_parallel_size:
            raise ValueError(
                f"--data-parallel-start-rank {self.data_parallel_start_rank} + "
                f"--data-parallel-size-local {self.num_local_replicas} runs ranks past the "
                f"last, {self.data_parallel_size - 1}")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ValueError(f"--data-parallel-rpc-port must be a port 1..65535, got "
                             f"{self.data_parallel_rpc_port}")
        if (self.num_local_replicas < self.data_parallel_size
                and self.distributed_executor_backend == "ray"):
            raise ValueError("--data-parallel-size-local is for replicas started on each host "
                             "by loom serve --headless; with --distributed-executor-backend "
                             "ray leave it out (Ray places every replica's ranks)")
        if self.cpu_threads_per_rank is not None and self.cpu_threads_per_rank < 1:
            raise ValueError(f"cpu_threads_per_rank must be positive, got "
                             f"{self.cpu_threads_per_rank}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}")
        across = self.tensor_parallel_size * self.data_parallel_size
        if self.expert_parallel_size not in (1, self.tensor_parallel_size, across):
            raise ValueError(f"--expert-parallel-size {self.expert_parallel_size} must be 1, "
                             f"the tensor parallel size {self.tensor_parallel_size}, or "
                             f"tensor x data parallel size {across}: experts are split over "
                             "the tensor-parallel ranks or over every replica's ranks")
        if self.num_redundant_experts < 0 or self.eplb_window_size < 1:
            raise ValueError("--num-redundant-experts must be >= 0 and --eplb-window-size > 0")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("--num-redundant-experts places copies of busy experts, which "
                             "only --enable-eplb does; add it or drop the flag")
        if self.enable_eplb and self.expert_parallel_size == 1:
            raise ValueError("--enable-eplb balances experts over expert-parallel ranks; add "
                             "--enable-expert-parallel")
        if self.experts_across_replicas:
            if self.data_parallel_start_rank == 0 and self.num_local_replicas == 0:
                raise ValueError("expert parallel across data-parallel replicas needs the "
                                 "head to run replica 0 (its rank 0 hosts the ranks' process "
                                 "group on --data-parallel-address): give the head "
                                 "--data-parallel-size-local >= 1")
            if self.distributed_executor_backend == "uni" or self.nnodes > 1:
                raise ValueError("expert parallel across data-parallel replicas runs each "
                                 "replica's ranks in worker processes or Ray actors; drop "
                                 "--distributed-executor-backend uni and --nnodes")
        if self.distributed_executor_backend not in (None, "mp", "uni", "ray"):
            raise ValueError("distributed_executor_backend must be 'mp', 'uni' or 'ray', got "
                             f"{self.distributed_executor_backend!r}")
        if self.distributed_executor_backend == "ray" and self.nnodes > 1:
            raise ValueError("--distributed-executor-backend ray places every rank itself; "
                             "--nnodes/--node-rank are for ranks started by `loom worker`")
        if self.ray_address is not None and self.distributed_executor_backend != "ray":
            raise ValueError("--ray-address needs --distributed-executor-backend ray")
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
        if self.watchdog_timeout_s <= 0:
            raise ValueError(f"watchdog_timeout_s must be positive, got {self.watchdog_timeout_s}")

    def step_bound_s(self, num_scheduled_tokens: int, num_encoder_tokens: int = 0) -> float:
        """How long a step of this many tokens may run before it counts as a hang: the
        floor plus 20 ms a token (50 tokens/s, far below any supported model's prefill
        speed even on a loaded CPU), so a large prefill is never taken for a hang; plus
        80 ms for each placeholder token whose image a vision tower makes in the step
        (``num_encoder_tokens``). A tower's rows cost several times a text token's: a
        Qwen2.5-VL tower makes a placeholder token from 4 patch rows through 32 blocks of
        0.6 B parameters, 5 GFLOP, where its 1B text model spends 2. Eight 448 x 448
        images (2,048 placeholder tokens) took 20 s on 2 idle cores and 98 s on 2 loaded
        ones, past the 99 s that 20 ms a token allowed."""
        return (self.watchdog_timeout_s + STEP_BOUND_S_PER_TOKEN * num_scheduled_tokens
                + STEP_BOUND_S_PER_IMAGE_TOKEN * num_encoder_tokens)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def experts_across_replicas(self) -> bool:
        """MoE experts split over every data-parallel replica's ranks (all-to-all)."""
        return self.data_parallel_size > 1 and self.expert_parallel_size > self.tensor_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def threads_per_rank(self, cores: int) -> int:
        """Torch threads for one worker rank on a host with ``cores`` cores."""
        if self.cpu_threads_per_rank is not None:
            return self.cpu_threads_per_rank
        return max(1, cores // (self.ranks_per_node * max(1, self.num_local_replicas)))

    @property
    def num_local_replicas(self) -> int:
        """Data-parallel replicas whose engine cores run on this host."""
        if self.data_parallel_size_local is None:
            return self.data_parallel_size
        return self.data_parallel_size_local

    @property
    def local_replica_ranks(self) -> range:
        return range(self.data_parallel_start_rank,
                     self.data_parallel_start_rank + self.num_local_replicas)

    @property
    def use_worker_processes(self) -> bool:
        """The ranks run outside the engine's process (worker processes or Ray actors)."""
        if self.distributed_executor_backend is None:
            return self.world_size > 1 or self.experts_across_replicas
        return self.distributed_executor_backend in ("mp", "ray")


_STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance", "llguidance", "off")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Grammar-constrained decoding (loom/structured_output/), vLLM's backend names:
    "xgrammar", "guidance" (alias "llguidance"), or "auto": per request, xgrammar unless
    the request needs what xgrammar does not enforce, then llguidance
    (docs/structured_outputs.md); "off" (the seed's default spelling) loads none, and a
    request asking for a grammar is refused."""

    backend: str = "auto"
    disable_any_whitespace: bool = False  # JSON without free whitespace (default per request)
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured outputs backend must be one of "
                             f"{', '.join(_STRUCTURED_OUTPUTS_BACKENDS)}, got {self.backend!r}")

    @property
    def enabled(self) -> bool:
        return self.backend != "off"

    @property
    def may_use_xgrammar(self) -> bool:
        """Some request may be served by xgrammar, which imports torch where it runs."""
        return self.backend in ("auto", "xgrammar")


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
    # The draft's HF config as plain values (as ModelConfig.hf_config), read with the target's.
    hf_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)

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


# FastDeploy's moba_attention_config keys that loom spells otherwise or does not take
_MOBA_SEED_KEYS = {
    "moba_encoder_top_k_left": "moba_topk", "moba_encoder_top_k_right": "moba_topk",
    "moba_decoder_top_k_left": "moba_topk", "moba_decoder_top_k_right": "moba_topk",
    "moba_use_encoder_seq_limit": "moba_min_seq_len",
    "moba_use_decoder_seq_limit": "moba_min_seq_len"}


@dataclass(frozen=True)
class MobaAttentionConfig:
    """MoBA, mixture of block attention (``--moba-attention-config``; the seed's
    ``moba_attention_config``; loom/model/attention/moba.py): a query at position p
    whose context (p + 1 keys) is at least ``moba_min_seq_len`` attends to its own block
    of ``moba_block_size`` keys (causally) and to the ``moba_topk - 1`` earlier blocks
    whose mean key scores highest against it, per query head; ``moba_topk`` counts the
    query's own block, as the MoBA paper's (MoonshotAI/MoBA). Below the minimum, full
    attention. Blocks are whole KV cache blocks (``--block-size`` divides
    ``moba_block_size``)."""

    moba_block_size: int
    moba_topk: int
    moba_min_seq_len: int = 0

    def __post_init__(self) -> None:
        for name, least in (("moba_block_size", 1), ("moba_topk", 1),
                            ("moba_min_seq_len", 0)):
            value = getattr(self, name)
            if type(value) is not int or value < least:
                raise ValueError(f"moba_attention_config: {name} must be an integer >= {least}, "
                                 f"got {value!r}")

    @classmethod
    def from_value(cls, value: MobaAttentionConfig | dict | str | None
                   ) -> MobaAttentionConfig | None:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"moba_attention_config is not valid JSON: {error}") from None
        if isinstance(value, dict):
            seed = sorted(set(value) & set(_MOBA_SEED_KEYS))
            if seed:
                ours = sorted({_MOBA_SEED_KEYS[key] for key in seed})
                raise ValueError(
                    f"moba_attention_config: {', '.join(seed)} "
                    f"{'is' if len(seed) == 1 else 'are'} FastDeploy's; loom takes "
                    f"{' and '.join(ours)}"
                    + (" (exactly moba_topk blocks per query, its own included)"
                       if "moba_topk" in ours else ""))
            missing = [name for name in ("moba_block_size", "moba_topk") if name not in value]
            if missing:
                raise ValueError(f"moba_attention_config needs {' and '.join(missing)}, e.g. "
                                 '\'{"moba_block_size": 512, "moba_topk": 3, '
                                 '"moba_min_seq_len": 4096}\'')
        return _config_from_value(cls, value, "moba_attention_config")


# Prefill/decode disaggregation (docs/disaggregation.md): vLLM's kv_role names and the
# seed's --splitwise-role names for the same three roles.
_KV_ROLES = {"kv_both": "mixed", "kv_producer": "prefill", "kv_consumer": "decode"}
SPLITWISE_ROLES = ("mixed", "prefill", "decode")
_KV_TRANSPORTS = ("tcp", "shm")
# vLLM's connector names are accepted for its command lines; loom moves the blocks itself.
_KV_CONNECTORS = ("LoomConnector", "NixlConnector", "P2pNcclConnector", "MooncakeConnector")


@dataclass(frozen=True)
class KVTransferConfig:
    """KV blocks shipped between instances (``--kv-transfer-config``, vLLM's form; or
    ``--splitwise-role``). A ``prefill`` instance (kv_producer) runs a request's prompt
    and holds its blocks until the decode side has pulled them (or
    ``kv_hold_timeout_s`` passed); a ``decode`` instance (kv_consumer) pulls the blocks
    rank to rank and samples from the last prompt position on; ``mixed`` (kv_both) does
    both, as each request's ``kv_transfer_params`` asks. Rank i of a prefill instance
    listens on ``kv_ip:kv_port + i`` (port 0: any free port; data-parallel replica r:
    ``kv_port + r * tensor_parallel_size + i``). ``kv_transport``: ``tcp`` (the blocks
    go over the socket, sent from and received into the caches' memory) or ``shm`` (one
    host: the prefill instance's cache lives in shared memory and the decode side copies
    the blocks from it; the socket carries only the handshake)."""

    kv_role: str = "kv_both"
    kv_connector: str = "LoomConnector"
    kv_transport: str = "tcp"
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_hold_timeout_s: float = 60.0  # prefill side: held blocks are freed after this
    kv_transfer_timeout_s: float = 30.0  # a socket silent this long fails its transfer
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)  # vLLM's; unused

    def __post_init__(self) -> None:
        if self.kv_role not in _KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(_KV_ROLES)}, got {self.kv_role!r}")
        if self.kv_connector not in _KV_CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(_KV_CONNECTORS)}, got "
                             f"{self.kv_connector!r}")
        if self.kv_transport not in _KV_TRANSPORTS:
            raise ValueError(f"kv_transport must be tcp or shm, got {self.kv_transport!r}")
        if not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be in [0, 65535], got {self.kv_port}")
        for name in ("kv_hold_timeout_s", "kv_transfer_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def splitwise_role(self) -> str:
        """The seed's name of this role: mixed, prefill or decode."""
        return _KV_ROLES[self.kv_role]

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_args(cls, splitwise_role: str | None,
                  kv_transfer_config: KVTransferConfig | dict | str | None
                  ) -> KVTransferConfig | None:
        """``--splitwise-role`` and ``--kv-transfer-config`` together: None (a plain
        instance) when neither asks for a connector; a role given both ways must agree."""
        config = _config_from_value(cls, kv_transfer_config, "kv_transfer_config")
        if splitwise_role is None or (config is None and splitwise_role == "mixed"):
            return config
        if splitwise_role not in SPLITWISE_ROLES:
            raise ValueError(f"splitwise_role must be one of {', '.join(SPLITWISE_ROLES)}, got "
                             f"{splitwise_role!r}")
        kv_role = {role: name for name, role in _KV_ROLES.items()}[splitwise_role]
        if config is None:
            return cls(kv_role=kv_role)
        if isinstance(kv_transfer_config, (dict, str)) and "kv_role" in (
                kv_transfer_config if isinstance(kv_transfer_config, dict)
                else json.loads(kv_transfer_config)) and config.kv_role != kv_role:
            raise ValueError(f"--splitwise-role {splitwise_role} contradicts kv_role "
                             f"{config.kv_role!r} in --kv-transfer-config; give one of them")
        return dataclasses.replace(config, kv_role=kv_role)


def _config_from_value(cls, value, name: str):
    """A sub-config from itself, a dict, or its JSON text (as ``--speculative-config``)."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    known = {name for name, spec in cls.__dataclass_fields__.items() if spec.repr}  # not hf_config
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
    kv_transfer: KVTransferConfig | None = None  # prefill/decode disaggregation
    device: str = "cpu"
    moba_attention: MobaAttentionConfig | None = None  # MoBA on full-attention layers

    def largest_step_bound_s(self) -> float:
        """The bound (``ParallelConfig.step_bound_s``) of the largest step the scheduler
        may make: ``max_num_batched_tokens`` tokens and, for a model that takes images, as
        many placeholder tokens made by its tower (the step's encoder budget), or one
        image of up to the whole context, which runs alone."""
        tokens = self.scheduler.max_num_batched_tokens
        images = max(tokens, self.model.max_model_len) if self.model.takes_images else 0
        return self.parallel.step_bound_s(tokens, images)

    def __post_init__(self) -> None:
        from loom.model.attention import check_attn_backend_device  # imports no torch

        check_attn_backend_device(self.model.attention_backend, self.device)
        if self.speculative is not None and self.model.logprobs_mode.startswith("processed"):
            raise ValueError(f"--logprobs-mode {self.model.logprobs_mode} is not supported "
                             "with speculative decoding; use raw_logprobs or raw_logits")
        if self.scheduler.max_model_len != self.model.max_model_len:
            raise ValueError("scheduler.max_model_len must equal model.max_model_len "
                             f"({self.scheduler.max_model_len} != {self.model.max_model_len})")
        moba = self.moba_attention
        if moba is not None and moba.moba_block_size % self.cache.block_size:
            raise ValueError(f"moba_attention_config: moba_block_size {moba.moba_block_size} "
                             f"must be a multiple of --block-size {self.cache.block_size}")
        if moba is not None and self.kv_transfer is not None:
            raise ValueError("--moba-attention-config does not go with --kv-transfer-config: "
                             "a transfer ships K/V blocks without MoBA's block means")


def resolve_device(device: str) -> str:
    """``auto``: cuda where torch sees a CUDA device, else cpu. Imports no torch for a
    CPU build of torch; the API server process asks a child process (loom/torch_free.py)."""
    from loom.torch_free import cuda_available, torch_build

    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        return device
    build = torch_build()
    if build.has_gpu_support and cuda_available():
        return "cuda"
    if device == "cuda":
        reason = ("this torch is built without CUDA" if not build.has_gpu_support
                  else "no CUDA device is visible")
        raise ValueError(f"--device cuda, but {reason} (torch {build.version}); use "
                         "--device cpu or --device auto")
    return "cpu"
