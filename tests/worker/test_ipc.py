"""Signals and the task queue on their own."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np

from loom.core.wire import (ExecuteModel, ModelRunnerOutput, SchedulerOutput, StepResult,
                            WorkerShutdown)
from loom.ipc.debris import remove_debris
from loom.ipc.signal import Signal, WorkerSignals
from loom.ipc.task_queue import (TaskQueue, TaskQueueAddresses, TaskQueueClient,
                                 new_instance_id)


def test_signal_is_shared_and_unlinked():
    name = f"loom-test-{new_instance_id()}"
    owner = Signal.create(name, (2,), np.float64)
    view = Signal.attach(name, (2,), np.float64)
    view.array[1] = 3.5
    assert owner.array[1] == 3.5
    view.close()
    assert os.path.exists(f"/dev/shm/{name}")  # only the owner unlinks
    owner.close()
    owner.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_worker_signals_are_per_instance():
    a, b = WorkerSignals.create(new_instance_id(), 2), WorkerSignals.create(new_instance_id(), 2)
    names = a.segment_names + b.segment_names
    assert len(set(names)) == 2 * len(WorkerSignals.FIELDS)
    a.ready[0] = 1
    assert b.ready[0] == 0
    a.close()
    b.close()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


def test_debris_of_dead_owners_is_removed_and_live_owners_kept(tmp_path):
    """Segments and socket dirs are named after their owner's PID; a new engine removes
    those whose owner no longer runs, and nothing else."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    left = [shm / f"loom-{dead.pid}-0123456789ab-ready", tmp / f"loom-{dead.pid}-engine-x1"]
    kept = [shm / f"loom-{os.getpid()}-0123456789ab-ready", shm / "other-segment",
            tmp / f"loom-{os.getpid()}-engine-y2", tmp / "loom-cache"]
    for path in left + kept:
        if path.parent == tmp:
            path.mkdir()
            (path / "output").write_text("")
        else:
            path.write_bytes(b"\0" * 8)
    removed = remove_debris(str(shm), str(tmp))
    assert sorted(removed) == sorted(str(p) for p in left)
    assert not any(p.exists() for p in left) and all(p.exists() for p in kept)


def test_debris_of_a_zombie_owner_is_removed(tmp_path):
    """A killed process its parent has not reaped yet (a zombie: an orphan's PID 1 may
    reap late or never) still answers kill(pid, 0), but runs nothing: its debris goes."""
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        with open(f"/proc/{zombie.pid}/stat") as f:
            while f.read().rsplit(")", 1)[1].split()[0] != "Z":
                assert time.monotonic() < deadline, "the child never exited"
                time.sleep(0.01)
                f.seek(0)
        os.kill(zombie.pid, 0)  # the PID still answers
        left = tmp_path / f"loom-{zombie.pid}-0123456789ab-ready"
        left.write_bytes(b"\0" * 8)
        assert remove_debris(str(tmp_path), str(tmp_path / "none")) == [str(left)]
    finally:
        zombie.wait()


def test_task_queue_round_trip():
    addresses, ipc_dir = TaskQueueAddresses.local(new_instance_id())
    queue = TaskQueue(addresses, ipc_dir)
    clients = [TaskQueueClient(addresses) for _ in range(2)]
    while queue.poll_subscriptions(timeout_ms=1000) < 2:
        pass
    output = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[],
                             num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                             finished_req_ids=["a"])
    queue.broadcast(ExecuteModel(step=1, scheduler_output=output))
    queue.broadcast(WorkerShutdown())
    for client in clients:
        assert client.poll(1000) == ExecuteModel(step=1, scheduler_output=output)
        assert isinstance(client.poll(1000), WorkerShutdown)
    reply = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]])
    clients[0].send(StepResult(step=1, output=reply))
    assert queue.poll(1000) == StepResult(step=1, output=reply)
    assert queue.poll(0) is None
    for client in clients:
        client.close()
    queue.close()
    assert not os.path.exists(ipc_dir)
