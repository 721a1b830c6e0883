"""Publishing a trainer's weights to a running engine (the seed's ``--load-strategy``).

Two strategies, as the seed's ``dynamic_load_weight`` has them:

    ipc_snapshot  the trainer writes a safetensors snapshot directory (``save_snapshot``);
                  the engine reloads from it: ``update_weights(path=DIR)``
    ipc           the trainer puts its tensors in one shared-memory segment and writes a
                  small manifest beside it (``WeightPublisher.publish``); every rank maps
                  the segment and loads its shard straight out of it, no tensor crosses a
                  socket: ``update_weights(path=MANIFEST)``

    publisher = WeightPublisher()                     # in the trainer's process
    manifest = publisher.publish(model.state_dict().items())
    llm.update_weights(path=manifest)   # or POST /update_weights {"path": manifest}
    ...                                 # next round: publish() rewrites the same segment
    publisher.close()                   # unlinks the segment, removes the manifest

A manifest (JSON) names the segment and, for each tensor, its checkpoint name, dtype,
shape and byte offset. Names are the checkpoint's (Hugging Face) names; each rank's
``weight_loader`` takes its own shard, so one publication serves every TP rank.

The publisher copies each tensor into the segment once; the ranks copy from the mapped
segment into their parameters.

GPU tensors (``WeightPublisher(device_ipc=True)``, the default when every tensor is on
a CUDA device) do not go through host memory: the manifest carries one CUDA IPC handle
per tensor instead of a segment, and each rank opens the handles (on the GPU that holds
the tensor, found by its UUID) and copies device to device into its parameters. The
publisher keeps the published tensors alive until the next ``publish`` or ``close``. A
handle is plain data in the JSON (``rebuild_cuda_tensor``'s arguments: the IPC handle
bytes, sizes, strides, offsets); nothing is unpickled. This path has not run on a GPU
here yet.
"""

from __future__ import annotations

import base64
import json
import mmap
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing import shared_memory

import _posixshmem

import torch

MANIFEST_FORMAT = "loom-ipc-weights/1"
MANIFEST_NAME = "loom_ipc_manifest.json"
_ALIGN = 64  # byte alignment of each tensor in the segment


class WeightPublisher:
    """The trainer's end of the ``ipc`` strategy: one shared-memory segment, reused (and
    grown if needed) by every ``publish``; ``close`` unlinks it."""

    def __init__(self, directory: str | None = None, device_ipc: bool | None = None) -> None:
        """``device_ipc``: CUDA tensors published as CUDA IPC handles (None: when every
        tensor of a publication is on a CUDA device; False: always through host memory)."""
        self.device_ipc = device_ipc
        self._held: list[torch.Tensor] = []  # what the CUDA IPC handles point to
        self._own_directory = directory is None
        self.directory = directory or tempfile.mkdtemp(prefix=f"loom-weights-{os.getpid()}-")
        os.makedirs(self.directory, exist_ok=True)
        self.manifest_path = os.path.join(self.directory, MANIFEST_NAME)
        self._shm: shared_memory.SharedMemory | None = None
        self.version = 0

    def publish(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
                partial: bool = False) -> str:
        """Copy the tensors into the segment and write the manifest; returns its path.
        ``partial``: a subset of the weights (else an update needs every one)."""
        named_tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        on_cuda = bool(named_tensors) and all(t.is_cuda for _, t in named_tensors)
        if self.device_ipc and not on_cuda:
            raise ValueError("WeightPublisher(device_ipc=True) publishes CUDA tensors only; "
                             "move them to the GPU or publish with device_ipc=False")
        if on_cuda and self.device_ipc is not False:
            return self._write_manifest({"transport": "cuda_ipc", "partial": partial,
                                         "tensors": self._cuda_handles(named_tensors)})
        tensors = [(name, tensor.to("cpu").contiguous()) for name, tensor in named_tensors]
        layout, offset = [], 0
        for name, tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            layout.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                           "shape": list(tensor.shape), "offset": offset})
            offset += -(-nbytes // _ALIGN) * _ALIGN
        size = max(offset, 1)
        if self._shm is None or self._shm.size < size:
            self._unlink()
            self._shm = shared_memory.SharedMemory(
                name=f"loom-weights-{os.getpid()}-{uuid.uuid4().hex[:8]}", create=True, size=size)
        for (_, tensor), entry in zip(tensors, layout):
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes:
                target = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes,
                                          offset=entry["offset"])
                target.copy_(tensor.reshape(-1).view(torch.uint8))
                del target
        self._held = []
        return self._write_manifest({"transport": "shm", "segment": self._shm.name,
                                     "size": size, "partial": partial, "tensors": layout})

    def _cuda_handles(self, named_tensors: list[tuple[str, torch.Tensor]]) -> list[dict]:
        from torch.multiprocessing.reductions import reduce_tensor

        held, entries = [], []
        for name, tensor in named_tensors:
            tensor = tensor.contiguous()
            held.append(tensor)
            _, args = reduce_tensor(tensor)
            entries.append({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                            "shape": list(tensor.shape),
                            "device_uuid": str(torch.cuda.get_device_properties(
                                tensor.device).uuid),
                            "cuda_ipc": encode_cuda_ipc_args(args)})
        self._held = held  # the previous publication's tensors may go once this one is out
        return entries

    def _write_manifest(self, manifest: dict) -> str:
        self.version += 1
        manifest = {"format": MANIFEST_FORMAT, "version": self.version, **manifest}
        staging = self.manifest_path + ".tmp"
        with open(staging, "w") as f:
            json.dump(manifest, f)
        os.replace(staging, self.manifest_path)  # a reader never sees half a manifest
        return self.manifest_path

    def close(self) -> None:
        """Unlink the segment and remove the manifest (and the directory it made)."""
        self._unlink()
        self._held = []
        if self._own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
        elif os.path.exists(self.manifest_path):
            os.remove(self.manifest_path)

    def _unlink(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm.unlink()
            self._shm = None

    def __enter__(self) -> WeightPublisher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def save_snapshot(named_tensors: Iterable[tuple[str, torch.Tensor]], directory: str) -> str:
    """The ``ipc_snapshot`` strategy's trainer side: write the tensors as
    ``DIR/model.safetensors`` (replacing it whole, so a reader never sees half a file);
    returns DIR, the path to give ``update_weights``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    staging = os.path.join(directory, ".model.safetensors.tmp")
    save_file(tensors, staging)
    os.replace(staging, os.path.join(directory, "model.safetensors"))
    return directory


# ----------------------------------------------------------------- the engine's side


def _opened_cuda_handles(manifest: dict) -> list[tuple[str, torch.Tensor]]:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise ValueError("the weights were published as CUDA IPC handles but this rank has "
                         "no CUDA device; publish with WeightPublisher(device_ipc=False)")
    devices = {str(torch.cuda.get_device_properties(i).uuid): i
               for i in range(torch.cuda.device_count())}
    views = []
    for entry in manifest["tensors"]:
        device = devices.get(entry["device_uuid"])
        if device is None:
            raise ValueError(f"tensor {entry['name']!r} lives on GPU {entry['device_uuid']}, "
                             "which this rank cannot see (CUDA_VISIBLE_DEVICES); publish "
                             "with WeightPublisher(device_ipc=False)")
        views.append((entry["name"],
                      rebuild_cuda_tensor(*decode_cuda_ipc_args(entry["cuda_ipc"], device))))
    return views



def read_manifest(path: str) -> dict | None:
    """The manifest at ``path`` (a file or a directory holding one), or None if ``path``
    is not a loom ipc manifest."""
    if os.path.isdir(path):
        path = os.path.join(path, MANIFEST_NAME)
    if not os.path.isfile(path) or path.endswith((".gguf", ".safetensors")):
        return None
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return manifest if isinstance(manifest, dict) and \
        manifest.get("format") == MANIFEST_FORMAT else None


# rebuild_cuda_tensor's arguments (torch.multiprocessing.reductions), by position, as JSON
_IPC_ARGS = ("tensor_cls", "size", "stride", "offset", "storage_cls", "dtype", "device",
             "handle", "storage_size_bytes", "storage_offset_bytes", "requires_grad",
             "ref_counter_handle", "ref_counter_offset", "event_handle", "event_sync_required")
_IPC_BYTES = ("handle", "ref_counter_handle", "event_handle")


def encode_cuda_ipc_args(args: tuple) -> dict:
    """``reduce_tensor``'s arguments for one CUDA tensor as plain JSON data."""
    if len(args) != len(_IPC_ARGS):
        raise RuntimeError(f"this torch's CUDA IPC takes {len(args)} arguments, loom knows "
                           f"{len(_IPC_ARGS)}")
    encoded = {}
    for key, value in zip(_IPC_ARGS, args):
        if key in ("tensor_cls", "storage_cls"):
            continue  # always torch.Tensor and torch.UntypedStorage when rebuilt
        if key in _IPC_BYTES:
            value = None if value is None else base64.b64encode(value).decode()
        elif key == "dtype":
            value = str(value).removeprefix("torch.")
        elif key in ("size", "stride"):
            value = list(value)
        encoded[key] = value
    return encoded


def decode_cuda_ipc_args(encoded: dict, device: int) -> tuple:
    """``rebuild_cuda_tensor``'s arguments from ``encode_cuda_ipc_args``'s data, opened on
    this process's CUDA device index ``device`` (the publisher's index may differ)."""
    args = []
    for key in _IPC_ARGS:
        if key == "tensor_cls":
            value = torch.Tensor
        elif key == "storage_cls":
            value = torch.UntypedStorage
        elif key == "device":
            value = device
        elif key in _IPC_BYTES:
            value = None if encoded[key] is None else base64.b64decode(encoded[key])
        elif key == "dtype":
            value = getattr(torch, encoded[key])
            if not isinstance(value, torch.dtype):
                raise ValueError(f"unknown dtype {encoded[key]!r} in a CUDA IPC handle")
        elif key == "size":
            value = torch.Size(encoded[key])
        elif key == "stride":
            value = tuple(encoded[key])
        else:
            value = encoded[key]
        args.append(value)
    return tuple(args)


@contextmanager
def mapped_weights(manifest: dict) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The manifest's tensors as views of the trainer's segment (or, for CUDA IPC
    handles, of its GPU memory), valid inside the block; nothing is copied.
    FileNotFoundError if the trainer has closed the segment."""
    if manifest.get("transport") == "cuda_ipc":
        views = _opened_cuda_handles(manifest)
        try:
            yield views
            torch.cuda.synchronize()  # the copies are done before the trainer may write again
        finally:
            views.clear()
        return
    # Mapped directly, not through SharedMemory: attaching one registers it with this
    # process's resource tracker (before Python 3.13), which would unlink the trainer's
    # segment when the engine exits, or, shared with the publisher's, unregister it twice.
    try:
        fd = _posixshmem.shm_open("/" + manifest["segment"].lstrip("/"), os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise FileNotFoundError(f"the weights' shared-memory segment {manifest['segment']!r} "
                                "is gone; did the trainer close its WeightPublisher?") from None
    try:
        buffer = mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)
    views: list[tuple[str, torch.Tensor]] = []
    try:
        for entry in manifest["tensors"]:
            dtype = getattr(torch, entry["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"tensor {entry['name']!r} has unknown dtype {entry['dtype']!r}")
            count = 1
            for dim in entry["shape"]:
                count *= dim
            view = (torch.frombuffer(buffer, dtype=dtype, count=count, offset=entry["offset"])
                    if count else torch.empty(0, dtype=dtype))
            views.append((entry["name"], view.view(entry["shape"])))
        yield views
    finally:
        views.clear()
        try:
            buffer.close()
        except BufferError:  # a view outlived the block; the mapping goes with it
            pass
