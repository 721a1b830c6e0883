"""LoRA slots (loom/model/layers/lora.py): loom's lora_add and lora_embedding_add kernels
and the PyTorch path beside them (CUDA's) add each row's adapter, as the product written
out, for rows of the base, of an adapter not targeting the layer, and of adapters whose
rows are consecutive or scattered."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from loom.kernels import native_ops
from loom.model.attention.metadata import set_forward_context
from loom.model.layers import lora as lora_layers
from loom.model.layers.lora import EmbeddingLoRASlots, LoRASlots

# slot per row: 0 scattered, 1 consecutive, 2 loaded but not active here, -1 the base
SLOTS = torch.tensor([0, -1, 1, 1, 1, 0, 2, -1, 0], dtype=torch.long)


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "kernel" and native_ops() is None:
        pytest.skip("loom's kernels are not built here")
    if request.param == "torch":
        monkeypatch.setattr(lora_layers, "native_ops_for", lambda device, dtype: None)
    return request.param


def test_linear_slots_add_each_rows_adapter(path):
    torch.manual_seed(0)
    slots = LoRASlots(8, [6, 4], max_loras=3, max_rank=4, dtype=torch.float32,
                      device=torch.device("cpu"))
    parts = {}
    for slot, rank in ((0, 4), (1, 2)):
        for part, size in enumerate((6, 4)):
            a, b = torch.randn(rank, 8), torch.randn(size, rank)
            slots.load(slot, part, a, b, scale=0.5)
            parts[slot, part] = (a, b)
    x, y = torch.randn(len(SLOTS), 8), torch.randn(len(SLOTS), 10)
    want = y.clone()
    for row, slot in enumerate(SLOTS.tolist()):
        if slot in (0, 1):
            want[row] += torch.cat([0.5 * b @ (a @ x[row])
                                    for a, b in (parts[slot, 0], parts[slot, 1])])
    with set_forward_context(SimpleNamespace(lora_slots=SLOTS)):
        slots.add(x, y)
    torch.testing.assert_close(y, want)


def test_embedding_slots_add_each_rows_adapter(path):
    torch.manual_seed(0)
    slots = EmbeddingLoRASlots(32, 8, max_loras=3, max_rank=4, dtype=torch.float32,
                               device=torch.device("cpu"))
    pairs = {slot: (torch.randn(rank, 32), torch.randn(8, rank))
             for slot, rank in ((0, 4), (1, 3))}
    for slot, (a, b) in pairs.items():
        slots.load(slot, a, b, scale=2.0)
    ids = torch.randint(0, 32, (len(SLOTS),))
    y = torch.randn(len(SLOTS), 8)
    want = y.clone()
    for row, slot in enumerate(SLOTS.tolist()):
        if slot in pairs:
            a, b = pairs[slot]
            want[row] += 2.0 * b @ a[:, ids[row]]
    with set_forward_context(SimpleNamespace(lora_slots=SLOTS)):
        slots.add(ids, y)
    torch.testing.assert_close(y, want)
