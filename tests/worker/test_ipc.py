"""Signals and the task queue on their own."""

from __future__ import annotations

import os

import numpy as np

from loom.core.outputs import ModelRunnerOutput, SchedulerOutput
from loom.ipc.signal import Signal, WorkerSignals
from loom.ipc.task_queue import (ExecuteModel, Shutdown, StepResult, TaskQueue,
                                 TaskQueueAddresses, TaskQueueClient, new_instance_id)


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
    assert len(set(names)) == 8
    a.ready[0] = 1
    assert b.ready[0] == 0
    a.close()
    b.close()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)


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
    queue.broadcast(Shutdown())
    for client in clients:
        assert client.poll(1000) == ExecuteModel(step=1, scheduler_output=output)
        assert isinstance(client.poll(1000), Shutdown)
    reply = ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[[7]])
    clients[0].send(StepResult(step=1, output=reply))
    assert queue.poll(1000) == StepResult(step=1, output=reply)
    assert queue.poll(0) is None
    for client in clients:
        client.close()
    queue.close()
    assert not os.path.exists(ipc_dir)
