"""Moving KV blocks' bytes: where a block lies in the cache, and the two transports.

A rank's cache is one tensor (loom/model/attention/kv_layout.py, per layer stacked):

    (num_layers, 2, num_kv_heads, num_blocks, block_size, head_dim)

so one block is not contiguous: it is ``num_layers * 2 * num_kv_heads`` pieces of
``block_size * head_dim`` elements, one per (layer, K/V, head). A run of consecutive
block ids is contiguous within each piece. Both transports walk the same order:

    for layer, kind, head:  for block in block_ids (in the order asked):  its piece

tcp: the sender hands the kernel those pieces straight from its cache (``sendmsg``
with up to IOV_MAX buffers a call) and the receiver reads into its newly allocated
blocks' pieces (``recvmsg_into``): no copy in user space on either side.

shm: the prefill rank's cache lives in a shared-memory segment; the decode rank maps
it and copies each run of blocks from it into its own cache: one copy in all, the
socket carries only the handshake.

A CUDA cache goes through a host staging tensor (gathered before sending, scattered
after receiving); that path is written but not yet run on a GPU.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import struct
import uuid
import weakref
from dataclasses import dataclass
from multiprocessing import shared_memory

import msgspec
import torch

_IOV_MAX = 1024  # Linux's limit on buffers per sendmsg / recvmsg_into call
_FRAME_HEADER = struct.Struct("!I")
_MAX_FRAME = 64 * 2**20
_SOCKET_BUFFER = 4 * 2**20


# The cache dtypes a KV layout's key tells apart (by index).
_DTYPE_CODES = ("float32", "bfloat16", "float16", "int8", "float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    block_size: int
    head_dim: int
    element_size: int
    dtype: int = 0  # _DTYPE_CODES: int8 and fp8 rows have the same bytes, not the same values

    @classmethod
    def of(cls, storage: torch.Tensor) -> KVLayout:
        num_layers, _, num_kv_heads, _, block_size, head_dim = storage.shape
        name = str(storage.dtype).removeprefix("torch.")
        code = _DTYPE_CODES.index(name) if name in _DTYPE_CODES else len(_DTYPE_CODES)
        return cls(num_layers, num_kv_heads, block_size, head_dim, storage.element_size(),
                   code)

    def key(self) -> list[int]:
        return [self.num_layers, self.num_kv_heads, self.block_size, self.head_dim,
                self.element_size, self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return (self.num_layers * 2 * self.num_kv_heads * self.block_size * self.head_dim
                * self.element_size)


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first id, length) of each run of consecutive ids, in order.

        [4, 5, 6, 9, 2, 3] -> [(4, 3), (9, 1), (2, 2)]
    """
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def block_buffers(storage: torch.Tensor, block_ids: list[int]) -> list[memoryview]:
    """The pieces of ``block_ids`` in the wire order, as writable views of ``storage``'s
    memory (a CPU tensor): one per (layer, kind, head, run of consecutive ids)."""
    assert storage.device.type == "cpu" and storage.is_contiguous()
    num_layers, _, num_kv_heads, num_blocks, block_size, head_dim = storage.shape
    # Through ctypes, not numpy: slicing a numpy-exported memoryview costs ~10x more, and
    # a scattered request has a piece per block per (layer, kind, head). The caller keeps
    # ``storage`` alive while the views are in use.
    nbytes = storage.numel() * storage.element_size()
    flat = memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")
    block_bytes = block_size * head_dim * storage.element_size()
    piece_stride = num_blocks * block_bytes  # from one (layer, kind, head) to the next
    runs = [(start * block_bytes, length * block_bytes) for start, length in block_runs(block_ids)]
    return [flat[base + offset:base + offset + size]
            for base in range(0, num_layers * 2 * num_kv_heads * piece_stride, piece_stride)
            for offset, size in runs]


def gather_to_host(storage: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """A device cache's blocks as a host tensor of the same layout, blocks 0..n-1."""
    index = torch.tensor(block_ids, device=storage.device)
    return storage.index_select(3, index).cpu().contiguous()


def send_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Send every buffer, in order, without copying them."""
    _Cursor(buffers).drain(sock.sendmsg, "sent")


def recv_into_buffers(sock: socket.socket, buffers: list[memoryview]) -> None:
    """Fill every buffer, in order, straight from the socket. ConnectionError if the
    peer closes first."""
    _Cursor(buffers).drain(lambda batch: sock.recvmsg_into(batch)[0], "received")


class _Cursor:
    """A position in a list of buffers, handed to scatter/gather calls IOV_MAX at a time."""

    def __init__(self, buffers: list[memoryview]) -> None:
        self.buffers = [b for b in buffers if len(b)]
        self.total = sum(len(b) for b in self.buffers)
        self.index = 0  # the first buffer not yet done
        self.head: memoryview | None = None  # what is left of it, if it was cut

    def drain(self, call, verb: str) -> None:
        done = 0
        while self.index < len(self.buffers):
            batch = self.buffers[self.index:self.index + _IOV_MAX]
            if self.head is not None:
                batch[0] = self.head
            count = call(batch)
            if count == 0:
                raise ConnectionError(f"the peer closed the connection after {done:,} of "
                                      f"{self.total:,} bytes were {verb}")
            done += count
            for buffer in batch:
                if count < len(buffer):
                    self.head = buffer[count:]
                    break
                count -= len(buffer)
                self.index += 1
                self.head = None


def copy_blocks(src: torch.Tensor, src_ids: list[int], dst: torch.Tensor,
                dst_ids: list[int]) -> None:
    """dst's blocks ``dst_ids`` = src's ``src_ids``, one strided copy per run that is
    consecutive on both sides."""
    index = 0
    while index < len(src_ids):
        length = 1
        while (index + length < len(src_ids)
               and src_ids[index + length] == src_ids[index] + length
               and dst_ids[index + length] == dst_ids[index] + length):
            length += 1
        s, d = src_ids[index], dst_ids[index]
        dst[:, :, :, d:d + length].copy_(src[:, :, :, s:s + length])
        index += length


# ----------------------------------------------------------------- framing


def tune_socket(sock: socket.socket) -> None:
    """No Nagle delay for the handshake; large kernel buffers for the blocks."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)


def send_frame(sock: socket.socket, message: msgspec.Struct) -> None:
    payload = msgspec.msgpack.encode(message)
    sock.sendall(_FRAME_HEADER.pack(len(payload)) + payload)


def recv_frame(sock: socket.socket, message_type: type):
    (length,) = _FRAME_HEADER.unpack(_recv_exact(sock, _FRAME_HEADER.size))
    if length > _MAX_FRAME:
        raise ConnectionError(f"a KV transfer frame of {length:,} bytes; the peer is not a "
                              "loom KV connector")
    return msgspec.msgpack.decode(_recv_exact(sock, length), type=message_type)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray(size)
    view = memoryview(data)
    received = 0
    while received < size:
        count = sock.recv_into(view[received:])
        if count == 0:
            raise ConnectionError("the peer closed the connection" + (
                f" after {received} of {size} bytes" if received else ""))
        received += count
    return bytes(data)


# ----------------------------------------------------------------- shared memory


class SharedKVSegment:
    """A KV cache in a named shared-memory segment (``loom-<owner pid>-kv-...``, so that
    loom.ipc.debris removes it if its owner is killed). The creator unlinks it when it
    is closed or collected; others attach by name, read-only by convention."""

    def __init__(self, shm: shared_memory.SharedMemory, tensor: torch.Tensor, owner: bool):
        self.name = shm.name
        self.tensor = tensor
        self._shm = shm
        self._finalizer = weakref.finalize(self, _release_segment, shm, owner)

    @classmethod
    def create(cls, shape: tuple[int, ...], dtype: torch.dtype, rank: int) -> SharedKVSegment:
        numel = 1
        for size in shape:
            numel *= size
        nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
        name = f"loom-{os.getpid()}-kv-{rank}-{uuid.uuid4().hex[:8]}"
        shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
        tensor = torch.frombuffer(shm.buf, dtype=dtype, count=numel).view(shape)
        return cls(shm, tensor, owner=True)

    @classmethod
    def attach(cls, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> SharedKVMapping:
        return SharedKVMapping(name, shape, dtype)

    def close(self) -> None:
        self.tensor = None
        self._finalizer()


class SharedKVMapping:
    """Another process's SharedKVSegment, mapped by name (straight from /dev/shm, so no
    resource tracker of this process ever unlinks it)."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        numel = 1
        for size in shape:
            numel *= size
        fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.name = name
        self.tensor = torch.frombuffer(self._mmap, dtype=dtype, count=numel).view(shape)

    def close(self) -> None:
        self.tensor = None
        try:
            self._mmap.close()
        except BufferError:  # a tensor still views it: the mapping goes with the process
            pass


def _release_segment(shm: shared_memory.SharedMemory, owner: bool) -> None:
    if owner:
        try:
            shm.unlink()
        except FileNotFoundError:
            pass
    try:
        shm.close()
    except BufferError:  # a tensor still views it: the mapping goes with the process
        pass
