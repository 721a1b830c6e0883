"""``loom serve --headless``: this host's data-parallel replicas for a head on another host.

    loom serve --headless -dp 2 -dpl 1 -dpr 1 -dpa HEAD_IP -dpp P MODEL

No API server here: the launcher announces its ranks and settings to the head at
``HEAD_IP:P`` (``DPHello``), and once welcomed starts one engine core process per rank
(each with its own workers, exactly as the head starts its local ones), connected to the
sockets the head bound for it. Then it watches, until one of these ends it:

    the head says goodbye (DPBye, its clean shutdown)   cores stop on their own -> exit 0
    the head goes away (its connection drops)           cores killed            -> exit 1
    an engine core dies                                  the others killed       -> exit 1
    SIGTERM / SIGINT here                                cores killed            -> exit 0
    the head refuses this host (DPRefusal)               nothing started         -> exit 2

The head sees its remote cores' connections drop when they die, and handles that as a
local core's death (loom/ipc/remote_engine_core.py): the replica's requests fail,
/health turns 503 and the head exits 1. The ranks' own workers die with their engine
core (PR_SET_PDEATHSIG), and the engine cores with this launcher.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import signal
import socket
import sys
import time

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from loom.config import EngineConfig
from loom.core.engine_core_proc import run_engine_core
from loom.core.wire import DPBye, DPHandshake, DPHello, DPRefusal, DPWelcome
from loom.dp_async_llm import replica_config
from loom.handshake import handshake_settings
from loom.ipc.debris import remove_debris
from loom.ipc.remote_engine_core import rank_list, set_heartbeat

_POLL_MS = 200
_SHUTDOWN_WAIT_S = 30.0  # after the head's goodbye, for the cores to finish stopping


def run_headless(config: EngineConfig) -> int:
    parallel = config.parallel
    ranks = parallel.local_replica_ranks
    head = f"tcp://{parallel.data_parallel_address}:{parallel.data_parallel_rpc_port}"
    prefix = "loom serve --headless"
    stop = []
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: stop.append(signum))
    remove_debris()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    set_heartbeat(dealer, parallel.worker_health_timeout_s)
    monitor = dealer.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    dealer.connect(head)
    decoder = msgspec.msgpack.Decoder(DPHandshake)
    processes: dict[int, multiprocessing.process.BaseProcess] = {}
    try:
        dealer.send(msgspec.msgpack.encode(DPHello(
            host=socket.gethostname(), start_rank=ranks.start, num_ranks=len(ranks),
            settings=handshake_settings(config))))
        print(f"{prefix}: data-parallel replica(s) {rank_list(ranks)} of "
              f"{parallel.data_parallel_size}: announcing them to the head at {head}",
              flush=True)
        deadline = time.monotonic() + parallel.worker_start_timeout_s
        while not dealer.poll(_POLL_MS):
            if stop:
                return 0
            if time.monotonic() > deadline:
                print(f"{prefix}: error: no answer from the head at {head} in "
                      f"{parallel.worker_start_timeout_s:.0f} s", file=sys.stderr, flush=True)
                return 1
        reply = decoder.decode(dealer.recv())
        if isinstance(reply, DPRefusal):
            print(f"{prefix}: error: the head refused this host: {reply.message}",
                  file=sys.stderr, flush=True)
            return 2
        if not isinstance(reply, DPWelcome):
            print(f"{prefix}: error: the head answered {type(reply).__name__}",
                  file=sys.stderr, flush=True)
            return 1
        if reply.master_port is not None:  # experts across the replicas: the head's choices
            config = dataclasses.replace(config, parallel=dataclasses.replace(
                parallel, data_parallel_master_port=reply.master_port,
                data_parallel_lockstep_addresses=tuple(
                    tuple(pair) for pair in reply.lockstep_addresses or ()) or None))
        spawn = multiprocessing.get_context("spawn")
        for rank, input_address, output_address in reply.addresses:
            processes[rank] = spawn.Process(
                target=run_engine_core, name=f"loom-engine-core-{rank}", daemon=False,
                args=(msgspec.msgpack.encode(replica_config(config, rank)), input_address,
                      output_address))
            processes[rank].start()
        print(f"{prefix}: started data-parallel replica(s) {rank_list(ranks)} (engine core "
              f"pid {', '.join(str(p.pid) for p in processes.values())}) for the head at "
              f"{head}", flush=True)
        return _watch(dealer, monitor, decoder, processes, stop, head, prefix)
    finally:
        for process in processes.values():
            if process.is_alive():
                process.kill()  # its workers die with it
            process.join(5)
        monitor.close(linger=0)
        dealer.close(linger=0)
        context.term()
        if processes:
            remove_debris()


def _watch(dealer: zmq.Socket, monitor: zmq.Socket, decoder, processes, stop, head: str,
           prefix: str) -> int:
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(_POLL_MS))
        if stop:
            print(f"{prefix}: stopping on signal {stop[0]}; the head's requests on these "
                  "replicas fail", flush=True)
            return 0
        if dealer in ready and isinstance(decoder.decode(dealer.recv()), DPBye):
            deadline = time.monotonic() + _SHUTDOWN_WAIT_S
            for process in processes.values():
                process.join(max(0.0, deadline - time.monotonic()))
            codes = {rank: process.exitcode for rank, process in processes.items()}
            print(f"{prefix}: the head shut down; engine core exit codes {codes}", flush=True)
            return 0 if all(code == 0 for code in codes.values()) else 1
        if monitor in ready:
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED and not dealer.poll(0):  # else: its goodbye
                print(f"{prefix}: error: the head at {head} went away; stopping data-parallel "
                      f"replica(s) {rank_list(sorted(processes))}", file=sys.stderr, flush=True)
                return 1
        for rank, process in processes.items():
            if not process.is_alive() and process.exitcode != 0:
                print(f"{prefix}: error: the engine core of data-parallel replica {rank} exited "
                      f"with code {process.exitcode}; stopping", file=sys.stderr, flush=True)
                return 1
