"""Every type that crosses a process boundary: the wire contract between loom's processes.

    API server ──EngineCoreInput──▶ engine core ──EngineToWorker──▶ every rank
               ◀─EngineCoreMessage─            ◀─WorkerToEngine──  (rank 0's StepResult)

All are msgspec Structs in tagged unions, encoded as msgpack, never pickled. The
sockets that carry them: ``loom.ipc.task_queue`` (engine core and ranks) and
``loom.ipc.engine_core_client`` (API server and engine core). With the worker in the
engine's process (``UniProcExecutor``) the scheduler and the model runner exchange
the same ``SchedulerOutput`` and ``ModelRunnerOutput`` objects directly.

Send differences, not state: a request's full data travels once, in
``NewRequestData`` (again after a preemption, since the worker dropped it); after
that each step carries only its new token ids and new block ids.

User-facing results (``RequestOutput``) are not wire types: ``loom.outputs``.
"""

from __future__ import annotations

from typing import Any, get_args

import msgspec

from loom.sampling_params import SamplingParams

# ================================================================= multimodal inputs
# Made by the API side's processor (loom/multimodal), carried by a request to the ranks.

class ShmSlot(msgspec.Struct, array_like=True):
    """Where an array's bytes wait in a shared-memory ring of the sender's host
    (loom/ipc/shm_ring.py): the ring's segment, the item's position, its byte count."""

    segment: str
    start: int
    length: int


class TensorData(msgspec.Struct, array_like=True):
    """An array as its raw bytes (msgpack bin, never pickled): what an image processor
    made of one image. Between processes of one host a large one's bytes travel in
    shared memory instead (``shm`` set, ``data`` empty) and are copied back into
    ``data`` on arrival (loom/ipc/shm_ring.py)."""

    dtype: str  # numpy's name: float32, int64
    shape: list[int]
    data: bytes
    shm: ShmSlot | None = None

    @classmethod
    def from_array(cls, array: Any) -> TensorData:
        import numpy as np

        array = np.ascontiguousarray(array)
        return cls(dtype=array.dtype.name, shape=list(array.shape), data=array.tobytes())

    def to_array(self) -> Any:
        """A writable numpy array of these bytes."""
        import numpy as np

        if self.shm is not None:
            raise RuntimeError(f"this array's bytes are still in shared memory "
                               f"({self.shm.segment}); the receiver must fetch them first")

        return np.frombuffer(self.data, dtype=self.dtype).reshape(self.shape).copy()


class MultiModalFeature(msgspec.Struct, kw_only=True):
    """One image (or video) of a prompt: the span of placeholder tokens it fills, and
    what the model's vision tower makes those tokens' embeddings from."""

    modality: str  # "image" or "video"
    identifier: str  # its content's hash: keys the prefix cache and the encoder cache
    offset: int  # the prompt index of its first placeholder token
    length: int  # its placeholder tokens: one per row its tower makes
    data: dict[str, TensorData] = {}  # the processor's arrays for this item alone
    # Its tokens attend to each other both ways, the earlier ones to the later (Gemma 3;
    # its processor sets it): the scheduler never ends a step inside its span, and the
    # runner tells attention where it lies in the step (AttentionMetadata).
    bidirectional: bool = False

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.offset < end and start < self.end


# ================================================================= one step's data
# The engine core's scheduler -> every rank's model runner, and rank 0 -> back.

class NewRequestData(msgspec.Struct, kw_only=True):
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty only when resuming after preemption
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]  # KV cache group 0's block table (the only group but for hybrids)
    num_computed_tokens: int  # prefix-cache hit: these tokens' K/V are already in block_ids
    # Groups 1.. of a hybrid KV cache (core/kv_cache_manager.py), each as block_ids.
    group_block_ids: list[list[int]] = []
    mm_features: list[MultiModalFeature] = []  # its images, in prompt order


class CachedRequestData(msgspec.Struct, kw_only=True):
    req_id: str
    new_token_ids: list[int]  # tokens appended since the worker last saw this request
    new_block_ids: list[int]
    num_computed_tokens: int
    new_group_block_ids: list[list[int]] = []  # groups 1.., each as new_block_ids


class KVHold(msgspec.Struct, array_like=True):
    """Prefill side: after this step, serve ``block_ids`` as ``transfer_id`` to the decode
    instance's pulls (the request finishes in this step; its blocks stay allocated)."""

    transfer_id: str
    block_ids: list[int]


class KVLoad(msgspec.Struct, array_like=True):
    """Decode side: pull ``remote_block_ids`` of ``transfer_id`` from the prefill
    instance (this rank's peer: ``remote_addresses[rank]``) into ``local_block_ids``."""

    transfer_id: str
    remote_addresses: list[str]
    remote_block_ids: list[int]
    local_block_ids: list[int]


class KVConnectorMetadata(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the scheduler's half of the KV connector tells every rank's half in a step:
    transfers to stop serving (before the step: their blocks may be reused in it), to
    serve (after the step), and to pull (in the background)."""

    releases: list[str] = []
    holds: list[KVHold] = []
    loads: list[KVLoad] = []

    @property
    def is_empty(self) -> bool:
        return not (self.releases or self.holds or self.loads)


class KVTierCopy(msgspec.Struct, array_like=True):
    """One block between the KV cache and a slot of the offload tier (core/kv_tier.py):
    the pool's block id, the tier's slot, and the key the slot's record holds (the
    block's chained hash and its KV cache group)."""

    block_id: int
    slot: int
    block_hash: int
    group: int


class KVTierOps(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A step's copies between the KV cache and the offload tier, done by every rank
    before the step's forward, saves first: a block saved here is reused by this step
    (or filled by one of its loads). A load whose record a rank refuses comes back in
    ``ModelRunnerOutput.kv_tier_failed``."""

    saves: list[KVTierCopy] = []
    loads: list[KVTierCopy] = []


class SchedulerOutput(msgspec.Struct, kw_only=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    # Placeholder tokens whose images the vision towers make this step (at most: an image
    # counted for a request the step then could not fit is not made); lengthens the
    # step's time bound (ParallelConfig.step_bound_s).
    num_encoder_tokens: int = 0
    # Requests the workers must forget (finished, aborted or preempted) since the last step.
    finished_req_ids: list[str]
    # Grammar-constrained requests that sample this step, and their allowed-token bits:
    # row i (ceil(vocab / 32) int32 words, little-endian) belongs to
    # structured_output_req_ids[i]; bit t % 32 of word t // 32 allows token t.
    structured_output_req_ids: list[str] = []
    grammar_bitmask: bytes | None = None
    # Speculative decoding: draft tokens to verify this step, req_id -> drafts. They
    # follow the request's known tokens and are counted in num_scheduled_tokens.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Prefill/decode disaggregation (core/kv_transfer.py): KV blocks to serve or pull.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # The KV offload tier (core/kv_tier.py): blocks to save before they are reused, and
    # blocks to load, before the step.
    kv_tier_ops: KVTierOps | None = None
    # Experts across data-parallel replicas (the replicas step in lock-step,
    # core/dp_lockstep.py): this replica has no tokens this step but must enter every
    # MoE layer's all-to-all with the others (ModelRunner.dummy_step).
    dummy_forward: bool = False

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class SampleLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one request's sampled tokens this step (or of a run of its prompt
    tokens, for prompt logprobs).

    For each token: ``token_ids = [token, top_1, ..., top_k]`` with the matching
    ``logprobs``, and ``ranks`` that token's rank (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class ModelRunnerOutput(msgspec.Struct, kw_only=True):
    """What rank 0 returns for one SchedulerOutput, aligned with ``req_ids``.

    A request still prefilling (a chunk that does not reach its last token) has an
    empty ``sampled_token_ids`` entry. With speculative decoding a request may get
    several tokens: its accepted drafts, then one sampled token.
    """

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[SampleLogprobs | None] | None = None
    # Draft tokens proposed for each request's next step (speculative decoding only).
    spec_token_ids: list[list[int]] | None = None
    # Early stop only: the probability of each sampled token, aligned with sampled_token_ids.
    sampled_token_probs: list[list[float]] | None = None
    # prompt_logprobs requests: logprobs of the prompt tokens that follow this step's
    # prefill chunk: chunk positions start .. min(end, num_prompt - 1) - 1 predict prompt
    # tokens start + 1 .. min(end, num_prompt - 1).
    prompt_logprobs: list[SampleLogprobs | None] | None = None
    # Mixture-of-experts models: tokens routed to each expert in this step, summed over
    # the MoE layers (a token counts once per layer and chosen expert); None otherwise.
    expert_tokens: list[int] | None = None
    # Pooling requests (loom/pooling.py): the vector of each one whose prompt this step
    # finished (an embedding, or a score as one value); None for the others.
    pooled: list[list[float] | None] | None = None
    # The KV offload tier: indices into the step's KVTierOps.loads whose record some rank
    # refused (its key, weights version or checksum did not match); those blocks are misses.
    kv_tier_failed: list[int] | None = None



# ================================================================= engine core <-> ranks
# loom.ipc.task_queue: the engine broadcasts to every rank; ranks reply.


class ExecuteModel(msgspec.Struct, tag="execute"):
    step: int
    scheduler_output: SchedulerOutput


class WorkerShutdown(msgspec.Struct, tag="shutdown"):
    pass


class StepResult(msgspec.Struct, tag="result"):
    step: int
    output: ModelRunnerOutput


class WorkerFailure(msgspec.Struct, tag="failure"):
    rank: int
    error: str  # "ValueError: ..." as the worker saw it
    exc_type: str
    traceback: str


class RemoteStatus(msgspec.Struct, tag="status"):
    """What a rank on another host would have written into the engine's signals."""

    rank: int
    loaded: bool
    ready: bool
    profiled_blocks: int
    heartbeat: float
    step: int = 0  # as WorkerSignals.step / step_started
    step_started: float = 0.0
    kv_cache_bytes_per_block: int = 0
    kv_cache_window: int = 0  # as WorkerSignals.kv_cache_window
    kv_cache_num_groups: int = 1  # as WorkerSignals.kv_cache_num_groups
    kv_cache_num_full_groups: int = 1
    weights_status: int = 0  # as WorkerSignals.weights_status


class WorkerRPC(msgspec.Struct, tag="rpc"):
    """Run ``Worker.<method>(**kwargs)`` on every rank (``collective_rpc``): weight updates,
    sleep and wake-up, between steps. Arguments and results are msgpack values."""

    call_id: int
    method: str
    kwargs: dict[str, Any] = {}
    args: list[Any] = []


class RPCResult(msgspec.Struct, tag="rpc_result"):
    """Every rank's answer to one WorkerRPC; a raised error is an answer too (``error``),
    so a failed weight update leaves the rank serving."""

    call_id: int
    rank: int
    result: Any = None
    error: str | None = None  # "ValueError: ..." as the worker raised it
    exc_type: str | None = None


class KVTransferEvent(msgspec.Struct, tag="kv_event"):
    """A rank's KV connector to its engine core (its own socket, from the transfer
    threads): ``recv_done`` / ``recv_failed`` (decode side, one per rank and load),
    ``send_done`` (prefill side: the peer rank has its blocks)."""

    rank: int
    transfer_id: str
    kind: str
    error: str | None = None


# ================================================================= decode rank <-> prefill rank
# loom.worker.kv_connector: one TCP connection per transfer, rank i to rank i. Frames are
# a 4-byte big-endian length and msgpack; the blocks follow the reply raw (tcp) or are
# copied from the prefill rank's shared-memory cache (shm); then one ack byte.


class KVPull(msgspec.Struct, kw_only=True):
    transfer_id: str
    block_ids: list[int]  # the prefill rank's blocks, in the order they are wanted
    rank: int
    tp_size: int
    layout: list[int]  # KVLayout.key(): layers, kv heads, block size, head dim, element bytes,
    # cache dtype
    transport: str


class KVPullReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    ok: bool
    error: str | None = None
    nbytes: int = 0  # tcp: the bytes that follow
    shm_name: str | None = None  # shm: the segment holding the prefill rank's cache
    num_blocks: int = 0  # shm: the blocks in that cache


EngineToWorker = ExecuteModel | WorkerShutdown | WorkerRPC
WorkerToEngine = StepResult | WorkerFailure | RemoteStatus | RPCResult


# ================================================================= API server <-> engine core
# loom.ipc.engine_core_client: the API process drives the engine core process.


class EngineCoreRequest(msgspec.Struct, tag="add", kw_only=True):
    """One sequence to generate (a request with n > 1 sends n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    parent_request_id: str
    index: int = 0
    mm_features: list[MultiModalFeature] = []  # its images, in prompt order


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class FinishRequests(msgspec.Struct, tag="finish"):
    """Sequences whose detokenized text reached a stop string: (request id, stop string)."""

    stops: list[tuple[str, str]]


class EngineCoreShutdown(msgspec.Struct, tag="shutdown"):
    pass


# Control calls: what changes what the engine serves, between steps (EngineCore.run_control).
# Each is named by its tag (AsyncLLM.control("sleep", level=2) -> Sleep(level=2)).


class PauseGeneration(msgspec.Struct, tag="pause_generation", kw_only=True,
                      forbid_unknown_fields=True):
    """Hold new requests; those in flight finish first ("wait": answered once they
    have) or end now with finish reason abort ("abort")."""

    mode: str = "wait"


class ResumeGeneration(msgspec.Struct, tag="resume_generation", forbid_unknown_fields=True):
    """Run what was held."""


class UpdateWeights(msgspec.Struct, tag="update_weights", kw_only=True,
                    forbid_unknown_fields=True):
    """New weights once the requests in flight have finished: a checkpoint directory, a
    .gguf file or an ipc manifest; None reloads the last checkpoint. With ``lora_name``:
    that LoRA adapter's weights from its PEFT directory ``path``, at once, the requests in
    flight running on (loom/lora.py)."""

    path: str | None = None
    lora_name: str | None = None


class Sleep(msgspec.Struct, tag="sleep", kw_only=True, forbid_unknown_fields=True):
    """Once the requests in flight have finished, free the KV cache (level 1) or the KV
    cache and the weights (level 2); requests are held until WakeUp."""

    level: int = 1


class WakeUp(msgspec.Struct, tag="wake_up", forbid_unknown_fields=True):
    pass


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", forbid_unknown_fields=True):
    pass


class CollectiveRPC(msgspec.Struct, tag="collective_rpc", kw_only=True,
                    forbid_unknown_fields=True):
    """``Worker.<method>(*args, **kwargs)`` on every rank; each rank's result."""

    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


class GetStatus(msgspec.Struct, tag="status", forbid_unknown_fields=True):
    """Paused, asleep (and at which level), how many requests are held."""


Control = (PauseGeneration | ResumeGeneration | UpdateWeights | Sleep | WakeUp
           | ResetPrefixCache | CollectiveRPC | GetStatus)
CONTROLS: dict[str, type[Control]] = {control.__struct_config__.tag: control
                                      for control in get_args(Control)}


def make_control(name: str, fields: dict[str, Any]) -> Control:
    """The control call named ``name`` with ``fields``; ValueError, naming what was
    wrong, for an unknown name or a field it does not have or of the wrong type."""
    if name not in CONTROLS:
        raise ValueError(f"no control call {name!r}; known: {', '.join(sorted(CONTROLS))}")
    try:
        return msgspec.convert(fields, CONTROLS[name])
    except msgspec.ValidationError as error:
        raise ValueError(f"control call {name}: {error}") from None


class ControlRequest(msgspec.Struct, tag="control"):
    """One control call; answered by one ControlResponse with the same ``call_id``."""

    call_id: int
    control: Control


EngineCoreInput = (EngineCoreRequest | AbortRequests | FinishRequests | EngineCoreShutdown
                   | ControlRequest)


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's progress in one step, for the output side."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # a FinishReason value
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: SampleLogprobs | None = None
    num_cached_tokens: int = 0
    # Logprobs of the next prompt tokens, in order; entries of one request arrive in
    # outputs that may carry no new tokens (prefill chunks).
    prompt_logprobs: SampleLogprobs | None = None
    # Prefill side of disaggregation: where the decode instance pulls this request's KV
    # blocks from, and its prompt logprobs (core/kv_transfer.py: KVTransferParams).
    kv_transfer_params: dict[str, Any] | None = None
    # A pooling request's vector (it finishes with it, with no new token)
    pooled: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of which found (cumulative)
    num_preemptions: int  # cumulative
    spec_decode_num_drafts: int = 0  # steps in which a request verified drafts (cumulative)
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified (cumulative)
    spec_decode_num_accepted_tokens: int = 0  # of which accepted (cumulative)
    # The empty-state check, live: both are 0 whenever no request is in flight.
    num_requests: int = 0  # requests the scheduler holds, in any state
    num_blocks_in_use: int = 0  # KV blocks with a reference (cached-but-free ones excluded)
    # MoE: tokens routed to each expert since start, summed over layers (cumulative;
    # ModelRunnerOutput.expert_tokens added up); empty for a dense model
    expert_tokens: list[int] = msgspec.field(default_factory=list)


class EngineCoreReady(msgspec.Struct, tag="ready"):
    num_blocks: int


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float


class EngineCoreFailed(msgspec.Struct, tag="failed"):
    message: str


class ControlResponse(msgspec.Struct, tag="control_response"):
    call_id: int
    result: Any = None
    error: str | None = None  # why the call failed; the engine serves on as before
    exc_type: str | None = None  # "ValueError" (the caller's fault) or another name
    # The core holds new requests after the call (paused or asleep): requests may then
    # wait without a step, and the API side's watchdog does not judge.
    holding: bool = False


EngineCoreMessage = EngineCoreReady | EngineCoreOutputs | EngineCoreFailed | ControlResponse


# ================================================================= head <-> headless hosts
# loom.ipc.remote_engine_core: a `loom serve --headless` host announces the data-parallel
# replicas it runs to the head (`loom serve --data-parallel-size-local`); the head
# answers with the addresses their engine cores connect to, or refuses by name.


class DPHello(msgspec.Struct, tag="dp_hello"):
    host: str
    start_rank: int
    num_ranks: int
    settings: dict[str, Any]  # flag -> value (loom/handshake.py: handshake_settings)


class DPWelcome(msgspec.Struct, tag="dp_welcome"):
    addresses: list[tuple[int, str, str]]  # (replica rank, input address, output address)
    # experts across the replicas: the store port of their ranks' one process group and
    # every replica's lock-step addresses (ParallelConfig's data_parallel_master_port and
    # data_parallel_lockstep_addresses, as the head chose them)
    master_port: int | None = None
    lockstep_addresses: list[tuple[str, str]] | None = None


class DPRefusal(msgspec.Struct, tag="dp_refusal"):
    message: str


class DPBye(msgspec.Struct, tag="dp_bye"):
    """The head is shutting down cleanly: its replicas were told to stop."""


DPHandshake = DPHello | DPWelcome | DPRefusal | DPBye
