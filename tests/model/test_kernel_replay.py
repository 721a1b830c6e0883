"""The native CPU path knows kernels, not models (loom/model/kernel_replay.py): a layer
nobody taught it, written with loom's kernels, is recorded and replayed from C++ as it
is, bit for bit with its eager forward; a layer that calls an op with no native kernel
is refused, once, by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.kernels import native_ops
from loom.model import kernel_replay
from loom.model.kernel_replay import KernelReplay

HIDDEN, INNER = 64, 96


@pytest.fixture
def ops(monkeypatch):
    ops = native_ops()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("no native bf16 kernels on this CPU")
    monkeypatch.setattr(kernel_replay, "RECORD_AFTER", 0)
    return ops


class ToyGatedBlock(nn.Module):
    """A residual block of no family: norm, a gated MLP on loom's kernels, a float32
    residual add, then its own second norm. ``activation`` is what sits between the
    two matmuls."""

    def __init__(self, ops, activation=None) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ops = ops
        self.norm = nn.Parameter(torch.rand(HIDDEN, generator=gen).bfloat16() + 0.5)
        up = torch.randn(2 * INNER, HIDDEN, generator=gen).bfloat16() / 8
        down = torch.randn(HIDDEN, INNER, generator=gen).bfloat16() / 8
        self.up = nn.Parameter(ops.pack_bf16_weight(up), requires_grad=False)
        self.down = nn.Parameter(ops.pack_bf16_weight(down), requires_grad=False)
        self.activation = activation or ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        normed = self.ops.rms_norm(x, self.norm, 1e-6)
        gate_up = torch.empty(tokens, 2 * INNER, dtype=x.dtype)
        self.ops.bf16_linear(gate_up, normed, self.up)
        act = self.activation(gate_up)
        down = torch.empty(tokens, HIDDEN, dtype=torch.float32)
        self.ops.bf16_linear(down, act, self.down, bias=None)
        residual = x.float() + down  # an ATen add into a planned buffer
        out = torch.empty_like(x)
        self.ops.add_rms_norm(out, down[:, :HIDDEN], residual, self.norm, 1e-6)
        return out[:, : HIDDEN // 2], residual


def test_a_toy_layer_of_native_ops_replays_with_no_cpp_change(ops):
    model = ToyGatedBlock(ops)
    replay = KernelReplay(model.forward, model)
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for tokens in (3, 3, 5, 3, 5):  # the first of each shape recorded, then replayed
            x = torch.randn(tokens, HIDDEN, generator=gen).bfloat16()
            got = replay(x)
            want = model.forward(x)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert replay.refusal is None
    assert (replay.stats.recorded, replay.stats.replayed) == (2, 3)
    # one step per kernel call and ATen op: the views of planned buffers are made once
    assert replay.stats.steps[3] == 7


def test_an_op_without_a_native_kernel_is_refused_by_name(ops, caplog):
    def tanh_and_mul(x):
        gate, up = x.chunk(2, dim=-1)
        return torch.tanh(gate) * up

    model = ToyGatedBlock(ops, activation=tanh_and_mul)
    replay = KernelReplay(model.forward, model)
    x = torch.randn(3, HIDDEN).bfloat16()
    with torch.inference_mode(), caplog.at_level("INFO", logger="loom.model.kernel_replay"):
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(replay(x), model.forward(x)))
    assert replay.refusal == "the forward called torch.tanh, which has no native kernel"
    assert [r.getMessage() for r in caplog.records] == [
        f"forward: PyTorch modules, as {replay.refusal}"]
    assert replay.stats.replayed == 0
    replay.clear()  # new weights or caches: tried again
    assert replay.refusal is None


def test_a_tensor_from_outside_the_forward_is_refused(ops):
    """A per-step tensor the forward did not get as an input would be baked into the
    recording as a constant: refused, not replayed stale."""
    stale = torch.ones(HIDDEN, dtype=torch.bfloat16)

    class Outside(nn.Module):
        def forward(self, x):
            return ops.rms_norm(x, stale, 1e-6)

    model = Outside()
    replay = KernelReplay(model.forward, model)
    with torch.inference_mode():
        replay(torch.randn(2, HIDDEN).bfloat16())
    assert replay.refusal.startswith("kernel rms_norm took a (64,) torch.bfloat16 tensor "
                                     "made outside the forward")


def test_reading_a_value_into_python_is_refused(ops):
    class Branchy(nn.Module):
        def forward(self, x):
            return ops.silu_and_mul(x) if float(x[0, 0]) > 0 else x

    model = Branchy()
    replay = KernelReplay(model.forward, model)
    with torch.inference_mode():
        replay(torch.ones(2, HIDDEN).bfloat16())
    assert replay.refusal is not None
    assert "read a tensor's value into Python" in replay.refusal
