"""A mixture-of-experts MLP: router, top-k, routed experts on stacked weights, shared
experts; tensor and expert parallel.

One step of the layer, for T tokens with hidden states x (T, H):

    router logits (T, E) = x @ gate^T                 (float32, as every family's HF code)
    scores  = softmax(logits) | sigmoid(logits)       (MoESpec.scoring)
    chosen  = top-k of (scores + correction bias)     (the bias picks experts, it does not weigh)
    weights = scores[chosen], renormalized to sum 1 where the family does
    out     = sum_k weights[t, k] * expert_{chosen[t, k]}(x[t])  (+ shared experts(x))

The routed experts run grouped by expert (``fused_experts``): the T*K (token, expert)
assignments are sorted by expert once; the tokens of each expert form one contiguous
segment, gathered once, and each expert hit this step runs its two matmuls once, on its
slice of the stacked weights ``w13`` (E, 2I, H) and ``w2`` (E, H, I) (held as packed
panels for loom's bf16 matmul on the CPU, one copy). No Python loop
over tokens; the loop is over the experts hit, which ``loop_over_experts`` (the shape of
Hugging Face's reference, a mask per expert) is measured against
(benchmarks/moe.py).

Parallelism, as vLLM's FusedMoE:

- tensor parallel (default): every rank holds every expert, with its intermediate
  size split as a column/row-parallel pair; each rank's partial sums are all-reduced.
- expert parallel (an ``EPGroup`` of size > 1, parallel_state.py): rank r holds experts
  ``[r * E / ep, (r + 1) * E / ep)`` whole. Hidden states are replicated over the ranks
  (they leave attention all-reduced), so each rank takes the tokens routed to its own
  experts, runs them, and the all-reduce over the group combines every token's
  experts' results: the dispatch is local selection, the combine one collective.
- expert parallel across data-parallel replicas (``EPGroup.all_to_all``; ``loom serve
  --data-parallel-size D --enable-expert-parallel``): rank r of the D x TP ranks holds
  experts ``[r * E / EP, (r + 1) * E / EP)``; each replica's tokens are its own, so
  each (token, expert) pair's row travels to its expert's rank and its result back by
  all-to-all (``_forward_all_to_all``). A replica with nothing to run takes part with
  no rows (``exchange_nothing``), so every rank enters every all-to-all. Under TP each
  TP rank dispatches a share of its replica's tokens; the TP group all-gathers the rest.

Quantized experts (``--quantization wint8|wint4``): each local expert is then a pair of
linear layers (``QuantizedExpert``: ``w13`` (2I, H), ``w2`` (H, I), both ``LinearBase``,
layers/linear.py), so an expert's weight is quantized in its loader from the whole
checkpoint tensor before the rank takes its shard, laid out once for loom's
``quantized_linear`` kernel (bf16 on AVX512-BF16 or AVX2) or held for the PyTorch reference
(float32, other CPUs), exactly as the dense linears are; the grouped path runs each
expert hit once on its segment, as above. A GGUF file's experts in a format loom keeps
(Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K; ``--quantization auto``) arrive as one
``QuantizedTensor`` per expert and are held the same way, in the file's format.

On CUDA with ``LOOM_TRITON_MATMULS=1`` (off by default: proven only under Triton's
interpreter), full-precision experts run loom's Triton fused MoE kernel instead
(triton_moe.py: the assignments sorted by expert and padded to its block, one grouped
matmul launch per projection over every expert), and quantized experts' linears run
loom's Triton quantized matmuls (triton_linear.py) on their segments.

A CUDA graph's decode step (worker/cuda_graphs.py, ``graph_safe_experts``) fixes every
shape, and the grouped path's are the routing's (each expert's segment, counted on the
host): there the experts run ``dense_experts`` (every local expert on the step's few
rows, each row keeping its own top-k's results; the Triton fused MoE where it is on,
whose padded buffers are routing-independent already), and the routing counts are a
scatter on the device that leaves out the graph's padding rows (``graph_rows``).
Proven on the CPU with the graph's padded steps run uncaptured; not run on a GPU yet.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loom.distributed.parallel_state import NO_EP, SINGLE, EPGroup, TPGroup
from loom.kernels import native_ops_for
from loom.model.layers.activation import silu_and_mul
from loom.model.layers.linear import LinearBase
from loom.model.layers.weight_forms import (Bf16Panels, PackedWeight, WeightForm, linear,
                                            pack_weight, select_form, triton_matmuls_on)
from loom.model.layers.quantization import QuantizedTensor, parse_weight_quantization

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MoESpec:
    """What one MoE layer of a family is (whole-model sizes)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    scoring: str = "softmax"  # softmax | sigmoid over the router logits
    renormalize: bool = True  # chosen weights divided by their sum
    renormalize_min: float = 0.0  # that sum clamped below (Ernie's moe_norm_min)
    correction_bias: bool = False  # e_score_correction_bias added to scores to choose
    shared_intermediate_size: int = 0  # one shared-expert MLP of this size, 0: none
    activation: str = "silu"

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"MoE scoring {self.scoring!r} is not supported; "
                             "only softmax and sigmoid")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.num_experts} experts")
        if self.activation != "silu":
            raise ValueError(f"MoE activation {self.activation!r} is not supported; only silu")




# Rank 0 logs each MoE layer's load (tokens per expert) every this many forwards.
LOG_LOAD_EVERY = 1000


def select_experts(router_logits: torch.Tensor, spec: MoESpec,
                   correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, E) float32 logits -> (weights (T, K) float32, expert ids (T, K) int64)."""
    if spec.scoring == "softmax":
        scores = router_logits.softmax(dim=-1)
    else:
        scores = router_logits.sigmoid()
    if correction_bias is not None:
        _, topk_ids = torch.topk(scores + correction_bias.float(), spec.top_k, dim=-1)
        topk_weights = scores.gather(-1, topk_ids)
    else:
        topk_weights, topk_ids = torch.topk(scores, spec.top_k, dim=-1)
    if spec.renormalize:
        total = topk_weights.sum(dim=-1, keepdim=True)
        if spec.renormalize_min > 0:
            total = total.clamp(min=spec.renormalize_min)
        topk_weights = topk_weights / total
    return topk_weights, topk_ids


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return linear(silu_and_mul(linear(x, w13)), w2)


def _held_expert_mlp(x: torch.Tensor, forms: tuple[WeightForm, WeightForm]) -> torch.Tensor:
    """One expert held as weight forms (its w13, its w2): (N, H) -> (N, H)."""
    return forms[1].apply(silu_and_mul(forms[0].apply(x, None)), None)


def fused_experts(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_start: int = 0,
                  forms: list[tuple[WeightForm, WeightForm]] | None = None,
                  experts: nn.ModuleList | None = None) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) over the experts this
    rank holds (``w13`` (E_local, 2I, H), ``w2`` (E_local, H, I), or ``experts``, one
    module (T, H) -> (T, H) per local expert, e.g. ``QuantizedExpert``; global ids
    ``expert_start ..``); assignments to other ranks' experts add nothing.

    Grouped by expert: sort the T*K assignments by expert id once, gather their tokens
    into one (N, H) matrix whose rows for expert e are one contiguous segment, run each
    expert hit once on its segment, weigh the rows, and scatter-add them back. With
    ``forms`` (each expert's w13 and w2 as held, weight_forms.py; bf16 on the CPU: loom's
    panels) every segment runs its form's matmul: one 1024x1024 +
    1024x512 expert in loom's bf16 kernel (the AMX tiles from 8 rows) took 0.24-0.4 ms
    at 1-32 rows against oneDNN's F.linear's 0.6-1.2 ms, 1.0/1.3 against 1.5/1.6 at
    64/128, level at 256 (1 thread, loaded 2-core host; benchmarks/moe_speed.md).

        topk_ids [[2, 0], [2, 1]] -> order of (token, k): (0,1) (1,1) (0,0) (1,0)
        experts 0 | 1 | 2 2  -> counts [1, 1, 2]
    """
    num_tokens, top_k = topk_ids.shape
    num_local = len(experts) if experts is not None else w13.shape[0]
    if num_tokens == 1:  # a batch-1 decode: its experts in turn, in the same order
        return _one_token(x, w13, w2, topk_weights, topk_ids, expert_start, forms, experts)
    flat_ids = topk_ids.flatten() - expert_start  # (T*K,) local ids
    mine = (flat_ids >= 0) & (flat_ids < num_local)
    flat_ids = torch.where(mine, flat_ids, num_local)  # other ranks' sort last, never run
    order = torch.argsort(flat_ids, stable=True)  # (T*K,) assignments grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_local + 1)[:num_local].tolist()
    token_of = order // top_k  # (T*K,) the token of each sorted assignment
    num_routed = sum(counts)
    out = torch.zeros_like(x)
    if num_routed == 0:
        return out
    token_of = token_of[:num_routed]
    routed = x.index_select(0, token_of)  # (N, H), N = assignments to this rank
    results = torch.empty_like(routed)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            if experts is not None:
                results[start:end] = experts[expert](routed[start:end])
            elif forms is not None:
                results[start:end] = _held_expert_mlp(routed[start:end], forms[expert])
            else:
                results[start:end] = _expert_mlp(routed[start:end], w13[expert], w2[expert])
            start = end
    weights = topk_weights.flatten()[order[:num_routed]].to(results.dtype)
    results.mul_(weights[:, None])
    return out.index_add_(0, token_of, results)


def _one_token(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None,
               topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_start: int,
               forms: list[tuple[WeightForm, WeightForm]] | None,
               experts: nn.ModuleList | None = None) -> torch.Tensor:
    """``fused_experts`` for one token, without the sort, gather and scatter (a dozen
    small ops that cost as much as an expert at batch 1); same roundings and order."""
    out = torch.zeros_like(x)
    weights = topk_weights[0].to(x.dtype)
    num_local = len(experts) if experts is not None else w13.shape[0]
    for k, expert in sorted(enumerate(topk_ids[0].tolist()), key=lambda item: item[1]):
        local = expert - expert_start
        if 0 <= local < num_local:
            out += _run_expert(x, local, w13, w2, forms, experts).mul_(weights[k])
    return out


def _run_expert(x: torch.Tensor, local: int, w13: torch.Tensor | None,
                w2: torch.Tensor | None, forms: list[tuple[WeightForm, WeightForm]] | None,
                experts: nn.ModuleList | None) -> torch.Tensor:
    """Local expert ``local`` on the rows ``x``, held as modules, weight forms or stacked
    tensors, whichever the caller has."""
    if experts is not None:
        return experts[local](x)
    if forms is not None:
        return _held_expert_mlp(x, forms[local])
    return _expert_mlp(x, w13[local], w2[local])


def dense_experts(x: torch.Tensor, w13: torch.Tensor | None, w2: torch.Tensor | None,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  expert_start: int = 0,
                  forms: list[tuple[WeightForm, WeightForm]] | None = None,
                  experts: nn.ModuleList | None = None) -> torch.Tensor:
    """``fused_experts`` with no shape that depends on the routing, and nothing read on
    the host: the form a CUDA graph captures (``FusedMoE.graph_rows``). Every local
    expert runs on every row; each row keeps the results of its own top-k, weighed::

        out[t] = sum over local e, in order, of  w[t, e] * expert_e(x[t])   (rows that
                 did not choose e add nothing: where(), not a multiply by 0)

    The same math as ``fused_experts`` (an expert's output rounded to the model's dtype,
    times its weight rounded to it, summed into zeros in expert order): only the
    matmuls' float32 sums may run in another order (more rows). Exact and simple, at a
    price: every expert's weights are read every step, E_local / K times what a batch-1
    step routes (a 128-expert top-8 model: 16x), the same once a step's T*K assignments
    hit most experts. (Full-precision experts under ``LOOM_TRITON_MATMULS=1`` take
    triton_moe.fused_moe instead, whose shapes are routing-independent already.)"""
    local = topk_ids - expert_start  # (T, K) local ids; other ranks' match no expert
    num_local = len(experts) if experts is not None else w13.shape[0]
    out = torch.zeros_like(x)
    for expert in range(num_local):
        chosen = local == expert  # (T, K): at most one True a row (top-k ids differ)
        weight = torch.where(chosen, topk_weights, 0.0).sum(dim=-1)  # (T,) its weight
        result = _run_expert(x, expert, w13, w2, forms, experts)
        result = result.mul_(weight.to(result.dtype)[:, None])
        out += torch.where(chosen.any(dim=-1, keepdim=True), result, 0.0)
    return out


def expert_counts(topk_ids: torch.Tensor, num_experts: int,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """(E,) int64: the (token, k) assignments to each expert, of the rows ``rows`` (T,)
    int64 marks with 1 (a CUDA graph's: 0 for its padding rows), all of them without.
    A scatter, not ``bincount``, whose output size waits on the GPU for the largest id."""
    flat = topk_ids.flatten()
    ones = (torch.ones_like(flat) if rows is None
            else rows[:, None].expand(topk_ids.shape).flatten())
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, ones)


@contextmanager
def graph_safe_experts(layers: Iterable[FusedMoE], real_rows: torch.Tensor) -> Iterator[None]:
    """The MoE ``layers`` run ``dense_experts`` (or the Triton fused MoE) for one forward
    and count only the rows ``real_rows`` (T,) int64 marks with 1: a CUDA graph's step,
    whose padding rows (copies of row 0) must not count. The graph reads ``real_rows``
    where it was at capture: the caller writes each step's mask into it."""
    layers = list(layers)
    for layer in layers:
        layer.graph_rows = real_rows
    try:
        yield
    finally:
        for layer in layers:
            layer.graph_rows = None


def loop_over_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      expert_start: int = 0) -> torch.Tensor:
    """The reference the grouped path is measured and tested against: Hugging Face's
    shape, a mask per expert (every expert, hit or not, looked at each step)."""
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        token_idx, k_idx = torch.where(topk_ids == expert + expert_start)
        if token_idx.numel() == 0:
            continue
        result = _expert_mlp(x[token_idx], w13[expert], w2[expert])
        out.index_add_(0, token_idx, result * topk_weights[token_idx, k_idx, None].to(x.dtype))
    return out


class ExpertLinear(LinearBase):
    """One expert's ``w13`` (gate rows then up rows, (2 I_shard, H)) or ``w2``
    ((H, I_shard)), loaded from the checkpoint's whole (out, in) gate/up/down tensors:
    this rank's part of the intermediate size is rows ``first .. first + I_shard`` of
    gate and up, columns of down (all of it under expert parallel)."""

    def __init__(self, input_size: int, output_size: int, first: int, inter: int,
                 quantization: str) -> None:
        super().__init__(input_size, output_size, False, SINGLE, quantization)
        self.first, self.inter = first, inter

    def weight_loader(self, param, loaded_weight, shard_id=None) -> None:
        first, inter = self.first, self.inter
        if shard_id in ("gate", "up"):
            rows = loaded_weight.narrow(0, first, inter)
            target = param.data.narrow(0, 0 if shard_id == "gate" else inter, inter)
        elif shard_id == "down":
            rows, target = loaded_weight.narrow(1, first, inter), param.data
        else:
            raise ValueError(f"expert weight {shard_id!r} is none of gate, up, down")
        if tuple(target.shape) != tuple(rows.shape):
            raise ValueError(f"expert {shard_id} weight has shape "
                             f"{tuple(loaded_weight.shape)}, which does not fit the "
                             f"parameter slice {tuple(target.shape)}; does the config match?")
        target.copy_(rows)


class QuantizedExpert(nn.Module):
    """One routed expert as two quantized linear layers: (T, H) -> (T, H)."""

    def __init__(self, hidden_size: int, inter: int, first: int, quantization: str) -> None:
        super().__init__()
        self.w13 = ExpertLinear(hidden_size, 2 * inter, first, inter, quantization)
        self.w2 = ExpertLinear(inter, hidden_size, first, inter, quantization)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2.matmul(silu_and_mul(self.w13.matmul(x, None)), None)


class FusedMoE(nn.Module):
    """The routed experts of one layer, with the router and the shared experts.

    Parameters (names the families' loaders fill): ``gate.weight`` (E, H) replicated;
    ``e_score_correction_bias`` (E,) where the spec has one; ``w13_weight``
    (E_local, 2 * I_shard, H) with gate rows then up rows, ``w2_weight``
    (E_local, H, I_shard), filled per expert through ``weight_loader(param, tensor,
    (expert_id, "gate" | "up" | "down"))``; ``shared_experts`` an MLP module given by
    the family (column/row parallel, it all-reduces its own output). With
    ``quantization`` wint8 or wint4[:G] (``LinearBase``'s), ``experts`` holds a
    ``QuantizedExpert`` per local expert instead of ``w13_weight``/``w2_weight``.
    ``load_expert`` fills either. Once loaded, bf16 experts on loom's kernel are held
    as its panels only (``process_weights_after_loading``; ``plain_weight`` gives the
    (E_local, N, K) values back, a reload unpacks first)."""

    def __init__(self, spec: MoESpec, hidden_size: int, tp_group: TPGroup = SINGLE,
                 expert_parallel: EPGroup = NO_EP,
                 shared_experts: nn.Module | None = None, layer_idx: int = 0,
                 quantization: str = "none") -> None:
        super().__init__()
        self.spec = spec
        self.layer_idx = layer_idx
        self.tp_group = tp_group
        self.expert_parallel = expert_parallel
        if expert_parallel.size > 1:
            if expert_parallel.tp_group != tp_group:
                raise ValueError("expert parallel runs over the tensor-parallel ranks")
            self.expert_start, self.expert_end = expert_parallel.expert_range(spec.num_experts)
            self.intermediate_per_rank = spec.intermediate_size
            self.intermediate_start = 0
        else:
            self.expert_start, self.expert_end = 0, spec.num_experts
            start, end = tp_group.shard_range(spec.intermediate_size)
            self.intermediate_per_rank, self.intermediate_start = end - start, start
        num_local = self.expert_end - self.expert_start
        inter = self.intermediate_per_rank
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(spec.num_experts),
                                                     requires_grad=False)
                                        if spec.correction_bias else None)
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.weight_loader = _bias_loader
        self.experts: nn.ModuleList | None = None
        if parse_weight_quantization(quantization)[0] == "none":
            self.w13_weight = nn.Parameter(torch.empty(num_local, 2 * inter, hidden_size),
                                           requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(num_local, hidden_size, inter),
                                          requires_grad=False)
            for param in (self.w13_weight, self.w2_weight):
                param.weight_loader = self.expert_weight_loader
        else:
            self.register_parameter("w13_weight", None)
            self.register_parameter("w2_weight", None)
            self.experts = nn.ModuleList(
                QuantizedExpert(hidden_size, inter, self.intermediate_start, quantization)
                for _ in range(num_local))
        self.shared_experts = shared_experts
        # tokens routed to each expert (all ranks' experts, counted on every rank) since
        # start: the load balance, logged by rank 0 every LOG_LOAD_EVERY forwards
        self.register_buffer("tokens_per_expert",
                             torch.zeros(spec.num_experts, dtype=torch.int64),
                             persistent=False)
        # Expert slots over the EP ranks (EPLB's redundant ones too): slot p holds expert
        # physical_to_logical[p], at first p % E; rank r holds slots [expert_start,
        # expert_end). A token's k-th choice runs on one of its expert's copies
        # (physical_ids); rearrange() places them anew.
        num_slots = spec.num_experts + (expert_parallel.num_redundant_experts
                                        if expert_parallel.size > 1 else 0)
        placement = torch.arange(num_slots, device="cpu") % spec.num_experts
        self.register_buffer("physical_to_logical", placement.clone(), persistent=False)
        self.logical_to_physical: torch.Tensor | None = None  # (E, copies), -1 padded
        self.replica_counts: torch.Tensor | None = None  # (E,); None: slot p is expert p
        self._window_start = torch.zeros(spec.num_experts, dtype=torch.int64)
        # the busiest rank's share of the last window's tokens, held then and planned
        self.last_rearrangement: tuple[float, float] | None = None
        self._set_placement(placement)
        # loom's mixture_of_experts kernel's view of this layer (native_experts), made at
        # the first forward that can use it, dropped whenever the weights change
        self._native: Any = None
        # the model runner's (E,) count of this step, shared by every MoE layer, zeroed
        # by it before each forward and shipped with the step's output; None: not counted
        self.step_tokens: torch.Tensor | None = None
        self.use_grouped = True  # False: loop_over_experts (the measured reference)
        # a CUDA graph's step (graph_safe_experts): (T,) 1 for the step's rows, 0 for
        # padding; the experts then run dense_experts, shapes fixed. None: eager
        self.graph_rows: torch.Tensor | None = None
        # full-precision experts run triton_moe.fused_moe (LOOM_TRITON_MATMULS=1, CUDA),
        # decided once loaded
        self.triton_experts = False
        # each local expert's w13 and w2 as held (weight_forms.py; select_form's choice,
        # on slices of the stacked parameters), made once loaded; None while loading
        self.expert_forms: list[tuple[WeightForm, WeightForm]] | None = None
        # the parameters held as loom's bf16 panels, (E_local, panels, K/2, 64, 2) in
        # place of (E_local, N, K): each expert's PackedWeight is a view of its slice
        self._panels: set[str] = set()
        self._out_features = {"w13_weight": 2 * inter, "w2_weight": hidden_size}
        self._forwards = 0
        self._experts_loaded = False  # load_expert has filled an expert

    @property
    def step_tokens(self) -> torch.Tensor | None:
        return self._step_tokens

    @step_tokens.setter
    def step_tokens(self, counts: torch.Tensor | None) -> None:
        self._step_tokens = counts
        self._native = None  # the kernel's view holds the counter

    def native_experts(self, ops: Any) -> Any:
        """This layer's routed experts as loom's ``mixture_of_experts`` kernel takes them
        (its arguments after ``x``: the float32 router, made once, the correction bias,
        each expert's w13 and w2 handle, the counters and the routing), or a sentence
        saying why they cannot be."""
        if not self.use_grouped:
            return "its experts run loop_over_experts (the measured reference)"
        if self._native is not None:
            return self._native
        if (self.expert_start, self.expert_end) != (0, self.spec.num_experts):
            return "it holds part of the experts (expert parallel)"
        if self.experts is not None:  # quantized: each expert a pair of LinearBase
            pairs = [(expert.w13.form, expert.w2.form) for expert in self.experts]
        elif self.expert_forms is None:
            return "its experts are being reloaded (process_weights_after_loading has not run)"
        else:
            pairs = self.expert_forms
        w13, w2 = [], []
        for pair in pairs:
            for form, held in zip(pair, (w13, w2)):
                handle = form.native_handle(ops)
                if isinstance(handle, str):
                    return f"its experts' {handle}"
                held.append(handle)
        # float32 once here (the PyTorch route converts at each forward: the same values)
        router = self.gate.weight.detach().float()
        bias = self.e_score_correction_bias
        spec = self.spec
        self._router = router  # held here: a replay of the forward takes it as a constant
        self._native = (router, None if bias is None else bias.detach().float(), w13, w2,
                        self.tokens_per_expert, self.step_tokens, spec.top_k, spec.scoring,
                        spec.renormalize, spec.renormalize_min, self.intermediate_per_rank)
        self._correction = self._native[1]
        return self._native

    def _hold_quantized_experts(self) -> None:
        """The checkpoint's experts arrive quantized in a format loom keeps (a GGUF file
        under ``--quantization auto``): hold each local expert as a ``QuantizedExpert``,
        as wint8/wint4 do, in place of the stacked full-precision parameters (never
        written: their pages were never touched)."""
        num_local, hidden = self.w2_weight.shape[0], self.w2_weight.shape[1]
        device, dtype = self.w2_weight.device, self.w2_weight.dtype
        del self.w13_weight, self.w2_weight
        self.register_parameter("w13_weight", None)
        self.register_parameter("w2_weight", None)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # an expert dequantized later comes back in it
        try:
            with torch.device(device):
                self.experts = nn.ModuleList(
                    QuantizedExpert(hidden, self.intermediate_per_rank,
                                    self.intermediate_start, "none")
                    for _ in range(num_local))
        finally:
            torch.set_default_dtype(previous)

    def process_weights_after_loading(self) -> None:
        """Pack each local expert's matrices for the CPU bf16 matmul (linear.py's
        ``pack_weight``; None elsewhere), once the weights are in place (and again after
        a reload). With loom's kernel the panels replace the stacked weights, as a
        ``LinearBase``'s replace its weight: one copy of the experts stays resident
        (peak RSS of benchmarks/moe_speed.py's 1.4B MoE, batch 1: 6,222 -> 5,527 MiB;
        the peak is now the load, the plain experts beside the checkpoint's mapped
        pages, before this runs). oneDNN's layout
        (other CPUs) is a second copy beside the plain one. Quantized experts lay
        themselves out (their ``ExpertLinear``s' own hooks)."""
        self._native = None
        if self.experts is not None:
            return
        forms = {name: self._hold(name) for name in ("w13_weight", "w2_weight")}
        self.expert_forms = list(zip(forms["w13_weight"], forms["w2_weight"]))
        self.triton_experts = not self._panels and triton_matmuls_on(self.w13_weight.device)

    def _hold(self, name: str) -> list[WeightForm]:
        """Each local expert's form of parameter ``name``, as ``select_form`` picks it
        for one expert's slice; loom's panels become the parameter (one expert's pack at
        a time beside the stacked weights)."""
        param, out_features = getattr(self, name), self._out_features[name]
        if name in self._panels:
            return [Bf16Panels(PackedWeight.loom_panels(param[e], out_features))
                    for e in range(param.shape[0])]
        first = select_form(param[0], param.device, param.dtype)
        if not isinstance(first, Bf16Panels):
            return [first] + [select_form(param[e], param.device, param.dtype)
                              for e in range(1, param.shape[0])]
        panels = torch.empty((param.shape[0], *first.packed.data.shape), dtype=param.dtype)
        panels[0].copy_(first.packed.data)
        for e in range(1, param.shape[0]):
            panels[e].copy_(pack_weight(param[e]).data)
        self._set_expert_param(name, panels)
        self._panels.add(name)
        return [Bf16Panels(PackedWeight.loom_panels(panels[e], out_features))
                for e in range(panels.shape[0])]

    def _set_expert_param(self, name: str, data: torch.Tensor) -> None:
        param = nn.Parameter(data, requires_grad=False)
        param.weight_loader = self.expert_weight_loader
        setattr(self, name, param)

    def plain_weight(self, name: str) -> torch.Tensor:
        """Parameter ``name`` ("w13_weight" | "w2_weight") as (E_local, N, K): itself,
        or a copy made from its panels."""
        param = getattr(self, name)
        if name not in self._panels:
            return param
        experts, panels, pairs = param.shape[:3]
        return param.permute(0, 1, 3, 2, 4).reshape(
            experts, panels * param.shape[3], 2 * pairs)[:, :self._out_features[name]]

    def _unpack_panels(self, name: str) -> None:
        """Back to the plain stacked parameter, to load into (a reload of some experts
        keeps the others), from its panels."""
        plain = self.plain_weight(name)
        self._set_expert_param(name, torch.empty(plain.shape, dtype=plain.dtype).copy_(plain))
        self._panels.discard(name)
        self.expert_forms = None  # made again by process_weights_after_loading
        self._native = None

    def release_weight(self) -> None:
        """Drop the experts' forms (views of the parameters, oneDNN's copies) before a
        weight-update sleep frees the parameters: nothing else holds the experts' bytes."""
        self.expert_forms = None
        self._native = None

    def count_forward(self) -> None:
        """One more forward of this layer: rank 0 logs the load every LOG_LOAD_EVERY
        (not while a CUDA graph captures the forward: reading the counts would end the
        capture; the replays count, ``on_replay``)."""
        self._forwards += 1
        if (self._forwards % LOG_LOAD_EVERY == 0 and self.tp_group.rank == 0
                and not (self.tokens_per_expert.is_cuda
                         and torch.cuda.is_current_stream_capturing())):
            logger.info("MoE layer %d: %s", self.layer_idx, self.load_summary())

    on_replay = count_forward  # a replayed forward (kernel_replay.py) counts too

    def load_summary(self) -> str:
        """Tokens routed to each expert since start, and the busiest expert's share over
        the mean (1.0: even load): "tokens per expert [12, 3, ...], max/mean 1.8"."""
        counts = self.tokens_per_expert.tolist()
        mean = sum(counts) / len(counts)
        ratio = max(counts) / mean if mean else 0.0
        return f"tokens per expert {counts}, max/mean {ratio:.2f}"

    def load_expert(self, loaded_weight: torch.Tensor, expert_id: int, which: str) -> list[str]:
        """Load expert ``expert_id``'s gate, up or down weight (the checkpoint's whole
        (out, in) tensor; another rank's expert is skipped); returns the names of the
        parameters (relative to this layer) that such tensors fill."""
        if which not in ("gate", "up", "down"):
            raise ValueError(f"expert weight {which!r} is none of gate, up, down")
        if isinstance(loaded_weight, QuantizedTensor) and self.experts is None:
            if self._experts_loaded:  # experts held in full precision already: stay so
                loaded_weight = loaded_weight.dequantize()
            else:
                self._hold_quantized_experts()
        self._experts_loaded = True
        if self.experts is None:
            param = self.w2_weight if which == "down" else self.w13_weight
            param.weight_loader(param, loaded_weight, (expert_id, which))
            return ["w2_weight" if which == "down" else "w13_weight"]
        name = "w2" if which == "down" else "w13"
        for local in self.local_slots(expert_id):  # each copy this rank holds (EPLB)
            linear_layer = getattr(self.experts[local], name)
            linear_layer.weight.weight_loader(linear_layer.weight, loaded_weight, which)
        return [f"experts.{local}.{name}.weight" for local in range(len(self.experts))]

    def expert_weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                             shard_id: tuple[int, str]) -> None:
        """Copy expert ``shard_id[0]``'s gate, up or down (``shard_id[1]``) weight, as
        the checkpoint has it (out, in), into this rank's slice; another rank's expert is
        skipped."""
        expert_id, which = shard_id
        if which not in ("gate", "up", "down"):
            raise ValueError(f"expert weight {which!r} is none of gate, up, down")
        slots = self.local_slots(expert_id)
        if not slots:
            return
        name = "w2_weight" if which == "down" else "w13_weight"
        if name in self._panels:
            self._unpack_panels(name)
        param = getattr(self, name)  # (a parameter held as panels was just replaced)
        inter, first = self.intermediate_per_rank, self.intermediate_start
        for local in slots:  # each copy of the expert this rank holds (EPLB)
            if which in ("gate", "up"):
                rows = loaded_weight[first:first + inter]
                offset = 0 if which == "gate" else inter
                target = param.data[local, offset:offset + inter]
            else:
                rows = loaded_weight[:, first:first + inter]
                target = param.data[local]
            if target.shape != rows.shape:
                raise ValueError(f"expert {expert_id} {which} weight has shape "
                                 f"{tuple(loaded_weight.shape)}, which does not fit the "
                                 f"parameter slice {tuple(target.shape)}; does the config "
                                 "match?")
            target.copy_(rows)

    # ----------------------------------------------------------------- EPLB

    @property
    def num_slots(self) -> int:
        return self.physical_to_logical.shape[0]

    def _set_placement(self, physical_to_logical: torch.Tensor) -> None:
        """Slot p holds expert physical_to_logical[p] (a CPU tensor): the maps routing
        reads."""
        device = self.tokens_per_expert.device
        self.physical_to_logical = physical_to_logical.to(device)
        self._placement = physical_to_logical.tolist()  # read by the loaders, on any device
        if self._placement == list(range(self.spec.num_experts)):
            self.logical_to_physical = self.replica_counts = None
            return
        slots = [[] for _ in range(self.spec.num_experts)]
        for slot, expert in enumerate(physical_to_logical.tolist()):
            slots[expert].append(slot)
        width = max(len(s) for s in slots)
        self.logical_to_physical = torch.tensor([s + [-1] * (width - len(s)) for s in slots],
                                                device=device)
        self.replica_counts = torch.tensor([len(s) for s in slots], device=device)

    def physical_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """(T, K) expert ids -> the slots that run them: pair i of the step takes copy
        ``i % copies`` of its expert, so a busy expert's copies share its tokens."""
        if self.replica_counts is None:
            return topk_ids
        pair = torch.arange(topk_ids.numel(), device=topk_ids.device).view_as(topk_ids)
        return self.logical_to_physical[topk_ids, pair % self.replica_counts[topk_ids]]

    def local_slots(self, expert_id: int) -> list[int]:
        """This rank's slots (0-based) that hold expert ``expert_id``."""
        if self.replica_counts is None:  # slot p holds expert p
            inside = self.expert_start <= expert_id < self.expert_end
            return [expert_id - self.expert_start] if inside else []
        held = self._placement[self.expert_start:self.expert_end]
        return [slot for slot, expert in enumerate(held) if expert == expert_id]

    def rearrange(self) -> bool:
        """EPLB: place the experts anew from the tokens they got since the last call
        (summed over the EP ranks; every EP rank calls this at the same step), moving
        each slot's weights from a rank that holds them (an all-gather of every slot).
        Returns whether the placement changed."""
        ep = self.expert_parallel
        load = (self.tokens_per_expert - self._window_start.to(self.tokens_per_expert.device))
        self._window_start = self.tokens_per_expert.clone()
        load = ep.group.all_reduce(load.clone())
        placement = torch.tensor(plan_placement(load.tolist(), self.num_slots, ep.size))
        old = torch.tensor(self._placement)
        before, after = (busiest_rank_share(load.tolist(), p.tolist(), ep.size)
                         for p in (old, placement))
        self.last_rearrangement = (before, after)
        if after >= before:  # no better than what is held: nothing moves
            return False
        source = {}  # expert -> a slot holding it now
        for slot, expert in enumerate(old.tolist()):
            source.setdefault(expert, slot)
        take = torch.tensor([source[e] for e in placement[self.expert_start:self.expert_end]
                             .tolist()], device=load.device)
        if self.experts is not None:
            self._move_quantized(take)
            self._native = None
            self._set_placement(placement)
            return True
        for name in ("w13_weight", "w2_weight"):
            every = ep.group.all_gather(self.plain_weight(name).contiguous(), dim=0)
            self._set_expert_param(name, every.index_select(0, take))
            self._panels.discard(name)
        self.expert_forms = None
        self._native = None
        self._set_placement(placement)
        self.process_weights_after_loading()
        return True

    def _move_quantized(self, take: torch.Tensor) -> None:
        """``rearrange`` for quantized experts: local slot i takes the held bytes (the
        form's tensors: kernel layout, or values and scales) of global slot take[i], by an
        all-gather of every slot's, copied into this slot's tensors in place (every
        expert of a layer is held alike: one format, one shape)."""
        group = self.expert_parallel.group
        for name in ("w13", "w2"):
            held = [getattr(expert, name).form.tensors() for expert in self.experts]
            for key in held[0]:
                parts = [h[key] for h in held]
                if any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
                    raise ValueError(f"EPLB moves a layer's experts held alike; layer "
                                     f"{self.layer_idx}'s {name} {key} differs between them")
                every = group.all_gather(torch.stack(parts), dim=0)
                for local, slot in enumerate(take.tolist()):
                    parts[local].copy_(every[slot])

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, H) -> (weights (T, K) float32, expert ids (T, K)): ``select_experts`` on
        the float32 router logits; for bf16 on the CPU loom's ``moe_route`` kernel (the
        same steps in one loop per token, its own float32 sum order; the native decoder
        stack routes through it too)."""
        ops = native_ops_for(x.device, x.dtype) if x.dtype == torch.bfloat16 else None
        if ops is not None and x.dim() == 2:
            spec = self.spec
            return tuple(ops.moe_route(x, self.gate.weight, self.e_score_correction_bias,
                                       spec.top_k, spec.scoring, spec.renormalize,
                                       spec.renormalize_min))
        router_logits = F.linear(x.float(), self.gate.weight.float())  # (T, E)
        return select_experts(router_logits, self.spec, self.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(T, H) -> (T, H), summed over the ranks."""
        if self.expert_parallel.all_to_all:
            out = self._forward_all_to_all(x)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
            return out
        ops = native_ops_for(x.device, x.dtype) if x.dtype == torch.bfloat16 else None
        native = (self.native_experts(ops) if ops is not None and x.dim() == 2
                  and x.is_contiguous() and self.graph_rows is None else None)
        if native is not None and not isinstance(native, str):
            out = ops.mixture_of_experts(x, *native)  # routes, counts, runs the experts
            self.count_forward()
        else:
            out = self._forward_modules(x)
        out = self.tp_group.all_reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def _forward_all_to_all(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts with experts spread over every data-parallel replica's ranks
        (``EPGroup.all_to_all``): this rank's tokens ``x`` (T, H) are its replica's own.

            route          (T, K) expert ids and weights, here
            dispatch       each (token, k) pair's row to the rank owning expert ids[t, k]:
                           all_to_all of the counts per rank, then of the rows and ids
            run            the experts held here on the rows received (grouped by expert)
            combine        the results back by the reverse all_to_all, each weighed by
                           its routing weight and summed into its token, here

        Under tensor parallel (the replica's tokens on each of its TP ranks) each TP rank
        dispatches its share, rows ``[tp_rank * S, (tp_rank + 1) * S)`` with S = ceil(T /
        TP), and the TP group all-gathers the combined rows. A replica with no tokens calls
        ``exchange_nothing`` instead: the same collectives, empty."""
        tp = self.tp_group
        if tp.world_size == 1:
            return self._dispatch_combine(x)
        num_tokens = x.shape[0]
        share = -(-num_tokens // tp.world_size)
        mine = x[tp.rank * share:(tp.rank + 1) * share]
        out = self._dispatch_combine(mine)
        if out.shape[0] < share:  # the last ranks' shares run short: pad to gather
            out = torch.cat([out, out.new_zeros((share - out.shape[0], out.shape[1]))])
        return tp.all_gather(out, dim=0)[:num_tokens]

    def _dispatch_combine(self, x: torch.Tensor) -> torch.Tensor:
        """``_forward_all_to_all`` for this rank's tokens ``x`` (T, H)."""
        ep = self.expert_parallel
        if x.shape[0] == 0:  # a TP rank whose share of a short step is empty
            topk_ids = torch.empty((0, self.spec.top_k), dtype=torch.int64, device=x.device)
            topk_weights = torch.empty((0, self.spec.top_k), dtype=torch.float32,
                                       device=x.device)
        else:
            topk_weights, topk_ids = self.route(x)
        counts = torch.bincount(topk_ids.flatten(), minlength=self.spec.num_experts)
        if self.tp_group.world_size > 1:  # every share's, as one rank counts a whole step
            self.tp_group.all_reduce(counts)
        self.tokens_per_expert += counts
        if self.step_tokens is not None:
            self.step_tokens += counts
        self.count_forward()
        top_k = topk_ids.shape[1]
        per_rank = self.num_slots // ep.size
        flat_ids = self.physical_ids(topk_ids).flatten()  # (T*K,) slots
        # pairs grouped by the rank owning their expert: ids [[3, 0], [1, 2]] with 2
        # experts a rank -> owners [1, 0, 0, 1] -> order (0,1) (1,0) (0,0) (1,1)
        order = torch.argsort(flat_ids // per_rank, stable=True)
        send_counts = torch.bincount(flat_ids // per_rank, minlength=ep.size)
        results = self._run_received(x.index_select(0, order // top_k), flat_ids[order],
                                     send_counts)
        weights = topk_weights.flatten()[order].to(results.dtype)
        out = torch.zeros_like(x)
        return out.index_add_(0, order // top_k, results.mul_(weights[:, None]))

    def exchange_nothing(self, hidden_size: int, dtype: torch.dtype,
                         device: torch.device) -> None:
        """A dummy step's part in this layer's all-to-alls (a replica with no tokens this
        step): sends no rows, runs what the other replicas send to its experts, and sends
        their results back. (No TP all-gather: every TP rank of the replica is here.)"""
        ep = self.expert_parallel
        self._run_received(torch.empty((0, hidden_size), dtype=dtype, device=device),
                           torch.empty(0, dtype=torch.int64, device=device),
                           torch.zeros(ep.size, dtype=torch.int64, device=device))

    def _run_received(self, rows: torch.Tensor, expert_ids: torch.Tensor,
                      send_counts: torch.Tensor) -> torch.Tensor:
        """Dispatch ``rows`` (N, H) with their ``expert_ids`` (N,), grouped by owner rank,
        ``send_counts`` (ranks,) per owner; run the received rows on the experts here;
        return each row's expert result (N, H), in ``rows``' order."""
        ep = self.expert_parallel
        recv_counts = ep.exchange_counts(send_counts)
        send, recv = send_counts.tolist(), recv_counts.tolist()
        received = ep.exchange(rows, send, recv)  # (M, H)
        received_ids = ep.exchange(expert_ids, send, recv)  # (M,)
        ones = torch.ones((received.shape[0], 1), dtype=torch.float32, device=rows.device)
        if self.experts is not None:
            results = fused_experts(received, None, None, ones, received_ids[:, None],
                                    self.expert_start, experts=self.experts)
        elif self.triton_experts:
            from loom.model.layers.triton_moe import fused_moe

            results = fused_moe(received, self.w13_weight, self.w2_weight, ones,
                                received_ids[:, None], self.expert_start)
        else:
            if self._panels and self.expert_forms is None:
                raise RuntimeError("the experts are being reloaded: "
                                   "process_weights_after_loading has not run yet")
            results = fused_experts(received, self.w13_weight, self.w2_weight, ones,
                                    received_ids[:, None], self.expert_start,
                                    self.expert_forms)
        return ep.exchange(results, recv, send)

    def _forward_modules(self, x: torch.Tensor) -> torch.Tensor:
        """The routed experts in PyTorch (this rank's part, before the all-reduce); in a
        CUDA graph's step (``graph_rows``) in shapes the routing does not change."""
        topk_weights, topk_ids = self.route(x)
        counts = expert_counts(topk_ids, self.spec.num_experts, self.graph_rows)
        self.tokens_per_expert += counts
        if self.step_tokens is not None:
            self.step_tokens += counts
        self.count_forward()
        topk_ids = self.physical_ids(topk_ids)  # (EPLB: the slots that run them)
        if self.experts is not None:
            run = fused_experts if self.graph_rows is None else dense_experts
            out = run(x, None, None, topk_weights, topk_ids, self.expert_start,
                      experts=self.experts)
        elif self.use_grouped or self.graph_rows is not None:
            if self._panels and self.expert_forms is None:
                raise RuntimeError("the experts are being reloaded: "
                                   "process_weights_after_loading has not run yet")
            if self.triton_experts:
                from loom.model.layers.triton_moe import fused_moe

                return fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                 self.expert_start)
            run = fused_experts if self.graph_rows is None else dense_experts
            out = run(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                      self.expert_start, self.expert_forms)
        else:
            out = loop_over_experts(x, self.plain_weight("w13_weight"),
                                    self.plain_weight("w2_weight"), topk_weights, topk_ids,
                                    self.expert_start)
        return out


def plan_placement(load: list[float], num_slots: int, num_ranks: int) -> list[int]:
    """EPLB's placement (vLLM's rebalance, greedy): which expert each of ``num_slots``
    slots holds, ranks taking ``num_slots / num_ranks`` consecutive slots each.

    Copies: every expert one, then each spare slot to the expert with the most tokens
    per copy. Ranks: the copies, heaviest first (an expert's tokens split evenly over
    its copies), each to the rank with room, without a copy of that expert if it can,
    carrying the least load so far. Deterministic: ties go to the lower index.

        load [9, 1, 1, 1], 6 slots, 2 ranks -> copies [3, 1, 1, 1] (3 tokens each, 1, 1, 1)
        -> rank 0: 0 0 3 (3 + 3 + 1), rank 1: 0 1 2 (3 + 1 + 1): [0, 0, 3, 0, 1, 2]
    """
    num_experts = len(load)
    copies = [1] * num_experts
    for _ in range(num_slots - num_experts):
        busiest = max(range(num_experts), key=lambda e: (load[e] / copies[e], -e))
        copies[busiest] += 1
    shares = sorted(((load[e] / copies[e], e) for e in range(num_experts)
                     for _ in range(copies[e])), key=lambda item: (-item[0], item[1]))
    per_rank = num_slots // num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    totals = [0.0] * num_ranks
    for share, expert in shares:
        rank = min((r for r in range(num_ranks) if len(held[r]) < per_rank),
                   key=lambda r: (expert in held[r], totals[r], r))
        held[rank].append(expert)
        totals[rank] += share
    return [expert for experts in held for expert in sorted(experts)]


def busiest_rank_share(load: list[float], placement: list[int], num_ranks: int) -> float:
    """The share of the tokens the busiest rank runs under ``placement`` (each expert's
    tokens split evenly over its copies): 1 / num_ranks is even; 0 with no tokens."""
    total = sum(load)
    if not total:
        return 0.0
    copies = [placement.count(e) for e in range(len(load))]
    per_rank = len(placement) // num_ranks
    return max(sum(load[e] / copies[e] for e in placement[r * per_rank:(r + 1) * per_rank])
               for r in range(num_ranks)) / total


def _bias_loader(param: nn.Parameter, loaded_weight: torch.Tensor,
                 shard_id: object = None) -> None:
    """Ernie stores the correction bias as (1, E): one group of experts."""
    param.data.copy_(loaded_weight.reshape(param.shape))


_EXPERT_WEIGHT = re.compile(r"^(?P<layer>.*\.)experts\.(?P<expert>\d+)\.(?P<name>\w+)\.weight$")


def load_expert_weights(weights: Iterable[tuple[str, torch.Tensor]], model: nn.Module,
                        loaded: set[str],
                        roles: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Load each checkpoint tensor ``<layer>.experts.<i>.<name>.weight`` whose ``name``
    is in ``roles`` (checkpoint name -> gate | up | down, e.g. Mixtral's w1 -> gate)
    into the FusedMoE ``<layer>`` of ``model`` (``FusedMoE.load_expert``), adding the
    parameter names it fills to ``loaded``; pass every other tensor on."""
    layers = {name: module for name, module in model.named_modules()
              if isinstance(module, FusedMoE)}
    for name, tensor in weights:
        match = _EXPERT_WEIGHT.match(name)
        if match is None or match["name"] not in roles:
            yield name, tensor
            continue
        layer_name = match["layer"].rstrip(".")
        if layer_name not in layers:
            raise ValueError(f"checkpoint tensor {name!r} has no matching MoE layer "
                             f"({layer_name}); is the architecture right?")
        filled = layers[layer_name].load_expert(tensor, int(match["expert"]),
                                                roles[match["name"]])
        loaded.update(f"{layer_name}.{param}" for param in filled)
