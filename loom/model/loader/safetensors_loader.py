"""Stream tensors from a Hugging Face checkpoint directory of ``*.safetensors``.

Each tensor is read from the file into its own new tensor (``readinto``), not through a
memory map: a mapped checkpoint's pages count in the process's resident memory until
the file is closed, so loading a 2.8 GB MoE held the whole file beside the weights it
had filled (benchmarks/moe_speed.md: peak RSS 5.5 GB for 2.8 GB of weights). The file's
pages stay in the page cache, shared and reclaimable, as a map's would."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def safetensors_weights_iterator(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` one tensor at a time, on CPU, in checkpoint dtype."""
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        if glob.glob(os.path.join(model_dir, "*.bin")) or glob.glob(os.path.join(model_dir, "*.pt")):
            raise ValueError(f"{model_dir} holds only PyTorch pickle weights (*.bin / *.pt); "
                             "loom loads safetensors only (no pickle). Convert with "
                             "model.save_pretrained(dir, safe_serialization=True)")
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    for path in files:
        yield from read_safetensors(path)


def read_safetensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one ``.safetensors`` file, in name order (as ``safe_open``'s keys):
    an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data
    offsets from the end of the header), then the data. The header is checked against
    the file's size before any tensor is read."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        header_len = int.from_bytes(f.read(8), "little")
        if size < 8 or header_len > size - 8:
            raise ValueError(f"{path} is not a safetensors file (truncated or corrupt header)")
        header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        base = 8 + header_len
        for name, info in header.items():
            if info["dtype"] not in _DTYPES:
                raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which "
                                 "loom does not read")
            start, end = info["data_offsets"]
            if base + end > size:
                raise ValueError(f"{path} is truncated: tensor {name} needs bytes up to "
                                 f"{base + end}, the file has {size}")
        for name in sorted(header):
            info = header[name]
            start, end = info["data_offsets"]
            tensor = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes != end - start:
                raise ValueError(f"{path}: tensor {name} of shape {info['shape']} "
                                 f"{info['dtype']} has {end - start} bytes of data")
            if nbytes:
                f.seek(base + start)
                view = memoryview(tensor.view(-1).view(torch.uint8).numpy())
                done = 0
                while done < nbytes:  # one read(2) returns at most ~2 GB
                    got = f.readinto(view[done:])
                    if not got:
                        raise ValueError(f"{path}: tensor {name} ends early")
                    done += got
            yield name, tensor
