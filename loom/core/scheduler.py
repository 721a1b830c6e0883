"""Scheduler: decides, every step, which tokens of which requests run.

There is no prefill phase and no decode phase. Each request has
``num_computed_tokens`` and ``num_tokens``; a step spends a token budget
(``max_num_batched_tokens``) closing that gap, running requests first (oldest
first), then waiting ones while fewer than ``max_num_seqs`` run. That one rule gives
continuous batching, chunked prefill (a long prompt takes what the budget leaves;
with ``enable_chunked_prefill`` off it waits, first in line, until it fits whole),
prefix caching (a new request's computed tokens start at its cached length) and
decode (a gap of one token). When the pool runs out of blocks, the newest running
request is preempted: its blocks are freed, and it goes back to the front of the
waiting queue to be recomputed, keeping the tokens it has produced. Under the priority
policy the waiting queue is ordered by (priority, arrival) and the lowest-priority
running request is the one preempted.

Speculative decoding fits the same rule: a request's draft tokens (proposed by the
workers in the previous step) count as tokens to compute, so a decoding request
schedules ``1 + num_drafts`` tokens; what the runner rejects is rolled back from
``num_computed_tokens``, and those KV slots are simply written again later.

    | computed | last token | drafts (spec_token_ids) | lookahead (draft model) |
               |<-- scheduled this step -------------->|<-- booked, not computed ->|
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from loom.config import (CacheConfig, EarlyStopConfig, KVTransferConfig, SchedulerConfig,
                         SpeculativeConfig)
from loom.core.kv_cache_manager import KVCacheManager
from loom.core.kv_tier import KVTier, TierBlock
from loom.core.kv_transfer import KVTransferScheduler, check_kv_transfer_params
from loom.core.wire import (CachedRequestData, EngineCoreOutput, KVTransferEvent,
                            ModelRunnerOutput, NewRequestData, SampleLogprobs, SchedulerOutput,
                            SchedulerStats)
from loom.request import FinishReason, Request, RequestStatus
from loom.sampling_params import longest_prompt


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, *, speculative_config: SpeculativeConfig | None = None,
                 early_stop_config: EarlyStopConfig | None = None,
                 kv_transfer_config: KVTransferConfig | None = None, tp_size: int = 1,
                 kv_cache_groups: Sequence[int | None] = (None,),
                 max_loras: int | None = None, kv_tier_slots: int = 0) -> None:
        """``kv_cache_groups``: the window of each KV cache group (None: full attention),
        as the workers report them; blocks behind a window are freed early. One group
        for most models, ``(W,)`` when every layer reads only the last W positions,
        several for a hybrid model (kv_cache_manager.py).
        ``kv_transfer_config``: this instance's side of prefill/decode disaggregation
        (core/kv_transfer.py), which moves one-group caches only.
        ``max_loras``: the LoRA adapters the ranks hold in slots (loom/lora.py; None: LoRA
        off); the running requests use at most this many.
        ``kv_tier_slots``: blocks the KV offload tier holds (core/kv_tier.py; 0: none),
        as the ranks made it (``init_kv_tier``)."""
        self.config = scheduler_config
        self.max_loras = max_loras
        self.num_lookahead_tokens = (speculative_config.num_lookahead_tokens
                                     if speculative_config else 0)
        self.early_stop = (early_stop_config if early_stop_config is not None
                           and early_stop_config.enable_early_stop else None)
        self.max_model_len = scheduler_config.max_model_len
        self.kv_cache = KVCacheManager(num_blocks, cache_config.block_size,
                                       cache_config.enable_prefix_caching,
                                       group_windows=kv_cache_groups,
                                       tier=KVTier(kv_tier_slots) if kv_tier_slots else None)
        # How often each waiting request had blocks brought back from the offload tier
        # since it last ran: past _MAX_TIER_FETCHES (its blocks were evicted again before
        # it was admitted, each time) it computes them instead.
        self._tier_fetches: dict[str, int] = {}
        if kv_transfer_config is not None and self.kv_cache.num_groups > 1:
            raise ValueError(
                f"prefill/decode disaggregation moves a KV cache of one group, but this "
                f"model's has {self.kv_cache.num_groups} (full-attention and sliding-window "
                "layers in separate block tables); run it without --kv-transfer-config")
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Prefill/decode disaggregation: the connector's scheduler half, and the requests
        # whose prompt K/V the ranks are pulling (neither waiting nor running).
        self.kv_transfer = (KVTransferScheduler(kv_transfer_config, self.kv_cache.pool,
                                                cache_config.block_size, tp_size)
                            if kv_transfer_config is not None else None)
        self.loading: dict[str, Request] = {}
        # Requests the workers must forget, sent with the next SchedulerOutput.
        self._forgotten_req_ids: set[str] = set()
        # How many of each running request's tokens and blocks the workers already have.
        self._num_tokens_sent: dict[str, int] = {}
        self._num_blocks_sent: dict[str, int] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0
        self.expert_tokens: list[int] = []  # MoE: tokens routed to each expert, cumulative

    # ----------------------------------------------------------------- requests in

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        pooled = request.sampling_params.pooling is not None
        if request.num_tokens > longest_prompt(self.max_model_len, pooled):
            raise ValueError(f"prompt has {request.num_tokens} tokens but max_model_len is "
                             f"{self.max_model_len}; shorten it or raise --max-model-len")
        budget = self.config.max_num_batched_tokens
        for feature in request.mm_features:
            if feature.bidirectional and feature.length > budget:  # see _fit_images
                raise ValueError(
                    f"an image of the prompt fills {feature.length} tokens, which attend to "
                    f"each other and so run in one step, but max_num_batched_tokens is "
                    f"{budget}; raise --max-num-batched-tokens to {feature.length} or more")
        if self.kv_transfer is not None:
            self.kv_transfer.prepare_request(request)
        else:  # refuses any transfer
            check_kv_transfer_params(request.sampling_params.kv_transfer_params, None, 1,
                                     self.kv_cache.block_size, request.num_prompt_tokens)
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request, first: bool = False) -> None:
        """Into the waiting queue: at its end (fcfs; ``first``: a preempted request, at its
        front), or by (priority, arrival) under the priority policy."""
        if self.config.policy != "priority":
            if first:
                self.waiting.appendleft(request)
            else:
                self.waiting.append(request)
            return
        key = _priority_key(request)
        at = next((i for i, other in enumerate(self.waiting) if _priority_key(other) > key),
                  len(self.waiting))
        self.waiting.insert(at, request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus,
                        stop_reason: int | str | None = None) -> None:
        """End requests from outside the step: an abort, or a stop string found in
        the detokenized text. Works in any state; unknown ids are ignored."""
        assert status.is_finished
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            loading = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not loading:
                self.waiting.remove(request)
            request.status = status
            request.stop_reason = stop_reason
            if not loading:  # else freed once every rank has stopped writing its blocks
                self._free(request)

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    # ----------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        token_budget = self.config.max_num_batched_tokens
        num_scheduled_tokens: dict[str, int] = {}
        scheduled_spec_tokens: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted = False

        # 1. Running requests, oldest first. If one does not fit, preempt from the tail.
        encoder_budget = self.config.max_num_batched_tokens
        self._encoder_tokens = 0  # placeholder tokens the towers make (_fit_images)
        index = 0
        while index < len(self.running) and token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens_with_spec - request.num_computed_tokens,
                                 token_budget)
            assert num_new_tokens > 0, f"{request} is running with nothing to compute"
            if request.mm_features:
                num_new_tokens, encoder_budget = self._fit_images(
                    request, request.num_computed_tokens, num_new_tokens, encoder_budget,
                    fresh=False)
                if num_new_tokens == 0:  # its next image waits for the next step
                    index += 1
                    continue
            new_blocks = self._allocate(request, num_new_tokens)
            while new_blocks is None:
                victim = self._victim()
                if self.running.index(victim) < index:  # scheduled already: undo it
                    token_budget += num_scheduled_tokens.pop(victim.request_id)
                    scheduled_spec_tokens.pop(victim.request_id, None)
                    cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                    index -= 1
                    # Its blocks this step was to fill hold no K/V: not a prefix.
                    self.kv_cache.forget_unwritten_blocks(victim)
                self.running.remove(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                new_blocks = self._allocate(request, num_new_tokens)
            if new_blocks is None:
                break  # this request was itself preempted; it was the last one
            if request.spec_token_ids:
                # The budget may cut drafts off: keep those that fit.
                num_spec = num_new_tokens + request.num_computed_tokens - request.num_tokens
                del request.spec_token_ids[max(num_spec, 0):]
                if request.spec_token_ids:
                    scheduled_spec_tokens[request.request_id] = list(request.spec_token_ids)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            cached_reqs.append(self._cached_request_data(request))
            index += 1

        # 2. Waiting requests, in arrival order, while there is room. Not after a
        #    preemption: the pool is full and the preempted request goes first.
        #    A request whose grammar is still compiling keeps its place but lets others by,
        #    as does one whose LoRA adapter would be one more than max_loras among the
        #    running requests (vLLM's rule; it runs once one of theirs has finished).
        skipped: deque[Request] = deque()
        loras = ({r.sampling_params.lora_name for r in self.running} - {None}
                 if self.max_loras is not None else set())
        while (self.waiting and token_budget > 0 and not preempted
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            if request.use_structured_output and not request.structured_output_request.is_ready:
                skipped.append(self.waiting.popleft())
                continue
            lora = request.sampling_params.lora_name if self.max_loras is not None else None
            if lora is not None and lora not in loras and len(loras) >= self.max_loras:
                skipped.append(self.waiting.popleft())
                continue
            if request.kv_load is not None:
                if not self._start_kv_load(request):
                    break
                continue
            if request.kv_follows is not None:
                if self.kv_transfer.is_pending(request.kv_follows):
                    skipped.append(self.waiting.popleft())  # sample 0 pulls its prompt
                    continue
                request.kv_follows = None  # it arrived: a prefix-cache hit from here
            # Its prompt's K/V arrived from a prefill instance: the last position runs
            # (its prefix-cache lookup was counted when its pull began).
            arrived = request.request_id in self.kv_cache.req_to_blocks
            if arrived:
                computed_blocks, num_hit_tokens = None, request.num_computed_tokens
            else:
                computed_blocks, num_hit_tokens = self._lookup_prefix(request)
                if computed_blocks is None:  # its prefix comes back from the tier this step
                    skipped.append(self.waiting.popleft())
                    continue
            num_new_tokens = min(request.num_tokens - num_hit_tokens, token_budget)
            if (not self.config.enable_chunked_prefill
                    and num_new_tokens < request.num_tokens - num_hit_tokens):
                break  # chunked prefill off: the whole prompt next step, or later
            if request.mm_features:
                num_new_tokens, encoder_budget = self._fit_images(
                    request, num_hit_tokens, num_new_tokens, encoder_budget, fresh=True)
                if num_new_tokens == 0:
                    break  # its first image waits for the next step; nobody overtakes it
            new_blocks = self._allocate(request, num_new_tokens, computed_blocks, num_hit_tokens)
            if new_blocks is None:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self._tier_fetches.pop(request.request_id, None)
            if not arrived:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if lora is not None:
                loras.add(lora)
            num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            new_reqs.append(self._new_request_data(request))
        self.waiting.extendleft(reversed(skipped))

        if self.kv_transfer is not None:
            self._schedule_kv_holds(num_scheduled_tokens)
        forgotten, self._forgotten_req_ids = self._forgotten_req_ids, set()
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - token_budget,
            num_encoder_tokens=self._encoder_tokens,
            finished_req_ids=sorted(forgotten),
            scheduled_spec_decode_tokens=scheduled_spec_tokens,
            kv_connector_metadata=(self.kv_transfer.take_metadata()
                                   if self.kv_transfer is not None else None),
            kv_tier_ops=(self.kv_cache.tier.take_ops()
                         if self.kv_cache.tier is not None else None),
        )

    def _lookup_prefix(self, request: Request):
        """A waiting request's cached prefix (``get_computed_blocks``), or (None, 0) when
        the offload tier holds more of it than the pool: those blocks are brought back
        this step, and the request waits for them (``KVCacheManager.fetch_from_tier``)."""
        tier_fetches = self._tier_fetches.get(request.request_id, 0)
        with_tier = self.kv_cache.tier is not None and tier_fetches < _MAX_TIER_FETCHES
        hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request, with_tier)
        if not with_tier or not any(isinstance(block, TierBlock)
                                    for blocks in hits for block in blocks):
            return hits, num_hit_tokens
        if self.kv_cache.fetch_from_tier(hits):
            self._tier_fetches[request.request_id] = tier_fetches + 1
            return None, 0
        return self.kv_cache.get_computed_blocks(request)  # no room for them now

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled ones, apply stops, free finished."""
        if self.kv_cache.tier is not None:
            self.kv_cache.finish_tier_fetches(set(runner_output.kv_tier_failed or ()))
        row = {req_id: i for i, req_id in enumerate(runner_output.req_ids)}
        if runner_output.expert_tokens:
            if not self.expert_tokens:
                self.expert_tokens = [0] * len(runner_output.expert_tokens)
            self.expert_tokens = [total + new for total, new
                                  in zip(self.expert_tokens, runner_output.expert_tokens)]
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        row_of_output: dict[str, int] = {}
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            start = request.num_computed_tokens
            request.num_computed_tokens += num_tokens
            i = row.get(req_id)
            sampled = runner_output.sampled_token_ids[i] if i is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts and sampled:
                # Accepted drafts, then one sampled token; the rejected drafts' K/V is stale.
                num_accepted = len(sampled) - 1
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_decode_num_drafts += 1
                self.spec_decode_num_draft_tokens += len(drafts)
                self.spec_decode_num_accepted_tokens += num_accepted
            prompt_logprobs = self._new_prompt_logprobs(
                request, start, runner_output.prompt_logprobs[i]
                if runner_output.prompt_logprobs and i is not None else None)
            if prompt_logprobs is not None and request.kv_transfer_id is not None:
                request.kv_prompt_logprobs.append(prompt_logprobs)  # for the decode side
            pooled = runner_output.pooled[i] if runner_output.pooled and i is not None else None
            if pooled is not None:  # a pooling request's prompt done: finished with its vector
                request.status = RequestStatus.FINISHED_STOPPED
                outputs.append(EngineCoreOutput(
                    req_id=req_id, new_token_ids=[], finish_reason=FinishReason.STOP.value,
                    num_cached_tokens=max(request.num_cached_tokens, 0), pooled=pooled))
                finished.append(request)
                row_of_output[req_id] = len(outputs) - 1
                continue
            if not sampled:
                # A prefill chunk that did not reach the last prompt token.
                if prompt_logprobs is not None:
                    outputs.append(EngineCoreOutput(req_id=req_id, new_token_ids=[],
                                                    prompt_logprobs=prompt_logprobs))
                continue
            probs = (runner_output.sampled_token_probs[i]
                     if runner_output.sampled_token_probs else None)
            new_token_ids = []
            for j, token_id in enumerate(sampled):
                request.append_output_token(token_id)
                new_token_ids.append(token_id)
                if (self._check_stop(request) or self._advance_grammar(request, token_id)
                        or (probs is not None and self._check_early_stop(request, probs[j]))):
                    break
            logprobs = runner_output.logprobs[i] if runner_output.logprobs else None
            if logprobs is not None and len(new_token_ids) < len(sampled):
                logprobs = _slice_logprobs(logprobs, 0, len(new_token_ids))
            if not request.is_finished:
                request.spec_token_ids = self._next_drafts(request, runner_output, i)
            reason = request.status.finish_reason
            outputs.append(EngineCoreOutput(
                req_id=req_id, new_token_ids=new_token_ids,
                finish_reason=reason.value if reason else None,
                stop_reason=request.stop_reason, logprobs=logprobs,
                num_cached_tokens=max(request.num_cached_tokens, 0),
                prompt_logprobs=prompt_logprobs))
            if request.is_finished:
                finished.append(request)
                row_of_output[req_id] = len(outputs) - 1
        if finished:
            finished_set = set(finished)
            self.running = [r for r in self.running if r not in finished_set]
            for request in finished:
                if (request.kv_transfer_id is not None and request.status in (
                        RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)):
                    outputs[row_of_output[request.request_id]].kv_transfer_params = \
                        self._hold_for_decode(request)
                else:
                    self._free(request)
        return outputs

    # ----------------------------------------------------------------- queries

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.loading)

    @property
    def only_loading(self) -> bool:
        """Nothing to compute: every unfinished request waits for its K/V to arrive
        (pulled for it, or for the sample whose blocks it will share)."""
        return bool(self.loading) and not self.running and all(
            request.kv_follows is not None and self.kv_transfer.is_pending(request.kv_follows)
            for request in self.waiting)

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running), num_waiting=len(self.waiting) + len(self.loading),
            kv_cache_usage=self.kv_cache.usage,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            spec_decode_num_drafts=self.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=self.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=self.spec_decode_num_accepted_tokens,
            num_requests=len(self.requests),
            num_blocks_in_use=self.kv_cache.pool.num_blocks - self.kv_cache.num_free_blocks,
            expert_tokens=list(self.expert_tokens))

    # ----------------------------------------------------------------- internals

    def _check_stop(self, request: Request) -> bool:
        params = request.sampling_params
        max_tokens = params.max_tokens
        if (request.num_tokens >= self.max_model_len
                or (max_tokens is not None and request.num_output_tokens >= max_tokens)):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        if request.num_output_tokens < params.min_tokens:
            return False
        last = request.all_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last
            return True
        return False

    def _check_early_stop(self, request: Request, prob: float) -> bool:
        """FastDeploy's repetition rule: stop once ``window_size`` tokens in a row were
        sampled with probability above ``threshold`` (not before min_tokens)."""
        if self.early_stop is None:
            return False
        if prob > self.early_stop.threshold:
            request.num_confident_tokens += 1
        else:
            request.num_confident_tokens = 0
        if (request.num_confident_tokens >= self.early_stop.window_size
                and request.num_output_tokens >= request.sampling_params.min_tokens):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = "early_stop"
            return True
        return False

    def _next_drafts(self, request: Request, runner_output: ModelRunnerOutput,
                     i: int) -> list[int]:
        """The proposer's drafts for ``request``'s next step, cut to what it may still
        produce: its last accepted draft plus the bonus token must fit max_model_len and
        max_tokens. None for grammar-constrained requests (their bitmask covers one
        position per step)."""
        if runner_output.spec_token_ids is None or request.use_structured_output:
            return []
        room = self.max_model_len - request.num_tokens - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return list(runner_output.spec_token_ids[i][:max(room, 0)])

    def _new_prompt_logprobs(self, request: Request, start: int,
                             logprobs: SampleLogprobs | None) -> SampleLogprobs | None:
        """The part of a chunk's prompt logprobs not reported before. The chunk began
        at position ``start``, so it covers prompt tokens ``start + 1, ...``; after a
        preemption the prompt is recomputed and its first tokens were already sent."""
        if logprobs is None:
            return None
        skip = max(0, request.num_prompt_logprobs_sent - start)
        request.num_prompt_logprobs_sent = max(request.num_prompt_logprobs_sent,
                                               start + len(logprobs.ranks))
        if skip >= len(logprobs.ranks):
            return None
        return _slice_logprobs(logprobs, skip, len(logprobs.ranks)) if skip else logprobs

    def _allocate(self, request: Request, num_new_tokens: int, computed_blocks=None,
                  num_hit_tokens: int = 0):
        """``allocate_slots`` plus the lookahead slots a draft model writes, within
        max_model_len."""
        end = max(request.num_computed_tokens, num_hit_tokens) + num_new_tokens
        lookahead = max(0, min(self.num_lookahead_tokens, self.max_model_len - end))
        return self.kv_cache.allocate_slots(request, num_new_tokens, computed_blocks, lookahead)

    def _advance_grammar(self, request: Request, token_id: int) -> bool:
        """Feed a sampled token to the request's grammar; True if that finished the request
        (the grammar is complete: stop; or it rejected the token: error)."""
        if not request.use_structured_output:
            return False
        try:
            complete = request.structured_output_request.accept_token(token_id)
        except ValueError as error:
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = str(error)
            return True
        if complete:
            request.status = RequestStatus.FINISHED_STOPPED
        return complete

    def _victim(self) -> Request:
        """The running request preempted when blocks run out: the newest (fcfs), or the
        one of lowest priority, the newest among equals (priority)."""
        if self.config.policy != "priority":
            return self.running[-1]
        return max(self.running, key=_priority_key)

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids.clear()
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._forget_on_workers(request)
        self._enqueue(request, first=True)

    def _free(self, request: Request) -> None:
        self.kv_cache.free(request)
        self._tier_fetches.pop(request.request_id, None)
        self._forget_on_workers(request)
        del self.requests[request.request_id]
        if request.kv_transfer_id is not None:
            self.kv_transfer.cancel_hold(request)
        if request.kv_load is not None:
            self.kv_transfer.forget_request(request)

    # ----------------------------------------------------------------- KV transfer
    # (loom/core/kv_transfer.py holds the account; these move requests between queues.)

    def _schedule_kv_holds(self, num_scheduled_tokens: dict[str, int]) -> None:
        """Prefill side: requests whose last prompt chunk runs this step have their
        blocks served by the ranks from the end of the step."""
        for req_id, num_tokens in num_scheduled_tokens.items():
            request = self.requests[req_id]
            if (request.kv_transfer_id is not None
                    and request.num_computed_tokens + num_tokens >= request.num_tokens):
                self.kv_transfer.schedule_hold(request, self.kv_cache.req_to_blocks[req_id][0])

    def _hold_for_decode(self, request: Request) -> dict:
        """Prefill side: a finished request leaves, its blocks stay for the decode
        instance; returns the kv_transfer_params of its last output."""
        blocks = self.kv_cache.take_blocks(request)
        self._forget_on_workers(request)
        del self.requests[request.request_id]
        return self.kv_transfer.hold(request, blocks)

    def _start_kv_load(self, request: Request) -> bool:
        """Decode side: blocks for the prompt, local prefix-cache hits included, and the
        ranks told to pull the rest; False if they do not fit. Blocks the prefill
        instance freed behind a sliding window (-1 there) are neither allocated nor
        counted: no query to come reads them, and nothing fills them."""
        load = request.kv_load
        hits, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
        num_new_tokens = load.remote_num_tokens - num_hit_tokens
        num_outside_window = next((i for i, block_id in enumerate(load.remote_block_ids)
                                   if block_id >= 0), len(load.remote_block_ids))
        if self.kv_cache.allocate_slots(request, num_new_tokens, hits, cache_blocks=False,
                                        num_absent_blocks=num_outside_window) is None:
            return False
        self.waiting.popleft()
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        request.num_cached_tokens = num_hit_tokens
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.loading[request.request_id] = request
        first = max(num_hit_tokens // self.kv_cache.block_size, num_outside_window)
        block_ids = self.kv_cache.get_block_ids(request.request_id)
        self.kv_transfer.start_load(request, block_ids[first:], load.remote_block_ids[first:])
        return True

    def process_kv_events(self, events: list[KVTransferEvent]) -> list[EngineCoreOutput]:
        """The ranks' reports; outputs for loads that ended (prompt logprobs, or an
        error). Also frees prefill-side holds past their deadline."""
        outputs = []
        for event in events:
            done = self.kv_transfer.on_event(event)
            if done is not None:
                outputs += self._finish_kv_load(*done)
        self.kv_transfer.expire_holds()
        return outputs

    def _finish_kv_load(self, request: Request, error: str | None) -> list[EngineCoreOutput]:
        """The prompt's K/V arrived (or failed): all but the last prompt token count as
        computed; that one runs with the next step, whose logits give the first token,
        as on a mixed instance."""
        del self.loading[request.request_id]
        load, request.kv_load = request.kv_load, None
        if request.is_finished:  # aborted while its blocks were on the way
            self._free(request)
            return []
        if error is not None:
            error = f"KV transfer from the prefill instance failed: {error}"
            followers = [r for r in self.waiting if r.kv_follows == load.transfer_id]
            for failed in [request] + followers:
                if failed is not request:
                    self.waiting.remove(failed)
                failed.status = RequestStatus.FINISHED_ERROR
                failed.stop_reason = error
                self._free(failed)
            return [EngineCoreOutput(req_id=failed.request_id, new_token_ids=[],
                                     finish_reason=RequestStatus.FINISHED_ERROR.finish_reason.value,
                                     stop_reason=error) for failed in [request] + followers]
        request.num_computed_tokens = load.remote_num_tokens - 1
        self.kv_cache.cache_blocks(request, load.remote_num_tokens)
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)  # it holds its blocks: first in line
        # The prompt's logprobs came with the blocks; the workers compute none of them.
        request.num_prompt_logprobs_sent = request.num_prompt_tokens - 1
        k = request.sampling_params.prompt_logprobs
        if k is None or load.prompt_logprobs is None:
            return []
        logprobs = load.prompt_logprobs
        return [EngineCoreOutput(req_id=request.request_id, new_token_ids=[],
                                 prompt_logprobs=SampleLogprobs(
                                     token_ids=[ids[:k + 1] for ids in logprobs.token_ids],
                                     logprobs=[values[:k + 1] for values in logprobs.logprobs],
                                     ranks=logprobs.ranks))]

    def _fit_images(self, request: Request, start: int, num_new_tokens: int, encoder_budget: int,
                    fresh: bool) -> tuple[int, int]:
        """The tokens of ``num_new_tokens`` from ``start`` that run this step, and the
        step's encoder budget (placeholder tokens the vision towers may make, as vLLM's
        ``max_num_encoder_input_tokens``) left after them.

        An image's embeddings are made once, when its first placeholder token runs, and
        kept by the workers until every token of its span has run (across chunks of a
        prefill): one whose encoding does not fit in what is left waits for the next
        step, and the chunk stops before it. ``fresh``: the request was just admitted
        (new, or after a preemption), so the workers hold none of its images and an
        image this chunk resumes inside is made again. An image larger than the whole
        budget runs alone.

        An image whose tokens attend to each other both ways (``bidirectional``) runs in
        one step: a chunk never ends inside it but stops before it (and where the chunk
        starts inside it, after a prefix-cache hit, the request waits for a step with room
        for the rest). ``add_request`` refuses one longer than a step's budget."""
        end = start + num_new_tokens
        for feature in request.mm_features:
            if feature.offset >= end:
                break
            if feature.bidirectional and feature.end > end:
                return max(feature.offset - start, 0), encoder_budget
            if feature.end <= start or (feature.offset < start and not fresh):
                continue  # done, or its embeddings are kept from an earlier step
            nothing_encoded = encoder_budget == self.config.max_num_batched_tokens
            if feature.length > encoder_budget and not nothing_encoded:
                return max(feature.offset - start, 0), encoder_budget
            encoder_budget = max(encoder_budget - feature.length, 0)
            self._encoder_tokens += feature.length
        return num_new_tokens, encoder_budget

    def _forget_on_workers(self, request: Request) -> None:
        if self._num_tokens_sent.pop(request.request_id, None) is not None:
            self._forgotten_req_ids.add(request.request_id)
        self._num_blocks_sent.pop(request.request_id, None)

    def _new_request_data(self, request: Request) -> NewRequestData:
        block_ids = self.kv_cache.get_block_ids(request.request_id)
        self._num_tokens_sent[request.request_id] = request.num_tokens
        self._num_blocks_sent[request.request_id] = len(block_ids)
        return NewRequestData(
            req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            output_token_ids=request.output_token_ids, sampling_params=request.sampling_params,
            eos_token_ids=sorted(request.eos_token_ids),
            block_ids=block_ids, num_computed_tokens=request.num_computed_tokens,
            group_block_ids=[self.kv_cache.get_block_ids(request.request_id, group)
                             for group in range(1, self.kv_cache.num_groups)],
            mm_features=request.mm_features)

    def _cached_request_data(self, request: Request) -> CachedRequestData:
        req_id = request.request_id
        num_sent = self._num_tokens_sent[req_id]
        num_blocks_sent = self._num_blocks_sent[req_id]
        self._num_tokens_sent[req_id] = request.num_tokens
        self._num_blocks_sent[req_id] = self.kv_cache.num_blocks(req_id)
        return CachedRequestData(
            req_id=req_id, new_token_ids=request.all_token_ids[num_sent:],
            new_block_ids=self.kv_cache.get_block_ids(req_id, 0, num_blocks_sent),
            num_computed_tokens=request.num_computed_tokens,
            new_group_block_ids=[self.kv_cache.get_block_ids(req_id, group, num_blocks_sent)
                                 for group in range(1, self.kv_cache.num_groups)])


# Times a waiting request may have its blocks brought back from the offload tier before
# it computes them: each fetch is let go, cached, until the request is admitted, and
# running requests short of blocks may evict them first.
_MAX_TIER_FETCHES = 2


def _slice_logprobs(logprobs: SampleLogprobs, start: int, end: int) -> SampleLogprobs:
    return SampleLogprobs(token_ids=logprobs.token_ids[start:end],
                          logprobs=logprobs.logprobs[start:end], ranks=logprobs.ranks[start:end])


def _priority_key(request: Request) -> tuple[int, float]:
    """Lower runs first: the request's priority, then its arrival."""
    return request.sampling_params.priority, request.arrival_time
