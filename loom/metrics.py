"""Prometheus metrics of the API server, under vLLM's names so its dashboards work.

Every metric is named ``vllm:<name>`` and labelled ``model_name`` and ``replica`` (the
data-parallel replica whose engine core it describes, "0" without data parallel; vLLM
calls it ``engine``), with the meaning vLLM (v1) gives it:

    vllm:num_requests_running          gauge      sequences in the running batch
    vllm:num_requests_waiting          gauge      sequences waiting to be scheduled
    vllm:kv_cache_usage_perc           gauge      share of KV blocks in use, 0..1
    vllm:prefix_cache_queries_total    counter    prompt tokens looked up in the prefix cache
    vllm:prefix_cache_hits_total       counter    of which were found
    vllm:num_preemptions_total         counter    sequences preempted for lack of KV blocks
    vllm:spec_decode_num_drafts_total  counter    (request, step) pairs that verified drafts
    vllm:spec_decode_num_draft_tokens_total     counter  draft tokens verified
    vllm:spec_decode_num_accepted_tokens_total  counter  of which accepted (their ratio is
                                                         the acceptance rate)
    vllm:prompt_tokens_total           counter    prompt tokens of sequences that started
    vllm:generation_tokens_total       counter    tokens generated
    vllm:request_success_total         counter    finished sequences, by finished_reason
    vllm:time_to_first_token_seconds   histogram  arrival -> first generated token
    vllm:inter_token_latency_seconds   histogram  between consecutive token batches
    vllm:time_per_output_token_seconds histogram  per sequence: (e2e - ttft) / (tokens - 1)
    vllm:e2e_request_latency_seconds   histogram  arrival -> finish

Beside them, loom's own empty-state check, live (each is 0 whenever nothing is in
flight; anything else is a leak that nothing will ever free):

    loom:engine_requests               gauge      requests the engine core's scheduler holds
    loom:kv_blocks_in_use              gauge      KV blocks with a reference
    loom:server_requests_in_flight     gauge      requests the API server waits on

Mixture-of-experts models only, so that load imbalance is visible:

    loom:moe_expert_tokens_total       counter    tokens routed to each expert (label
                                                  ``expert``), summed over the MoE layers:
                                                  a token counts once per layer and per
                                                  expert chosen (top-k)
    loom:moe_expert_load_max_over_mean gauge      the busiest expert's count over the
                                                  mean of those counters (1.0: even)

Counts are per sequence: a request with n = 4 is four sequences. Times are measured
in the API process, where requests arrive and tokens leave.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from loom.core.wire import EngineCoreOutput
from loom.core.scheduler import SchedulerStats

CONTENT_TYPE = CONTENT_TYPE_LATEST
disable_created_metrics()  # no *_created series, as in vLLM

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class _SequenceTimes:
    arrival_time: float
    num_prompt_tokens: int
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_generation_tokens: int = 0


class ServerMetrics:
    """One registry per server, so two servers in one process never share counters; the
    replicas of one data-parallel server share theirs (``ServerMetrics.for_replicas``),
    each writing its own ``replica`` label."""

    def __init__(self, model_name: str, replica: int = 0,
                 registry: CollectorRegistry | None = None,
                 families: dict[str, Any] | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        families = {} if families is None else families
        r, labels = self.registry, ["model_name", "replica"]
        self.labels = {"model_name": model_name, "replica": str(replica)}
        values = (model_name, str(replica))

        def family(kind, name: str, doc: str, label_names=labels, **kwargs):
            if name not in families:  # made once per registry, shared by its replicas
                families[name] = kind(name, doc, label_names, registry=r, **kwargs)
            return families[name]

        def gauge(name: str, doc: str):
            return family(Gauge, f"vllm:{name}", doc).labels(*values)

        def counter(name: str, doc: str):
            return family(Counter, f"vllm:{name}", doc).labels(*values)

        def histogram(name: str, doc: str, buckets):
            return family(Histogram, f"vllm:{name}", doc, buckets=buckets).labels(*values)

        self.num_requests_running = gauge("num_requests_running", "Sequences running.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting.")
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.")
        # The empty-state check as gauges: all three are 0 whenever nothing is in flight;
        # anything else is a leak (a request or KV block that nothing will ever free).
        self.engine_requests = family(Gauge, "loom:engine_requests",
                                      "Requests the engine core's scheduler holds."
                                      ).labels(*values)
        self.kv_blocks_in_use = family(Gauge, "loom:kv_blocks_in_use",
                                       "KV blocks with a reference (cached free ones excluded)."
                                       ).labels(*values)
        self.server_requests_in_flight = family(Gauge, "loom:server_requests_in_flight",
                                                "Requests the API server waits on."
                                                ).labels(*values)
        self.prefix_cache_queries = counter("prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions", "Preempted sequences.")
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts",
                                              "Steps in which a sequence verified drafts.")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens",
                                                    "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                                       "Draft tokens accepted.")
        self.prompt_tokens = counter("prompt_tokens", "Prefilled prompt tokens.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = family(Counter, "vllm:request_success", "Finished sequences.",
                                       ["model_name", "replica", "finished_reason"])
        self._label_values = values
        self.time_to_first_token = histogram("time_to_first_token_seconds",
                                             "Time to first token.", _LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between token batches.", _LATENCY_BUCKETS)
        self.time_per_output_token = histogram("time_per_output_token_seconds",
                                               "Mean time per output token after the first.",
                                               _LATENCY_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds",
                                             "End-to-end request latency.", _REQUEST_BUCKETS)
        self._expert_tokens = family(Counter, "loom:moe_expert_tokens",
                                     "Tokens routed to each expert, summed over MoE layers.",
                                     ["model_name", "replica", "expert"])
        self.expert_load_max_over_mean = family(
            Gauge, "loom:moe_expert_load_max_over_mean",
            "Busiest expert's routed tokens over the mean (1.0: even).").labels(*values)
        self._sequences: dict[str, _SequenceTimes] = {}
        self._last_stats = SchedulerStats(0, 0, 0.0, 0, 0, 0)

    @classmethod
    def for_replicas(cls, model_name: str, num_replicas: int) -> list[ServerMetrics]:
        """The metrics of each replica of a data-parallel server, in one registry."""
        registry, families = CollectorRegistry(), {}
        return [cls(model_name, replica, registry, families) for replica in range(num_replicas)]

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ----------------------------------------------------------------- recording

    def record_sequence_added(self, engine_request_id: str, num_prompt_tokens: int,
                              arrival_time: float) -> None:
        self._sequences[engine_request_id] = _SequenceTimes(arrival_time, num_prompt_tokens)

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Set the gauges; advance counters by what the core's cumulative totals grew."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.engine_requests.set(stats.num_requests)
        self.kv_blocks_in_use.set(stats.num_blocks_in_use)
        last = self._last_stats
        self.prefix_cache_queries.inc(
            max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.num_preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.spec_decode_num_drafts.inc(
            max(0, stats.spec_decode_num_drafts - last.spec_decode_num_drafts))
        self.spec_decode_num_draft_tokens.inc(
            max(0, stats.spec_decode_num_draft_tokens - last.spec_decode_num_draft_tokens))
        self.spec_decode_num_accepted_tokens.inc(
            max(0, stats.spec_decode_num_accepted_tokens - last.spec_decode_num_accepted_tokens))
        if stats.expert_tokens:
            self._record_expert_tokens(stats.expert_tokens, last.expert_tokens)
        self._last_stats = stats

    def _record_expert_tokens(self, totals: list[int], last: list[int]) -> None:
        last = last or [0] * len(totals)
        for expert, (total, before) in enumerate(zip(totals, last)):
            # every expert gets its series, an idle one at 0: that is the imbalance
            self._expert_tokens.labels(*self._label_values, str(expert)).inc(
                max(0, total - before))
        mean = sum(totals) / len(totals)
        self.expert_load_max_over_mean.set(max(totals) / mean if mean else 0.0)

    def record_core_outputs(self, outputs: list[EngineCoreOutput], now: float) -> None:
        for out in outputs:
            times = self._sequences.get(out.req_id)
            if times is None:
                continue
            if out.new_token_ids:
                self.generation_tokens.inc(len(out.new_token_ids))
                if times.first_token_time is None:
                    times.first_token_time = now
                    self.prompt_tokens.inc(times.num_prompt_tokens)
                    self.time_to_first_token.observe(now - times.arrival_time)
                else:
                    self.inter_token_latency.observe(now - times.last_token_time)
                times.last_token_time = now
                times.num_generation_tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.record_sequence_finished(out.req_id, out.finish_reason, now)

    def record_sequence_finished(self, engine_request_id: str, finish_reason: str,
                                 now: float) -> None:
        """A sequence ended (in the core, at a stop string, or aborted)."""
        times = self._sequences.pop(engine_request_id, None)
        if times is None or finish_reason in ("abort", "error"):
            return
        self._request_success.labels(*self._label_values, finish_reason).inc()
        self.e2e_request_latency.observe(now - times.arrival_time)
        if times.first_token_time is not None and times.num_generation_tokens > 1:
            self.time_per_output_token.observe((times.last_token_time - times.first_token_time)
                                               / (times.num_generation_tokens - 1))

    def forget_sequence(self, engine_request_id: str) -> None:
        self._sequences.pop(engine_request_id, None)
