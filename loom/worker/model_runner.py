"""ModelRunner: turns a SchedulerOutput into tensors, runs the model, samples.

It never decides anything. It mirrors each scheduled request from the diffs in
``SchedulerOutput`` (full data once, then new tokens and new blocks), lays the
step's tokens out flat, requests contiguous in the scheduler's order, and samples
one token for every request whose computed tokens reach its known tokens.

With speculative decoding a request's scheduled tokens run past its known tokens
into its drafts; it gets one logits row per draft plus one, and the rejection
sampler keeps the accepted drafts and samples one more. After sampling, rank 0's
proposer drafts the next step's tokens (``ModelRunnerOutput.spec_token_ids``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from loom.config import EngineConfig
from loom.core.wire import (ModelRunnerOutput, MultiModalFeature, NewRequestData,
                            SampleLogprobs, SchedulerOutput)
from loom.distributed.parallel_state import SINGLE, TPGroup, across_replicas
from loom.model.attention.kv_cache_groups import KVCacheGroups
from loom.model.attention.kv_layout import is_quantized_kv, kv_cache_dtype
from loom.model.attention.metadata import AttentionMetadata, set_forward_context
from loom.model.attention.moba import describe_moba, enable_moba
from loom.model.layers import logits_processors
from loom.model.kernel_replay import forget_recordings
from loom.progress import progress
from loom.model.layers.rotary import LengthScaledRotaryEmbedding
from loom.model.layers.sampler import Sampler, SamplingMetadata, gather_logprobs
from loom.model.layers.scratch import reserve
from loom.model.loader import kv_cache_bytes_per_block, load_model, model_hf_config
from loom.sampling_params import SamplingParams
from loom.spec_decode.draft_model import DraftModelProposer
from loom.spec_decode.ngram_proposer import NgramProposer
from loom.spec_decode.rejection_sampler import RejectionSampler
from loom.worker.cuda_graphs import (
    MAX_MIXED_TOKENS,
    DecodeGraphs,
    graphs_memory_estimate,
    mixed_steps_apply,
)
from loom.worker.lora_manager import LoRAManager

logger = logging.getLogger(__name__)

_PROMPT_LOGPROBS_CHUNK = 512  # prompt positions whose logits are materialised at once
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    return _TORCH_DTYPES[name]


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + output tokens the worker knows of
    num_prompt_tokens: int
    sampling_params: SamplingParams
    stop_ids_for_min_tokens: list[int]  # eos (unless ignore_eos) + stop_token_ids
    block_ids: list[int] = field(default_factory=list)
    group_block_ids: list[list[int]] = field(default_factory=list)  # KV cache groups 1..
    # The scheduler's count when it scheduled this step: set from NewRequestData or
    # CachedRequestData every step the request runs, never advanced here (the
    # scheduler advances its own after the step, and rolls back rejected drafts).
    num_computed_tokens: int = 0
    generator: torch.Generator | None = None
    # A pooling request's running pool over the chunks prefilled so far (MEAN: the sum
    # of its hidden states in float32; CLS: the first token's)
    pooled: torch.Tensor | None = None
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    # M-RoPE models, a request with images: its prompt's (3, P) positions, and the
    # delta of every position after them (i + delta on all three axes)
    mrope_positions: np.ndarray | None = None
    mrope_delta: int = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


class ModelRunner:
    def __init__(self, config: EngineConfig, device: torch.device, tp_group: TPGroup = SINGLE):
        self.config = config
        self.device = device
        self.tp_group = tp_group
        self.dtype = torch_dtype(config.model.dtype)
        self.block_size = config.cache.block_size
        self.hf_config = model_hf_config(config.model)
        self.model: torch.nn.Module | None = None
        self.rope_scales_past: int | None = None  # set by load_model
        self.sampler = Sampler(config.model.logprobs_mode)
        self.logits_processors = logits_processors.load(config.model.logits_processors)
        self.rejection_sampler = RejectionSampler(config.model.logprobs_mode)
        self.requests: dict[str, CachedRequestState] = {}
        # The last step's sampling rows and their metadata, while reusable (_sampling_metadata)
        self._last_sampling: tuple[list[CachedRequestState], SamplingMetadata] | None = None
        self.kv_caches: list[torch.Tensor] = []
        # Where the KV cache's one allocation comes from: (shape, dtype) -> tensor;
        # None: torch.empty on the device (a KV connector may put it in shared memory).
        self.kv_cache_allocator = None
        # Decode and verification steps (on the Triton backend mixed steps too) replayed
        # from CUDA graphs (cuda_graphs.py); made with each real KV cache where they
        # apply, dropped when the cache or the weights change.
        self.cuda_graphs: DecodeGraphs | None = None
        self.lora: LoRAManager | None = None  # LoRA adapters' slots (load_model)
        # Multimodal models: each image's rows by its content hash, made when its first
        # placeholder token runs and kept while a request still has tokens of it to run
        # (vLLM's encoder cache; the scheduler budgets the encoding, core/scheduler.py)
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self._graphs_said: str | None = ""  # what was last logged of them: said once
        self._eplb_steps = 0  # steps run, for EPLB's window (--eplb-window-size)
        self.eplb_rearrangements = 0  # MoE layers placed anew by EPLB so far
        self._graphs_failed: str | None = None  # a capture's failure: none again
        self.early_stop = config.early_stop is not None and config.early_stop.enable_early_stop
        # Proposers run on rank 0 only, after sampling.
        spec = config.speculative
        self.ngram_proposer = self.draft_proposer = None
        if spec is not None and spec.method == "ngram":
            self.ngram_proposer = NgramProposer(spec.num_speculative_tokens,
                                                spec.prompt_lookup_min, spec.prompt_lookup_max)
        elif spec is not None and tp_group.rank == 0:
            self.draft_proposer = DraftModelProposer(config, device, self.dtype)

    # ----------------------------------------------------------------- set-up

    def load_model(self) -> None:
        chosen = self.config.model.attention_backend
        self.model = load_model(self.config.model.model, self.hf_config, dtype=self.dtype,
                                device=self.device, tp_group=self.tp_group,
                                attention_backend=chosen,
                                quantization=self.config.model.quantization,
                                quantization_group_size=self.config.model.quantization_group_size,
                                lm_head_fp32=self.config.model.lm_head_fp32,
                                expert_parallel_size=self.config.parallel.expert_parallel_size,
                                max_model_len=self.config.model.max_model_len,
                                replicas_group=across_replicas(),
                                num_redundant_experts=self.config.parallel.num_redundant_experts)
        # the original context of a rope whose frequencies depend on the sequence's
        # length (the shortest, if several): steps past it carry each token's length
        self.rope_scales_past = min((module.scales_past for module in self.model.modules()
                                     if isinstance(module, LengthScaledRotaryEmbedding)),
                                    default=None)
        if self.config.moba_attention is not None:  # MoBA on the full-attention layers
            layers = enable_moba(self.model, self.config.moba_attention)
            if self.tp_group.rank == 0:
                describe_moba(self.config.moba_attention, layers,
                              len(getattr(self.model, "attention_layers", ())))
        if self.tp_group.rank == 0 and getattr(self.model, "is_encoder_only", False):
            logger.info("attention: the encoder's own, both ways within each prompt, with "
                        "no KV cache (layers/encoder_attention.py)")
        elif self.tp_group.rank == 0:
            backend = self.model.attention_layers[0].impl.name
            logger.info("attention backend: %s%s", backend,
                        " (auto)" if chosen == "auto" else "")
        self.vocab_size = self.hf_config.vocab_size
        self.lora = self._load_loras()
        self._bind_expert_counts()
        across = across_replicas()
        if across is not None and across.rank == 0 and self.moe_layers:
            ep = self.moe_layers[0].expert_parallel
            progress(f"expert parallel over {ep.size} ranks of "
                     f"{self.config.parallel.data_parallel_size} data-parallel replicas: rank r "
                     f"holds experts [r*{self.moe_layers[0].spec.num_experts}/{ep.size}, "
                     f"(r+1)*...), tokens travel to them by all-to-all")
        if self.draft_proposer is not None:
            self.draft_proposer.load_model()

    def _load_loras(self) -> LoRAManager | None:
        """LoRA slots on the decoder's linears and the adapters named at start-up
        (loom/lora.py)."""
        config = self.config.model
        if not config.enable_lora:
            return None
        manager = LoRAManager(self.model, config.max_loras, config.max_lora_rank, self.dtype,
                              self.device, config.max_cpu_loras)
        for name, path in config.lora_modules:
            manager.add(name, path)
        forget_recordings(self.model)  # recorded without the adapters' slots
        return manager

    def _bind_expert_counts(self) -> None:
        """MoE models: one (E,) tensor every FusedMoE layer adds its routing counts to,
        zeroed before each step and returned with it (ModelRunnerOutput.expert_tokens):
        one zero_ and one tolist a step, whatever the number of layers."""
        from loom.model.layers.fused_moe import FusedMoE

        layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)]
        self.moe_layers = layers  # in forward order: the decoder layers' order
        self.expert_step_tokens = None
        if layers:
            self.expert_step_tokens = torch.zeros(layers[0].spec.num_experts,
                                                  dtype=torch.int64, device=self.device)
            for layer in layers:
                layer.step_tokens = self.expert_step_tokens

    @property
    def kv_cache_bytes_per_block(self) -> int:
        """Per block of the pool: this rank's share of the target's K/V (of the layers
        of one KV cache group: the groups' blocks share one pool), plus a draft
        model's K/V (counted on every rank, so that all size their pools alike). 0 for
        an encoder, which keeps no KV cache (its blocks only count the scheduler's tokens)."""
        if self.model is not None and getattr(self.model, "is_encoder_only", False):
            return 0
        target = kv_cache_bytes_per_block(self.hf_config, self.block_size, self.dtype,
                                          self.tp_group.world_size,
                                          self.config.cache.kv_cache_dtype)
        if self.model is not None:
            target = (target // self.hf_config.num_hidden_layers
                      * self.kv_cache_groups.layers_per_block)
            # MoBA's block means: each such layer's, for every block (attention/moba.py)
            target += sum(layer.moba.bytes_per_block for layer in self.model.attention_layers
                          if layer.moba is not None)
        spec = self.config.speculative
        if spec is None or spec.method != "draft_model":
            return target
        return target + kv_cache_bytes_per_block(model_hf_config(spec), self.block_size,
                                                 self.dtype, 1)

    @functools.cached_property
    def kv_cache_groups(self) -> KVCacheGroups:
        """The attention layers split into KV cache groups, each with its own block
        tables (core/kv_cache_manager.py): one group but for a model that mixes
        full-attention and sliding-window layers (Gemma 3), which gets vLLM's hybrid
        layout, unless a KV transfer (which moves one group's blocks) is on; then its
        blocks are all kept. Under speculative decoding every block is kept, windows or
        not: a proposer's own layers (a draft model's full attention) read the target's
        block tables, and rolled-back drafts are not accounted for per group."""
        windows = [layer.sliding_window for layer in self.model.attention_layers]
        if self.config.speculative is not None:  # every block kept, as before groups
            windows = [None] * len(windows)
        return KVCacheGroups.of(windows, hybrid=self.config.kv_transfer is None)

    @property
    def kv_cache_window(self) -> int:
        """W when every attention layer reads only the last W positions of a request's
        KV cache (or, in a hybrid layout, every layer of the sliding groups), so the
        scheduler may free the blocks behind them; 0 when every group reads them all."""
        return next((w for w in self.kv_cache_groups.windows if w is not None), 0)

    @property
    def kv_cache_group_counts(self) -> tuple[int, int]:
        """(KV cache groups, of which full attention): what the engine needs besides
        ``kv_cache_window`` to know every group's window (full groups come first)."""
        windows = self.kv_cache_groups.windows
        return len(windows), windows.count(None)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        if self.cuda_graphs is not None and self.cuda_graphs.disabled:
            self._graphs_failed = self.cuda_graphs.disabled  # off for the process
        self.cuda_graphs = None  # graphs and their inputs, made again for this cache
        dtype = kv_cache_dtype(self.config.cache.kv_cache_dtype, self.dtype)
        shape = self.model.kv_cache_shape(num_blocks, self.block_size,  # see kv_layout.py
                                          quantized=is_quantized_kv(dtype))
        # Not zeroed: attention never reads a slot before writing it (padding repeats a
        # request's last key). One allocation for all layers: on the CPU a large one is
        # fresh mmap'd memory, resident only once written or populated (the Worker
        # populates it in the background), and a view per layer slot: the i-th layer of
        # each KV cache group shares slot i (a block belongs to one group at a time).
        groups = self.kv_cache_groups
        full_shape = (groups.layers_per_block, *shape)
        self.kv_cache_storage = (
            self.kv_cache_allocator(full_shape, dtype) if self.kv_cache_allocator
            else torch.empty(full_shape, dtype=dtype, device=self.device))
        slots = self.kv_cache_storage.unbind(0)
        self.kv_caches = [slots[slot] for slot in groups.slot_of_layer]
        for attention, group in zip(self.model.attention_layers, groups.group_of_layer):
            attention.kv_cache_group = group
        self.model.bind_kv_cache(self.kv_caches)
        if self.draft_proposer is not None:
            self.draft_proposer.initialize_kv_cache(num_blocks)
        if num_blocks > 0 and self.device.type == "cuda":
            refusal = self._cuda_graphs_refusal()
            if refusal is None:
                scheduler = self.config.scheduler
                self.cuda_graphs = DecodeGraphs(
                    self.model, scheduler.max_num_seqs, self.config.model.max_model_len,
                    self.block_size, self.device,
                    num_kv_cache_groups=len(self.kv_cache_groups.windows),
                    tp_group=self.tp_group, max_query_len=self._graph_query_len,
                    max_mixed_tokens=self._graph_mixed_tokens)
            if self.tp_group.rank == 0 and refusal != self._graphs_said:
                logger.info("CUDA graphs: %s", refusal or (
                    f"decode steps of up to {self.cuda_graphs.batch_buckets[-1]} requests "
                    f"and contexts of up to {self.cuda_graphs.context_buckets[-1]} tokens"
                    + (f" (with up to {self.cuda_graphs.max_query_len - 1} drafts each)"
                       if self.cuda_graphs.max_query_len > 1 else "")
                    + (f", and mixed steps of up to {self.cuda_graphs.mixed_buckets[-1]} "
                       "tokens," if self.cuda_graphs.mixed_buckets else "")
                    + " are captured as they first run, then replayed"))
                self._graphs_said = refusal

    def _cuda_graphs_refusal(self) -> str | None:
        """Why this model's decode steps run eagerly on CUDA, or None: graphs apply."""
        if self.config.model.enforce_eager:
            return "off (--enforce-eager)"
        if self._graphs_failed:
            return f"off after a capture failed ({self._graphs_failed})"
        if any(layer.expert_parallel.size > 1 for layer in self.moe_layers):
            return ("off under expert parallel (its all-to-all dispatch reads each step's "
                    "counts on the host; EPLB moves experts between steps)")
        if getattr(self.model, "is_encoder_only", False):
            return "off for an encoder (its steps are whole prompts, never decode steps)"
        if self.config.moba_attention is not None:
            return "off with MoBA (its PyTorch path plans each step's blocks on the host)"
        return None

    def drop_cuda_graphs(self) -> None:
        """Forget every captured graph (the KV cache or the weights they read moved);
        later decode steps capture them again."""
        if self.cuda_graphs is not None:
            self.cuda_graphs.clear()

    def cuda_graphs_memory_reserve(self) -> int:
        """Bytes the KV cache sizing leaves for CUDA graphs (0 where none are made):
        their memory pool holds the largest captured step's activations for good,
        where the profiled eager steps cannot reuse them (``graphs_memory_estimate``)."""
        if self.device.type != "cuda" or self._cuda_graphs_refusal() is not None:
            return 0
        scheduler = self.config.scheduler
        return graphs_memory_estimate(self.model, scheduler.max_num_seqs,
                                      self.config.model.max_model_len, self.block_size,
                                      self.dtype, len(self.kv_cache_groups.windows),
                                      self._graph_query_len,
                                      self._graph_mixed_tokens
                                      if mixed_steps_apply(self.model,
                                                           len(self.kv_cache_groups.windows))
                                      else 0)

    @property
    def _graph_mixed_tokens(self) -> int:
        """The most tokens of a captured mixed step (prefills with decodes; the Triton
        attention backend only, cuda_graphs.py)."""
        return min(MAX_MIXED_TOKENS, self.config.scheduler.max_num_batched_tokens)

    @property
    def _graph_query_len(self) -> int:
        """The most tokens a request runs in a captured step: its last token and every
        draft (a verification step), or 1 without speculative decoding."""
        spec = self.config.speculative
        return 1 if spec is None else spec.num_speculative_tokens + 1

    def profile_run(self) -> int:
        """Run the largest step the scheduler can send, for the memory profiler.

        ``max_num_batched_tokens`` prompt tokens split over up to ``max_num_seqs``
        fake requests, each prefilled from position 0 and sampled (top-p/top-k, the
        costly path), on a throwaway KV cache just large enough. Returns that
        cache's bytes, which the caller excludes from the activation peak.
        """
        scheduler = self.config.scheduler
        num_tokens = min(scheduler.max_num_batched_tokens,
                         scheduler.max_num_seqs * (self.config.model.max_model_len - 1))
        num_reqs = min(scheduler.max_num_seqs, num_tokens)
        # 10 tokens over 4 requests -> [3, 3, 2, 2]
        lengths = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
        blocks_per_req = [-(-length // self.block_size) for length in lengths]
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=1)
        new_reqs, first_block = [], 0
        num_groups = len(self.kv_cache_groups.windows)
        for i, (length, num_blocks) in enumerate(zip(lengths, blocks_per_req)):
            block_ids = list(range(first_block, first_block + num_blocks))
            new_reqs.append(NewRequestData(
                req_id=f"profile-{i}", prompt_token_ids=[0] * length, output_token_ids=[],
                sampling_params=params, eos_token_ids=[], block_ids=block_ids,
                num_computed_tokens=0, group_block_ids=[block_ids] * (num_groups - 1)))
            first_block += num_blocks
        self.initialize_kv_cache(first_block)
        try:
            self.execute_model(SchedulerOutput(
                scheduled_new_reqs=new_reqs, scheduled_cached_reqs=[],
                num_scheduled_tokens={r.req_id: n for r, n in zip(new_reqs, lengths)},
                total_num_scheduled_tokens=num_tokens, finished_req_ids=[]))
            # The sampler's persistent workspaces at their largest (the step above took
            # the top-p/top-k path, which does not use them), counted in the peak; made
            # in inference mode, as the steps that use them run.
            with torch.inference_mode():
                for name in ("scaled_logits", "sampling_probs"):
                    reserve(name, (scheduler.max_num_seqs, self.vocab_size), torch.float32,
                            self.device)
        finally:
            self.requests.clear()
            self.initialize_kv_cache(0)
        return first_block * self.kv_cache_bytes_per_block

    # ----------------------------------------------------------------- the step

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.config.parallel.enable_eplb and self.moe_layers:
            # every step counts, empty and dummy ones too: every EP rank runs the same
            # steps, so all of them rearrange before the same one
            self._eplb_steps += 1
            if self._eplb_steps % self.config.parallel.eplb_window_size == 0:
                with torch.inference_mode(False), torch.no_grad():
                    self._rearrange_experts()
        self._update_states(scheduler_output)
        if scheduler_output.is_empty:
            if scheduler_output.dummy_forward:
                self.dummy_step()
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        req_ids = list(scheduler_output.num_scheduled_tokens)
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        input_ids, positions, metadata, sample_rows, logits_indices = \
            self._prepare_inputs(req_ids, scheduler_output.num_scheduled_tokens, spec_tokens)
        if self.expert_step_tokens is not None:
            self.expert_step_tokens.zero_()
        if self.lora is not None:
            starts = metadata.query_start_loc_cpu
            metadata.lora_slots = self.lora.token_slots(
                [self.requests[r].sampling_params.lora_name for r in req_ids],
                [end - start for start, end in zip(starts, starts[1:])])
        mm_embeds = (self._multimodal_embeds(req_ids, metadata.query_start_loc_cpu)
                     if self.encoder_cache or any(self.requests[r].mm_features
                                                  for r in req_ids) else None)
        if mm_embeds is not None:
            spans = self._bidirectional_spans(req_ids, metadata.query_start_loc_cpu)
            for group_metadata in (metadata, *metadata.group_metadata):
                group_metadata.bidirectional_spans = spans
        mm_kwargs = {}
        if mm_embeds is not None:  # image tokens in the step: their rows go in
            mm_kwargs["mm_embeds"] = mm_embeds
        if getattr(self.model, "mm_marker_token_ids", None):
            markers = self._prompt_markers(req_ids, metadata.query_start_loc_cpu)
            if markers is not None:
                mm_kwargs["mm_markers"] = markers
        if self.config.model.is_pooling:  # (not images: a cross-encoder's pairs' segments)
            token_types = self._token_type_ids(req_ids, metadata)
            if token_types is not None:
                mm_kwargs["token_type_ids"] = token_types
        with set_forward_context(metadata):
            hidden_states = None
            if mm_kwargs:  # (a step without them may replay natively)
                hidden_states = self.model(input_ids, positions, **mm_kwargs)
            elif self.cuda_graphs is not None:
                hidden_states = self.cuda_graphs.run(input_ids, positions, metadata)
            if hidden_states is None:
                hidden_states = self.model(input_ids, positions)
        sampled: list[list[int]] = [[] for _ in req_ids]
        logprobs: list[SampleLogprobs | None] = [None] * len(req_ids)
        probs: list[list[float]] | None = None
        if sample_rows:
            # Every rank computes logits (the LM head gathers across ranks); rank 0 samples.
            # Rows: each sampling request's last position, then the draft positions.
            logits = self._logits(hidden_states, logits_indices)
            if self.tp_group.rank == 0:
                if scheduler_output.grammar_bitmask is not None:
                    self._apply_grammar_bitmask(scheduler_output, req_ids, sample_rows, logits)
                if spec_tokens or self.early_stop:
                    probs = self._verify(req_ids, sample_rows, spec_tokens, logits, sampled,
                                         logprobs)
                else:
                    self._sample(req_ids, sample_rows, logits, sampled, logprobs)
        prompt_logprobs = self._prompt_logprobs(req_ids, metadata, hidden_states)
        pooled = self._pool(req_ids, metadata, hidden_states)
        spec_token_ids = None
        if self.tp_group.rank == 0 and (self.ngram_proposer or self.draft_proposer):
            spec_token_ids = self._propose(req_ids, sampled, input_ids, positions, metadata)
        has_logprobs = any(entry is not None for entry in logprobs)
        expert_tokens = (self.expert_step_tokens.tolist()
                         if self.expert_step_tokens is not None and self.tp_group.rank == 0
                         else None)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled,
                                 logprobs=logprobs if has_logprobs else None,
                                 spec_token_ids=spec_token_ids, sampled_token_probs=probs,
                                 prompt_logprobs=prompt_logprobs, expert_tokens=expert_tokens,
                                 pooled=pooled)

    def _rearrange_experts(self) -> None:
        """EPLB: every MoE layer places its experts anew from the window's loads."""
        moved = [layer.rearrange() for layer in self.moe_layers]
        ep = self.moe_layers[0].expert_parallel
        if ep.rank == 0:
            shares = [layer.last_rearrangement for layer in self.moe_layers
                      if layer.last_rearrangement is not None]
            before = sum(b for b, _ in shares) / max(1, len(shares))
            after = sum(min(b, a) for b, a in shares) / max(1, len(shares))
            logger.info("EPLB after %d steps: %d of %d MoE layers' experts placed anew; the "
                        "busiest of %d ranks' share of the window's tokens %.2f -> %.2f "
                        "(mean over layers; even: %.2f)", self._eplb_steps, sum(moved),
                        len(moved), ep.size, before, after, 1 / ep.size)
        self.eplb_rearrangements += sum(moved)

    def dummy_step(self) -> None:
        """A step of a replica with no tokens while its experts serve other replicas'
        (experts across data-parallel replicas): every MoE layer, in forward order, takes
        part in its all-to-alls with no rows of its own, as vLLM's DP + EP dummy batch
        does; it runs no attention and touches no KV block. Only the families whose
        forward runs every MoE layer once, in order, whatever its tokens, are allowed
        here (checkpoint_defaults.EXPERTS_ACROSS_REPLICAS)."""
        for layer in self.moe_layers:
            layer.exchange_nothing(layer.gate.in_features, self.dtype, self.device)

    def _logits(self, hidden_states: torch.Tensor,
                rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The LM head's logits of the step's token rows ``rows`` (indices or a slice;
        None: all), with the LoRA adapters of their requests on the head."""
        x = hidden_states if rows is None else hidden_states[rows]
        if self.lora is None:
            return self.model.compute_logits(x)
        with self.lora.logits_of(rows):
            return self.model.compute_logits(x)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in scheduler_output.scheduled_new_reqs:
            params = new.sampling_params
            stop_ids = list(params.stop_token_ids)
            if not params.ignore_eos:
                stop_ids += new.eos_token_ids
            generator = None
            if params.seed is not None and not params.is_greedy:
                generator = torch.Generator(device=self.device)
            state = self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, token_ids=new.prompt_token_ids + new.output_token_ids,
                num_prompt_tokens=len(new.prompt_token_ids), sampling_params=params,
                stop_ids_for_min_tokens=stop_ids, block_ids=list(new.block_ids),
                group_block_ids=[list(ids) for ids in new.group_block_ids],
                num_computed_tokens=new.num_computed_tokens, generator=generator,
                mm_features=list(new.mm_features))
            if new.mm_features:
                self._check_multimodal(new.mm_features)
                if hasattr(self.model, "mrope_positions"):
                    state.mrope_positions, state.mrope_delta = self.model.mrope_positions(
                        len(new.prompt_token_ids), new.mm_features)
        for cached in scheduler_output.scheduled_cached_reqs:
            state = self.requests[cached.req_id]
            state.token_ids.extend(cached.new_token_ids)
            state.block_ids.extend(cached.new_block_ids)
            for block_ids, new_ids in zip(state.group_block_ids, cached.new_group_block_ids):
                block_ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ----------------------------------------------------------------- images

    def _check_multimodal(self, features: list[MultiModalFeature]) -> None:
        if not hasattr(self.model, "embed_multimodal"):
            raise ValueError(f"{type(self.model).__name__} takes no images")

    def _mrope(self, states: list[CachedRequestState], positions: np.ndarray,
               query_start_loc: np.ndarray) -> np.ndarray:
        """The step's positions as the model's rope takes them: ``positions`` (T,) as
        they are, but for M-RoPE requests with images, whose prompt tokens take their
        (3,) positions and later tokens ``i + delta``. (3, T) where some token's three
        differ (an image's tokens in the step), else (T,)."""
        if not any(state.mrope_positions is not None for state in states):
            return positions
        axes = np.broadcast_to(positions, (3, len(positions))).copy()
        for i, state in enumerate(states):
            if state.mrope_positions is None:
                continue
            start, end = query_start_loc[i], query_start_loc[i + 1]
            index = positions[start:end]
            in_prompt = index < state.num_prompt_tokens
            axes[:, start:end] = index + state.mrope_delta
            axes[:, start:end][:, in_prompt] = state.mrope_positions[:, index[in_prompt]]
        if (axes[0] == axes[1]).all() and (axes[0] == axes[2]).all():
            return axes[0]
        return axes

    def _multimodal_embeds(self, req_ids: list[str], query_start_loc: list[int]
                           ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(indices in the step, rows) of the image tokens this step runs, each image's
        rows made by the model's tower once (``encoder_cache``), or None where the step
        holds no image token. Images no request needs any more leave the cache."""
        index_parts: list[torch.Tensor] = []
        row_parts: list[torch.Tensor] = []
        needed: set[str] = set()
        spans = [(i, state, state.num_computed_tokens,
                  state.num_computed_tokens + query_start_loc[i + 1] - query_start_loc[i])
                 for i, state in enumerate(self.requests[r] for r in req_ids)]
        self._encode({f.identifier: f for _, state, start, end in spans
                      for f in state.mm_features
                      if f.overlaps(start, end) and f.identifier not in self.encoder_cache})
        for i, state, start, end in spans:
            for feature in state.mm_features:
                if feature.end > end:
                    needed.add(feature.identifier)
                if not feature.overlaps(start, end):
                    continue
                rows = self.encoder_cache[feature.identifier]
                first, last = max(start, feature.offset), min(end, feature.end)
                row_parts.append(rows[first - feature.offset:last - feature.offset])
                at = query_start_loc[i] + first - start
                index_parts.append(torch.arange(at, at + last - first, device=self.device))
        in_step = set(req_ids)
        for req_id, state in self.requests.items():  # waiting for a later step
            if req_id not in in_step:
                needed.update(f.identifier for f in state.mm_features
                              if f.end > state.num_computed_tokens)
        for identifier in [k for k in self.encoder_cache if k not in needed]:
            del self.encoder_cache[identifier]
        if not row_parts:
            return None
        return torch.cat(index_parts), torch.cat(row_parts)

    def _encode(self, features: dict[str, MultiModalFeature]) -> None:
        """Each item's rows into the encoder cache: the step's items of one modality in
        one call where the model batches them (``embed_multimodal_batch``: one tower
        pass over 8 images is larger matmuls than 8 passes), else one by one."""
        batched = getattr(self.model, "embed_multimodal_batch", None)
        by_modality: dict[str, list[MultiModalFeature]] = {}
        for feature in features.values():
            by_modality.setdefault(feature.modality, []).append(feature)
        for group in by_modality.values():
            if batched is not None and len(group) > 1:
                rows = batched(group)
            else:
                rows = [self.model.embed_multimodal(feature) for feature in group]
            for feature, item_rows in zip(group, rows):
                self.encoder_cache[feature.identifier] = item_rows

    def _prompt_markers(self, req_ids: list[str], query_start_loc: list[int]
                        ) -> torch.Tensor | None:
        """Step indices of the prompt tokens a model treats as part of an image beside
        its rows (``model.mm_marker_token_ids``: ERNIE 4.5 VL's start and end markers,
        which its vision experts take), in requests with images; None where the step
        has none. A marker the model generated is text, as transformers treats it."""
        markers = self.model.mm_marker_token_ids
        found: list[int] = []
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            if not state.mm_features:
                continue
            start = state.num_computed_tokens
            end = min(start + query_start_loc[i + 1] - query_start_loc[i],
                      state.num_prompt_tokens)
            found += [query_start_loc[i] + j - start for j in range(start, end)
                      if state.token_ids[j] in markers]
        return torch.tensor(found, device=self.device) if found else None

    def _bidirectional_spans(self, req_ids: list[str], query_start_loc: list[int]
                             ) -> tuple[tuple[int, int], ...]:
        """The step token ranges of the images in it whose tokens attend to each other
        both ways (``MultiModalFeature.bidirectional``). The scheduler ends no step inside
        such an image, so each range runs to its image's end; it starts where the image
        does, or where a prefix-cache hit left off inside it (the cached tokens' K/V were
        computed with all of the image, and the step's queries see them as earlier keys)."""
        spans = []
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + query_start_loc[i + 1] - query_start_loc[i]
            for feature in state.mm_features:
                if not (feature.bidirectional and feature.overlaps(start, end)):
                    continue
                if feature.end > end:
                    raise RuntimeError(
                        f"request {req_id}: the step runs tokens {start}..{end - 1}, ending "
                        f"inside an image whose tokens {feature.offset}..{feature.end - 1} "
                        "attend to each other; the scheduler must run them in one step")
                first = query_start_loc[i] + max(feature.offset, start) - start
                spans.append((first, query_start_loc[i] + feature.end - start))
        return tuple(spans)

    def _prepare_inputs(self, req_ids: list[str], num_scheduled: dict[str, int],
                        spec_tokens: dict[str, list[int]] | None = None):
        num_reqs = len(req_ids)
        query_lens = np.fromiter((num_scheduled[r] for r in req_ids), np.int64, num_reqs)
        query_start_loc = np.zeros(num_reqs + 1, np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        states = [self.requests[r] for r in req_ids]
        context_starts = np.fromiter((s.num_computed_tokens for s in states), np.int64, num_reqs)
        seq_lens = context_starts + query_lens

        # positions: each request's computed length, then counting up.
        # query_lens [2, 3] starts [5, 0] -> [5, 6, 0, 1, 2]
        if num_tokens == num_reqs:  # one token each (a decode step): its computed length
            req_of_token, positions = np.arange(num_reqs), context_starts
        else:
            req_of_token = np.repeat(np.arange(num_reqs), query_lens)
            positions = (np.arange(num_tokens) - query_start_loc[req_of_token]
                         + context_starts[req_of_token])

        token_positions = positions  # each token's index in its sequence
        positions = self._mrope(states, positions, query_start_loc)
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((num_reqs, max_blocks), np.int64)
        input_ids = np.empty(num_tokens, np.int64)
        sample_rows: list[int] = []
        num_drafts = [0] * num_reqs
        for i, state in enumerate(states):
            block_table[i, :len(state.block_ids)] = state.block_ids
            start, end = int(context_starts[i]), int(seq_lens[i])
            drafts = spec_tokens.get(req_ids[i]) if spec_tokens else None
            if drafts:
                # | computed | last token, drafts |: the drafts follow the known tokens.
                assert end == len(state.token_ids) + len(drafts), f"{req_ids[i]}: drafts cut"
                input_ids[query_start_loc[i]:query_start_loc[i + 1]] = \
                    state.token_ids[start:] + drafts
                num_drafts[i] = len(drafts)
            else:
                input_ids[query_start_loc[i]:query_start_loc[i + 1]] = state.token_ids[start:end]
            if end >= len(state.token_ids) and state.sampling_params.pooling is None:
                sample_rows.append(i)  # (a pooling request is pooled, not sampled: _pool)
        # a token's slot through a block table: its block's id * block_size + offset
        token_block, token_offset = (token_positions // self.block_size,
                                     token_positions % self.block_size)
        slot_mapping = block_table[req_of_token, token_block] * self.block_size + token_offset
        # Last positions first (one per sampling request), then each one's draft rows:
        # drafts [2, 0, 1], queries ending before [10, 13, 21] -> [9, 12, 20, 7, 8, 19]
        # None when that is every token in order (each request one token, all sampling).
        logits_indices = query_start_loc[1:][sample_rows] - 1
        if any(num_drafts):
            logits_indices = np.concatenate([logits_indices] + [
                np.arange(query_start_loc[i + 1] - 1 - num_drafts[i], query_start_loc[i + 1] - 1)
                for i in sample_rows if num_drafts[i]])
        elif len(sample_rows) == num_tokens:
            logits_indices = None

        device = self.device
        metadata = AttentionMetadata.from_numpy(slot_mapping, query_start_loc, seq_lens,
                                                block_table, self.block_size, device)
        if self.rope_scales_past is not None:
            metadata.rope_lengths = self._rope_lengths(states, req_of_token, token_positions)
        for group in range(len(self.kv_cache_groups.windows) - 1):
            # KV cache groups 1..: the same step through their own block tables
            group_table = np.zeros((num_reqs, max_blocks), np.int64)
            for i, state in enumerate(states):
                group_table[i, :len(state.group_block_ids[group])] = state.group_block_ids[group]
            metadata.group_metadata.append(metadata.with_blocks(
                group_table[req_of_token, token_block] * self.block_size + token_offset,
                group_table, device))
        return (torch.from_numpy(input_ids).to(device),
                torch.from_numpy(np.ascontiguousarray(positions)).to(device),
                metadata, sample_rows,
                None if logits_indices is None else torch.from_numpy(logits_indices).to(device))

    def _rope_lengths(self, states: list[CachedRequestState], req_of_token: np.ndarray,
                      token_positions: np.ndarray) -> torch.Tensor | None:
        """Each token's length for a length-scaled rope, ``max(prompt length, position +
        1)``: transformers' generate turns a prompt in one forward at its length, then
        each new token at its own (layers/rotary.py). None when none is past the rope's
        original context (the plain rope then)."""
        prompt_lens = np.fromiter((s.num_prompt_tokens for s in states), np.int64, len(states))
        lengths = np.maximum(prompt_lens[req_of_token], token_positions + 1)
        if lengths.max() <= self.rope_scales_past:
            return None
        return torch.from_numpy(lengths).to(self.device)

    @staticmethod
    def _apply_grammar_bitmask(scheduler_output: SchedulerOutput, req_ids: list[str],
                               sample_rows: list[int], logits: torch.Tensor) -> None:
        """-inf on the tokens each grammar-constrained request may not sample; in place."""
        from loom.structured_output.bitmask import apply_grammar_bitmask

        logits_row = {req_ids[i]: row for row, i in enumerate(sample_rows)}
        rows = [logits_row.get(req_id, -1) for req_id in scheduler_output.structured_output_req_ids]
        apply_grammar_bitmask(logits, rows, scheduler_output.grammar_bitmask)

    def _sample(self, req_ids: list[str], sample_rows: list[int], logits: torch.Tensor,
                sampled: list[list[int]], logprobs: list[SampleLogprobs | None]) -> None:
        states = [self.requests[req_ids[i]] for i in sample_rows]
        generators = {}
        for row, state in enumerate(states):
            if state.generator is not None:
                # Seeded by (seed, position): reproducible whatever the batch, even
                # across a preemption that rebuilds this state.
                seed = hash((state.sampling_params.seed, len(state.token_ids))) & (2**63 - 1)
                generators[row] = state.generator.manual_seed(seed)
        metadata = self._sampling_metadata(states, generators)
        result = self.sampler(logits, metadata)
        token_ids = result.sampled_token_ids.tolist()
        if result.logprobs is not None:
            lp_ids = result.logprob_token_ids.tolist()
            lp_values = result.logprobs.tolist()
            ranks = result.sampled_token_ranks.tolist()
        for row, i in enumerate(sample_rows):
            sampled[i] = [token_ids[row]]
            k = states[row].sampling_params.logprobs
            if k is not None:
                logprobs[i] = SampleLogprobs(token_ids=[lp_ids[row][:k + 1]],
                                             logprobs=[lp_values[row][:k + 1]],
                                             ranks=[ranks[row]])

    def _sampling_metadata(self, states: list[CachedRequestState],
                           generators: dict[int, torch.Generator]) -> SamplingMetadata:
        """The step's SamplingMetadata for rows ``states``; the last step's when the same
        requests (the same state objects: a preempted request comes back as a new one)
        sample in the same order and nothing in it reads the output so far (no
        penalties, no min_tokens still masking: output only grows; no bad words, no reasoning budget). Building it is ~10
        small tensors a step; its generators are the requests' own, re-seeded in place."""
        last = self._last_sampling
        if last is not None and len(last[0]) == len(states) and all(
                a is b for a, b in zip(last[0], states)):
            return last[1]
        metadata = SamplingMetadata.build(
            [s.sampling_params for s in states],
            [s.token_ids[:s.num_prompt_tokens] for s in states],
            [s.output_token_ids for s in states],
            [s.stop_ids_for_min_tokens for s in states],
            generators, self.vocab_size, self.device, self.logits_processors)
        reusable = (metadata.no_penalties and metadata.min_tokens_rows is None
                    and not self.logits_processors
                    and not any(s.sampling_params.bad_words_token_ids
                                or s.sampling_params.think_forced_ids for s in states))
        self._last_sampling = (states, metadata) if reusable else None
        return metadata

    def _verify(self, req_ids: list[str], sample_rows: list[int],
                spec_tokens: dict[str, list[int]], logits: torch.Tensor,
                sampled: list[list[int]], logprobs: list[SampleLogprobs | None]
                ) -> list[list[float]] | None:
        """Rejection-sample the drafts (requests without drafts sample as usual); with
        early stop on, also return each sampled token's probability."""
        states = [self.requests[req_ids[i]] for i in sample_rows]
        drafts = [spec_tokens.get(req_ids[i], []) for i in sample_rows]
        # One metadata row per logits row: row j of a request sees its drafts before j as
        # output tokens and samples position len(token_ids) + j.
        rows = [(state, d, len(d)) for state, d in zip(states, drafts)]  # bonus rows
        rows += [(state, d, j) for state, d in zip(states, drafts) for j in range(len(d))]
        row_seeds = {}
        for row, (state, d, j) in enumerate(rows):
            if state.generator is not None:
                position = len(state.token_ids) + j
                row_seeds[row] = (state.generator,
                                  hash((state.sampling_params.seed, position)) & (2**63 - 1))
        metadata = SamplingMetadata.build(
            [state.sampling_params for state, _, _ in rows],
            [state.token_ids[:state.num_prompt_tokens] for state, _, _ in rows],
            [state.output_token_ids + d[:j] for state, d, j in rows],
            [state.stop_ids_for_min_tokens for state, _, _ in rows],
            {}, self.vocab_size, self.device, self.logits_processors)
        result = self.rejection_sampler(logits, metadata, drafts, row_seeds,
                                        want_probs=self.early_stop)
        probs: list[list[float]] = [[] for _ in req_ids]
        offset = 0
        for row, i in enumerate(sample_rows):
            tokens = result.token_ids[row]
            sampled[i] = tokens
            end = offset + len(tokens)
            k = states[row].sampling_params.logprobs
            if k is not None:
                logprobs[i] = SampleLogprobs(
                    token_ids=[ids[:k + 1] for ids in result.logprob_token_ids[offset:end]],
                    logprobs=[values[:k + 1] for values in result.logprobs[offset:end]],
                    ranks=result.ranks[offset:end])
            if result.probs is not None:
                probs[i] = result.probs[offset:end]
            offset = end
        return probs if result.probs is not None else None

    def _prompt_logprobs(self, req_ids: list[str], metadata: AttentionMetadata,
                         hidden_states: torch.Tensor) -> list[SampleLogprobs | None] | None:
        """For requests asking for prompt logprobs, the raw logprobs of each prompt token
        this chunk's logits predict: positions start .. min(end, num_prompt - 1) - 1
        predict tokens start + 1 .. (every rank computes logits; rank 0 keeps them)."""
        result: list[SampleLogprobs | None] | None = None
        starts = metadata.query_start_loc_cpu
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            start = metadata.seq_lens_cpu[i] - (starts[i + 1] - starts[i])
            end = min(metadata.seq_lens_cpu[i], state.num_prompt_tokens - 1)
            if end <= start:
                continue
            token_ids = torch.tensor(state.token_ids[start + 1:end + 1], device=self.device)
            entry = SampleLogprobs(token_ids=[], logprobs=[], ranks=[])
            for first in range(0, end - start, _PROMPT_LOGPROBS_CHUNK):
                last = min(first + _PROMPT_LOGPROBS_CHUNK, end - start)
                logits = self._logits(
                    hidden_states, slice(starts[i] + first, starts[i] + last)).float()
                reported = (logits if self.config.model.logprobs_mode == "raw_logits"
                            else torch.log_softmax(logits, dim=-1))
                ids, values, ranks = gather_logprobs(reported, token_ids[first:last], k)
                entry.token_ids += ids.tolist()
                entry.logprobs += values.tolist()
                entry.ranks += ranks.tolist()
            if self.tp_group.rank == 0:
                if result is None:
                    result = [None] * len(req_ids)
                result[i] = entry
        return result

    def _pool(self, req_ids: list[str], metadata: AttentionMetadata,
              hidden_states: torch.Tensor) -> list[list[float] | None] | None:
        """Each pooling request's chunk pooled into its running pool (loom/pooling.py);
        at the chunk that ends its prompt, its vector: the embedding (normalized and cut
        to ``dimensions`` as asked) or, for a score, ``softmax([logit_no, logit_yes])[1]``
        at the last position."""
        if not self.config.model.is_pooling:
            return None  # a generating engine has no pooling request: no loop per step
        result: list[list[float] | None] | None = None
        starts = metadata.query_start_loc_cpu
        pooler = self.config.model.pooler
        encoder = getattr(self.model, "is_encoder_only", False)
        # an encoder's classifier (BERT, ModernBERT): its head reads the whole prompt
        head = getattr(self.model, "sequence_logits", None)
        for i, req_id in enumerate(req_ids):
            state = self.requests[req_id]
            params = state.sampling_params.pooling
            if params is None:
                continue
            end = metadata.seq_lens_cpu[i]
            start = end - (starts[i + 1] - starts[i])
            rows = hidden_states[starts[i]:starts[i + 1]]
            if encoder and (start != 0 or end < state.num_prompt_tokens):
                raise RuntimeError(f"an encoder ran part of prompt {req_id!r} ({start}:{end} "
                                   f"of {state.num_prompt_tokens}); it runs each prompt whole, "
                                   "with chunked prefill and prefix caching off")
            kind = pooler.pooling_type if params.task == "embed" else "LAST"
            if kind == "MEAN":
                chunk_sum = rows.float().sum(dim=0)
                state.pooled = chunk_sum if state.pooled is None else state.pooled + chunk_sum
            elif kind == "CLS" and start == 0:
                state.pooled = rows[0].float()
            if end < state.num_prompt_tokens:
                continue  # more of the prompt to come
            if head is not None and params.task != "embed":
                logits = head(rows)
                if params.task == "classify":
                    vector = torch.softmax(logits, dim=0)
                else:  # a cross-encoder's one logit, through the checkpoint's activation
                    vector = torch.sigmoid(logits) if pooler.score_activation == "sigmoid" \
                        else logits
            elif params.task == "score":
                no, yes = params.classifier_token_ids
                logits = self._logits(hidden_states, slice(starts[i + 1] - 1, starts[i + 1]))
                vector = torch.softmax(logits.float()[0][[no, yes]], dim=0)[1:]
            elif params.task == "classify":  # a sequence classifier: its labels' logits
                vector = torch.softmax(self.model.compute_logits(rows[-1:]).float()[0], dim=0)
            else:
                vector = (rows[-1].float() if kind == "LAST" else
                          state.pooled / state.num_prompt_tokens if kind == "MEAN" else
                          state.pooled)
                if params.dimensions is not None:
                    vector = vector[:params.dimensions]
                normalize = pooler.normalize if params.normalize is None else params.normalize
                if normalize:
                    vector = torch.nn.functional.normalize(vector, dim=0)
            state.pooled = None
            if self.tp_group.rank == 0:
                if result is None:
                    result = [None] * len(req_ids)
                result[i] = vector.tolist()
        return result

    def _token_type_ids(self, req_ids: list[str],
                        metadata: AttentionMetadata) -> torch.Tensor | None:
        """The step's token types (T,) where a cross-encoder's pair is in it: 1 from the
        pair's ``token_type_start`` on, else 0; None where no request has types."""
        starts = metadata.query_start_loc_cpu
        types = None
        for i, req_id in enumerate(req_ids):
            pooling = self.requests[req_id].sampling_params.pooling
            if pooling is None or pooling.token_type_start is None:
                continue
            if types is None:
                types = np.zeros(starts[-1], np.int64)
            first = metadata.seq_lens_cpu[i] - (starts[i + 1] - starts[i])  # its position
            types[starts[i] + max(pooling.token_type_start - first, 0):starts[i + 1]] = 1
        return None if types is None else torch.from_numpy(types).to(self.device)

    def _propose(self, req_ids: list[str], sampled: list[list[int]], input_ids: torch.Tensor,
                 positions: torch.Tensor, metadata: AttentionMetadata) -> list[list[int]]:
        """Drafts for the next step of every request that sampled this step."""
        proposals: list[list[int]] = [[] for _ in req_ids]
        rows = [i for i, tokens in enumerate(sampled) if tokens]
        if self.ngram_proposer is not None:
            for i in rows:
                proposals[i] = self.ngram_proposer.propose(self.requests[req_ids[i]].token_ids
                                                           + sampled[i])
            return proposals
        self.draft_proposer.catch_up(input_ids, positions, metadata)
        if rows:
            states = [self.requests[req_ids[i]] for i in rows]
            drafts = self.draft_proposer.propose(
                [sampled[i][-1] for i in rows],
                [len(state.token_ids) + len(sampled[i]) - 1 for state, i in zip(states, rows)],
                [state.block_ids for state in states], self.vocab_size)
            for i, row_drafts in zip(rows, drafts):
                proposals[i] = row_drafts
        return proposals
