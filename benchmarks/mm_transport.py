"""Images' arrays between loom's processes: shared-memory rings against bytes inside the
messages, hop by hop, interleaved.

    python benchmarks/mm_transport.py [--rounds 15] [--result-file results/mm_transport.json]

Two payloads, Qwen2.5-VL's preprocessed pixels (float32, 14-pixel patches of 3 x 2 x 14 x
14 = 1176 values, 28-pixel multiples): 8 images of 448 x 448 (8 x 1024 x 1176, 38.5 MB)
and one of 1792 x 1792 (16384 x 1176, 77 MB). Random values: the hops move bytes and do
not look at them. Each hop as loom runs it, in two processes over ipc:// sockets:

- API -> core: ``EngineCoreRequest`` over PUSH/PULL; the sender stages
  (``SenderRing.stage``) and encodes, the receiver decodes and fetches
  (``FeatureFetcher``), as ``EngineCoreClient.send`` and ``EngineCoreProc._add_request``.
- core -> rank: ``ExecuteModel`` (one ``NewRequestData``) over XPUB/SUB, as
  ``MultiProcExecutor.execute_model`` and the worker's event loop, then ``to_array`` of
  every array (what the model does first).

The time is from the sender's first byte of work to the receiver's answer (a 1-byte
PUSH back), median over rounds; shm and inline alternate within each round. The other
processes' share of the CPUs over the run is reported (from /proc/stat, less this run's
processes); a result file is written only when it was under 10 %.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
import uuid

import msgspec
import numpy as np
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from loom.core.wire import (EngineCoreRequest, ExecuteModel, MultiModalFeature,  # noqa: E402
                            NewRequestData, SchedulerOutput, TensorData)
from loom.ipc.shm_ring import FeatureFetcher, SenderRing  # noqa: E402
from loom.sampling_params import SamplingParams  # noqa: E402

PATCH_VALUES = 1176
CASES = {"8 x 448x448": [448] * 8, "1 x 1792x1792": [1792]}


def features(sizes: list[int]) -> list[MultiModalFeature]:
    rng = np.random.default_rng(0)
    out = []
    for index, side in enumerate(sizes):
        patches = (side // 14) ** 2
        pixels = rng.standard_normal((patches, PATCH_VALUES), dtype=np.float32)
        grid = np.array([[1, side // 14, side // 14]], dtype=np.int64)
        out.append(MultiModalFeature(
            modality="image", identifier=f"image-{index}", offset=index * 1000,
            length=patches // 4, data={"pixel_values": TensorData.from_array(pixels),
                                       "image_grid_thw": TensorData.from_array(grid)}))
    return out


def request(mm_features: list[MultiModalFeature]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id="r", prompt_token_ids=list(range(64)),
                             sampling_params=SamplingParams(), eos_token_ids=[0],
                             arrival_time=0.0, parent_request_id="r", mm_features=mm_features)


def step(mm_features: list[MultiModalFeature]) -> ExecuteModel:
    new = NewRequestData(req_id="r", prompt_token_ids=list(range(64)), output_token_ids=[],
                         sampling_params=SamplingParams(), eos_token_ids=[0], block_ids=[0],
                         num_computed_tokens=0, mm_features=mm_features)
    return ExecuteModel(step=1, scheduler_output=SchedulerOutput(
        scheduled_new_reqs=[new], scheduled_cached_reqs=[], num_scheduled_tokens={"r": 64},
        total_num_scheduled_tokens=64, finished_req_ids=[]))


def receiver(hop: str, address: str, reply_address: str) -> None:
    context = zmq.Context()
    if hop == "input":
        socket = context.socket(zmq.PULL)
        decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
    else:
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        decoder = msgspec.msgpack.Decoder(ExecuteModel)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.connect(address)
    reply = context.socket(zmq.PUSH)
    reply.connect(reply_address)
    fetcher = FeatureFetcher(index=0)
    reply.send(b"r")  # connected
    while True:
        frame = socket.recv(copy=False)
        if frame.bytes[:1] == b"q" and len(frame) == 1:
            break
        message = decoder.decode(frame.buffer)
        if hop == "input":
            fetcher.fetch(message.mm_features)
        else:
            for new in message.scheduler_output.scheduled_new_reqs:
                fetcher.fetch(new.mm_features)
                for feature in new.mm_features:
                    for tensor in feature.data.values():
                        tensor.to_array()
        reply.send(b"k")
    fetcher.close()
    context.destroy(linger=0)


def run_hop(hop: str, cases: dict[str, list[MultiModalFeature]], rounds: int) -> dict:
    directory = tempfile.mkdtemp(prefix=f"loom-{os.getpid()}-bench-")
    address, reply_address = f"ipc://{directory}/a", f"ipc://{directory}/b"
    context = zmq.Context()
    sender = context.socket(zmq.PUSH if hop == "input" else zmq.XPUB)
    sender.setsockopt(zmq.SNDHWM, 0)
    sender.bind(address)
    replies = context.socket(zmq.PULL)
    replies.bind(reply_address)
    child = multiprocessing.get_context("spawn").Process(
        target=receiver, args=(hop, address, reply_address))
    child.start()
    replies.recv()
    if hop == "ranks":  # the subscription has reached the XPUB
        sender.recv()
    ring = SenderRing(f"loom-{os.getpid()}-{uuid.uuid4().hex[:12]}-mm-{hop}", 256, 1)
    encoder = msgspec.msgpack.Encoder()
    times: dict[str, dict[str, list[float]]] = {case: {"shm": [], "inline": []}
                                                for case in cases}
    for _ in range(rounds + 1):  # the first round warms up (page faults of the ring)
        for case, mm_features in cases.items():
            for mode in ("shm", "inline"):
                started = time.perf_counter()
                staged = ring.stage(mm_features) if mode == "shm" else mm_features
                message = request(staged) if hop == "input" else step(staged)
                sender.send(encoder.encode(message), copy=False)
                replies.recv()
                times[case][mode].append(time.perf_counter() - started)
    sender.send(b"q")
    child.join(30)
    ring.close()
    context.destroy(linger=0)
    os.rmdir(directory) if not os.listdir(directory) else None
    return {case: {mode: {"median_ms": round(1000 * statistics.median(values[1:]), 2),
                          "min_ms": round(1000 * min(values[1:]), 2)}
                   for mode, values in modes.items()}
            for case, modes in times.items()}


def cpu_busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                 resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    cases = {case: features(sizes) for case, sizes in CASES.items()}
    wall, busy, own = time.monotonic(), cpu_busy_seconds(), own_cpu_seconds()
    results = {hop: run_hop(hop, cases, args.rounds) for hop in ("input", "ranks")}
    wall = time.monotonic() - wall
    others = max(0.0, (cpu_busy_seconds() - busy) - (own_cpu_seconds() - own))
    share = others / (wall * os.cpu_count())
    for hop, by_case in results.items():
        for case, modes in by_case.items():
            shm, inline = modes["shm"]["median_ms"], modes["inline"]["median_ms"]
            print(f"{hop:6s} {case:14s} shm {shm:8.2f} ms  inline {inline:8.2f} ms  "
                  f"inline/shm {inline / shm:5.2f}x")
    print(f"other processes' CPU share over the run: {share:.0%} of {os.cpu_count()} cores")
    record = {"hops": results, "rounds": args.rounds, "others_cpu_share": round(share, 3),
              "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
              "command": "python benchmarks/mm_transport.py " + " ".join(sys.argv[1:])}
    if args.result_file:
        if share < 0.10:
            with open(args.result_file, "w") as f:
                json.dump(record, f, indent=2)
            print(f"wrote {args.result_file}")
        else:
            print(f"not writing {args.result_file}: other processes took {share:.0%} of the "
                  "CPUs; run again on idle cores")


if __name__ == "__main__":
    main()
