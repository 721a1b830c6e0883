"""loom's safetensors reader (loader/safetensors_loader.py) against the safetensors
library's own: the same names, dtypes, shapes and bytes; a truncated file is refused
before any tensor is read."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from loom.model.loader.safetensors_loader import read_safetensors


def test_reads_what_safe_open_reads(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b.weight": torch.randn(7, 5, generator=gen).bfloat16(),
        "a.bias": torch.randn(3, generator=gen),
        "c.half": torch.randn(2, 3, 4, generator=gen).half(),
        "d.ids": torch.arange(11, dtype=torch.int64),
        "e.mask": torch.tensor([True, False, True]),
        "f.scalar": torch.tensor(2.5),
        "g.empty": torch.empty(0, 4),
        "h.bytes": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=gen),
    }
    path = str(tmp_path / "model.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    with safe_open(path, framework="pt", device="cpu") as f:
        expected = [(name, f.get_tensor(name)) for name in f.keys()]
    got = list(read_safetensors(path))
    assert [name for name, _ in got] == [name for name, _ in expected]
    for (_, ours), (_, theirs) in zip(got, expected):
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
        assert torch.equal(ours, theirs)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(open(path, "rb").read()[:-10])
    with pytest.raises(ValueError, match="truncated"):
        next(read_safetensors(str(cut)))
