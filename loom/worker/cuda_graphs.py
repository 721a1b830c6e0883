"""Decode steps replayed from CUDA graphs.

Eager PyTorch on a GPU is bound by the host: every kernel of a step is launched from
Python, ~0.5 ms a decoder layer whatever the batch (benchmarks/cuda.md: a 1B model's
step 8.7 ms against a roofline of 0.5). A step that only decodes (one new token per
request) is captured once as a CUDA graph and from then on replayed: one launch.

A graph fixes every shape and every address it reads:

- **Batch.** The step's requests are padded up to the next batch bucket
  (``batch_buckets``). A padding row repeats the first request: its token, position,
  slot, block table row and length. It writes that request's own K/V, computed from the
  same inputs, to the same slot, so the write changes nothing; its output is dropped.
- **Context.** The torch attention backend's decode gathers the same number of
  positions for every request and masks those past each one's length
  (attention/torch_backend.py). In a graph that number is the step's context bucket,
  a power of two at least the longest context, so each (batch, context) pair of
  buckets has its own graph. Contexts past the largest bucket run eagerly.
- **Inputs.** The graph reads static buffers (token ids, positions, slots, lengths,
  block tables); each step copies its own into them, then replays. Block table
  columns past a step's own stay as an earlier step left them: they index only
  positions past every length, which attention masks and never gathers.
- **Verification steps.** Under speculative decoding a step whose every request runs
  its last token and k drafts (k + 1 tokens each) is captured per (batch, context,
  k + 1): the static token buffers hold ``batch * (k + 1)`` rows, request i's at
  ``i*(k+1) .. i*(k+1) + k``, ``query_start_loc`` is 0, k + 1, 2(k + 1), ..., and a
  padding request repeats request 0's k + 1 rows (the same K/V to the same slots). The
  torch backend batches such a step over the cache as it batches decode
  (``AttentionMetadata.query_len``: a gather of the context bucket, each query masked
  causally by its position ``seq_len - (k + 1) + j`` read on the device, and by the
  sliding window), never through the ``*_cpu`` lists, which hold the buckets; the
  Triton kernels read ``seq_lens`` and ``query_start_loc`` as tensors and take
  ``max_query_len`` (k + 1) and ``max_seq_len`` (the context bucket) only for the
  launch. A step whose requests have different numbers of drafts (the n-gram proposer
  finds fewer for some) runs eagerly. The draft model's own steps (``DraftModelProposer``:
  k one-token forwards of its model on its own KV cache, after a catch-up forward over
  the target's step) run eagerly: it would need graphs of its own, over its model and
  cache, with their memory counted. Proven with ``capture=False`` on the CPU, torch
  backend (a tiny Llama and Gemma 3, drafts accepted in part, in whole and not at all);
  not run on a GPU yet.
- **Mixed steps** (prefill chunks beside decodes), on the Triton attention backend only:
  its kernels read the step's lengths and query starts as tensors, where the torch
  backend runs one SDPA a prefilling request, shaped by host lists. A step of T tokens
  (up to ``MAX_MIXED_TOKENS``) is padded to a token bucket N (powers of two) and always
  N requests: the N - T padding tokens are one-token requests repeating the step's last
  token (id, position, slot, its request's length and block table row; that token is
  its request's last query, so each copy computes the same query over the same keys and
  writes the same K/V to the same slot), the remaining requests have no tokens. The
  host-side values are the bucket's (``max_query_len`` N, above 1: the query-block
  launch; ``max_seq_len`` max_model_len, unread off pure decode). Hybrid KV caches and
  MoE models keep mixed steps eager (the experts would run dense over a prefill's
  tokens), as do other backends. Proven with ``capture=False`` on the CPU, the kernels
  under Triton's interpreter (a tiny Llama, prefill chunks mixed with decodes: greedy
  tokens equal the plain runner's); not run on a GPU yet. The static block table is N
  rows of max_model_len's blocks (512 x 2,048 int32 at 32k tokens and block 16: 4 MiB).
- **Experts.** An MoE layer's grouped path takes its shapes from the routing (each
  expert's tokens, counted on the host). In a graph's step (``graph_safe_experts``,
  layers/fused_moe.py) every expert runs on the step's rows and each row keeps its own
  top-k's results (``dense_experts``: the same math, every expert's weights read each
  step), or the Triton fused MoE runs over its worst-case padded buffers where it is on;
  the routing counts are a device scatter weighed by ``real_rows`` (1 for the step's
  rows, 0 for padding), so ``ModelRunnerOutput.expert_tokens`` counts no padding row.
  Proven with ``capture=False`` on the CPU (tests/worker/test_cuda_graphs.py); not run
  on a GPU yet.
- **KV cache groups.** A hybrid KV cache (Gemma 3: full-attention and sliding-window
  groups, kv_cache_groups.py) has a slot mapping and block table per group; each has
  static buffers of its own, staged and padded as group 0's, and the graph's metadata
  reads each group through them (``AttentionMetadata.group_metadata``). Every group
  gathers the same context bucket: a sliding window's group masks the positions before
  its window as well, and its hidden positions read the last key again, so its freed
  blocks are never read (attention/torch_backend.py). Proven with ``capture=False`` on
  the CPU (a tiny Gemma 3, contexts past its window); not run on a GPU yet.
- **Tensor parallel.** Every rank gets the same scheduler output and builds the same
  metadata, so every rank pads to the same buckets and misses, captures and replays the
  same graphs at the same steps; each rank's graph holds its NCCL collectives
  (ProcessGroupNCCL's are capturable, on the capture stream). A capture that fails on
  one rank turns graphs off on all: after each capture the ranks all-reduce a failure
  flag over a gloo group beside the NCCL one (``TPGroup.any_rank``; once a capture, never
  a step), so no rank replays a graph while another runs the step eagerly. Proven with
  ``capture=False`` over two gloo ranks on the CPU (tests/worker/test_cuda_graphs_tp.py);
  NCCL inside a captured graph is not run on a GPU yet. ``collective_bytes`` counts a
  graph's all-reduces once, at its capture, not at each replay.

Graphs are captured the first time their buckets run, on one stream of their own (a
capture runs the step once eagerly on it first, for real, as the graph then will
again), share one memory pool, and are dropped with it whenever what they captured
moves: the KV cache is re-allocated, or the weights are updated, freed or re-derived
(``ModelRunner.drop_cuda_graphs``). The KV cache's sizing leaves the pool
``graphs_memory_estimate``.

Steps that run eagerly, as before: any with a prefill (on the Triton backend: past
``MAX_MIXED_TOKENS``, or of a hybrid KV cache or MoE model), or with draft tokens
unevenly spread or more than the speculative config's k a request (on the Triton
backend these are mixed steps), or whose rope
turns tokens by their lengths (``rope_lengths``: dynamic NTK, longrope, past the original
context; layers/rotary.py), or with LoRA adapters on (``lora_slots``: a graph's metadata
carries none, and the PyTorch path groups rows by adapter on the host); models with
experts spread over ranks (expert parallel: the all-to-all reads each step's counts on
the host); and every step under ``enforce_eager``. A capture that fails is logged once
and turns graphs off for the process, on every tensor-parallel rank (the runner makes
none for a later KV cache): the step, and every later one, runs eagerly.
"""

from __future__ import annotations

import logging
import dataclasses
from dataclasses import dataclass
from functools import partial

import torch

from loom.distributed.parallel_state import SINGLE, TPGroup
from loom.model.attention.metadata import AttentionMetadata, set_forward_context
from loom.model.layers.fused_moe import FusedMoE, graph_safe_experts

logger = logging.getLogger(__name__)

MAX_CONTEXT = 8192  # the longest context a graph gathers (vLLM's max_seq_len_to_capture)
# A graph's attention gathers batch * context positions of K and V per layer: past this
# many, the step runs eagerly rather than hold the gather's memory in the graphs' pool.
MAX_GATHERED_POSITIONS = 1 << 17
MIN_CONTEXT = 256
# Mixed steps (prefills with decodes) are captured up to this many tokens, in buckets of
# powers of two from MIN_MIXED_TOKENS; longer steps are compute-bound: they run eagerly.
MAX_MIXED_TOKENS = 512
MIN_MIXED_TOKENS = 16


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to max_num_seqs (itself the last)."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs]
    sizes += range(8, max_num_seqs, 8)
    return sizes + [max_num_seqs]


def context_buckets(max_context: int, block_size: int) -> list[int]:
    """Powers of two from MIN_CONTEXT (or a block) up to ``max_context``, itself last,
    each a whole number of blocks."""
    def whole_blocks(n: int) -> int:
        return -(-n // block_size) * block_size
    top = whole_blocks(max_context)
    sizes, size = [], max(MIN_CONTEXT, block_size)
    while size < top:
        sizes.append(whole_blocks(size))
        size *= 2
    return sizes + [top]


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Powers of two from MIN_MIXED_TOKENS below ``max_tokens``, then itself."""
    sizes, size = [], MIN_MIXED_TOKENS
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return sizes + [max_tokens]


def largest_gather(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """The most positions (requests x context) one captured step's attention gathers."""
    contexts = context_buckets(min(max_model_len, MAX_CONTEXT), block_size)
    return max((b * c for b in batch_buckets(max_num_seqs) for c in contexts
                if b * c <= MAX_GATHERED_POSITIONS), default=0)


CUBLAS_WORKSPACE_BYTES = 64 << 20  # the capture stream's (32 MiB on Hopper), with room


def graphs_memory_estimate(model: torch.nn.Module, max_num_seqs: int, max_model_len: int,
                           block_size: int, dtype: torch.dtype,
                           num_kv_cache_groups: int = 1, max_query_len: int = 1,
                           max_mixed_tokens: int = 0) -> int:
    """An upper estimate of the bytes the graphs' memory pool keeps: one layer's decode
    attention at the largest captured step (K and V gathered; scores, softmax in
    float32 and probabilities; the mask; the gather's int64 indices and their
    intermediates), the other KV cache groups' gather indices and masks (each group's
    are built once a step and held through it), the largest linear on the PyTorch
    quantized path dequantized (its float32 weight and the two float32 temporaries that
    make it), and the capture stream's cuBLAS workspace. Activations between layers are
    a few rows: ignored. A verification step of ``max_query_len`` tokens a request holds
    that many rows of scores, probabilities and mask for each gathered position. A mixed
    step of ``max_mixed_tokens`` (the Triton backend's) holds a few of its widest
    activations: four rows of the widest linear's output a token, the kernels gathering
    nothing."""
    from loom.model.layers.linear import LinearBase

    elt = torch.empty((), dtype=dtype).element_size()
    per_position = max(2 * a.num_kv_heads * a.head_dim * elt
                       + max_query_len * (a.num_heads * (2 * elt + 8) + elt) + 6 * 8
                       for a in model.attention_layers)
    per_position += (num_kv_cache_groups - 1) * (8 + elt)
    dequantized = max((m.output_size * m.input_size for m in model.modules()
                       if isinstance(m, LinearBase) and m.on_reference_path),
                      default=0)
    widest = max((m.output_size for m in model.modules() if isinstance(m, LinearBase)),
                 default=0)
    return (largest_gather(max_num_seqs, max_model_len, block_size) * per_position
            + 3 * 4 * dequantized + 4 * max_mixed_tokens * widest * elt
            + CUBLAS_WORKSPACE_BYTES)


def mixed_steps_apply(model: torch.nn.Module, num_kv_cache_groups: int) -> bool:
    """Whether a model's mixed prefill/decode steps are captured: on the Triton backend
    only (its kernels read the step's lengths and query starts as tensors; the torch
    backend loops over requests on the host), one KV cache group, no experts (a
    prefill's tokens through every expert)."""
    return (num_kv_cache_groups == 1
            and not any(isinstance(m, FusedMoE) for m in model.modules())
            and all(getattr(a.impl, "name", None) == "triton" for a in model.attention_layers))


def _bucket(buckets: list[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass
class _StaticInputs:
    """The buffers every graph reads, sized for the largest batch bucket."""

    # B requests of up to Q tokens each (Q: max_query_len, 1 without drafts); a step of
    # q tokens a request uses the first B*q token rows, request i's at i*q .. i*q + q-1
    input_ids: torch.Tensor  # (B*Q,) int64
    positions: torch.Tensor  # (B*Q,) int64
    slot_mapping: torch.Tensor  # (B*Q,) int64
    seq_lens: torch.Tensor  # (B,) int32
    block_table: torch.Tensor  # (B, max_blocks_per_seq) int32
    # q -> (B + 1,) int32: 0, q, 2q, ... (q tokens each), for q = 1..Q
    query_start_loc: dict[int, torch.Tensor]
    # KV cache groups 1.. (a hybrid layout), as AttentionMetadata.group_metadata: each
    # group's slots (B*Q,) int64 and block table (B, max_blocks_per_seq) int32
    group_slot_mapping: list[torch.Tensor]
    group_block_table: list[torch.Tensor]

    @classmethod
    def allocate(cls, max_batch: int, max_query_len: int, max_blocks: int, num_groups: int,
                 device: torch.device) -> _StaticInputs:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)
        others = range(num_groups - 1)
        rows = max_batch * max_query_len
        starts = {q: torch.arange(0, (max_batch + 1) * q, q, dtype=torch.int32, device=device)
                  for q in range(1, max_query_len + 1)}
        return cls(zeros(rows), zeros(rows), zeros(rows),
                   zeros(max_batch, dtype=torch.int32),
                   zeros(max_batch, max_blocks, dtype=torch.int32), starts,
                   [zeros(rows) for _ in others],
                   [zeros(max_batch, max_blocks, dtype=torch.int32) for _ in others])

    def group_inputs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(slot mapping, block table) of every KV cache group, group 0 first."""
        return [(self.slot_mapping, self.block_table),
                *zip(self.group_slot_mapping, self.group_block_table)]


@dataclass
class _MixedInputs:
    """The buffers every mixed step's graph reads: N tokens and N requests for a token
    bucket N (a step's R requests have at most its T <= N tokens, so R + N - T <= N)."""

    input_ids: torch.Tensor  # (N,) int64
    positions: torch.Tensor  # (N,) int64
    slot_mapping: torch.Tensor  # (N,) int64
    query_start_loc: torch.Tensor  # (N + 1,) int32
    seq_lens: torch.Tensor  # (N,) int32
    block_table: torch.Tensor  # (N, max_blocks_per_seq) int32

    @classmethod
    def allocate(cls, max_tokens: int, max_blocks: int, device: torch.device) -> _MixedInputs:
        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)
        return cls(zeros(max_tokens), zeros(max_tokens), zeros(max_tokens),
                   zeros(max_tokens + 1, dtype=torch.int32), zeros(max_tokens, dtype=torch.int32),
                   zeros(max_tokens, max_blocks, dtype=torch.int32))


class _Graph:
    """One captured step; ``replay`` runs it on what the static inputs hold."""

    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph, self.output = graph, output

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.output


class _Uncaptured:
    """The same padded step on the same static inputs, run eagerly (``capture=False``):
    what a graph replays, on a device without graphs, for tests."""

    def __init__(self, forward) -> None:
        self.forward = forward

    def replay(self) -> torch.Tensor:
        return self.forward()


class DecodeGraphs:
    """A model's pure-decode steps, and its verification steps of up to
    ``max_query_len`` tokens a request, replayed from CUDA graphs, one per (batch,
    context, tokens a request) triple of buckets; ``run`` returns a step's hidden
    states, or None where the step runs eagerly."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_model_len: int,
                 block_size: int, device: torch.device, capture: bool = True,
                 num_kv_cache_groups: int = 1, tp_group: TPGroup = SINGLE,
                 max_query_len: int = 1, max_mixed_tokens: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.max_query_len = max_query_len
        self.max_model_len = max_model_len
        self.capture = capture
        self.num_kv_cache_groups = num_kv_cache_groups
        self.tp_group = tp_group
        self.batch_buckets = batch_buckets(max_num_seqs)
        self.context_buckets = context_buckets(min(max_model_len, MAX_CONTEXT), block_size)
        max_blocks = -(-self.context_buckets[-1] // block_size)
        self.inputs = _StaticInputs.allocate(self.batch_buckets[-1], max_query_len,
                                             max_blocks, num_kv_cache_groups, device)
        self.graphs: dict[tuple[int, int, int], _Graph | _Uncaptured] = {}
        # One stream for every warm-up and capture: cuBLAS keeps a workspace per
        # (handle, stream), made by the eager warm-up outside the graphs' pool; a fresh
        # stream per capture would leave one behind each time (32 MiB on Hopper).
        self.stream = torch.cuda.Stream(device) if capture else None
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.disabled: str | None = None  # why graphs were turned off, once they are
        self.replays = 0
        # MoE layers run in shapes the routing does not change and count only the rows
        # real_rows marks (1: the step's, 0: padding); a replay runs no Python, so the
        # modules' on_replay hooks (their forward counts) are called after it
        self.moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.real_rows = torch.zeros(self.batch_buckets[-1] * max_query_len, dtype=torch.int64,
                                     device=device)
        self._on_replay = [m.on_replay for m in model.modules()
                           if callable(getattr(m, "on_replay", None))]
        mixed = max_mixed_tokens > 0 and mixed_steps_apply(model, num_kv_cache_groups)
        self.mixed_buckets = mixed_token_buckets(max_mixed_tokens) if mixed else []
        self.mixed_inputs = (_MixedInputs.allocate(self.mixed_buckets[-1],
                                                   -(-max_model_len // block_size), device)
                             if mixed else None)
        self.mixed_graphs: dict[int, _Graph | _Uncaptured] = {}

    def clear(self) -> None:
        """Drop every graph (what they read moved); later steps capture them again, in
        a fresh pool."""
        self.graphs.clear()
        self.mixed_graphs.clear()
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()

    def buckets_for(self, metadata: AttentionMetadata) -> tuple[int, int, int] | None:
        """The (batch, context, tokens a request) buckets a step runs in, or None: it
        runs eagerly. Tokens a request: 1 for a decode step, k + 1 for a verification
        step whose every request runs its last token and k drafts; a step whose
        requests have different counts (fewer drafts for some) runs eagerly."""
        query_len = metadata.max_query_len
        if (self.disabled or query_len > self.max_query_len
                or metadata.num_tokens != metadata.num_reqs * query_len
                or len(metadata.group_metadata) != self.num_kv_cache_groups - 1
                or metadata.rope_lengths is not None  # (cos and sin computed per step)
                or metadata.lora_slots is not None):  # (adapters grouped on the host)
            return None
        batch = _bucket(self.batch_buckets, metadata.num_reqs)
        context = _bucket(self.context_buckets, metadata.max_seq_len)
        if batch is None or context is None or batch * context > MAX_GATHERED_POSITIONS:
            return None
        width = self.inputs.block_table.shape[1]
        if any(group.block_table.shape[1] > width
               for group in (metadata, *metadata.group_metadata)):
            return None
        return batch, context, query_len

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            metadata: AttentionMetadata) -> torch.Tensor | None:
        """The step's hidden states (num_tokens, hidden), replayed; None: run it eagerly.
        The result is the graph's own output buffer: read it before the next step."""
        buckets = self.buckets_for(metadata)
        if buckets is None:
            return self._run_mixed(input_ids, positions, metadata)
        batch, context, query_len = buckets
        n = metadata.num_reqs
        self._stage(n, batch, query_len, input_ids, positions, metadata)
        self.real_rows[:n * query_len].fill_(1)
        self.real_rows[n * query_len:batch * query_len].zero_()
        graph = self.graphs.get(buckets)
        if graph is None:
            graph = self._capture(
                f"a step of batch {batch}, context {context}, {query_len} tokens a request",
                partial(self._forward, batch, context, query_len))
            if graph is None:
                return None
            self.graphs[buckets] = graph
        self.replays += 1
        output = graph.replay()[:n * query_len]
        if isinstance(graph, _Graph):
            for hook in self._on_replay:
                hook()
        return output

    def mixed_bucket_for(self, metadata: AttentionMetadata) -> int | None:
        """The token bucket a mixed step (any query lengths) runs in, or None: eagerly."""
        if (self.disabled or not self.mixed_buckets or metadata.group_metadata
                or metadata.rope_lengths is not None or metadata.lora_slots is not None
                or metadata.bidirectional_spans
                or metadata.block_table.shape[1] > self.mixed_inputs.block_table.shape[1]):
            return None
        return _bucket(self.mixed_buckets, metadata.num_tokens)

    def _run_mixed(self, input_ids: torch.Tensor, positions: torch.Tensor,
                   metadata: AttentionMetadata) -> torch.Tensor | None:
        tokens = self.mixed_bucket_for(metadata)
        if tokens is None:
            return None
        self._stage_mixed(tokens, input_ids, positions, metadata)
        graph = self.mixed_graphs.get(tokens)
        if graph is None:
            graph = self._capture(f"a mixed step of {tokens} tokens",
                                  partial(self._forward_mixed, tokens))
            if graph is None:
                return None
            self.mixed_graphs[tokens] = graph
        self.replays += 1
        return graph.replay()[:metadata.num_tokens]

    def _stage_mixed(self, size: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     metadata: AttentionMetadata) -> None:
        """Copy a step of T tokens and R requests into the mixed inputs of ``size`` N.
        The N - T padding tokens are one-token requests, each the step's last token
        again: its id, position and slot, its request's length and block table row.
        The last token is its request's last query, so each copy computes what it does,
        layer after layer (the same query over the same keys), and writes the same K/V
        to the same slot. Requests R + N - T .. N - 1 have no tokens (query starts N):
        their kernel programs exit at once.

            T = 5, R = 2, N = 8: query_start_loc [0, 3, 5, 6, 7, 8, 8, 8, 8]"""
        s, num_tokens, num_reqs = self.mixed_inputs, metadata.num_tokens, metadata.num_reqs
        pad = size - num_tokens
        for buffer, values in ((s.input_ids, input_ids), (s.positions, positions),
                               (s.slot_mapping, metadata.slot_mapping)):
            buffer[:num_tokens].copy_(values)
            buffer[num_tokens:size].copy_(buffer[num_tokens - 1:num_tokens].expand(pad))
        starts = metadata.query_start_loc_cpu + list(range(num_tokens + 1, size + 1))
        starts += [size] * (size + 1 - len(starts))
        s.query_start_loc[:size + 1].copy_(torch.tensor(starts, dtype=torch.int32))
        s.seq_lens[:num_reqs].copy_(metadata.seq_lens)
        s.seq_lens[num_reqs:size].copy_(s.seq_lens[num_reqs - 1:num_reqs].expand(
            size - num_reqs))
        width = metadata.block_table.shape[1]
        s.block_table[:num_reqs, :width].copy_(metadata.block_table)
        s.block_table[num_reqs:size].copy_(s.block_table[num_reqs - 1:num_reqs].expand(
            size - num_reqs, -1))

    def _forward_mixed(self, size: int, counted: bool = True) -> torch.Tensor:
        """The padded mixed step on the mixed inputs. What the host reads of it is the
        bucket's: ``max_query_len`` N (above 1: the kernels' query-block launch) and
        ``max_seq_len`` max_model_len (unread for a step that is not pure decode); the
        ``*_cpu`` lists are placeholders the Triton backend never reads."""
        s = self.mixed_inputs
        metadata = AttentionMetadata(
            slot_mapping=s.slot_mapping[:size], query_start_loc=s.query_start_loc[:size + 1],
            seq_lens=s.seq_lens[:size], block_table=s.block_table[:size],
            query_start_loc_cpu=list(range(size + 1)), seq_lens_cpu=[self.max_model_len] * size,
            max_query_len=max(size, 2), max_seq_len=self.max_model_len,
            block_size=self.block_size)
        with set_forward_context(metadata):
            return self.model(s.input_ids[:size], s.positions[:size])

    def _stage(self, n: int, batch: int, query_len: int, input_ids: torch.Tensor,
               positions: torch.Tensor, metadata: AttentionMetadata) -> None:
        """Copy the step into the static inputs, each KV cache group's slots and block
        table into its own; requests n..batch repeat request 0: its ``query_len`` token
        rows (the same tokens at the same positions, whose K/V go to the same slots
        again), its length and its block table rows."""
        s = self.inputs
        groups = (metadata, *metadata.group_metadata)
        token_rows = [(s.input_ids, input_ids), (s.positions, positions)]
        token_rows += [(slots, group.slot_mapping)
                       for (slots, _), group in zip(s.group_inputs(), groups)]
        # (B*q,) -> (B, q): a request's tokens as one row
        rows = [(buffer[:batch * query_len].view(batch, query_len), values.view(n, query_len))
                for buffer, values in token_rows]
        rows.append((s.seq_lens, metadata.seq_lens))
        for buffer, values in rows:
            buffer[:n].copy_(values)
            if batch > n:
                buffer[n:batch].copy_(buffer[:1].expand(batch - n, *buffer.shape[1:]))
        for (_, table), group in zip(s.group_inputs(), groups):
            table[:n, :group.block_table.shape[1]].copy_(group.block_table)
            if batch > n:
                table[n:batch].copy_(table[:1].expand(batch - n, -1))

    def _metadata(self, batch: int, context: int, query_len: int) -> AttentionMetadata:
        """A step of ``batch`` requests of ``query_len`` tokens each over the static
        inputs, whose longest context is taken as ``context``: a fresh object each time,
        since the backend caches what it derives on it (those derivations must be
        captured too). What a backend reads on the host is the buckets': the ``*_cpu``
        lists (every context taken as ``context``), ``max_query_len`` and
        ``max_seq_len``; a verification step's attention (``query_len``) reads the
        lengths on the device (torch_backend.py's batched path; the Triton kernels read
        ``seq_lens`` and ``query_start_loc`` as tensors and take the maxima only for the
        launch). KV cache groups 1.. are the same step through their own static slots
        and tables: the same context bucket, a sliding window's group masking what lies
        before it (attention/torch_backend.py)."""
        s = self.inputs
        tokens = batch * query_len
        metadata = AttentionMetadata(
            slot_mapping=s.slot_mapping[:tokens],
            query_start_loc=s.query_start_loc[query_len][:batch + 1],
            seq_lens=s.seq_lens[:batch], block_table=s.block_table[:batch],
            query_start_loc_cpu=list(range(0, tokens + 1, query_len)),
            seq_lens_cpu=[context] * batch, max_query_len=query_len, max_seq_len=context,
            block_size=self.block_size, query_len=query_len if query_len > 1 else None)
        metadata.group_metadata = [
            dataclasses.replace(metadata, slot_mapping=slots[:tokens],
                                block_table=table[:batch], group_metadata=[])
            for slots, table in zip(s.group_slot_mapping, s.group_block_table)]
        return metadata

    def _forward(self, batch: int, context: int, query_len: int,
                 counted: bool = True) -> torch.Tensor:
        """The padded step on the static inputs; ``counted=False``: its MoE layers count
        no row (the warm-up before a capture, whose step the replay then counts)."""
        tokens = batch * query_len
        rows = self.real_rows[:tokens]
        if not counted:
            rows = torch.zeros_like(rows)
        with (set_forward_context(self._metadata(batch, context, query_len)),
              graph_safe_experts(self.moe_layers, rows)):
            return self.model(self.inputs.input_ids[:tokens], self.inputs.positions[:tokens])

    def _capture(self, what: str, forward) -> _Graph | _Uncaptured | None:
        """The step's graph, made on every tensor-parallel rank or on none: each rank
        captures, then one all-reduce on the ranks' host group (gloo) says whether any
        failed; if one did, all turn graphs off together, rather than one replaying
        while another waits in an eager step's collective. Every rank reaches this at
        the same step: the ranks run the same steps on the same metadata, so they pick
        the same buckets and miss the same graphs."""
        try:
            graph, failure = self._record(forward), None
        except Exception as exc:  # noqa: BLE001 - any failure: eager from now on
            graph, failure = None, f"{type(exc).__name__}: {exc}".splitlines()[0]
        if self.tp_group.any_rank(failure is not None) and failure is None:
            failure = "a capture failed on another tensor-parallel rank"
        if failure is not None:
            self.disabled = failure
            logger.warning("CUDA graphs off for this process, every step runs eagerly: "
                           "capturing %s failed (%s)", what, failure)
            self.clear()
            return None
        logger.debug("captured %s", what)
        return graph

    def _record(self, forward) -> _Graph | _Uncaptured:
        """Capture ``forward``'s step on this rank (``capture=False``: its uncaptured
        stand-in); ``forward(counted=False)`` is the warm-up's."""
        if not self.capture:
            return _Uncaptured(forward)
        previous = torch.cuda.current_stream()
        try:
            # Once eagerly on the capture stream first (lazy initialisation, cuBLAS's
            # workspace), as torch.cuda.graph asks; it computes this very step, writing
            # the K/V the replay will write again (counting no MoE routing: the replay
            # counts the step).
            self.stream.wait_stream(previous)
            try:
                with torch.cuda.stream(self.stream):
                    forward(counted=False)
            finally:
                previous.wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream,
                                  capture_error_mode="thread_local"):
                output = forward()
        except Exception:
            # a capture that failed may leave its stream current: every later step,
            # and what other threads order after it, runs on the step's own stream
            torch.cuda.set_stream(previous)
            torch.cuda.synchronize()
            raise
        return _Graph(graph, output)
