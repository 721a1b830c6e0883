"""Start-up time and resident memory of tensor parallel 2 on Ray actors against worker
processes (mp), on a tiny random checkpoint, alternating the two backends in one run.

    PYTHONPATH=. python benchmarks/ray_startup.py [--repeats 3]

Ray's cluster (two nodes on this machine, one CPU each, as tests/worker/test_ray_executor.py
starts it) is started once, before the timings: what is measured is an engine's start on
a running cluster (connect, place, start the actors, load, ready), not the cluster's.
Prints the median of each and their ratio, and each backend's resident MiB per rank (the
start-up log line's figure). Then, after that cluster is stopped, one start with no
cluster at all, where ray.init() starts a local one (--ray-address and RAY_ADDRESS unset).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path[:0] = [os.path.join(os.path.dirname(__file__), "..", "tests"),
                os.path.join(os.path.dirname(__file__), "..", "tests", "model")]

ENGINE_ARGS = dict(max_model_len=128, num_gpu_blocks_override=64, dtype="float32")


def start_once(model_dir: str, backend: str) -> tuple[float, list[float]]:
    from loom import LLM

    started = time.monotonic()
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend=backend,
              **ENGINE_ARGS)
    seconds = time.monotonic() - started
    try:
        resident = [usage["rss"] / 2**20 for usage in llm.collective_rpc("memory_usage")]
    finally:
        llm.shutdown()
    return seconds, resident


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    from worker.helpers import make_model_dir

    node_args = dict(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)
    started = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args=dict(node_args, resources={"node_a": 1}))
    cluster.add_node(**node_args, resources={"node_b": 1})
    ray.init(address=cluster.address, logging_level="WARNING")
    print(f"cluster of two nodes up in {time.monotonic() - started:.1f}s")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_model_dir("qwen3", os.path.join(tmp, "qwen3"))
            start_once(model_dir, "mp")  # kernels built, files cached, before any timing
            times: dict[str, list[float]] = {"mp": [], "ray": []}
            resident: dict[str, list[float]] = {}
            for _ in range(args.repeats):
                for backend in ("mp", "ray"):
                    seconds, resident[backend] = start_once(model_dir, backend)
                    times[backend].append(seconds)
            for backend in ("mp", "ray"):
                print(f"{backend:>3}: start-up median {statistics.median(times[backend]):.2f}s "
                      f"of {', '.join(f'{t:.2f}' for t in times[backend])}; resident MiB per "
                      f"rank {', '.join(f'{r:.0f}' for r in resident[backend])}")
            print(f"ray / mp: {statistics.median(times['ray']) / statistics.median(times['mp']):.2f}x")
            ray.shutdown()
            cluster.shutdown()
            os.environ.pop("RAY_ADDRESS", None)
            seconds, _ = start_once(model_dir, "ray")
            print(f"ray, no cluster running (the engine starts a local one): {seconds:.2f}s")
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
