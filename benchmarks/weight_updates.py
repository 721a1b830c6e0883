"""Weight update latency and sleep memory, for benchmarks/weight_updates.md.

    python benchmarks/weight_updates.py                    # the default model (GGUF)
    python benchmarks/weight_updates.py --llama-1b DIR     # a random Llama-3.2-1B-shaped
                                                           # bf16 checkpoint, made in DIR once

For each model: the engine's start-up; update_weights from the checkpoint itself (path),
through the ipc strategy (WeightPublisher: publish, then update), and from in-process
tensors; sleep(1) and sleep(2) with the process's RSS before and after and the time of
wake_up. Medians of --repeats runs. One rank, in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def make_llama_1b(directory: str) -> str:
    """Llama-3.2-1B's shapes (1.24 B parameters, tied embeddings), random bf16 weights,
    written tensor by tensor (no 5 GB float32 model in memory)."""
    import torch
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(directory, "model.safetensors")):
        return directory
    os.makedirs(directory, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
              "vocab_size": 128256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    generator = torch.Generator().manual_seed(0)
    hidden, inter, head_dim = 2048, 8192, 64

    def randn(*shape):
        return (torch.randn(*shape, generator=generator) * 0.02).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": randn(128256, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(16):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": randn(32 * head_dim, hidden),
                    p + "self_attn.k_proj.weight": randn(8 * head_dim, hidden),
                    p + "self_attn.v_proj.weight": randn(8 * head_dim, hidden),
                    p + "self_attn.o_proj.weight": randn(hidden, 32 * head_dim),
                    p + "mlp.gate_proj.weight": randn(inter, hidden),
                    p + "mlp.up_proj.weight": randn(inter, hidden),
                    p + "mlp.down_proj.weight": randn(hidden, inter),
                    p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                    p + "post_attention_layernorm.weight": torch.ones(hidden,
                                                                      dtype=torch.bfloat16)}
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return directory


def measure(model: str, repeats: int, **engine) -> dict:
    from loom import LLM
    from loom.weight_sync import WeightPublisher
    from loom.worker.memory import keep_freed_memory

    keep_freed_memory()  # as the engine's own processes run
    started = time.perf_counter()
    llm = LLM(model, **engine)
    result: dict = {"model": os.path.basename(model.rstrip("/")), "engine": engine,
                    "start_s": time.perf_counter() - started}
    try:
        core = llm.engine.engine_core

        def timed(fn) -> float:
            started = time.perf_counter()
            fn()
            return time.perf_counter() - started

        result["update_path_s"] = statistics.median(
            timed(lambda: llm.update_weights(model)) for _ in range(repeats))
        worker = core.executor.worker
        tensors = [(name, param.detach().clone()) for name, param in _hf_tensors(model)]
        with WeightPublisher() as publisher:
            publish, update = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                manifest = publisher.publish(tensors)
                publish.append(time.perf_counter() - started)
                update.append(timed(lambda: llm.update_weights(manifest)))
        result["ipc_publish_s"] = statistics.median(publish)
        result["ipc_update_s"] = statistics.median(update)
        result["tensors_update_s"] = statistics.median(
            timed(lambda: llm.update_weights_from_tensors(tensors)) for _ in range(repeats))
        tensors.clear()  # their memory, before the RSS figures
        if worker.populate_thread is not None:
            worker.populate_thread.join()
        [awake] = llm.collective_rpc("memory_usage")
        result |= {"rss_awake_mib": awake["rss"] / 2**20,
                   "kv_cache_mib": awake["kv_cache_bytes"] / 2**20,
                   "weights_mib": awake["weight_bytes"] / 2**20}
        for level in (1, 2):
            llm.sleep(level)
            [asleep] = llm.collective_rpc("memory_usage")
            result[f"rss_sleep{level}_mib"] = asleep["rss"] / 2**20
            result[f"wake{level}_s"] = timed(llm.wake_up)
    finally:
        llm.shutdown()
    return result


def _hf_tensors(model: str):
    from loom.model.loader import load_hf_config
    from loom.model.loader.gguf_loader import gguf_weights_iterator
    from loom.model.loader.model_loader import is_gguf
    from loom.model.loader.safetensors_loader import safetensors_weights_iterator

    if is_gguf(model):
        return gguf_weights_iterator(model, load_hf_config(model))
    return safetensors_weights_iterator(model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-1b", metavar="DIR", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    from loom.default_model import default_model_path

    model = make_llama_1b(args.llama_1b) if args.llama_1b else default_model_path()
    engine = dict(max_model_len=args.max_model_len, enable_warm_up=False,
                  skip_tokenizer_init=args.llama_1b is not None)
    print(json.dumps(measure(model, args.repeats, **engine), indent=1), flush=True)


if __name__ == "__main__":
    main()
