"""The settings that processes on different hosts must agree on, keyed by the flag
that sets each, so a difference is refused by name.

    handshake_settings   a data-parallel replica on a headless host and the head
                         (ipc/remote_engine_core.py: HeadRendezvous)
    node_settings        the nodes of one engine (`loom worker`; worker_process.py:
                         check_nodes_agree)

Each host builds its config from its own flags and its own paths: a model or a draft
compares by its file or directory name, never by where it lies or what was read there.
"""

from __future__ import annotations

import os
from typing import Any

from loom.config import EngineConfig


def handshake_settings(config: EngineConfig) -> dict[str, Any]:
    """What every host's replicas must agree on, keyed by the flag that sets it: the
    head routes and validates requests by its own config, and the replicas must answer
    alike."""
    model, parallel = config.model, config.parallel
    return {
        "MODEL (its file or directory name)": os.path.basename(model.model.rstrip("/")),
        "vocabulary size (the checkpoint's)": model.vocab_size,
        "--data-parallel-size": parallel.data_parallel_size,
        "--tensor-parallel-size": parallel.tensor_parallel_size,
        "--dtype": model.dtype,
        "--max-model-len": model.max_model_len,
        "--quantization": model.quantization,
        "--quantization-group-size": model.quantization_group_size,
        "--lm-head-fp32": model.lm_head_fp32,
        "--seed": model.seed,
        "--block-size": config.cache.block_size,
        "--enable-prefix-caching": config.cache.enable_prefix_caching,
        "--max-num-seqs": config.scheduler.max_num_seqs,
        "--max-num-batched-tokens": config.scheduler.max_num_batched_tokens,
        "--speculative-config": speculative_settings(config),
        "--device": config.device,
        # experts split over every replica's ranks: each must hold its share of them
        "--expert-parallel-size": parallel.expert_parallel_size,
        "--enable-eplb": parallel.enable_eplb,
        "--num-redundant-experts": parallel.num_redundant_experts,
        "--eplb-window-size": parallel.eplb_window_size,
    }


def speculative_settings(config: EngineConfig) -> dict[str, Any] | None:
    """The speculative config as the flag sets it: the draft by its file or directory
    name (each host has its own path), without the draft's HF config as read there."""
    spec = config.speculative
    if spec is None:
        return None
    return {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "prompt_lookup_min": spec.prompt_lookup_min,
            "prompt_lookup_max": spec.prompt_lookup_max,
            "model": None if spec.model is None else os.path.basename(spec.model.rstrip("/"))}


def node_settings(config: EngineConfig) -> dict[str, Any]:
    """What every node's ranks must agree on, by the flag that sets it: what shapes the
    weights a rank holds and the steps it runs."""
    settings = {name: value for name, value in handshake_settings(config).items()
                if name not in _SCHEDULER_ONLY_SETTINGS}
    cache = config.cache
    settings.update({
        # the ranks' KV caches: each sizes and caps its own, and the profile run and the
        # warm-up are forwards with collectives, whose batches these flags size
        "--num-gpu-blocks-override": cache.num_gpu_blocks_override,
        "--kv-cache-memory": cache.kv_cache_memory_bytes,
        "--memory-utilization": cache.memory_utilization,
        "--enable-warm-up": config.model.enable_warm_up,
    })
    return settings


# handshake_settings' entries that ranks of one engine need not agree on: node 0's engine
# alone reads them (the data-parallel layout, prefix caching's block reuse, sampling)
_SCHEDULER_ONLY_SETTINGS = ("--data-parallel-size", "--seed", "--enable-prefix-caching")
