"""Every argument that shapes an engine, declared once.

``EngineArgs`` is the one declaration: each field carries its flag names, help, value
parser and the config field it lands in. From it come

- the flags of every command that builds an engine (``EngineArgs.add_cli_args``; the
  ``serve`` command adds the fields scoped to it),
- the keyword arguments ``LLM(...)`` accepts (``EngineArgs.from_llm_kwargs``, with vLLM's
  spellings and the closest-name error for a misspelt one),
- the frozen ``EngineConfig`` (``create_engine_config``), field by field.

Reading the checkpoint to resolve what is left to it (``None``: the dtype, the context
length, the step's token budget ...) is its own step, in ``loom/checkpoint_defaults.py``.
No heavy imports here: the parser is built for every ``loom`` command.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
from dataclasses import dataclass, field
from typing import Any

from loom import arg_types
from loom.config import (DTYPE_CHOICES, KV_CACHE_DTYPES, CacheConfig, EarlyStopConfig,
                         EngineConfig, KVTransferConfig, MobaAttentionConfig, ModelConfig,
                         ParallelConfig, SchedulerConfig, SpeculativeConfig,
                         StructuredOutputsConfig)

logger = logging.getLogger(__name__)

# Where a field's flag is offered: every command that builds an engine (generate, chat,
# serve, worker, bench throughput/latency), ``loom serve`` only, or no flag (``LLM``'s
# keyword and the Python API only).
ENGINE, SERVE, API = "engine", "serve", "api"

# EngineConfig's sections, each built from the fields whose ``to`` names it.
_SECTIONS = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
             "parallel": ParallelConfig, "structured_outputs": StructuredOutputsConfig}


def arg(default: Any = None, *, to: str | tuple[str, ...] | None, help: str | None = None,
        flags: tuple[str, ...] = (), parse: Any = None, choices: Any = None,
        metavar: str | None = None, action: str | type[argparse.Action] | None = None,
        scope: str = ENGINE, nargs: str | None = None) -> Any:
    """A field of ``EngineArgs``.

    ``to``: the config field(s) it lands in, ``section.name`` (``"scheduler.max_num_seqs"``)
    or a whole section (``"speculative"``); None for an argument that only steers how
    others are resolved. ``flags``: the flag names, default ``--`` + the field's name
    with dashes. ``parse``: argparse's ``type``; ``action``: ``"store_true"`` or
    ``argparse.BooleanOptionalAction`` for switches.
    """
    targets = (to,) if isinstance(to, str) else (to or ())
    metadata = {"to": targets, "help": help, "flags": flags, "parse": parse,
                "choices": choices, "metavar": metavar, "action": action, "scope": scope,
                "nargs": nargs}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class EngineArgs:
    """User arguments to an engine, as given; None leaves a value to the checkpoint or
    the device (``loom/checkpoint_defaults.py``)."""

    # Each command declares MODEL itself (serve takes it positionally as well).
    model: str | None = arg(None, to="model.model", scope=API)
    tokenizer: str | None = arg(None, to="model.tokenizer",
                                help="tokenizer path if not beside the model")
    mmproj: str | None = arg(
        None, to="model.mmproj", metavar="FILE",
        help="a llama.cpp vision projector (mmproj-*.gguf, as convert_hf_to_gguf.py "
             "--mmproj writes it) beside a .gguf MODEL: the model then takes images "
             "(Qwen2.5-VL, Gemma 3)")
    skip_tokenizer_init: bool = arg(False, to="model.skip_tokenizer_init", scope=API)
    dtype: str = arg("auto", to="model.dtype", choices=DTYPE_CHOICES,
                     help="weights and activations; half = float16, float = float32. On the "
                          "CPU float16 runs as bfloat16 (with a warning)")
    max_model_len: int | None = arg(
        None, to=("model.max_model_len", "scheduler.max_model_len"),
        parse=arg_types.human_readable_int,
        help="context length in tokens; 32k = 32000, 32K = 32768 (as vLLM)")
    max_num_seqs: int = arg(64, to="scheduler.max_num_seqs", parse=arg_types.positive_int)
    scheduling_policy: str = arg(
        "fcfs", to="scheduler.policy", choices=["fcfs", "priority"],
        help="fcfs: arrival order, the newest preempted first; priority: each request's "
             "priority (lower first, then arrival), the lowest preempted first")
    max_num_batched_tokens: int | None = arg(
        None, to="scheduler.max_num_batched_tokens", parse=arg_types.human_readable_int,
        help="token budget of one step (default: at least 2048)")
    enable_chunked_prefill: bool | None = arg(
        None, to="scheduler.enable_chunked_prefill", action=argparse.BooleanOptionalAction,
        help="split long prompts over steps (default: on). Off: a prompt runs whole in one "
             "step or waits; --max-num-batched-tokens must then be at least --max-model-len")
    block_size: int = arg(16, to="cache.block_size", parse=arg_types.positive_int)
    enable_prefix_caching: bool = arg(True, to="cache.enable_prefix_caching",
                                      action=argparse.BooleanOptionalAction)
    num_gpu_blocks_override: int | None = arg(None, to="cache.num_gpu_blocks_override",
                                              parse=arg_types.positive_int)
    kv_cache_memory_bytes: int | None = arg(
        None, to="cache.kv_cache_memory_bytes", flags=("--kv-cache-memory",),
        parse=arg_types.byte_size, help="KV cache budget per rank, e.g. 2GiB or 512MiB")
    memory_utilization: float | None = arg(
        None, to="cache.memory_utilization",
        flags=("--memory-utilization", "--gpu-memory-utilization"), parse=arg_types.fraction,
        help="share of available memory the KV cache may take (0, 1]; default: 0.5 on CUDA; "
             "on the CPU max-num-seqs x max-model-len tokens, at most 512 MiB")
    kv_cache_dtype: str = arg(
        "auto", to="cache.kv_cache_dtype", choices=KV_CACHE_DTYPES,
        help="auto: the model's dtype; int8, fp8_e4m3 (fp8) or fp8_e5m2: K and V quantized "
             "per token and head (a float32 scale each), about twice the tokens in the same "
             "memory")
    kv_offload_size: int | None = arg(
        None, to="cache.kv_offload_size", parse=arg_types.byte_size, metavar="BYTES",
        help="a KV offload tier per rank, e.g. 8GiB: prefix-cache blocks the KV cache evicts "
             "(a preempted request's too) are kept in memory-mapped files under "
             "--kv-offload-path (on CUDA without that flag: pinned host memory) and loaded "
             "back on a prefix hit instead of recomputed; the least recently used go when it "
             "is full")
    kv_offload_path: str | None = arg(
        None, to="cache.kv_offload_path", metavar="DIR",
        help="a writable directory for the KV offload tier's files (default: the system's "
             "temporary directory; on CUDA, host memory instead of files); each rank's file "
             "is removed when it exits")
    tensor_parallel_size: int = arg(1, to="parallel.tensor_parallel_size",
                                    flags=("--tensor-parallel-size", "-tp"),
                                    parse=arg_types.positive_int)
    enable_expert_parallel: bool = arg(
        False, to=None, action="store_true",
        help="MoE models: split the experts, whole, over the tensor-parallel ranks (each "
             "rank runs the tokens routed to its experts) instead of splitting every expert; "
             "with --data-parallel-size D, over all D x TP ranks of every replica (tokens "
             "travel to their experts by all-to-all, the replicas step together)")
    expert_parallel_size: int | None = arg(
        None, to="parallel.expert_parallel_size", flags=("--expert-parallel-size", "-ep"),
        parse=arg_types.positive_int,
        help="ranks the experts are split over: 1, the tensor parallel size, or tensor x "
             "data parallel size (--enable-expert-parallel picks the largest)")
    enable_eplb: bool = arg(
        False, to="parallel.enable_eplb", action="store_true",
        help="expert-parallel load balancing (vLLM's EPLB): every --eplb-window-size steps "
             "each MoE layer places its experts anew from the tokens they got in the "
             "window, the busiest with more copies (--num-redundant-experts), spread so "
             "every rank gets a like share of the load; needs expert parallel")
    num_redundant_experts: int = arg(
        0, to="parallel.num_redundant_experts", parse=arg_types.non_negative_int,
        help="with --enable-eplb: extra expert slots each MoE layer holds (experts + "
             "redundant must divide over the expert-parallel ranks)")
    eplb_window_size: int = arg(
        1000, to="parallel.eplb_window_size", parse=arg_types.positive_int,
        help="with --enable-eplb: steps between rearrangements, whose loads decide each")
    distributed_executor_backend: str | None = arg(
        None, to="parallel.distributed_executor_backend", choices=["mp", "uni", "ray"],
        help="mp: worker processes; uni: in-process (one rank); ray: one Ray actor per rank "
             "on a Ray cluster (pip install 'loom[ray]'); default: uni for one rank, mp for "
             "more (loom serve: mp)")
    ray_address: str | None = arg(
        None, to="parallel.ray_address",
        help="with --distributed-executor-backend ray: the cluster to join (`ray start "
             "--head` prints it); default: RAY_ADDRESS, else the cluster last started on "
             "this host, else a new local one")
    nnodes: int = arg(1, to="parallel.nnodes", parse=arg_types.positive_int,
                      help="hosts the tensor-parallel ranks are spread over")
    node_rank: int = arg(0, to="parallel.node_rank", parse=int,
                         help="this host's index (0: engine)")
    master_addr: str = arg("127.0.0.1", to="parallel.master_addr",
                           help="address of node 0, where the engine listens")
    master_port: int | None = arg(
        None, to="parallel.master_port", parse=arg_types.positive_int,
        help="torch.distributed port on node 0; the task queue uses the next two")
    worker_health_timeout_s: float = arg(
        30.0, to="parallel.worker_health_timeout_s", flags=("--worker-health-timeout",),
        parse=float,
        help="seconds an idle worker's event loop may stay silent before the engine "
             "declares it hung (docs/robustness.md)")
    watchdog_timeout_s: float = arg(
        60.0, to="parallel.watchdog_timeout_s", flags=("--watchdog-timeout",), parse=float,
        help="floor of a step's time bound, in seconds; the bound adds 20 ms a scheduled "
             "token and 80 ms a placeholder token whose image a vision tower makes in the "
             "step. A step past its bound is a hang: stacks are logged, requests fail, "
             "/health turns 503 and the server exits 1 (docs/robustness.md)")
    seed: int = arg(0, to="model.seed", parse=int)
    device: str = arg("auto", to="device", choices=["auto", "cpu", "cuda"])
    attention_backend: str = arg(
        "auto", to="model.attention_backend", metavar="auto|cpu|torch|triton",
        help="attention implementation, by registered name: cpu (loom's native CPU "
             "kernels), torch (the PyTorch reference), triton (loom's Triton kernels, CUDA "
             "only; opt-in: not yet proven on a GPU), or auto (default: cpu where the "
             "native kernels apply, else torch)")
    quantization: str = arg(
        "auto", to="model.quantization", flags=("--quantization", "-q"),
        metavar="auto|none|wint8|wint4",
        help="weight-only quantization of the decoder's linear weights: auto (default) runs "
             "them as stored, a GGUF file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K kept "
             "quantized; none dequantizes everything; wint8 makes them int8 per output "
             "channel at load, wint4 4-bit in groups of --quantization-group-size (both also "
             "make the embedding and LM head int8 per row, unless --lm-head-fp32)")
    quantization_group_size: int = arg(
        128, to="model.quantization_group_size", parse=int, metavar="32|64|128",
        help="wint4: input features per scale and offset (default 128)")
    task: str = arg(
        "generate", to="model.task", choices=["generate", "embed", "score", "classify"],
        help="what the engine answers: generate (completions, chat; the default), embed "
             "(/v1/embeddings, LLM.embed: the prompt's hidden states pooled), score "
             "(/v1/rerank, /score, LLM.score: a decoder reranker's yes/no probability) or "
             "classify (/classify, LLM.classify: a *ForSequenceClassification checkpoint's "
             "label probabilities); loom/pooling.py")
    pooler_config: dict[str, Any] | str | None = arg(
        None, to=None, parse=arg_types.json_object,
        flags=("--pooler-config", "--override-pooler-config"),
        help='embed/score: how to pool, JSON over the checkpoint\'s sentence-transformers '
             'config, e.g. \'{"pooling_type": "MEAN", "normalize": false}\' (fields: '
             'pooling_type LAST|MEAN|CLS, normalize, matryoshka_dimensions, '
             'classifier_from_token, score_template, instruction)')
    enable_lora: bool = arg(
        False, to="model.enable_lora", action="store_true",
        help="serve LoRA adapters beside the base model, batched together (loom/lora.py)")
    lora_modules: tuple[tuple[str, str], ...] | list[str] = arg(
        (), to="model.lora_modules", nargs="+", metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) loaded at start-up, each served under its "
             "NAME (a request's model)")
    max_loras: int = arg(1, to="model.max_loras", parse=arg_types.positive_int,
                         help="LoRA adapters in the ranks' slots at once: at most this many "
                              "among the running requests (requests for others wait)")
    max_cpu_loras: int | None = arg(
        None, to="model.max_cpu_loras", parse=arg_types.positive_int,
        help="LoRA adapters kept read in host memory, the slots' ones included (default "
             "--max-loras; >= --max-loras); the least recently used beyond it are read "
             "from disk again when next needed")
    max_lora_rank: int = arg(16, to="model.max_lora_rank", parse=arg_types.positive_int,
                             help="the largest LoRA rank an adapter may have")
    limit_mm_per_prompt: dict[str, int] = arg(
        None, to="model.limit_mm_per_prompt", parse=arg_types.json_object,
        help='images (and video) one prompt may hold, JSON, e.g. \'{"image": 2}\' (default: '
             "no limit but the context)")
    allowed_media_domains: tuple[str, ...] = arg(
        (), to="model.allowed_media_domains", parse=arg_types.comma_list, scope=SERVE,
        help="hosts (and their subdomains) image URLs may be fetched from, comma-separated "
             "(default: none; data: URLs only). Never a private or loopback address")
    allowed_local_media_path: str | None = arg(
        None, to="model.allowed_local_media_path", scope=SERVE,
        help="a directory whose files image URLs (file://) may name (default: none)")
    media_io_kwargs: dict[str, dict[str, Any]] | None = arg(
        None, to="model.media_io_kwargs", parse=arg_types.json_object, scope=SERVE,
        help='how media are read, JSON, e.g. \'{"video": {"num_frames": 16}}\': the frames '
             "sampled evenly from a video_url (default 32)")
    mm_shm_cache_size_mib: int = arg(
        256, to="model.mm_shm_cache_size_mib", parse=arg_types.non_negative_int,
        help="shared memory for images' arrays (64 KiB or more) on their way to the engine "
             "core and to the ranks of this host: a ring of this size per sending process "
             "(the API server per replica, each engine core), in /dev/shm, removed at exit; "
             "an array finding no room travels inside the message, as all do with 0 and to "
             "other hosts")
    lm_head_fp32: bool = arg(
        False, to="model.lm_head_fp32", action="store_true",
        help="compute logits in float32 from a float32 copy of the LM head (dequantized if "
             "the checkpoint stores it quantized)")
    cpu_threads_per_rank: int | None = arg(
        None, to="parallel.cpu_threads_per_rank", parse=arg_types.positive_int,
        help="torch threads of each worker rank on the CPU (default: the cores shared evenly "
             "by the ranks of every replica on this host)")
    chat_template: str | None = arg(None, to="model.chat_template",
                                    help="a Jinja template or a file holding one")
    structured_outputs_backend: str = arg(
        "auto", to="structured_outputs.backend",
        flags=("--structured-outputs-backend", "--guided-decoding-backend"),
        choices=["auto", "xgrammar", "guidance", "llguidance", "off"],
        help="grammar engine for structured outputs: xgrammar, guidance (llguidance), or auto "
             "(per request: xgrammar unless the request needs what it does not enforce, then "
             "guidance); off loads none, and a request asking for a grammar gets a 400")
    structured_outputs_disable_any_whitespace: bool = arg(
        False, to="structured_outputs.disable_any_whitespace",
        flags=("--structured-outputs-disable-any-whitespace",
               "--guided-decoding-disable-any-whitespace", "--disable-any-whitespace"),
        action="store_true",
        help="JSON outputs without free whitespace (a request may override)")
    structured_outputs_disable_additional_properties: bool = arg(
        False, to="structured_outputs.disable_additional_properties", action="store_true",
        help="JSON schemas' objects closed unless they allow additionalProperties")
    speculative_config: SpeculativeConfig | dict | str | None = arg(
        None, to="speculative", parse=arg_types.json_object,
        help='speculative decoding as JSON, e.g. \'{"method": "ngram", '
             '"num_speculative_tokens": 3}\' or \'{"method": "draft_model", "model": PATH, '
             '"num_speculative_tokens": 3}\'')
    early_stop_config: EarlyStopConfig | dict | str | None = arg(
        None, to="early_stop", parse=arg_types.json_object,
        help='early stop as JSON, e.g. \'{"enable_early_stop": true, "window_size": 3000, '
             '"threshold": 0.99}\'')
    splitwise_role: str | None = arg(
        None, to=None, choices=["mixed", "prefill", "decode"],
        help="prefill/decode disaggregation (docs/disaggregation.md): prefill runs prompts "
             "and holds their KV blocks for a decode instance, which pulls them and "
             "generates the rest; mixed (default) does all")
    kv_transfer_config: KVTransferConfig | dict | str | None = arg(
        None, to="kv_transfer", parse=arg_types.json_object,
        help='the same as vLLM\'s JSON, e.g. \'{"kv_connector": "LoomConnector", '
             '"kv_role": "kv_producer", "kv_transport": "tcp", "kv_port": 0}\' '
             "(kv_producer: prefill, kv_consumer: decode, kv_both: mixed)")
    moba_attention_config: MobaAttentionConfig | dict | str | None = arg(
        None, to="moba_attention", parse=arg_types.json_object,
        help='MoBA sparse attention as JSON (the seed\'s names), e.g. \'{"moba_block_size": '
             '512, "moba_topk": 3, "moba_min_seq_len": 4096}\': a query whose context is at '
             "least moba_min_seq_len tokens (default 0) attends to its own block and the "
             "moba_topk - 1 earlier blocks of moba_block_size tokens whose mean key it scores "
             "highest (docs/architecture.md, Attention)")
    enable_warm_up: bool = arg(
        True, to="model.enable_warm_up", action=argparse.BooleanOptionalAction,
        help="dummy decode steps at start-up so that the first step at each batch size is "
             "not slower (benchmarks/warm_up.md)")
    generation_config: str = arg(
        "auto", to=None, metavar="auto|vllm|PATH",
        help="sampling defaults for what a request leaves out: auto, the model's "
             "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
             "max_new_tokens); vllm, loom's own; or a directory holding a "
             "generation_config.json")
    override_generation_config: dict[str, Any] | str | None = arg(
        None, to=None, parse=arg_types.json_object,
        help='JSON laid over the generation config, e.g. \'{"temperature": 0.5}\'')
    hf_overrides: dict[str, Any] | str | None = arg(
        None, to=None, parse=arg_types.json_object,
        help='JSON laid over the checkpoint\'s config (sub-configs key by key), e.g. '
             '\'{"max_position_embeddings": 32768}\'')
    trust_remote_code: bool = arg(
        False, to=None, action="store_true",
        help="accepted for vLLM's sake: loom never runs code from a checkpoint")
    max_logprobs: int = arg(
        20, to="model.max_logprobs", parse=arg_types.non_negative_int,
        help="the most logprobs (and prompt_logprobs) one request may ask for (default 20, "
             "as vLLM); more is a 400 naming the field")
    logprobs_mode: str = arg(
        "raw_logprobs", to="model.logprobs_mode",
        choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
        help="what logprobs report: the model's raw logprobs (default) or logits, or those "
             "of the distribution a token is drawn from (after bias, masks, penalties, "
             "temperature, min_p, top-k, top-p)")
    logits_processors: tuple[str, ...] = arg(
        (), to="model.logits_processors", parse=arg_types.comma_list,
        help="custom logits processors, comma-separated class names package.module:Class, "
             "each applied to the batch's logits before bias and penalties "
             "(loom/model/layers/logits_processors.py)")
    reasoning_budget: int = arg(
        -1, to="model.reasoning_budget", parse=int,
        help="thinking models: at most this many tokens of reasoning for a request that sets "
             "no thinking_token_budget, then </think> is forced (-1: unlimited; 0: no "
             "thinking); applies where the tokenizer has <think> and </think>")
    reasoning_budget_message: str | None = arg(
        None, to="model.reasoning_budget_message",
        help="text forced before </think> when a reasoning budget is spent, e.g. \"Time to "
             "answer.\"")
    reasoning_effort_budgets: dict[str, int] | str | None = arg(
        None, to="model.reasoning_effort_budgets", parse=arg_types.json_object,
        help='OpenAI\'s reasoning_effort as budgets, JSON (default \'{"low": 1024, '
             '"medium": 4096, "high": -1}\')')
    enforce_eager: bool = arg(
        False, to="model.enforce_eager", action="store_true",
        help="on CUDA, capture no CUDA graphs: every decode step runs eagerly (no effect on "
             "the CPU)")
    served_model_name: str | None = arg(
        None, to="model.served_model_name", scope=SERVE,
        help="the model name clients send (default: the model's file or directory name)")
    data_parallel_size: int = arg(
        1, to="parallel.data_parallel_size", flags=("--data-parallel-size", "-dp"),
        parse=arg_types.positive_int, scope=SERVE,
        help="replicas of the whole engine (each its own engine core, workers and KV cache; "
             "each --tensor-parallel-size ranks) behind this one server, which routes each "
             "request by load and prefix affinity. On the CPU each rank takes cores / (ranks "
             "x replicas) threads unless --cpu-threads-per-rank says otherwise")
    data_parallel_size_local: int | None = arg(
        None, to="parallel.data_parallel_size_local",
        flags=("--data-parallel-size-local", "-dpl"), parse=arg_types.non_negative_int,
        scope=SERVE,
        help="replicas on this host (default: all); the others run on other hosts, each "
             "started with --headless")
    data_parallel_start_rank: int = arg(
        0, to="parallel.data_parallel_start_rank", flags=("--data-parallel-start-rank", "-dpr"),
        parse=arg_types.non_negative_int, scope=SERVE,
        help="--headless: the first replica rank this host runs (the head runs ranks 0 .. "
             "--data-parallel-size-local - 1)")
    data_parallel_address: str | None = arg(
        None, to="parallel.data_parallel_address", flags=("--data-parallel-address", "-dpa"),
        scope=SERVE,
        help="the head host's address: where it listens for --headless hosts and binds "
             "their replicas' sockets (default 127.0.0.1)")
    data_parallel_rpc_port: int = arg(
        29550, to="parallel.data_parallel_rpc_port", flags=("--data-parallel-rpc-port", "-dpp"),
        parse=arg_types.port_not_zero, scope=SERVE,
        help="the head's port for --headless hosts to announce themselves")

    # ------------------------------------------------------------------ the three faces

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, scope: str = ENGINE) -> None:
        """The flags of the fields offered in ``scope`` (ENGINE: every command that builds
        an engine; SERVE: the ones only ``loom serve`` adds)."""
        group = parser.add_argument_group("engine" if scope == ENGINE else "engine (loom serve)")
        for spec in dataclasses.fields(cls):
            meta = spec.metadata
            if meta["scope"] != scope:
                continue
            flags = meta["flags"] or (f"--{spec.name.replace('_', '-')}",)
            options: dict[str, Any] = {"default": spec.default, "dest": spec.name}
            if meta["action"] is not None:
                options["action"] = meta["action"]
            else:
                for key, option in (("parse", "type"), ("choices", "choices"),
                                    ("metavar", "metavar"), ("nargs", "nargs")):
                    if meta[key] is not None:
                        options[option] = meta[key]
            if meta["help"] is not None:
                options["help"] = meta["help"]
            group.add_argument(*flags, **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The fields the parser holds (a command without the SERVE flags keeps their
        defaults); MODEL as the command resolved it."""
        return cls(**{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(cls)
                      if hasattr(args, spec.name)})

    @classmethod
    def from_llm_kwargs(cls, model: str | None, kwargs: dict[str, Any]) -> EngineArgs:
        """``LLM(model, **kwargs)``: vLLM's names, values and no-op arguments mapped onto
        these fields; an unknown name is a TypeError naming the closest valid ones, as a
        misspelt argument is in Python."""
        return cls(model=model, **llm_kwargs_to_fields(kwargs))

    def create_engine_config(self) -> EngineConfig:
        """The frozen config: each field copied to the config field its ``to`` names, after
        the checkpoint has resolved what was left to it. Everything that can be checked
        without loading weights is checked on the way, cheapest first, so a bad argument
        fails before any process starts."""
        from loom.checkpoint_defaults import resolve_against_checkpoint
        from loom.config_checks import check_kv_budget, check_kv_offload

        resolved = resolve_against_checkpoint(self)
        args = resolved.args
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        whole: dict[str, Any] = {}
        for spec in dataclasses.fields(args):
            for target in spec.metadata["to"]:
                section, _, name = target.partition(".")
                if name:
                    sections[section][name] = getattr(args, spec.name)
                else:
                    whole[section] = getattr(args, spec.name)
        sections["model"].update(resolved.model_fields)
        built = {name: cls(**sections[name]) for name, cls in _SECTIONS.items()}
        check_kv_budget(resolved.hf_config, built["cache"], args.dtype,
                        args.tensor_parallel_size, args.max_model_len)
        check_kv_offload(resolved.hf_config, built["cache"], args.dtype,
                         args.tensor_parallel_size, whole["device"])
        return EngineConfig(**built, speculative=whole["speculative"],
                            early_stop=EarlyStopConfig.from_value(whole["early_stop"]),
                            kv_transfer=whole["kv_transfer"], device=whole["device"],
                            moba_attention=MobaAttentionConfig.from_value(
                                whole["moba_attention"]))


def make_engine_config(model: str, **kwargs: Any) -> EngineConfig:
    """``EngineArgs(model=model, **kwargs).create_engine_config()``."""
    return EngineArgs(model=model, **kwargs).create_engine_config()


# ---------------------------------------------------------------------- LLM(**kwargs)

# vLLM's names for arguments loom spells otherwise.
_ALIASES = {"gpu_memory_utilization": "memory_utilization"}
# vLLM arguments for features loom does not have: accepted at these values only.
_ONLY_AT = {
    "revision": None, "tokenizer_revision": None, "code_revision": None,  # local paths only
    "pipeline_parallel_size": 1,
    "tokenizer_mode": "auto",
}
# vLLM arguments that change nothing here: accepted, with a warning if they would matter.
_NO_EFFECT = {
    "disable_log_stats": None,  # the offline API logs no periodic stats
    "disable_custom_all_reduce": None,
    "cpu_offload_gb": "loom does not offload weights to the CPU",
}


def llm_kwarg_names() -> list[str]:
    """The keyword arguments ``LLM(model, ...)`` takes as its own: every field but MODEL."""
    return [spec.name for spec in dataclasses.fields(EngineArgs) if spec.name != "model"]


def llm_kwargs_to_fields(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``LLM(**kwargs)`` -> ``EngineArgs`` fields (see ``EngineArgs.from_llm_kwargs``)."""
    known = llm_kwarg_names()
    result = {}
    for name, value in kwargs.items():
        if name in _ALIASES:
            result[_ALIASES[name]] = value
        elif name in _ONLY_AT:
            if value != _ONLY_AT[name] and not (name == "tokenizer_mode" and value == "hf"):
                raise ValueError(f"LLM({name}={value!r}) is not supported; loom takes only "
                                 f"{name}={_ONLY_AT[name]!r}")
        elif name == "swap_space":  # vLLM's and FastDeploy's CPU swap space, in GiB
            if value:
                result.setdefault("kv_offload_size", int(value * 2**30))
        elif name in _NO_EFFECT:
            reason = _NO_EFFECT[name]
            if reason is not None and value:
                logger.warning("LLM(%s=%r) has no effect: %s", name, value, reason)
        elif name == "quantization" and value is None:  # vLLM's default: as stored
            result[name] = "auto"
        elif name in known:
            result[name] = value
        else:
            valid = sorted({*known, *_ALIASES, *_ONLY_AT, *_NO_EFFECT, "swap_space"})
            close = difflib.get_close_matches(name, valid, n=3)
            hint = (f"did you mean {' or '.join(map(repr, close))}?" if close
                    else f"valid ones: {', '.join(valid)}")
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}; {hint}")
    return result
