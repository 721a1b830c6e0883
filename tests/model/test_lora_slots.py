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


# ---------------------------------------------------------------- the kernels' own paths
#
# loom's lora_add in one pass (shrink: per-row dots with A in float32; expand: per-column
# sums over the rank, a fused layer's parts reading their own rank rows only), on each
# instruction set the build has: bf16 and float32 weights, x and y of either dtype, sizes
# that leave tails (K not a multiple of 32, columns not of 16), rows scattered over several
# slots, an inactive slot and the base.

# a q|k|v-like layer: parts of 70, 30 and 30 columns, max rank 16 (R = 48), K = 200
K, PARTS, MAX_RANK = 200, [70, 30, 30], 16
MIXED = torch.tensor([3, -1, 0, 2, 3, 1, -1, 0, 3, 2, 0], dtype=torch.long)  # 2 inactive


@pytest.fixture
def ops():
    module = native_ops()
    if module is None:
        pytest.skip("loom's kernels are not built here")
    return module


@pytest.fixture(params=["generic", "avx512"])
def isa(request, ops):
    """Each instruction-set path of the build (``set_isa``; put back afterwards)."""
    if request.param not in ops.isas():
        pytest.skip("this CPU lacks AVX512_BF16: the build has the generic path only")
    previous = ops.set_isa(request.param)
    yield request.param
    ops.set_isa(previous)


def _fused_slots(dtype: torch.dtype) -> tuple[LoRASlots, dict]:
    """Slots 0, 1, 3 loaded (ranks 16, 5, 16: a rank below the slots' leaves zero rows),
    slot 2 left inactive; (slot, part) -> (A, B) as loaded."""
    torch.manual_seed(3)
    slots = LoRASlots(K, PARTS, max_loras=4, max_rank=MAX_RANK, dtype=dtype,
                      device=torch.device("cpu"))
    parts = {}
    for slot, rank in ((0, 16), (1, 5), (3, 16)):
        for part, size in enumerate(PARTS):
            a, b = torch.randn(rank, K) / K ** 0.5, torch.randn(size, rank) / rank ** 0.5
            slots.load(slot, part, a, b, scale=0.75)
            parts[slot, part] = (slots.a.dtype, a, b)
    return slots, parts


def _want(slots: LoRASlots, parts: dict, x: torch.Tensor, y: torch.Tensor,
          token_slots: torch.Tensor) -> torch.Tensor:
    """y + each row's adapter in float64, from A, B (scaled) and x as the slots hold them
    (x rounded to the weights' dtype, as torch's x.to(a.dtype))."""
    want = y.double().clone()
    for row, slot in enumerate(token_slots.tolist()):
        if (slot, 0) not in parts:
            continue
        xr = x[row].to(slots.a.dtype).double()
        delta = []
        for part in range(len(PARTS)):
            dtype, a, b = parts[slot, part]
            a64 = a.to(dtype).double()
            b64 = (b.float() * 0.75).to(dtype).double()
            delta.append(b64 @ (a64 @ xr))
        want[row] += torch.cat(delta)
    return want


@pytest.mark.parametrize("w_dtype,x_dtype,y_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16),  # a bf16 model's linears
    (torch.bfloat16, torch.bfloat16, torch.float32),   # a bf16 LM head's float logits
    (torch.bfloat16, torch.float32, torch.bfloat16),
    (torch.float32, torch.float32, torch.float32),     # a float32 model
    (torch.float32, torch.bfloat16, torch.float32),
])
def test_lora_add_kernel_adds_each_rows_adapter(ops, isa, w_dtype, x_dtype, y_dtype):
    slots, parts = _fused_slots(w_dtype)
    torch.manual_seed(4)
    x = torch.randn(len(MIXED), K).to(x_dtype)
    y = torch.randn(len(MIXED), sum(PARTS)).to(y_dtype)
    before = y.clone()
    ops.lora_add(y, x, slots.a, slots.b, MIXED, slots.active, PARTS)
    want = _want(slots, parts, x, before, MIXED)
    tolerance = 1e-5 if torch.bfloat16 not in (w_dtype, y_dtype) else 2e-2
    torch.testing.assert_close(y.double(), want, rtol=tolerance, atol=tolerance)
    untouched = (MIXED < 0) | (MIXED == 2)  # the base's rows, an inactive slot's
    assert torch.equal(y[untouched], before[untouched])
    # the parts' layout only skips zeros: the same bits as one part of every rank row
    dense = before.clone()
    ops.lora_add(dense, x, slots.a, slots.b, MIXED, slots.active, [])
    assert torch.equal(dense, y)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_add_rows_are_batch_invariant(ops, isa, dtype):
    """A row's bits are the same alone and anywhere in a batch of other rows and slots
    (the per-row sums' order depends on K, R and the parts only)."""
    slots, _ = _fused_slots(dtype)
    torch.manual_seed(5)
    x = torch.randn(len(MIXED), K).to(dtype)
    y = torch.randn(len(MIXED), sum(PARTS)).to(dtype)
    batched = y.clone()
    ops.lora_add(batched, x, slots.a, slots.b, MIXED, slots.active, PARTS)
    for row in range(len(MIXED)):
        alone = y[row:row + 1].clone()
        ops.lora_add(alone, x[row:row + 1], slots.a, slots.b, MIXED[row:row + 1],
                     slots.active, PARTS)
        assert torch.equal(alone[0], batched[row]), row
    # the same rows reversed, with copies of row 0 around them: bits unchanged
    order = torch.tensor([0] + list(range(len(MIXED) - 1, -1, -1)) + [0])
    shuffled = y[order].clone()
    ops.lora_add(shuffled, x[order], slots.a, slots.b, MIXED[order], slots.active, PARTS)
    assert torch.equal(shuffled, batched[order])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_lora_embedding_add_kernel(ops, isa, dtype):
    """The embedding's adapter: A's column of each row's token times B, row by row."""
    torch.manual_seed(6)
    slots = EmbeddingLoRASlots(50, 37, max_loras=4, max_rank=8, dtype=dtype,
                               device=torch.device("cpu"))
    pairs = {slot: (torch.randn(rank, 50), torch.randn(37, rank)) for slot, rank in
             ((0, 8), (1, 3), (3, 8))}
    for slot, (a, b) in pairs.items():
        slots.load(slot, a, b, scale=2.0)
    ids = torch.randint(0, 50, (len(MIXED),))
    y = torch.randn(len(MIXED), 37).to(dtype)
    batched = y.clone()
    ops.lora_embedding_add(batched, ids, slots.a_t, slots.b, MIXED, slots.active)
    want = y.double().clone()
    for row, slot in enumerate(MIXED.tolist()):
        if slot in pairs:
            a, b = pairs[slot]
            want[row] += ((2.0 * b.float()).to(dtype).double()
                          @ a[:, ids[row]].to(dtype).double())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batched.double(), want, rtol=tolerance, atol=tolerance)
    for row in range(len(MIXED)):
        alone = y[row:row + 1].clone()
        ops.lora_embedding_add(alone, ids[row:row + 1], slots.a_t, slots.b,
                               MIXED[row:row + 1], slots.active)
        assert torch.equal(alone[0], batched[row]), row


def test_lora_kernels_refuse_what_does_not_fit(ops):
    slots, _ = _fused_slots(torch.float32)
    x, y = torch.randn(2, K), torch.randn(2, sum(PARTS))
    with pytest.raises(RuntimeError, match="names slot 4 of 4"):
        ops.lora_add(y, x, slots.a, slots.b, torch.tensor([0, 4]), slots.active, PARTS)
    with pytest.raises(RuntimeError, match="part sizes sum to 120, not y's 130"):
        ops.lora_add(y, x, slots.a, slots.b, torch.tensor([0, 1]), slots.active, [70, 30, 20])
    with pytest.raises(RuntimeError, match="5 parts must share the rank 48 evenly"):
        ops.lora_add(y, x, slots.a, slots.b, torch.tensor([0, 1]), slots.active,
                     [30, 30, 30, 20, 20])
    with pytest.raises(RuntimeError, match="token_slot must be"):
        ops.lora_add(y, x, slots.a, slots.b, torch.tensor([0, 1], dtype=torch.int32),
                     slots.active, PARTS)
    table = EmbeddingLoRASlots(50, 37, max_loras=4, max_rank=8, dtype=torch.float32,
                               device=torch.device("cpu"))
    table.load(0, torch.randn(8, 50), torch.randn(37, 8), 1.0)
    with pytest.raises(RuntimeError, match="id 50 is outside the vocabulary of 50"):
        ops.lora_embedding_add(torch.randn(1, 37), torch.tensor([50]), table.a_t, table.b,
                               torch.tensor([0]), table.active)
