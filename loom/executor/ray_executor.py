"""RayExecutor: one Ray actor per rank, placed by a placement group, reached as worker
processes are (``--distributed-executor-backend ray``).

Start-up, in order:

    ray.init(address)            --ray-address, else RAY_ADDRESS, else the cluster last
                                 started on this host, else a new local one (ray.init's
                                 own rule, as vLLM uses it)
    placement group              one bundle per rank ({"CPU": 1}, or {"GPU": 1} on CUDA),
                                 strategy PACK; a cluster too small is an error naming it
    one RayWorker actor a bundle reports its node, IP and PID; ranks are numbered with the
                                 engine's node first, then by node
    signals + task queue         shared-memory WorkerSignals as with worker processes;
                                 the task queue on ipc:// when every rank is on the
                                 engine's node, else on tcp:// at the engine's node IP
    actor.run(spec)              the same rank life cycle as a worker process
                                 (worker_process.run_worker): torch.distributed over a
                                 TCP store in rank 0's actor, at rank 0's node IP

From then on the engine reaches its ranks exactly as MultiProcExecutor does (this class
is one): steps and RPCs on the task queue; a rank on the engine's Ray node writes the
shared-memory signals, a rank on another node (another host, or another raylet on this
one) sends the same facts as RemoteStatus messages, as `loom worker` ranks do. A rank's
handle (``RayRank``) has a process's pid, exitcode, is_alive(), join() and kill(): an
actor is alive while its ``run`` call is, and a dead actor (killed, crashed, its node
gone) is a dead rank: requests fail, the engine stops.

Stop: the ranks leave as worker processes do, then every actor is killed (an actor
outlives its ``run``), the placement group removed and, if this executor connected to
Ray, it disconnects. Actors are not detached: if the engine's process dies, Ray ends
them and the placement group with their owner.

Every node runs the same Python environment with loom installed (as vLLM requires);
``LOOM_*`` switches of the engine's environment are passed to the actors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from loom.errors import WorkerDiedError
from loom.executor.multiproc import SHUTDOWN_GRACE_S, MultiProcExecutor, WorkerResources
from loom.ipc.signal import WorkerSignals
from loom.ipc.task_queue import TaskQueue, TaskQueueAddresses
from loom.worker.worker_process import WorkerSpec, configure_process, run_worker

logger = logging.getLogger(__name__)

ACTOR_NAMESPACE = "loom"  # actors are named loom-<instance id>-bundle<index> in it
PLACEMENT_LOG_INTERVAL_S = 10.0
ACTOR_DIED = -1  # RayRank.exitcode of an actor whose run() never returned


@dataclass(frozen=True)
class RankPlacement:
    """Where an actor landed, as it reports it."""

    node_id: str
    node_ip: str
    pid: int


class RayWorker:
    """The actor behind one rank. ``placement`` and ``host_store`` answer before ``run``,
    which then holds the actor for the engine's whole life (the rank's event loop)."""

    def placement(self) -> RankPlacement:
        return RankPlacement(node_id=ray.get_runtime_context().get_node_id(),
                             node_ip=ray.util.get_node_ip_address(), pid=os.getpid())

    def host_store(self, world_size: int, timeout_s: float) -> int:
        """Rank 0's actor: start the ranks' TCP store in this process now, on a port the
        OS picks, and return it (``run`` joins through it)."""
        from loom.distributed.parallel_state import host_store

        return host_store(ray.util.get_node_ip_address(), world_size, timeout_s)

    def run(self, spec: WorkerSpec) -> int:
        configure_process(spec)  # a Ray worker runs actor calls in its main thread
        return run_worker(spec)


class RayRank:
    """One rank's actor, with the part of multiprocessing.Process the executor uses."""

    def __init__(self, actor, run_ref, placement: RankPlacement) -> None:
        self.actor = actor
        self.placement = placement
        self.pid = placement.pid
        self.death: str | None = None  # Ray's account of why the actor died
        self._run_ref = run_ref
        self._exitcode: int | None = None

    @property
    def exitcode(self) -> int | None:
        """None while ``run`` runs; its return value (0: shut down, 1: failed) once it
        returned; ACTOR_DIED if the actor died under it."""
        if self._exitcode is None:
            done, _ = ray.wait([self._run_ref], timeout=0)
            if done:
                self._collect()
        return self._exitcode

    def _collect(self) -> None:
        try:
            self._exitcode = int(ray.get(self._run_ref))
        except ray.exceptions.RayActorError as error:
            self._exitcode, self.death = ACTOR_DIED, _death_cause(error)
        except Exception as error:  # noqa: BLE001 — e.g. the spec could not be unpickled
            self._exitcode, self.death = ACTOR_DIED, f"{type(error).__name__}: {error}"

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if self._exitcode is None:
            ray.wait([self._run_ref], timeout=timeout)

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)


class RayWorkerResources(WorkerResources):
    """A worker process's resources, and the actors, the placement group, the connection."""

    def __init__(self) -> None:
        super().__init__()
        self.placement_group = None
        self.connected_by_us = False  # this executor called ray.init

    def release(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        super().release(grace_s)  # the ranks leave (their run() returns) or are killed
        if not ray.is_initialized():  # disconnected (interpreter exit): Ray ends the job's
            return                    # actors and placement groups itself
        try:
            for rank in self.processes:
                rank.kill()  # an actor outlives its run()
            if self.placement_group is not None:
                remove_placement_group(self.placement_group)
            if self.connected_by_us:
                ray.shutdown()
        except Exception as exc:  # noqa: BLE001 — release must not raise
            logger.warning("releasing the Ray actors failed: %s: %s", type(exc).__name__, exc)


class RayExecutor(MultiProcExecutor):
    resources_type = RayWorkerResources
    not_ready_hint = "their Ray worker logs say why (the rank's lines above, prefixed by Ray)"

    def _launch_ranks(self) -> None:
        parallel = self.config.parallel
        resources = self._resources
        if not ray.is_initialized():
            ray.init(address=parallel.ray_address, logging_level=logging.WARNING)
            resources.connected_by_us = True
        cuda = self.config.device == "cuda"
        bundle = {"GPU": 1.0} if cuda else {"CPU": 1.0}
        _check_cluster_fits(bundle, parallel.world_size)
        deadline = time.monotonic() + parallel.worker_start_timeout_s
        resources.placement_group = group = placement_group(
            [dict(bundle)] * parallel.world_size, strategy="PACK",
            name=f"loom-{self.instance_id}")
        _wait_for_placement(group, bundle, parallel.world_size, deadline)

        actor_class = ray.remote(RayWorker)
        env_vars = {name: value for name, value in os.environ.items()
                    if name.startswith("LOOM_")}
        actors = [actor_class.options(
            name=f"loom-{self.instance_id}-bundle{index}", namespace=ACTOR_NAMESPACE,
            num_cpus=0 if cuda else 1, num_gpus=1 if cuda else 0, max_restarts=0,
            runtime_env={"env_vars": env_vars} if env_vars else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=index)).remote()
            for index in range(parallel.world_size)]
        placements = _get([actor.placement.remote() for actor in actors], deadline,
                          "reporting where it runs")
        engine_node = ray.get_runtime_context().get_node_id()
        # Ranks on the engine's node first (rank 0 among them when there is one), then
        # node by node.
        order = sorted(range(len(actors)), key=lambda i: (
            placements[i].node_id != engine_node, placements[i].node_ip, placements[i].node_id))
        actors = [actors[i] for i in order]
        placements = [placements[i] for i in order]
        self.rank_placements = placements
        self.rank_is_local = [p.node_id == engine_node for p in placements]

        resources.signals = self.signals = WorkerSignals.create(self.instance_id,
                                                                parallel.world_size)
        if all(self.rank_is_local):
            addresses, ipc_dir = TaskQueueAddresses.local(self.instance_id)
        else:
            addresses = TaskQueueAddresses.tcp_any_port(ray.util.get_node_ip_address())
            ipc_dir = None
        resources.queue = self.queue = TaskQueue(addresses, ipc_dir)
        config = self.config
        if parallel.experts_across_replicas:
            # One process group over every replica's ranks: its store in replica 0's rank
            # 0, at this (the engine cores') host's node IP and the port the API process
            # picked, which every replica's executor knows alike.
            master_addr = ray.util.get_node_ip_address()
            if parallel.data_parallel_rank == 0 and placements[0].node_ip != master_addr:
                raise RuntimeError(
                    f"expert parallel across data-parallel replicas on Ray: replica 0's "
                    f"rank 0 hosts the ranks' process group and must run on this host "
                    f"({master_addr}), but Ray placed it on {placements[0].node_ip}; free a "
                    f"{'GPU' if cuda else 'CPU'} here for it")
            master_port = parallel.data_parallel_master_port
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                parallel, data_parallel_address=master_addr))
        else:
            master_addr = placements[0].node_ip
            [master_port] = _get([actors[0].host_store.remote(
                parallel.world_size, parallel.worker_start_timeout_s)], deadline,
                "starting the store")
        ranks_on_ip = Counter(p.node_ip for p in placements)  # ranks sharing a host's cores
        log_level = logging.getLevelName(logging.getLogger("loom").getEffectiveLevel())
        for rank, (actor, where) in enumerate(zip(actors, placements)):
            spec = WorkerSpec(config=config, rank=rank, instance_id=self.instance_id,
                              addresses=self.queue.addresses, master_addr=master_addr,
                              master_port=master_port, parent_pid=os.getpid(),
                              local=self.rank_is_local[rank], log_level=log_level,
                              in_ray_actor=True, ranks_on_host=ranks_on_ip[where.node_ip])
            resources.processes.append(RayRank(actor, actor.run.remote(spec), where))
        logger.info("Ray placed %d rank(s): %s", parallel.world_size, "; ".join(
            f"rank {rank} on node {p.node_id[:8]} ({p.node_ip}, pid {p.pid}"
            f"{', this node' if local else ''})"
            for rank, (p, local) in enumerate(zip(placements, self.rank_is_local))))

    def _describe_death(self, process: RayRank, during: str) -> str:
        where = process.placement
        if process.exitcode == ACTOR_DIED:
            return (f"(Ray actor, pid {where.pid} on {where.node_ip}) died during {during}: "
                    f"{process.death}")
        return (f"(Ray actor, pid {where.pid} on {where.node_ip}) exited during {during} "
                f"with status {process.exitcode}")

    def _dump_stacks(self, rank: int, process: RayRank) -> None:
        if process.placement.node_ip == ray.util.get_node_ip_address():
            super()._dump_stacks(rank, process)  # into its Ray worker log, sent to ours
        else:
            logger.error("rank %d runs on %s: its stacks cannot be asked for from here",
                         rank, process.placement.node_ip)


def _death_cause(error: Exception) -> str:
    """Ray's reason for an actor's death, in one line, without its troubleshooting list."""
    text = " ".join(str(error).split())
    start = text.find("The actor is dead because")
    text = text[start:] if start >= 0 else text
    end = text.find(" Some common causes")
    return text[:end] if end >= 0 else text[:500]


def _check_cluster_fits(bundle: dict[str, float], world_size: int) -> None:
    """A cluster that could never hold the ranks is an error now, not a wait forever."""
    total = ray.cluster_resources()
    for resource, amount in bundle.items():
        if total.get(resource, 0.0) < amount * world_size:
            raise ValueError(
                f"the Ray cluster has {total.get(resource, 0.0):g} {resource} in all but "
                f"{world_size} rank(s) need {amount:g} each; add nodes to the cluster "
                "(`ray start --address ...`) or lower --tensor-parallel-size")


def _wait_for_placement(group, bundle: dict[str, float], world_size: int,
                        deadline: float) -> None:
    while True:
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_LOG_INTERVAL_S)
        if ready:
            return
        if time.monotonic() > deadline:
            raise WorkerDiedError(f"Ray could not place {world_size} bundle(s) of {bundle} "
                                  "before the start-up timeout; the cluster has "
                                  f"{ray.available_resources()} free")
        logger.warning("waiting for Ray to place %d bundle(s) of %s; free now: %s",
                       world_size, bundle, ray.available_resources())


def _get(refs: list, deadline: float, what: str) -> list:
    """ray.get before the start-up deadline; an actor that died doing it is a dead rank."""
    try:
        return ray.get(refs, timeout=max(1.0, deadline - time.monotonic()))
    except ray.exceptions.GetTimeoutError:
        raise WorkerDiedError(f"a Ray actor was still {what} at the start-up timeout") from None
    except ray.exceptions.RayActorError as error:
        raise WorkerDiedError(f"a Ray actor died {what}: {_death_cause(error)}") from None
