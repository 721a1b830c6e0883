"""The step between the arguments a user gave and the config: read the checkpoint once,
check the arguments against it, and resolve what was left to it.

``resolve_against_checkpoint(args)`` takes ``EngineArgs`` as given and returns them with
every value left to the checkpoint or the device filled in (the device, the dtype, the
context length, the step's token budget, chunked prefill, the expert-parallel size, the
speculative and KV-transfer sub-configs), plus the values of ``ModelConfig`` that no
argument declares (the vocabulary size, the sampling defaults, the checkpoint's config as
plain values). Checks run cheapest first, so a bad argument is one line naming it before
any weight is read or any process starts; the checks themselves are in config_checks.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from loom.config import (DTYPE_ALIASES, DTYPE_CHOICES, DTYPES, KVTransferConfig,
                         SpeculativeConfig, resolve_device)

if TYPE_CHECKING:  # the arguments' declaration imports this module, never the reverse
    from loom.engine_args import EngineArgs

logger = logging.getLogger("loom.config")

# generation_config.json keys that become a request's defaults, as vLLM applies them.
_GENERATION_CONFIG_KEYS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p",
                           "max_new_tokens")


@dataclass(frozen=True)
class ResolvedArgs:
    args: EngineArgs  # every None the checkpoint or the device decides, decided
    model_fields: dict[str, Any]  # ModelConfig's vocab_size, sampling_defaults, hf_config
    hf_config: Any  # the checkpoint's config, for the checks that need the config built


def resolve_against_checkpoint(args: EngineArgs) -> ResolvedArgs:
    from loom.config_checks import (check_architecture_before_loading, check_quantization,
                                    check_ray_installed, check_tensor_parallel,
                                    check_tokenizer_files)
    from loom.model.loader.hf_config import load_hf_config
    from loom.model.loader.hf_config_values import hf_config_values
    from loom.model.models.registry import get_model_architecture, is_encoder_only

    model = args.model
    if model is None or not os.path.exists(model):
        raise ValueError(f"model {model!r} does not exist; give a Hugging Face directory "
                         "or a .gguf file")
    device = resolve_device(args.device)
    if args.trust_remote_code:
        logger.warning("--trust-remote-code: loom never runs code from a checkpoint; its "
                       "own implementations serve the architectures it supports")
    check_architecture_before_loading(model)
    hf_config = load_hf_config(model, args.mmproj)
    apply_hf_overrides(hf_config, _json_object(args.hf_overrides, "--hf-overrides",
                                               '\'{"max_position_embeddings": 32768}\''))
    architecture = get_model_architecture(hf_config)  # unsupported: a ValueError naming them
    encoder = is_encoder_only(architecture)
    check_task(args.task, architecture, encoder, hf_config, model)
    check_quantization(hf_config, args.quantization, model)
    if not args.skip_tokenizer_init:
        check_tokenizer_files(model, args.tokenizer)
    check_tensor_parallel(hf_config, args.tensor_parallel_size, args.nnodes, device)
    if args.distributed_executor_backend == "ray":
        check_ray_installed()
    expert_parallel_size = args.expert_parallel_size
    if expert_parallel_size is None:
        expert_parallel_size = (args.tensor_parallel_size * args.data_parallel_size
                                if args.enable_expert_parallel else 1)
    check_expert_parallel(hf_config, expert_parallel_size,
                          across_replicas=expert_parallel_size > args.tensor_parallel_size,
                          num_redundant_experts=args.num_redundant_experts)
    if args.enable_eplb:
        check_eplb(args, expert_parallel_size)
    max_model_len = args.max_model_len
    limit = derived_max_model_len(hf_config)
    if max_model_len is None:
        max_model_len = min(limit, 4096) if limit else 4096
    elif limit and max_model_len > limit:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                         f"{_describe_limit(hf_config, limit)}; lower --max-model-len")
    enable_chunked_prefill = (True if args.enable_chunked_prefill is None
                              else args.enable_chunked_prefill)
    if encoder:  # attends both ways over the whole prompt: never a part of one in a step
        if args.enable_chunked_prefill:
            raise ValueError(f"{architecture} is an encoder: each prompt runs whole in one "
                             "step; drop --enable-chunked-prefill")
        enable_chunked_prefill = False
    max_num_batched_tokens = args.max_num_batched_tokens
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(2048, min(max_model_len, 8192))
        if not enable_chunked_prefill:  # every prompt must fit one step (as vLLM)
            max_num_batched_tokens = max(2048, max_model_len)
    if encoder and max_num_batched_tokens < max_model_len:
        raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) is smaller than "
                         f"max_model_len ({max_model_len}), but {architecture} is an encoder, "
                         "which runs each prompt whole in one step: a longer prompt could "
                         "never run; raise --max-num-batched-tokens or lower --max-model-len")
    speculative = SpeculativeConfig.from_value(args.speculative_config)
    if speculative is not None and speculative.model is not None:
        speculative = dataclasses.replace(
            speculative, hf_config=check_draft_model(speculative.model, hf_config))
    dtype = resolve_dtype(args.dtype, hf_config, model, device)
    kv_transfer = KVTransferConfig.from_args(args.splitwise_role, args.kv_transfer_config)
    if kv_transfer is not None and kv_transfer.kv_transport == "shm" and device != "cpu":
        raise ValueError("kv_transport shm shares the KV cache in host memory, so it needs "
                         "--device cpu; use kv_transport tcp on CUDA")
    if args.logits_processors:
        from loom.model.layers.logits_processors import check_names

        check_names(args.logits_processors)
    sampling_defaults = load_sampling_defaults(model, args.generation_config,
                                               args.override_generation_config)
    resolved = dataclasses.replace(
        args, device=device, dtype=dtype, max_model_len=max_model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=max_num_batched_tokens,
        expert_parallel_size=expert_parallel_size, speculative_config=speculative,
        kv_transfer_config=kv_transfer,
        data_parallel_address=args.data_parallel_address or "127.0.0.1",
        reasoning_effort_budgets=_effort_budgets(args.reasoning_effort_budgets),
        logits_processors=tuple(args.logits_processors or ()))
    model_fields = {"vocab_size": getattr(hf_config, "vocab_size", None),
                    "sampling_defaults": tuple(sampling_defaults.items()),
                    "hf_config": hf_config_values(hf_config)}
    scales_past = rope_scales_past(hf_config)
    if scales_past is not None and max_model_len > scales_past and resolved.enable_prefix_caching:
        # a prompt's keys turn at the prompt's length past it: another prompt's cached
        # blocks would not hold the keys this one needs (layers/rotary.py)
        logger.info("prefix caching off: the model's %s rope turns a sequence's keys by "
                    "its length past %d tokens; --max-model-len %d keeps it on",
                    _flat_rope_parameters(hf_config)["rope_type"], scales_past, scales_past)
        resolved = dataclasses.replace(resolved, enable_prefix_caching=False)
    if args.enable_lora or args.lora_modules:
        resolved = _check_lora(resolved, architecture)
    if args.task != "generate":
        from loom.pooling import pooler_config

        pooler = model_fields["pooler"] = pooler_config(
            model, hf_config, args.pooler_config, default_pooling="CLS" if encoder else "LAST",
            cross_encoder=encoder and args.task == "score")
        if encoder and resolved.enable_prefix_caching:
            # its K/V at a position depend on the later tokens: nothing to share, none kept
            logger.info("prefix caching off: %s is an encoder (each prompt runs whole in "
                        "one step, attending both ways, with no KV cache)", architecture)
            resolved = dataclasses.replace(resolved, enable_prefix_caching=False)
        if args.task == "embed" and pooler.pooling_type != "LAST" \
                and resolved.enable_prefix_caching:
            # a cached block's hidden states are never computed, and MEAN and CLS read them
            logger.info("prefix caching off: %s pooling reads every prompt token's hidden "
                        "state", pooler.pooling_type)
            resolved = dataclasses.replace(resolved, enable_prefix_caching=False)
    elif args.pooler_config:
        raise ValueError("--pooler-config applies to --task embed or score; this engine "
                         "generates")
    return ResolvedArgs(resolved, model_fields, hf_config)


def check_task(task: str, architecture: str, encoder: bool, hf_config: Any,
               model: str) -> None:
    """The tasks a checkpoint serves: a sequence classifier classifies, and an encoder's
    with one label scores pairs too (a cross-encoder); another encoder embeds; a decoder
    generates, embeds or scores (a yes/no reranker)."""
    if architecture.endswith("ForSequenceClassification"):
        if task == "classify":
            return
        if encoder and task == "score":
            labels = getattr(hf_config, "num_labels", 1)
            if labels != 1:
                raise ValueError(f"--task score takes a cross-encoder with one label; {model} "
                                 f"({architecture}) has {labels}: start it with --task classify")
            return
        raise ValueError(f"{model} is a {architecture} checkpoint: start it with --task "
                         + ("score (a cross-encoder) or classify" if encoder else "classify"))
    if task == "classify":
        raise ValueError(f"--task classify needs a *ForSequenceClassification checkpoint; "
                         f"{model} is a {architecture}")
    if encoder and task != "embed":
        raise ValueError(f"{model} is a {architecture} checkpoint, an encoder: start it with "
                         "--task embed (a cross-encoder for --task score is a "
                         "*ForSequenceClassification checkpoint)")


def _check_lora(args: EngineArgs, architecture: str | None = None) -> EngineArgs:
    """The adapters named at start-up, read and checked (a bad one is the start-up's
    error, naming it); ``--lora-modules`` alone enables LoRA."""
    from loom.lora import AdapterError, parse_lora_modules, read_adapter_config

    modules = parse_lora_modules(args.lora_modules)
    if args.max_cpu_loras is not None and args.max_cpu_loras < args.max_loras:
        raise ValueError(f"--max-cpu-loras {args.max_cpu_loras} is below --max-loras "
                         f"{args.max_loras}: the adapters in slots are held in host memory "
                         f"too; give --max-cpu-loras {args.max_loras} or more")
    for _, path in modules:
        try:
            read_adapter_config(path, args.max_lora_rank, architecture)
        except AdapterError as error:
            raise ValueError(str(error)) from None
    return dataclasses.replace(args, enable_lora=True, lora_modules=modules)


def resolve_dtype(dtype: str, hf_config, model: str, device: str) -> str:
    """``auto`` follows the checkpoint, except where that dtype is slow on the device.

    GGUF files are dequantized to bfloat16. On CPU float16 matmuls are a slow
    fallback, so float16 (asked for or the checkpoint's) runs in bfloat16 there, with
    a warning. ``half`` and ``float`` are float16 and float32, as in vLLM.
    """
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if dtype == "auto":
        if model.endswith(".gguf"):
            dtype = "bfloat16"
        else:
            raw = getattr(hf_config, "torch_dtype", None) or getattr(hf_config, "dtype", None)
            dtype = str(raw).removeprefix("torch.") if raw else "float32"
            if dtype not in DTYPES:
                dtype = "float32"
    if device == "cpu" and dtype == "float16":
        logger.warning("dtype float16 runs as bfloat16 on the CPU (float16 matmuls are a slow "
                       "fallback there); pass --dtype float32 for full precision")
        dtype = "bfloat16"
    return dtype


def load_sampling_defaults(model: str, generation_config: str = "auto",
                           override: dict[str, Any] | str | None = None) -> dict[str, Any]:
    """Request defaults in SamplingParams' names, as vLLM derives them.

    ``auto``: the sampling keys (temperature, top_p, top_k, min_p, repetition_penalty,
    max_new_tokens as max_tokens) that the checkpoint's generation_config.json sets; a
    .gguf file has none. ``vllm``: none, loom's own defaults. Otherwise a directory
    holding a generation_config.json, or the file itself. ``override`` (a dict or its
    JSON) is laid over the result.
    """
    override = _json_object(override, "--override-generation-config",
                            '\'{"temperature": 0.5}\'')
    if generation_config == "vllm":
        values: dict[str, Any] = {}
    else:
        path = model if generation_config == "auto" else generation_config
        if generation_config != "auto" and not os.path.exists(path):
            raise ValueError(f"--generation-config {path} does not exist; give auto, vllm, or "
                             "a directory holding a generation_config.json")
        if os.path.isdir(path):
            path = os.path.join(path, "generation_config.json")
        values = {}
        if path.endswith(".json") and os.path.isfile(path):
            try:
                with open(path) as f:
                    values = json.load(f)
            except ValueError as error:
                raise ValueError(f"cannot read {path}: {error}") from None
    values = {**values, **(override or {})}
    defaults = {key: values[key] for key in _GENERATION_CONFIG_KEYS if values.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if defaults:
        from loom.sampling_params import SamplingParams

        SamplingParams(**defaults)  # a bad value fails here, naming its field
    return defaults


def check_draft_model(path: str, target_hf_config) -> dict[str, Any]:
    """Check the draft checkpoint against the target; returns its config's plain values."""
    from loom.config_checks import check_stored_quantization
    from loom.model.loader.hf_config import load_hf_config
    from loom.model.loader.hf_config_values import hf_config_values

    if not os.path.exists(path):
        raise ValueError(f"draft model {path!r} does not exist; give a Hugging Face directory "
                         "or a .gguf file")
    draft_config = load_hf_config(path)
    check_stored_quantization(draft_config, path, what="the draft model")
    draft_vocab = getattr(draft_config, "vocab_size", None)
    target_vocab = getattr(target_hf_config, "vocab_size", None)
    if draft_vocab is not None and target_vocab is not None and draft_vocab < target_vocab:
        raise ValueError(f"the draft model's vocabulary ({draft_vocab}) is smaller than the "
                         f"target's ({target_vocab}); the draft must share the target's tokenizer")
    return hf_config_values(draft_config)


def check_expert_parallel(hf_config: Any, expert_parallel_size: int,
                          across_replicas: bool = False, num_redundant_experts: int = 0) -> None:
    """Experts split whole over the ranks: their number must divide (a model without
    experts ignores the setting, with a warning; split over data-parallel replicas, it
    is refused: the replicas would step together for nothing)."""
    if expert_parallel_size == 1:
        return
    num_experts = next((getattr(hf_config, name) for name in
                        ("num_experts", "num_local_experts", "moe_num_experts")
                        if getattr(hf_config, name, None)), None)
    if isinstance(num_experts, (list, tuple)):  # text and vision experts (ERNIE 4.5 VL)
        num_experts = num_experts[0]
    if across_replicas:
        from loom.model.models.registry import get_model_architecture

        architecture = get_model_architecture(hf_config)
        if num_experts is None:
            raise ValueError(f"expert parallel across data-parallel replicas needs a MoE "
                             f"model, and {architecture} has no experts; drop "
                             "--enable-expert-parallel/--expert-parallel-size")
        if architecture not in EXPERTS_ACROSS_REPLICAS:
            raise ValueError(f"expert parallel across data-parallel replicas is not supported "
                             f"yet for {architecture} (only {', '.join(EXPERTS_ACROSS_REPLICAS)}"
                             "); use --tensor-parallel-size with --enable-expert-parallel")
    if num_experts is None:
        logger.warning("expert parallel: the model has no experts; its layers split over the "
                       "tensor-parallel ranks as usual")
    elif (num_experts + num_redundant_experts) % expert_parallel_size:
        extra = f" + {num_redundant_experts} redundant" if num_redundant_experts else ""
        raise ValueError(f"--expert-parallel-size {expert_parallel_size} does not divide the "
                         f"model's {num_experts}{extra} experts; choose a size that does")


# The text MoE families whose every forward runs each MoE layer once, in layer order,
# whatever its tokens: what a replica's dummy step repeats (model_runner.dummy_step).
EXPERTS_ACROSS_REPLICAS = ("Qwen3MoeForCausalLM", "MixtralForCausalLM",
                           "Ernie4_5_MoeForCausalLM")


def check_eplb(args: Any, expert_parallel_size: int) -> None:
    """EPLB needs experts split over expert-parallel ranks."""
    if expert_parallel_size == 1:
        raise ValueError("--enable-eplb balances experts over expert-parallel ranks; add "
                         "--enable-expert-parallel")


def max_position_embeddings(hf_config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value > 0:
            if getattr(hf_config, "model_type", None) in ("roberta", "xlm-roberta"):
                value -= hf_config.pad_token_id + 1  # positions start past it (roberta.py)
            return value
    return None


def _flat_rope_parameters(hf_config) -> dict[str, Any] | None:
    """The config's one rope (``rope_parameters``, or ``rope_scaling`` before
    transformers 5) with its ``rope_type``; None where it has none or one per layer type
    (Gemma 3's, whose max_position_embeddings already counts its scaling)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not isinstance(params, dict) or not ("rope_type" in params or "type" in params):
        return None
    return {**params, "rope_type": params.get("rope_type", params.get("type"))}


def derived_max_model_len(hf_config) -> int | None:
    """The longest sequence the checkpoint serves, as vLLM derives it: its
    max_position_embeddings, times rope scaling's factor for the types that extend the
    context by it (linear, dynamic; yarn from its original_max_position_embeddings).
    llama3 and longrope configs (Llama 3.1, Phi-3) state the extended length in
    max_position_embeddings itself."""
    limit = max_position_embeddings(hf_config)
    params = _flat_rope_parameters(hf_config)
    if limit is None or params is None or params["rope_type"] not in ("linear", "dynamic", "yarn") \
            or not params.get("factor"):
        return limit
    if params["rope_type"] == "yarn":
        limit = params.get("original_max_position_embeddings") or limit
    return int(limit * params["factor"])


def _describe_limit(hf_config, limit: int) -> str:
    positions = max_position_embeddings(hf_config)
    if limit == positions:
        return f"max_position_embeddings {limit}"
    params = _flat_rope_parameters(hf_config)
    base = (f"original_max_position_embeddings {params['original_max_position_embeddings']}"
            if params["rope_type"] == "yarn" and params.get("original_max_position_embeddings")
            else f"max_position_embeddings {positions}")
    return (f"longest sequence {limit} ({base} x {params['rope_type']} rope scaling factor "
            f"{params['factor']})")


def rope_scales_past(hf_config) -> int | None:
    """Where a rope whose frequencies depend on the sequence's length starts to scale
    (rotary.py's ``LengthScaledRotaryEmbedding.scales_past``): dynamic NTK past
    max_position_embeddings, longrope past its original context; None for other ropes."""
    params = _flat_rope_parameters(hf_config)
    if params is None or params["rope_type"] not in ("dynamic", "longrope"):
        return None
    if params["rope_type"] == "dynamic":
        return max_position_embeddings(hf_config)
    return (getattr(hf_config, "original_max_position_embeddings", None)
            or params.get("original_max_position_embeddings")
            or max_position_embeddings(hf_config))


def _effort_budgets(value: dict[str, int] | str | None) -> dict[str, int]:
    """--reasoning-effort-budgets over the defaults (ModelConfig checks the result)."""
    budgets = {"low": 1024, "medium": 4096, "high": -1}
    value = _json_object(value, "--reasoning-effort-budgets", '\'{"low": 512}\'')
    unknown = sorted(set(value or {}) - set(budgets))
    if unknown:
        raise ValueError(f"--reasoning-effort-budgets has unknown efforts {unknown}; "
                         "known: low, medium, high")
    return {**budgets, **(value or {})}


def apply_hf_overrides(hf_config: Any, overrides: dict[str, Any] | None) -> None:
    """Lay ``overrides`` over the checkpoint's config, as vLLM's ``--hf-overrides``: a key
    whose value is an object and whose attribute is a sub-config (``text_config``) is laid
    over that sub-config key by key; any other key is set as given."""
    for key, value in (overrides or {}).items():
        current = getattr(hf_config, key, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value)
        else:
            setattr(hf_config, key, value)
    if overrides:
        logger.info("checkpoint config overridden: %s", json.dumps(overrides, sort_keys=True))


def _json_object(value: dict[str, Any] | str | None, flag: str,
                 example: str) -> dict[str, Any] | None:
    """A flag's JSON object, given as itself or as its text; a ValueError naming the flag."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValueError(f"{flag} is not valid JSON: {error}") from None
    if value is not None and not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, e.g. {example}")
    return value
