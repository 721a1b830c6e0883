"""The trainer's end of the ipc strategy (loom/weight_sync.py), in units: the CUDA IPC
manifest's handle encoding and the errors a CPU-only rank or publisher gives. Updates
through shared memory run end to end in tests/e2e/test_weight_updates.py; the CUDA IPC
path itself needs a GPU (benchmarks/cuda_check.py)."""

import inspect
import json

import pytest
import torch

from loom.weight_sync import (WeightPublisher, decode_cuda_ipc_args, encode_cuda_ipc_args,
                              mapped_weights, read_manifest)


def test_the_encoding_follows_this_torchs_rebuild_cuda_tensor():
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    from loom.weight_sync import _IPC_ARGS

    assert len(inspect.signature(rebuild_cuda_tensor).parameters) == len(_IPC_ARGS)


def test_cuda_ipc_arguments_round_trip_through_json_on_another_device_index():
    args = (torch.Tensor, torch.Size([4, 3]), (3, 1), 2, torch.UntypedStorage, torch.bfloat16,
            0, b"\x01\x02handle\xff", 4096, 512, False, b"/torch_123_ref", 7,
            b"\x00event", True)
    encoded = json.loads(json.dumps(encode_cuda_ipc_args(args)))
    decoded = decode_cuda_ipc_args(encoded, device=3)
    assert decoded[:6] == args[:6] and decoded[6] == 3 and decoded[7:] == args[7:]
    with pytest.raises(RuntimeError, match="arguments"):
        encode_cuda_ipc_args(args[:-1])


def test_device_ipc_publishes_cuda_tensors_only():
    with WeightPublisher(device_ipc=True) as publisher:
        with pytest.raises(ValueError, match="device_ipc=False"):
            publisher.publish([("w", torch.zeros(2))])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rank here has a CUDA device")
def test_a_cpu_rank_refuses_cuda_handles_naming_the_fix(tmp_path):
    path = tmp_path / "loom_ipc_manifest.json"
    path.write_text(json.dumps({
        "format": "loom-ipc-weights/1", "version": 1, "transport": "cuda_ipc",
        "partial": False, "tensors": [{"name": "w", "dtype": "float32", "shape": [2],
                                       "device_uuid": "GPU-0", "cuda_ipc": {}}]}))
    manifest = read_manifest(str(tmp_path))
    assert manifest is not None
    with pytest.raises(ValueError, match=r"no CUDA device.*device_ipc=False"):
        with mapped_weights(manifest):
            pass


def test_host_publication_is_read_back_exactly():
    weights = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)),
               ("b", torch.tensor([1.5, -2.0], dtype=torch.bfloat16))]
    with WeightPublisher() as publisher:
        manifest = read_manifest(publisher.publish(weights))
        assert manifest["transport"] == "shm"
        with mapped_weights(manifest) as views:
            assert [name for name, _ in views] == ["a", "b"]
            for (_, got), (_, want) in zip(views, weights):
                assert got.dtype == want.dtype and torch.equal(got, want)
