"""A mixture of experts' routed experts in one grouped matmul kernel per projection, in
Triton for CUDA (the design of vLLM's ``fused_moe``). Opt-in: ``LOOM_TRITON_MATMULS=1``
(``loom/envs.py``); ``FusedMoE`` (fused_moe.py) calls it for full-precision experts.

The T*K (token, k) assignments, numbered ``a = t * K + k``, are sorted by expert and
each expert's run padded to a whole number of ``BLOCK_M`` rows (``align_to_blocks``)::

    topk_ids [[2, 0], [2, 1]], BLOCK_M 4   (assignments 0: (t0, e2) 1: (t0, e0) ...)
    sorted_ids   1 P P P | 3 P P P | 0 2 P P      P = T*K: a padding row, never stored
    block_expert 0       | 1       | 2            num_padded 12

so that every block of rows belongs to one expert, and one launch multiplies every
block by its expert's slice of the stacked weights (E_local, N, K): no loop over
experts, no copy of the tokens. Two launches make an expert's MLP::

    h   (T*K, 2I) = x[a // K] @ w13[e]^T                 rounded to the model's dtype
    act (T*K, I)  = silu(h[:, :I]) * h[:, I:]            (``silu_and_mul``)
    y   (T*K, H)  = round(act[a] @ w2[e]^T) * weight[a]  (the weight rounded to the dtype)
    out (T, H)    = sum over k of y[t * K + k]

rounding where ``fused_experts`` (the layer's PyTorch path) rounds: each matmul's
float32 sums once to the model's dtype, the routing weight applied after, as that path
weighs an expert's output. Only the order of float32 sums and of the final sum over k
differ. Assignments to experts this rank does not hold (expert parallel) get no row
and add nothing.

What is proven (tests/model/test_triton_matmuls.py): the layer's results under Triton's
interpreter on the CPU, and a compile to cubin for sm_90 and sm_80. Not proven:
nothing has run on a GPU; speed is unmeasured; block sizes are first guesses.
Quantized experts (wint8, wint4, a GGUF file's) do not come here: each runs its two
linears (with the switch on, through ``triton_linear``'s kernels) on its segment of
the tokens, as ``fused_experts`` groups them.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from loom.model.layers.activation import silu_and_mul
from loom.model.layers.triton_linear import INTERPRETED

BLOCK_M = 16  # rows per block: each expert's run is padded to a multiple of it
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16}


@triton.jit
def _fused_moe_kernel(
        out_ptr, a_ptr, b_ptr, topk_weights_ptr, sorted_ids_ptr, block_expert_ptr,
        num_padded_ptr, N, K, num_assignments,
        stride_am, stride_be, stride_bn, stride_om,
        ROWS_PER_A: tl.constexpr, WEIGH: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_DTYPE: tl.constexpr,
        PRECISION: tl.constexpr):
    """Program p: block p // cdiv(N, BLOCK_N) of sorted rows, output features
    (p % cdiv(N, BLOCK_N)) * BLOCK_N ..; row a of the output reads row a // ROWS_PER_A
    of ``a`` (x's token for the first projection, K = top_k; itself for the second)."""
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_N)
    block = pid // blocks_n
    if block * BLOCK_M >= tl.load(num_padded_ptr):
        return
    ids = tl.load(sorted_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = ids < num_assignments
    a_rows = (ids // ROWS_PER_A).to(tl.int64)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    n = (pid % blocks_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    b_base = b_ptr + expert * stride_be + n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + k[None, :],
                    mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        b = tl.load(b_base + k[:, None], mask=k_valid[:, None] & n_valid[None, :], other=0.0)
        acc += tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE), input_precision=PRECISION)
    out = acc.to(out_ptr.dtype.element_ty)
    if WEIGH:
        weight = tl.load(topk_weights_ptr + ids, mask=row_valid, other=0.0)
        weight = weight.to(out_ptr.dtype.element_ty).to(tl.float32)
        out = (out.to(tl.float32) * weight[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ids.to(tl.int64)[:, None] * stride_om + n[None, :], out,
             mask=row_valid[:, None] & n_valid[None, :])


def align_to_blocks(topk_ids: torch.Tensor, num_local: int, expert_start: int = 0,
                    block_m: int = BLOCK_M
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids (capacity,) int32, block_expert (capacity / block_m,) int32,
    num_padded (1,) int32): the assignments grouped by local expert, each run padded to
    ``block_m`` rows with T*K (the module's picture). ``capacity`` bounds the padded
    total (T*K + E_local (block_m - 1), rounded up), so nothing waits on the GPU for
    the counts; blocks past ``num_padded`` exit at once."""
    num_assignments = topk_ids.numel()
    device = topk_ids.device
    flat = topk_ids.flatten().long() - expert_start
    mine = (flat >= 0) & (flat < num_local)
    flat = torch.where(mine, flat, num_local)  # other ranks' experts sort last, unplaced
    # (a scatter, not bincount, whose output size waits on the GPU for the largest id)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(
        0, flat, torch.ones_like(flat))[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert
    expert_of = flat[order].clamp(max=num_local - 1)
    first_of_expert = torch.cumsum(counts, 0) - counts  # in ``order``
    position = (ends - padded)[expert_of] + torch.arange(num_assignments, device=device) \
        - first_of_expert[expert_of]
    capacity = -(-(num_assignments + num_local * (block_m - 1)) // block_m) * block_m
    position = torch.where(flat[order] < num_local, position, capacity)  # a slot to drop
    sorted_ids = torch.full((capacity + 1,), num_assignments, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, position, order.to(torch.int32))
    block_starts = torch.arange(0, capacity, block_m, device=device)
    block_expert = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_local - 1)
    return sorted_ids[:capacity], block_expert.to(torch.int32), ends[-1:].to(torch.int32)


def grouped_matmul(out: torch.Tensor, a: torch.Tensor, weights: torch.Tensor,
                   sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                   num_padded: torch.Tensor, rows_per_a: int,
                   topk_weights: torch.Tensor | None = None) -> None:
    """``out[i] = a[i // rows_per_a] @ weights[e]^T`` for every assignment i placed in
    ``sorted_ids`` (e its block's expert), times ``topk_weights.flatten()[i]`` if given."""
    num_n, num_k = weights.shape[1], weights.shape[2]
    if a.stride(-1) != 1 or weights.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("the grouped matmul needs rows with contiguous features")
    constants = kernel_constants(a.dtype, topk_weights is not None, rows_per_a)
    grid = (sorted_ids.shape[0] // constants["BLOCK_M"]
            * triton.cdiv(num_n, constants["BLOCK_N"]),)
    _fused_moe_kernel[grid](
        out, a, weights, topk_weights if topk_weights is not None else out, sorted_ids,
        block_expert, num_padded, num_n, num_k, out.shape[0],
        a.stride(0), weights.stride(0), weights.stride(1), out.stride(0), **constants)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              expert_start: int = 0) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) over the experts held
    here: ``w13`` (E_local, 2I, H) gate rows then up rows, ``w2`` (E_local, H, I), global
    ids ``expert_start ..``; (T, H) in x's dtype."""
    if x.device.type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"loom's Triton fused MoE needs a CUDA device, not {x.device} "
                           "(or TRITON_INTERPRET=1, Triton's interpreter, set before loom "
                           "starts)")
    num_tokens, top_k = topk_ids.shape
    num_assignments = num_tokens * top_k
    num_local = w13.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    sorted_ids, block_expert, num_padded = align_to_blocks(topk_ids, num_local, expert_start)
    hidden = torch.empty(num_assignments, w13.shape[1], dtype=x.dtype, device=x.device)
    grouped_matmul(hidden, x, w13, sorted_ids, block_expert, num_padded, top_k)
    act = silu_and_mul(hidden)  # rows of other ranks' experts: never read
    out = torch.zeros(num_assignments, w2.shape[1], dtype=x.dtype, device=x.device)
    grouped_matmul(out, act, w2, sorted_ids, block_expert, num_padded, 1,
                   topk_weights.contiguous())
    return out.view(num_tokens, top_k, -1).sum(dim=1)


def kernel_constants(dtype: torch.dtype, weigh: bool, rows_per_a: int,
                     interpreted: bool = INTERPRETED) -> dict[str, Any]:
    """The kernel's compile-time constants: 16-row blocks (decode steps route few tokens
    to each expert), 64 output features, 64 input features per step (first guesses);
    the dot in the model's dtype (float32 under the interpreter: exact for bf16 and
    float16 operands), float32 as IEEE, not TF32."""
    dot_dtype = tl.float32 if interpreted else _TL_DTYPES[dtype]
    return dict(ROWS_PER_A=rows_per_a, WEIGH=weigh, BLOCK_M=BLOCK_M, BLOCK_N=64, BLOCK_K=64,
                DOT_DTYPE=dot_dtype, PRECISION="ieee" if dot_dtype == tl.float32 else None)
