"""A minimal GGUF reader: metadata and memory-mapped tensor bytes, nothing else.

``gguf.GGUFReader`` builds one numpy view per array element, which for a model with a
50k-token vocabulary costs seconds; this reader walks the header with ``struct`` once
(tens of milliseconds) and maps the tensor data lazily.

Layout (little-endian, GGUF v2/v3)::

    | magic "GGUF" | version u32 | n_tensors u64 | n_kv u64 |
    | n_kv x (key str, type u32, value) | n_tensors x (name str, n_dims u32,
    | dims u64 x n_dims, ggml type u32, offset u64) | pad to alignment | tensor data |

A string is ``len u64`` + UTF-8 bytes; an array is ``elem type u32, count u64`` +
elements. Tensor dims are ggml order (innermost first); ``shape`` here is numpy
order (outermost first).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

# GGUF value type -> (struct format, numpy dtype); 8 = string, 9 = array
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"),
    4: ("<I", "<u4"), 5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "?"),
    10: ("<Q", "<u8"), 11: ("<q", "<i8"), 12: ("<d", "<f8"),
}
_STRING, _ARRAY = 8, 9
_DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    ggml_type: int  # a gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # numpy order: (rows, ..., elements per row)
    offset: int  # absolute byte offset of the data in the file
    num_bytes: int


class GGUFFile:
    """``metadata``: key -> int | float | bool | str | list[str] | np.ndarray;
    ``tensors``: name -> :class:`GGUFTensorInfo` in file order."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file_size = os.path.getsize(path)
        if self.file_size == 0:
            raise ValueError(f"{path} is empty (0 bytes); download the GGUF file again")
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self._parse()
        except struct.error:
            raise ValueError(f"{path} is truncated or corrupt: its header ends early "
                             f"({self.file_size} bytes); download the GGUF file again") from None
        except (UnicodeDecodeError, KeyError, OverflowError, MemoryError) as error:
            raise ValueError(f"{path} is corrupt: its header does not parse "
                             f"({type(error).__name__}); download the GGUF file again") from None
        expected = max((info.offset + info.num_bytes for info in self.tensors.values()),
                       default=self._pos)
        if expected > self.file_size:
            raise ValueError(f"{path} is truncated: its tensors need {expected} bytes but the "
                             f"file has {self.file_size}; download the GGUF file again")

    def _parse(self) -> None:
        path = self.path
        magic, version = self._unpack("<4sI")
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (magic {magic!r})")
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; loom reads versions 2 and 3 "
                             "(little-endian)")
        num_tensors, num_kv = self._unpack("<QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = self._string()
            (value_type,) = self._unpack("<I")
            self.metadata[key] = self._value(value_type)
        raw_infos = []
        for _ in range(num_tensors):
            name = self._string()
            (num_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{num_dims}Q")
            ggml_type, offset = self._unpack("<IQ")
            raw_infos.append((name, ggml_type, tuple(reversed(dims)), offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, ggml_type, shape, offset in raw_infos:
            try:
                num_bytes = _num_bytes(shape, ggml_type)
            except ValueError:  # a type id the installed gguf package does not know
                raise ValueError(
                    f"{self.path}: tensor {name} is GGML type {ggml_type}, which loom "
                    f"cannot read (retired or newer than the gguf package; type ids 31-33 "
                    f"were llama.cpp's old Q4_0_4_4/Q4_0_4_8/Q4_0_8_8 layouts): convert the "
                    f"file again with current llama.cpp (llama-quantize, e.g. to Q4_K_M)"
                ) from None
            self.tensors[name] = GGUFTensorInfo(name, ggml_type, shape, data_start + offset,
                                                num_bytes)

    def tensor_bytes(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's raw bytes, (rows, bytes per row) uint8, a read-only view of the
        mapped file (no copy)."""
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.num_bytes,
                             offset=info.offset)
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return data.reshape(rows, -1)

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop the tensor's pages from this process's resident set once its bytes have
        been copied (a read-only file mapping: a later read faults them in again from
        the page cache, so a view still held stays correct). Without it every page read
        stays resident until the file is unmapped: a 2 GB bf16 file on top of the 2 GB
        of weights copied out of it, at the peak of loading."""
        start = info.offset - info.offset % mmap.PAGESIZE
        end = min(self.file_size, info.offset + info.num_bytes)
        if end > start and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, start, end - start)

    # ---- header parsing ------------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._pos)
        start = self._pos + 8
        self._pos = start + length
        if self._pos > len(self._map):
            raise struct.error("string past the end of the file")
        return self._map[start:self._pos].decode("utf-8", errors="replace")

    def _value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            elem_type, count = self._unpack("<IQ")
            if elem_type == _STRING:
                return [self._string() for _ in range(count)]
            if elem_type == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_SCALARS[elem_type][1])
            if self._pos + count * dtype.itemsize > len(self._map):
                raise struct.error("array past the end of the file")
            array = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
            self._pos += count * dtype.itemsize
            return array
        if value_type not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        return self._unpack(_SCALARS[value_type][0])[0]


def _num_bytes(shape: tuple[int, ...], ggml_type: int) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    num_elements = int(np.prod(shape)) if shape else 1
    return num_elements // block_size * type_size
