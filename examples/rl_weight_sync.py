"""A minimal RL-style loop over a live engine: a trainer process perturbs the weights and
publishes them through shared memory (the ``ipc`` strategy, loom.weight_sync); the engine
maps them (update_weights), rolls out, and the trainer goes on. Prints each round's
update latency.

    python examples/rl_weight_sync.py                       # the default model
    python examples/rl_weight_sync.py MODEL --rounds 5 --tensor-parallel-size 2
    python examples/rl_weight_sync.py --device cuda         # trainer and engine on the GPU

With ``--device cuda`` the trainer holds its weights on the GPU and publishes CUDA IPC
handles (no copy through host memory); the engine's ranks copy device to device. That
path has not run on a GPU here yet.

MODEL is a checkpoint directory of safetensors or a .gguf file; the trainer reads it
with loom's loaders (a GGUF dequantized) under Hugging Face names, which is what
update_weights maps through each parameter's weight_loader.
"""

from __future__ import annotations

import argparse
import multiprocessing
import time


def trainer(model: str, connection, noise: float, device: str) -> None:
    """The trainer's process: hold the weights, perturb them each round ("a training
    step"), publish them, send the manifest's path, wait for the rollouts."""
    import torch

    from loom.model.loader import load_hf_config
    from loom.model.loader.gguf_loader import gguf_weights_iterator
    from loom.model.loader.model_loader import is_gguf
    from loom.model.loader.safetensors_loader import safetensors_weights_iterator
    from loom.weight_sync import WeightPublisher

    weights = (gguf_weights_iterator(model, load_hf_config(model)) if is_gguf(model)
               else safetensors_weights_iterator(model))
    state = {name: tensor.float().to(device) for name, tensor in weights}
    generator = torch.Generator(device).manual_seed(0)
    with WeightPublisher() as publisher:
        while connection.recv() == "step":
            for tensor in state.values():  # a stand-in for an optimizer step
                tensor.add_(torch.randn(tensor.shape, generator=generator, device=device),
                            alpha=noise)
            started = time.perf_counter()
            manifest = publisher.publish(state.items())
            connection.send((manifest, time.perf_counter() - started))
            connection.recv()  # the engine has loaded them; the segment may change again


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--noise", type=float, default=1e-3)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the trainer and the engine hold the weights")
    args = parser.parse_args()

    from loom import LLM, SamplingParams
    from loom.default_model import default_model_path

    model = args.model or default_model_path()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    process = context.Process(target=trainer, args=(model, theirs, args.noise, args.device),
                                daemon=True)
    process.start()
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    with LLM(model, tensor_parallel_size=args.tensor_parallel_size, device=args.device) as llm:
        for round_index in range(args.rounds):
            ours.send("step")
            manifest, publish_s = ours.recv()
            started = time.perf_counter()
            llm.update_weights(manifest)
            update_s = time.perf_counter() - started
            ours.send("loaded")
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            rollout_s = time.perf_counter() - started
            print(f"round {round_index}: publish {publish_s * 1000:.0f} ms, update_weights "
                  f"{update_s * 1000:.0f} ms, rollout {rollout_s * 1000:.0f} ms: "
                  f"{outputs[0].outputs[0].text!r}", flush=True)
    ours.send("stop")
    process.join(30)


if __name__ == "__main__":
    main()
