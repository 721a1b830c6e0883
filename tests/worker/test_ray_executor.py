"""--distributed-executor-backend ray on a real two-node Ray cluster, on this machine.

The module's cluster is two raylets (ray.cluster_utils.Cluster: a head node with the
custom resource node_a and a second node with node_b), one CPU each, so a placement
group of two {"CPU": 1} bundles puts one rank on each node. This process connects to it
as a driver; the offline engine uses that connection, a server's engine core makes its
own. Actors and placement groups are read from the GCS (``ray._private.state``, what
``ray list actors`` shows): ``ray.util.state`` needs the dashboard, which a minimal
``pip install ray`` does not run.

Without Ray installed the cluster's tests skip, saying so; the CLI's error for that case
is tested here with Ray hidden from the interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from dp_greedy import one_then_all

from loom import LLM, SamplingParams

from .helpers import executor_of, make_model_dir

try:
    import ray
except ImportError:  # the `ray` extra is not installed
    ray = None

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "entrypoints"))

requires_ray = pytest.mark.skipif(
    ray is None, reason="Ray is not installed; pip install 'loom[ray]' runs these tests")

ENGINE_ARGS = dict(max_model_len=128, num_gpu_blocks_override=64, dtype="float32")
NODE_ARGS = dict(num_cpus=1, object_store_memory=80 * 2**20, include_dashboard=False)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]},
           {"prompt_token_ids": list(range(20, 47))}, {"prompt_token_ids": [3] * 11}]


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no network: Ray reports nothing home
        started = time.monotonic()
        cluster = Cluster(initialize_head=True,
                          head_node_args=dict(NODE_ARGS, resources={"node_a": 1}))
        cluster.add_node(**NODE_ARGS, resources={"node_b": 1})
        ray.init(address=cluster.address, logging_level="WARNING")
        print(f"\nRay cluster of two nodes up in {time.monotonic() - started:.1f}s")
        try:
            yield cluster
        finally:
            ray.shutdown()
            cluster.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir("qwen3", tmp_path_factory.mktemp("qwen3"))


def loom_actors(state: str | None = None) -> list[dict]:
    """loom's actors on the cluster (any job), optionally only those in ``state``."""
    from ray._private import state as gcs

    return [actor for actor in gcs.actors().values()
            if (actor.get("Name") or "").startswith("loom-")
            and (state is None or actor["State"] == state)]


def leftovers(timeout_s: float = 15.0) -> tuple[list, list]:
    """loom actors still alive and placement groups not removed, once both are gone or
    at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        actors = [a for a in loom_actors() if a["State"] != "DEAD"]
        groups = [g for g in ray.util.placement_group_table().values()
                  if g["name"].startswith("loom-") and g["state"] != "REMOVED"]
        if not (actors or groups) or time.monotonic() > deadline:
            return actors, groups
        time.sleep(0.1)


@requires_ray
def test_tp2_one_rank_per_node_equals_tp1_and_leaves_nothing(ray_cluster, model_dir):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model_dir, **ENGINE_ARGS) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params,
                                                                   use_tqdm=False)]

    # A cluster that could never hold the ranks: an error at once, naming the shortfall.
    with pytest.raises(ValueError, match=r"has 2 CPU in all but 4 rank\(s\) need 1 each"):
        LLM(model_dir, tensor_parallel_size=4, distributed_executor_backend="ray",
            **ENGINE_ARGS)

    started = time.monotonic()
    with LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
             **ENGINE_ARGS) as llm:
        print(f"TP=2 on Ray ready in {time.monotonic() - started:.1f}s")
        executor = executor_of(llm)
        placements = executor.rank_placements
        nodes = {node["NodeID"]: node["Resources"] for node in ray.nodes() if node["Alive"]}
        # One rank per node, node_a's and node_b's; the rank on this driver's node writes
        # the shared-memory signals, the other reports over the task queue.
        assert [("node_a" in nodes[p.node_id], "node_b" in nodes[p.node_id])
                for p in placements] in ([(True, False), (False, True)],
                                         [(False, True), (True, False)])
        assert executor.rank_is_local == [True, False]
        assert executor.queue.addresses.broadcast.startswith("tcp://")
        assert len(loom_actors("ALIVE")) == 2
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == expected
    assert leftovers() == ([], [])


@requires_ray
def test_rank_actors_stuck_in_a_step_are_a_hang_and_leave_nothing(ray_cluster, model_dir,
                                                                   monkeypatch):
    """LOOM_* switches reach the actors (this one stalls every rank's loop in step 3); the
    step's bound finds the hang, as with worker processes, and the actors are stopped."""
    from loom.errors import WorkerHungError

    monkeypatch.setenv("LOOM_TEST_STALL_WORKER_AT_STEP", "3")
    llm = LLM(model_dir, tensor_parallel_size=2, distributed_executor_backend="ray",
              watchdog_timeout_s=2.0, enable_warm_up=False, **ENGINE_ARGS)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerHungError, match=r"is hung: step 3 .* past its bound"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=20, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - started < 2.0 + 5.0
        assert leftovers() == ([], [])
    finally:
        llm.shutdown()


@requires_ray
def test_killed_rank_actor_fails_requests_and_server_exits_nonzero(ray_cluster, model_dir):
    from loom_server import LoomServer

    server = LoomServer(model_dir, "--max-model-len", "128", "--num-gpu-blocks-override", "64",
                        "--dtype", "float32", "--tensor-parallel-size", "2",
                        "--distributed-executor-backend", "ray",
                        "--ray-address", ray_cluster.address)
    try:
        request = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with server.http() as http, http.stream("POST", "/v1/completions",
                                                json=request) as stream:
            lines = (line for line in stream.iter_lines() if line)
            assert "choices" in json.loads(next(lines).removeprefix("data: "))
            # The rank on the other node than the engine core's: its process dies.
            [victim] = [actor for actor in loom_actors("ALIVE")
                        if actor["Address"]["NodeID"] != actor["OwnerAddress"]["NodeID"]]
            os.kill(victim["Pid"], signal.SIGKILL)
            events = [line.removeprefix("data: ") for line in lines]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead", error
        assert server.proc.wait(30) != 0
        assert leftovers() == ([], [])
    finally:
        server.kill()


@requires_ray
def test_data_parallel_replicas_on_ray_then_sigterm_leaves_nothing(ray_cluster, model_dir):
    """Two replicas, each an engine core with its own placement group and actor (one per
    node, as each node has one CPU): the same greedy text as one offline engine; SIGTERM
    then stops the server with status 0 and takes every actor and group with it."""
    from concurrent.futures import ThreadPoolExecutor

    from loom_server import LoomServer

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(model_dir, **ENGINE_ARGS) as llm:
        expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    server = LoomServer(model_dir, "--max-model-len", "128", "--num-gpu-blocks-override", "64",
                        "--dtype", "float32", "--data-parallel-size", "2",
                        "--distributed-executor-backend", "ray",
                        "--ray-address", ray_cluster.address)
    try:
        actors = loom_actors("ALIVE")
        assert len(actors) == 2 and len({a["Address"]["NodeID"] for a in actors}) == 2, actors

        def complete(prompt):
            body = {"prompt": prompt["prompt_token_ids"], "max_tokens": 8, "temperature": 0.0,
                    "ignore_eos": True}
            with server.http() as http:
                return http.post("/v1/completions", json=body).json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(complete, PROMPTS)) == expected
        assert server.terminate(60) == 0
        assert leftovers() == ([], [])
    finally:
        server.kill()


@requires_ray
def test_experts_across_replicas_on_ray_equal_one_rank(ray_cluster, tmp_path):
    """DP=2 x EP=2 on Ray: each replica's engine core places its one actor (one per node),
    and both actors join one process group (its store in replica 0's actor, at this
    host's node IP and the port the API process picked); tokens travel to their experts
    by all-to-all. The greedy tokens equal one rank's (every expert), one request at a
    time (the other replica in dummy steps) and all at once; nothing is left behind."""
    import asyncio

    from loom.dp_async_llm import DPAsyncLLM
    from loom.engine_args import EngineArgs

    moe = make_model_dir("qwen3_moe", tmp_path / "qwen3_moe")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    with LLM(moe, **ENGINE_ARGS) as llm:
        expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params,
                                                                   use_tqdm=False)]
    config = EngineArgs(model=moe, data_parallel_size=2, enable_expert_parallel=True,
                        distributed_executor_backend="ray", ray_address=ray_cluster.address,
                        watchdog_timeout_s=15.0, **ENGINE_ARGS).create_engine_config()
    assert config.parallel.experts_across_replicas

    async def serve() -> tuple[list, list, list, list, list]:
        llm = DPAsyncLLM(config, log_requests=False)
        await llm.start()
        try:
            actors = loom_actors("ALIVE")
            one, together, replicas = await one_then_all(
                llm, [p["prompt_token_ids"] for p in PROMPTS], params)
            sent = await llm.control("collective_rpc", method="collective_bytes")
            return one, together, replicas, sent, actors
        finally:
            await llm.shutdown()

    one, together, replicas, sent, actors = asyncio.run(serve())
    assert len(actors) == 2 and len({a["Address"]["NodeID"] for a in actors}) == 2, actors
    assert one == expected and together == expected
    assert set(replicas) == {0, 1}, replicas
    assert all(rank["all_to_all_remote"] > 0 for replica in sent for rank in replica), sent
    assert leftovers() == ([], [])


def test_cli_error_when_ray_is_not_installed(model_dir):
    """One line, exit 2, before anything loads: Ray hidden from the interpreter."""
    code = ("import sys; sys.modules['ray'] = None; from loom.cli import main; "
            f"sys.exit(main(['serve', {model_dir!r}, '--distributed-executor-backend', 'ray']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == ("loom serve: error: --distributed-executor-backend ray needs Ray, "
                         "which is not installed; pip install 'loom[ray]' (ray==2.60.0), or "
                         "use --distributed-executor-backend mp"), lines
