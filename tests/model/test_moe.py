"""The mixture-of-experts layer (layers/fused_moe.py): routing as each family defines
it, the grouped expert path against a loop over experts, tensor parallel and expert
parallel against one rank, with a router biased toward a few experts."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from loom.distributed.parallel_state import NO_EP, EPGroup, TPGroup, expert_parallel_group
from loom.kernels import native_ops
from loom.model.layers.fused_moe import (FusedMoE, MoESpec, fused_experts, loop_over_experts,
                                         select_experts)
from loom.model.loader import load_hf_config, load_model

from .checkpoints import FAVOURED, MOE_FAMILIES, bias_router, make_tiny_checkpoint
from .test_models import run_scenario


def _random_routing(num_tokens: int, num_experts: int, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return select_experts(logits, MoESpec(num_experts, top_k, 8), None)


@pytest.mark.parametrize("num_tokens", [1, 7, 64])
def test_grouped_experts_equal_the_loop_over_experts(num_tokens):
    torch.manual_seed(0)
    num_experts, top_k, hidden, inter = 8, 3, 32, 24
    x = torch.randn(num_tokens, hidden)
    w13 = torch.randn(num_experts, 2 * inter, hidden) * 0.1
    w2 = torch.randn(num_experts, hidden, inter) * 0.1
    weights, ids = _random_routing(num_tokens, num_experts, top_k)
    expected = loop_over_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_experts(x, w13, w2, weights, ids), expected,
                               atol=1e-6, rtol=1e-5)
    # a rank holding experts 4..7 gives exactly their part; the two halves sum to all
    half = [fused_experts(x, w13[s:s + 4], w2[s:s + 4], weights, ids, expert_start=s)
            for s in (0, 4)]
    torch.testing.assert_close(half[0] + half[1], expected, atol=1e-6, rtol=1e-5)
    direct = torch.stack([
        sum(weights[t, k] * loop_over_experts(x[t:t + 1], w13[ids[t, k]:ids[t, k] + 1],
                                              w2[ids[t, k]:ids[t, k] + 1],
                                              torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.long))[0]
            for k in range(top_k))
        for t in range(num_tokens)])
    torch.testing.assert_close(expected, direct, atol=1e-6, rtol=1e-5)


def test_packed_bf16_experts_equal_the_loop():
    """bf16 on the CPU: each expert's matrices packed for loom's bf16 matmul give the
    loop over experts (plain F.linear) within bf16 rounding."""
    torch.manual_seed(0)
    layer = FusedMoE(MoESpec(8, 2, 64), hidden_size=64).to(torch.bfloat16)
    for param in (layer.gate.weight, layer.w13_weight, layer.w2_weight):
        param.data.normal_(0, 0.1)
    layer.process_weights_after_loading()
    x = torch.randn(9, 64).to(torch.bfloat16)
    with torch.inference_mode():
        grouped = layer(x)
        layer.use_grouped = False
        looped = layer(x)
    torch.testing.assert_close(grouped.float(), looped.float(), atol=2e-2, rtol=2e-2)


def test_bf16_experts_are_held_as_panels_and_reload_in_part():
    """bf16 with loom's kernel: once loaded, the experts' one copy is the packed panels
    (the parameters hold as many values as the plain weights; each expert's packed
    weight is a view of its slice). Loading one expert's gate again unpacks w13 only,
    keeps every other expert, and packs again: the layer then equals a fresh one loaded
    with the same weights, bit for bit; release_weight (a sleep) drops every view."""
    ops = native_ops()
    if ops is None or not ops.bf16_gemm_available():
        pytest.skip("no AVX512-BF16 kernels here")
    experts, hidden, inter = 4, 128, 64
    gen = torch.Generator().manual_seed(4)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.1).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 0.1).bfloat16()
    gate = torch.randn(experts, hidden, generator=gen).bfloat16()

    def loaded(w13, w2):
        layer = FusedMoE(MoESpec(experts, 2, inter), hidden_size=hidden).to(torch.bfloat16)
        layer.gate.weight.data.copy_(gate)
        for e in range(experts):
            layer.load_expert(w13[e, :inter], e, "gate")
            layer.load_expert(w13[e, inter:], e, "up")
            layer.load_expert(w2[e], e, "down")
        layer.process_weights_after_loading()
        return layer

    layer = loaded(w13, w2)
    assert layer.w13_weight.dim() == 5 and layer.w2_weight.dim() == 5
    assert sum(p.numel() for p in layer.parameters()) == gate.numel() + w13.numel() + w2.numel()
    assert torch.equal(layer.plain_weight("w13_weight"), w13)
    assert torch.equal(layer.plain_weight("w2_weight"), w2)
    assert all(a.packed.data.data_ptr() == layer.w13_weight[e].data_ptr()
               and b.packed.data.data_ptr() == layer.w2_weight[e].data_ptr()
               for e, (a, b) in enumerate(layer.expert_forms))
    new_gate = (torch.randn(inter, hidden, generator=gen) * 0.1).bfloat16()
    w2_panels = layer.w2_weight
    layer.load_expert(new_gate, 2, "gate")
    assert layer.w13_weight.shape == w13.shape and layer.w2_weight is w2_panels
    layer.process_weights_after_loading()
    updated = w13.clone()
    updated[2, :inter] = new_gate
    fresh = loaded(updated, w2)
    x = torch.randn(6, hidden, generator=gen).bfloat16()
    with torch.inference_mode():
        for rows in (1, 6):
            assert torch.equal(layer(x[:rows]), fresh(x[:rows]))
    layer.release_weight()
    assert layer.expert_forms is None


@pytest.mark.parametrize("quantization", ["none", "wint8"])
def test_module_path_runs_the_stack_s_kernel_with_pytorch_s_values(quantization):
    """bf16 on the CPU with loom's kernels: FusedMoE.forward runs the native
    mixture_of_experts kernel, loom's one implementation of the routed
    experts; it gives the PyTorch path's values (fused_experts) bit for bit, at one
    token and at several, and counts the same tokens per expert."""
    ops = native_ops()
    if ops is None or (quantization == "none" and not ops.bf16_gemm_available()) \
            or not ops.quant_gemm_available():
        pytest.skip("no native kernels for these experts here")
    experts, hidden, inter = 8, 64, 32
    gen = torch.Generator().manual_seed(7)
    torch.set_default_dtype(torch.bfloat16)
    try:
        layer = FusedMoE(MoESpec(experts, 2, inter), hidden_size=hidden,
                         quantization=quantization)
    finally:
        torch.set_default_dtype(torch.float32)
    layer.gate.weight.data.copy_(torch.randn(experts, hidden, generator=gen))
    for e in range(experts):
        for which, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                             ("down", (hidden, inter))):
            layer.load_expert((torch.randn(*shape, generator=gen) * 0.1).bfloat16(), e, which)
    layer.process_weights_after_loading()
    assert not isinstance(layer.native_experts(ops), str)
    for rows in (1, 9):
        x = torch.randn(rows, hidden, generator=gen).bfloat16()
        with torch.inference_mode():
            before = layer.tokens_per_expert.clone()
            native = layer(x)
            native_counts = layer.tokens_per_expert - before
            before = layer.tokens_per_expert.clone()
            reference = layer._forward_modules(x)
            reference_counts = layer.tokens_per_expert - before
        assert torch.equal(native, reference), rows
        assert torch.equal(native_counts, reference_counts) and native_counts.sum() == 2 * rows


def test_routing_rules():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    # softmax, top-2, not renormalized (Qwen3-MoE without norm_topk_prob)
    weights, ids = select_experts(logits, MoESpec(4, 2, 8, renormalize=False), None)
    probs = logits.softmax(-1)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probs[:, :2])
    # renormalized (Mixtral)
    weights, _ = select_experts(logits, MoESpec(4, 2, 8), None)
    torch.testing.assert_close(weights, probs[:, :2] / probs[:, :2].sum())
    # a correction bias chooses (experts 3 and 2 here) but does not weigh (Ernie)
    bias = torch.tensor([0.0, 0.0, 1.0, 2.0])
    weights, ids = select_experts(logits, MoESpec(4, 2, 8, correction_bias=True), bias)
    assert ids.tolist() == [[3, 2]]
    chosen = probs[:, [3, 2]]
    torch.testing.assert_close(weights, chosen / chosen.sum())
    # sigmoid scoring
    weights, ids = select_experts(logits, MoESpec(4, 2, 8, scoring="sigmoid"), None)
    sig = logits.sigmoid()[:, :2]
    torch.testing.assert_close(weights, sig / sig.sum())
    with pytest.raises(ValueError, match="scoring"):
        MoESpec(4, 2, 8, scoring="relu")


@pytest.mark.parametrize("spec", [
    MoESpec(16, 4, 8),  # softmax, renormalized (Qwen3-MoE, Mixtral)
    MoESpec(16, 2, 8, renormalize=False),
    MoESpec(16, 3, 8, scoring="sigmoid"),
    MoESpec(16, 4, 8, correction_bias=True, renormalize_min=0.9),  # Ernie: bias, clamp
], ids=["softmax", "not-renormalized", "sigmoid", "bias-and-clamp"])
def test_native_router_equals_select_experts(spec):
    """loom's moe_route (bf16 hidden states on the CPU: FusedMoE.route and the native
    stack) against select_experts on F.linear's float32 logits: the same experts in the
    same order, weights equal up to float32 summation order; a bf16 router and its
    float32 copy route identically."""
    ops = native_ops()
    if ops is None:
        pytest.skip("no native kernels")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(37, 200, generator=gen).bfloat16()
    router = (torch.randn(spec.num_experts, 200, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(spec.num_experts, generator=gen) * 0.05 if spec.correction_bias else None
    weights, ids = ops.moe_route(x, router, bias, spec.top_k, spec.scoring, spec.renormalize,
                                 spec.renormalize_min)
    expected_weights, expected_ids = select_experts(F.linear(x.float(), router.float()), spec,
                                                    bias)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=1e-6, rtol=1e-5)
    again = ops.moe_route(x, router.float(), bias, spec.top_k, spec.scoring, spec.renormalize,
                          spec.renormalize_min)
    assert torch.equal(again[0], weights) and torch.equal(again[1], ids)
    if spec.renormalize_min:  # the clamp took effect somewhere, or the case tests nothing
        assert (weights.sum(-1) < 0.99).any()


def test_layer_counts_tokens_per_expert():
    torch.manual_seed(0)
    layer = FusedMoE(MoESpec(4, 2, 8), hidden_size=16)
    for param in (layer.gate.weight, layer.w13_weight, layer.w2_weight):
        param.data.normal_(0, 0.1)
    with torch.no_grad():
        layer(torch.randn(5, 16))
    assert layer.tokens_per_expert.sum() == 10
    assert layer.load_summary().startswith("tokens per expert [")


def test_expert_parallel_group_splits_experts():
    assert NO_EP.expert_range(8) == (0, 8)
    groups = [expert_parallel_group(TPGroup(rank, 2, None), 2) for rank in range(2)]
    assert [g.expert_range(8) for g in groups] == [(0, 4), (4, 8)]
    with pytest.raises(ValueError, match="do not split"):
        EPGroup(TPGroup(0, 3, None)).expert_range(8)
    with pytest.raises(ValueError, match="must be 1, the tensor parallel size 2, or that "
                                         "times the data parallel size"):
        expert_parallel_group(TPGroup(0, 2, None), 4)


def _scenario(path: str, tp_group: TPGroup, expert_parallel_size: int):
    config = load_hf_config(path)
    model = load_model(path, config, dtype=torch.float32, tp_group=tp_group,
                       expert_parallel_size=expert_parallel_size)
    logits = [logits for _, logits, _ in run_scenario(model, config.vocab_size)]
    loads = [m.tokens_per_expert.clone() for m in model.modules() if isinstance(m, FusedMoE)]
    return logits, loads


def _worker(rank: int, store_path: str, paths: list[str], out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=2)
    try:
        group = TPGroup(rank, 2, dist.group.WORLD)
        results = {(path, ep): _scenario(path, group, ep) for path in paths for ep in (1, 2)}
        if rank == 0:
            torch.save(results, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # as test_tensor_parallel.py: no C++ static destructors after gloo


def test_tp2_and_ep2_equal_one_rank_with_uneven_experts(tmp_path):
    """Each MoE family, its router biased toward two experts (both on rank 0 under
    EP=2): TP=2 (experts' matrices split) and EP=2 (experts split whole) give the
    logits of one rank through prefill chunks, mixed steps and decodes."""
    paths = [bias_router(make_tiny_checkpoint(f, tmp_path / f)) for f in MOE_FAMILIES]
    out_path = str(tmp_path / "ranks.pt")
    mp.spawn(_worker, args=(str(tmp_path / "store"), paths, out_path), nprocs=2, join=True)
    results = torch.load(out_path)
    for path in paths:
        one_rank, loads = _scenario(path, TPGroup(), 1)
        for layer_load in loads:  # the bias worked: the favoured experts are busiest
            mean = layer_load.float().mean()
            assert layer_load[list(FAVOURED)].float().min() > 1.5 * mean, (path, layer_load)
        for ep in (1, 2):
            logits, ep_loads = results[(path, ep)]
            assert len(logits) == len(one_rank)
            for a, b in zip(one_rank, logits):
                torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
                assert torch.equal(a.argmax(-1), b.argmax(-1))
            for a, b in zip(loads, ep_loads):
                assert torch.equal(a, b)  # every rank counts every expert's tokens


def test_expert_parallel_settings_are_checked():
    from types import SimpleNamespace

    from loom.checkpoint_defaults import check_expert_parallel
    from loom.config import ParallelConfig

    assert ParallelConfig(tensor_parallel_size=2, expert_parallel_size=2).expert_parallel_size == 2
    with pytest.raises(ValueError, match="must be 1, the tensor parallel size 2, or tensor x "
                                         "data parallel size 2"):
        ParallelConfig(tensor_parallel_size=2, expert_parallel_size=4)
    with pytest.raises(ValueError, match="does not divide the model's 3 experts"):
        check_expert_parallel(SimpleNamespace(num_local_experts=3), 2)
    check_expert_parallel(SimpleNamespace(moe_num_experts=8), 2)
    check_expert_parallel(SimpleNamespace(), 2)  # no experts: a warning only


def _reference_moe(shared: bool = False) -> FusedMoE:
    """8 experts of intermediate 8, top-2, hidden 16, seeded (the same on every rank)."""
    torch.manual_seed(3)
    layer = FusedMoE(MoESpec(8, 2, 8), hidden_size=16)
    for param in (layer.gate.weight, layer.w13_weight, layer.w2_weight):
        param.data.normal_(0, 0.3)
    layer.process_weights_after_loading()
    return layer


def _all_to_all_moe(tp_group: TPGroup, across: TPGroup) -> FusedMoE:
    """The reference's experts split over ``across`` (its rank's quarter or half)."""
    reference = _reference_moe()
    ep = EPGroup(tp_group, across)
    layer = FusedMoE(MoESpec(8, 2, 8), hidden_size=16, tp_group=tp_group, expert_parallel=ep)
    start, end = ep.expert_range(8)
    layer.gate.weight.data.copy_(reference.gate.weight.data)
    layer.w13_weight.data.copy_(reference.plain_weight("w13_weight")[start:end])
    layer.w2_weight.data.copy_(reference.plain_weight("w2_weight")[start:end])
    layer.process_weights_after_loading()
    return layer


def _all_to_all_worker(rank: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=2)
    try:
        world = TPGroup(rank, 2, dist.group.WORLD)
        x = torch.randn(7, 16, generator=torch.Generator().manual_seed(5))
        results = {}
        with torch.no_grad():
            # two replicas of TP=1: each its own tokens (rank 0 rows 0..4, rank 1 rows
            # 5..6); then rank 1 idle (a dummy step's exchange) while rank 0 runs all 7
            replicas = _all_to_all_moe(TPGroup(), world)
            results["replicas"] = replicas(x[:5] if rank == 0 else x[5:])
            if rank == 0:
                results["one idle"] = replicas(x)
            else:
                replicas.exchange_nothing(16, torch.float32, torch.device("cpu"))
            # one replica of TP=2: both ranks hold the same tokens, each dispatches its
            # share (7 rows: 4 and 3; 1 row: 1 and none) and they all-gather the rows
            tensor_parallel = _all_to_all_moe(world, world)
            results["tp shares"] = tensor_parallel(x)
            results["tp one row"] = tensor_parallel(x[:1])
        torch.save(results, f"{out_path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_all_to_all_across_replicas_equals_one_rank(tmp_path):
    """Experts split over two ranks that each hold their own tokens (EPGroup.across, the
    layout of experts across data-parallel replicas): rows to their experts' rank and
    back by all-to-all give one rank's output, when one rank is idle too; and under TP=2
    (each rank a share of the same tokens, then an all-gather)."""
    out_path = str(tmp_path / "out.pt")
    mp.spawn(_all_to_all_worker, args=(str(tmp_path / "store"), out_path), nprocs=2,
             join=True)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    x = torch.randn(7, 16, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = _reference_moe()(x)
    close = dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([ranks[0]["replicas"], ranks[1]["replicas"]]),
                               expected, **close)
    torch.testing.assert_close(ranks[0]["one idle"], expected, **close)
    for rank in ranks:
        torch.testing.assert_close(rank["tp shares"], expected, **close)
        torch.testing.assert_close(rank["tp one row"], expected[:1], **close)


def test_plan_placement_copies_busy_experts_and_evens_the_ranks():
    from loom.model.layers.fused_moe import busiest_rank_share, plan_placement

    placement = plan_placement([9, 1, 1, 1], 6, 2)
    assert placement == [0, 0, 3, 0, 1, 2]  # expert 0: three copies, on both ranks
    assert busiest_rank_share([9, 1, 1, 1], placement, 2) == pytest.approx(7 / 12)
    assert busiest_rank_share([9, 1, 1, 1], [0, 1, 2, 3, 1, 2], 2) == pytest.approx(10 / 12)
    assert sorted(plan_placement([5, 0, 0, 7, 1, 1, 0, 2], 10, 2)) == \
        sorted([0, 1, 2, 3, 4, 5, 6, 7, 0, 3])


def _eplb_moe(tp_group: TPGroup, across: TPGroup | None,
              quantization: str = "none") -> FusedMoE:
    """The reference's experts over two ranks with 2 redundant slots (10 slots, 5 a
    rank), loaded through the checkpoint's loader (a copy fills every slot of it), with
    the router leaning hard on experts 2 and 3; ``quantization`` wint8: each slot a
    QuantizedExpert."""
    reference = _biased(_reference_moe())
    ep = EPGroup(tp_group, across, num_redundant_experts=2)
    layer = FusedMoE(MoESpec(8, 2, 8), hidden_size=16, tp_group=tp_group, expert_parallel=ep,
                     quantization=quantization)
    layer.gate.weight.data.copy_(reference.gate.weight.data)
    w13, w2 = reference.plain_weight("w13_weight"), reference.plain_weight("w2_weight")
    for expert in range(8):
        for which, tensor in (("gate", w13[expert][:8]), ("up", w13[expert][8:]),
                              ("down", w2[expert])):
            layer.load_expert(tensor, expert, which)
    for module in layer.modules():  # the loader's hooks: quantized experts lay themselves out
        if module is not layer and hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    layer.process_weights_after_loading()
    return layer


def _biased(layer: FusedMoE) -> FusedMoE:
    layer.gate.weight.data[2:4, 0] = 4.0  # x[:, 0] > 0 below: most tokens go to 2 and 3
    return layer


def _eplb_worker(rank: int, store_path: str, out_path: str, quantization: str = "none") -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                            world_size=2)
    try:
        world = TPGroup(rank, 2, dist.group.WORLD)
        x = torch.randn(12, 16, generator=torch.Generator().manual_seed(6))
        x[:, 0] = x[:, 0].abs() + 1
        results = {}
        with torch.no_grad():
            for name, tp, across in (("across replicas", TPGroup(), world),
                                     ("over TP", world, None)):
                layer = _eplb_moe(tp, across, quantization)
                mine = x[:6] if across is not None and tp.world_size == 1 and rank == 0 \
                    else x[6:] if across is not None and tp.world_size == 1 else x
                before = layer(mine)
                moved = layer.rearrange()
                results[name] = (before, layer(mine), moved, layer.last_rearrangement,
                                 layer.physical_to_logical.tolist())
        torch.save(results, f"{out_path}.{rank}")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_eplb_rearranges_busy_experts_and_keeps_the_output(tmp_path):
    """EPLB over two ranks, in both layouts: with the router leaning on experts 2 and 3,
    rearrange() gives them copies and evens the ranks' load (each rank half the
    tokens' experts), and the layer's output is one rank's before and after."""
    out_path = str(tmp_path / "out.pt")
    mp.spawn(_eplb_worker, args=(str(tmp_path / "store"), out_path), nprocs=2, join=True)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(6))
    x[:, 0] = x[:, 0].abs() + 1
    with torch.no_grad():
        expected = _biased(_reference_moe())(x)
    close = dict(atol=1e-5, rtol=1e-5)
    for name in ("across replicas", "over TP"):
        for rank in ranks:
            moved, (share_before, share_after), placement = rank[name][2:]
            assert moved and share_after < share_before, rank[name]
            assert placement.count(2) + placement.count(3) >= 3, placement  # copies
            assert placement == ranks[0][name][4]  # every rank planned the same
        if name == "across replicas":
            for i in (0, 1):  # before, after
                got = torch.cat([ranks[0][name][i], ranks[1][name][i]])
                torch.testing.assert_close(got, expected, **close)
        else:
            for rank in ranks:
                torch.testing.assert_close(rank[name][0], expected, **close)
                torch.testing.assert_close(rank[name][1], expected, **close)


def test_eplb_moves_quantized_experts_and_keeps_the_output(tmp_path):
    """As above with wint8 experts (each slot a QuantizedExpert): rearrange() moves the
    held quantized bytes; in both layouts the layer's output after it is the output
    before (the same quantized weights, now in more slots)."""
    out_path = str(tmp_path / "out.pt")
    mp.spawn(_eplb_worker, args=(str(tmp_path / "store"), out_path, "wint8"), nprocs=2,
             join=True)
    ranks = [torch.load(f"{out_path}.{rank}") for rank in range(2)]
    for name in ("across replicas", "over TP"):
        for rank in ranks:
            before, after, moved, (share_before, share_after), placement = rank[name]
            assert moved and share_after < share_before, rank[name]
            assert placement.count(2) + placement.count(3) >= 3, placement
            assert placement == ranks[0][name][4]
            torch.testing.assert_close(after, before, atol=1e-5, rtol=1e-5)
