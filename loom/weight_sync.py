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

The publisher copies each tensor into the segment once (a GPU tensor comes to host
memory on the way); the ranks copy from the mapped segment into their parameters.
CUDA IPC handles (device memory mapped by the ranks) are not built yet.
"""

from __future__ import annotations

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

    def __init__(self, directory: str | None = None) -> None:
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
        tensors = [(name, tensor.detach().to("cpu").contiguous()) for name, tensor in named_tensors]
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
        self.version += 1
        manifest = {"format": MANIFEST_FORMAT, "segment": self._shm.name, "size": size,
                    "version": self.version, "partial": partial, "tensors": layout}
        staging = self.manifest_path + ".tmp"
        with open(staging, "w") as f:
            json.dump(manifest, f)
        os.replace(staging, self.manifest_path)  # a reader never sees half a manifest
        return self.manifest_path

    def close(self) -> None:
        """Unlink the segment and remove the manifest (and the directory it made)."""
        self._unlink()
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


@contextmanager
def mapped_weights(manifest: dict) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The manifest's tensors as views of the trainer's segment, valid inside the block;
    nothing is copied. FileNotFoundError if the trainer has closed the segment."""
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
