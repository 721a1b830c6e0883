"""The shared-memory ring that carries images' arrays between processes of one host."""

from __future__ import annotations

import os
import uuid

import msgspec
import numpy as np
import pytest

from loom.core.wire import EngineCoreRequest, MultiModalFeature, TensorData
from loom.ipc.shm_ring import (INLINE_MAX_BYTES, FeatureFetcher, ShmRing, ShmRingReader,
                               StaleSlotError, stage_features)
from loom.sampling_params import SamplingParams

KIB = 1024


@pytest.fixture
def name():
    name = f"loom-{os.getpid()}-{uuid.uuid4().hex[:12]}-mm-test"
    yield name
    assert not os.path.exists(f"/dev/shm/{name}")  # every test's ring is unlinked


def _ring(name: str, capacity: int, num_readers: int = 1) -> ShmRing:
    return ShmRing(name, capacity, num_readers)


def test_write_read_and_unlink_at_close(name):
    ring = _ring(name, 64 * KIB)
    reader = ShmRingReader(name, 0)
    payload = os.urandom(10_000)
    slot = ring.put(payload)
    assert slot.segment == name and slot.length == len(payload)
    assert reader.get(slot) == payload
    assert os.path.exists(f"/dev/shm/{name}")
    reader.close()
    ring.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    ring.close()  # idempotent


def test_wraps_around_once_read_and_waits_for_every_reader(name):
    ring = _ring(name, 64 * KIB, num_readers=2)
    readers = [ShmRingReader(name, 0), ShmRingReader(name, 1)]
    payloads = [bytes([i]) * 20_000 for i in range(3)]
    slots = [ring.put(p) for p in payloads]  # 3 x 20 KB fill most of 64 KiB
    assert all(slots)
    # The fourth needs the first one's space (the tail is too short): not until both read.
    assert ring.put(b"x" * 20_000) is None
    assert readers[0].get(slots[0]) == payloads[0]
    assert ring.put(b"x" * 20_000) is None  # reader 1 has not taken it yet
    assert readers[1].get(slots[0]) == payloads[0]
    wrapped = ring.put(b"y" * 20_000)
    assert wrapped is not None and wrapped.start == 64 * KIB  # the second lap, at offset 0
    for reader in readers:
        assert reader.get(slots[1]) == payloads[1]
        assert reader.get(slots[2]) == payloads[2]
        assert reader.get(wrapped) == b"y" * 20_000
    for reader in readers:
        reader.close()
    ring.close()


def test_a_reused_slot_is_detected_never_read(name):
    ring = _ring(name, 64 * KIB)
    reader = ShmRingReader(name, 0)
    first = ring.put(b"a" * 30_000)
    second = ring.put(b"b" * 30_000)
    assert reader.get(first) == b"a" * 30_000
    assert reader.get(second) == b"b" * 30_000
    reused = ring.put(b"c" * 30_000)  # takes the first one's space
    assert reused.start == 64 * KIB
    with pytest.raises(StaleSlotError, match="overwritten"):
        reader.get(first)  # its bytes are c's now
    assert reader.get(reused) == b"c" * 30_000
    # Also when the bytes at the old slot's header happen to read as its header: the
    # writer's published position says it has lapped the slot.
    ring.close()
    reader.close()
    ring = _ring(name + "-2", 64 * KIB)
    reader = ShmRingReader(name + "-2", 0)
    first = ring.put(b"a" * 30_000)  # [0, 30016)
    second = ring.put(b"b" * 20_000)  # [30016, 50032)
    assert reader.get(first) and reader.get(second)
    forged = bytearray(b"c" * 35_000)  # lands at [0, 35024) of the next lap
    forged[second.start - 16:second.start] = np.array([second.start, second.length]).tobytes()
    assert ring.put(bytes(forged)).start == 64 * KIB
    with pytest.raises(StaleSlotError):
        reader.get(second)
    reader.close()
    ring.close()


def test_too_large_or_off_stays_inline(name, tmp_path, monkeypatch):
    ring = _ring(name, 64 * KIB)
    assert ring.put(b"z" * (64 * KIB)) is None  # with its header it does not fit
    ring.close()
    assert ShmRing.create(name, 0, 1) is None  # --mm-shm-cache-size-mib 0
    assert ShmRing.create(name, 1, 1, shm_dir=str(tmp_path / "absent")) is None
    # A /dev/shm too small for the ring (a container's 64 MiB): off, not SIGBUS later.
    small = os.statvfs_result((4096, 4096, 100, 10, 10, 0, 0, 0, 0, 255))
    monkeypatch.setattr(os, "statvfs", lambda path: small)
    assert ShmRing.create(name, 1, 1) is None


def test_features_round_trip_through_a_message(name):
    ring = _ring(name, 4096 * KIB)
    pixels = np.random.default_rng(0).standard_normal((256, 1176), dtype=np.float32)
    grid = np.array([[1, 16, 16]], dtype=np.int64)
    feature = MultiModalFeature(modality="image", identifier="h", offset=3, length=64,
                                data={"pixel_values": TensorData.from_array(pixels),
                                      "image_grid_thw": TensorData.from_array(grid)})
    staged = stage_features([feature], ring)
    assert feature.data["pixel_values"].shm is None  # the original is untouched
    assert staged[0].data["pixel_values"].shm is not None
    assert staged[0].data["pixel_values"].data == b""
    assert staged[0].data["image_grid_thw"] is feature.data["image_grid_thw"]  # small: inline
    assert len(grid.tobytes()) < INLINE_MAX_BYTES <= pixels.nbytes
    request = EngineCoreRequest(request_id="r", prompt_token_ids=[1, 2, 3],
                                sampling_params=SamplingParams(), eos_token_ids=[0],
                                arrival_time=0.0, parent_request_id="r",
                                mm_features=staged)
    wire = msgspec.msgpack.encode(request)
    assert len(wire) < 1000  # the pixels are not in it
    received = msgspec.msgpack.decode(wire, type=EngineCoreRequest)
    with pytest.raises(RuntimeError, match="shared memory"):
        received.mm_features[0].data["pixel_values"].to_array()
    fetcher = FeatureFetcher(0)
    fetcher.fetch(received.mm_features)
    np.testing.assert_array_equal(received.mm_features[0].data["pixel_values"].to_array(), pixels)
    np.testing.assert_array_equal(received.mm_features[0].data["image_grid_thw"].to_array(), grid)
    fetcher.close()
    ring.close()
