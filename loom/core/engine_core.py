"""EngineCore: the scheduler and the executor in one loop. One ``step()`` is:

    schedule() -> SchedulerOutput -> every rank executes -> rank 0's ModelRunnerOutput
    -> update_from_output() -> EngineCoreOutputs

It imports no torch: the executor it drives is handed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from loom.config import EngineConfig
from loom.core.scheduler import Scheduler
from loom.core.wire import (CollectiveRPC, Control, EngineCoreOutput, GetStatus, ModelRunnerOutput,
                            PauseGeneration, ResetPrefixCache, ResumeGeneration, SchedulerOutput,
                            SchedulerStats, Sleep, UpdateWeights, WakeUp)
from loom.errors import WeightsLostError
from loom.request import Request, RequestStatus

if TYPE_CHECKING:
    from loom.tokenizer import Tokenizer


class ExecutorLike(Protocol):
    """loom.executor.base.Executor, handed in (it is not core code)."""

    def initialize(self) -> int: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
    def collective_rpc(self, method: str, kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None, args: tuple = ()) -> list[Any]: ...
    def check_health(self) -> None: ...
    def shutdown(self) -> None: ...


class StructuredOutputLike(Protocol):
    """loom.structured_output.StructuredOutputManager, handed in (it is not core code)."""

    def add_request(self, request: Request) -> None: ...
    def take_failed(self) -> list[tuple[Request, str]]: ...
    def wait_for_compiles(self, timeout: float) -> None: ...
    def grammar_bitmask(self, requests: list[Request]) -> bytes: ...
    def shutdown(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, executor: ExecutorLike,
                 structured_output: StructuredOutputLike | None = None) -> None:
        self.config = config
        self.executor = executor
        self.structured_output = structured_output
        self.num_blocks = executor.initialize()
        kv_tier_slots = self._start_kv_tier() if config.cache.kv_offload_size else 0
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_blocks,
            speculative_config=config.speculative, early_stop_config=config.early_stop,
            kv_transfer_config=config.kv_transfer,
            tp_size=config.parallel.tensor_parallel_size,
            kv_cache_groups=getattr(executor, "kv_cache_groups", (None,)),
            max_loras=config.model.max_loras if config.model.enable_lora else None,
            kv_tier_slots=kv_tier_slots)
        # Prefill/decode disaggregation: the ranks' transfer threads report here.
        self.kv_events = None
        if config.kv_transfer is not None:
            self._start_kv_connector()
        # Weights that change (docs/weight_updates.md). While generation is paused, the
        # engine asleep, or in-flight requests drain before a change, new requests are
        # held here, not scheduled: every request runs on one set of weights.
        self.paused = False
        self.sleep_level = 0  # 0 awake; 1 KV cache freed; 2 KV cache and weights freed
        self.draining = False
        self._held: list[Request] = []

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: Tokenizer | None = None) -> EngineCore:
        """The executor ``config.parallel`` asks for (worker processes for more than one
        rank or with ``distributed_executor_backend="mp"``, else the worker in-process)
        and a grammar manager, which loads the model's tokenizer the first time a
        request needs a grammar unless ``tokenizer`` is given. Imports stay lazy, so an
        engine core driving worker processes never imports torch or transformers."""
        from loom.executor import make_executor

        def tokenizer_factory() -> Tokenizer:
            if tokenizer is not None:
                return tokenizer
            from loom.tokenizer import load_tokenizer

            return load_tokenizer(config.model.model, config.model.tokenizer,
                                  config.model.chat_template)

        vocab_size = config.model.vocab_size or (len(tokenizer.hf) if tokenizer is not None else 0)
        structured_output = None  # --structured-outputs-backend off: no grammar engine loaded
        if config.structured_outputs.enabled:
            from loom.structured_output import StructuredOutputManager

            structured_output = StructuredOutputManager(config.structured_outputs,
                                                        tokenizer_factory, vocab_size)
        return cls(config, make_executor(config), structured_output)

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None and self.structured_output is None:
            raise ValueError("structured outputs are off on this engine "
                             "(--structured-outputs-backend off)")
        if self.is_holding:
            self._held.append(request)
            return
        self.scheduler.add_request(request)
        if self.structured_output is not None:
            self.structured_output.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self._held:
            aborted = set(request_ids)
            self._held = [r for r in self._held if r.request_id not in aborted]
        self.scheduler.abort_requests(request_ids)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED, stop)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, lockstep: bool = False) -> list[EngineCoreOutput]:
        """One step. ``lockstep`` (experts across data-parallel replicas, which step
        together: core/dp_lockstep.py): the ranks run exactly one forward, a dummy one
        (``SchedulerOutput.dummy_forward``) when this replica has nothing to run."""
        outputs = self.poll_kv_transfers() if self.kv_events is not None else []
        if not self.scheduler.has_unfinished_requests():
            if lockstep:
                self.executor.execute_model(_dummy_step())
            return outputs
        if self.structured_output is None:
            scheduler_output = self.scheduler.schedule()
            if self._nothing_to_run(scheduler_output):
                if lockstep:
                    self.executor.execute_model(_dummy_step())
                return outputs  # only K/V transfers in flight
            scheduler_output.dummy_forward = lockstep and scheduler_output.is_empty
            runner_output = self.executor.execute_model(scheduler_output)
            return outputs + self.scheduler.update_from_output(scheduler_output, runner_output)
        failed = outputs + self._finish_failed_grammars()
        scheduler_output = self.scheduler.schedule()
        self._attach_grammar_bitmask(scheduler_output)
        if self._nothing_to_run(scheduler_output):
            if lockstep:
                self.executor.execute_model(_dummy_step())
            if self.scheduler.waiting:
                # Only requests whose grammar is compiling are left: wait for one, briefly.
                self.structured_output.wait_for_compiles(0.05)
            return failed
        scheduler_output.dummy_forward = lockstep and scheduler_output.is_empty
        runner_output = self.executor.execute_model(scheduler_output)
        return failed + self.scheduler.update_from_output(scheduler_output, runner_output)

    @staticmethod
    def _nothing_to_run(scheduler_output: SchedulerOutput) -> bool:
        return (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                and scheduler_output.kv_connector_metadata is None
                and scheduler_output.kv_tier_ops is None)

    def _start_kv_tier(self) -> int:
        """Every rank opens its part of the KV offload tier (worker/kv_tier_io.py) with as
        many slots as ``--kv-offload-size`` holds blocks; returns that count."""
        from loom.core.kv_tier import tier_num_slots

        cache = self.config.cache
        bytes_per_block = self.executor.kv_cache_bytes_per_block
        num_slots = tier_num_slots(cache.kv_offload_size, bytes_per_block)
        if num_slots < 1:
            raise ValueError(f"--kv-offload-size {cache.kv_offload_size:,} bytes holds no KV "
                             f"block of {bytes_per_block:,} bytes; raise it")
        self.executor.collective_rpc("init_kv_tier", {"num_slots": num_slots})
        return num_slots

    # ----------------------------------------------------------------- KV transfer
    # Prefill/decode disaggregation (core/kv_transfer.py): the ranks move the blocks in
    # background threads and report here; nothing in a step waits on the wire.

    def _start_kv_connector(self) -> None:
        """Every rank starts its connector half (a listener on a prefill instance, a
        puller on a decode one) and says where it listens."""
        from loom.ipc.kv_events import KVEventReceiver

        host = (self.config.parallel.master_addr if self.config.parallel.nnodes > 1
                else "127.0.0.1")
        self.kv_events = KVEventReceiver(host)
        addresses = self.executor.collective_rpc(
            "init_kv_connector", {"notify_address": self.kv_events.address})
        self.scheduler.kv_transfer.rank_addresses = list(addresses)

    def poll_kv_transfers(self, timeout_s: float = 0.0) -> list[EngineCoreOutput]:
        """Take the ranks' transfer reports (waiting up to ``timeout_s`` for one) and free
        holds past their deadline; outputs of the loads that ended."""
        events = self.kv_events.poll(int(timeout_s * 1000))
        return self.scheduler.process_kv_events(events)

    @property
    def kv_transfer_stats(self) -> dict[str, int]:
        """Blocks held for decode instances and requests waiting for their K/V."""
        kv = self.scheduler.kv_transfer
        return ({"num_held_blocks": kv.num_held_blocks, "num_loading": kv.num_loading}
                if kv is not None else {})

    def _finish_failed_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar did not compile end with an error (the API side validates
        grammars first, so this is rare); never an exception in the step."""
        outputs = []
        for request, error in self.structured_output.take_failed():
            message = f"the grammar failed to compile: {error}"
            self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR,
                                           message)
            outputs.append(EngineCoreOutput(req_id=request.request_id, new_token_ids=[],
                                            finish_reason="error", stop_reason=message))
        return outputs

    def _attach_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """Allowed-token bits for each grammar-constrained request that samples this step."""
        requests = []
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            if (request.use_structured_output
                    and request.num_computed_tokens + num_tokens >= request.num_tokens):
                requests.append(request)
        if requests:
            scheduler_output.structured_output_req_ids = [r.request_id for r in requests]
            scheduler_output.grammar_bitmask = self.structured_output.grammar_bitmask(requests)

    def get_stats(self) -> SchedulerStats:
        stats = self.scheduler.get_stats()
        if self._held:  # held requests wait too
            stats = msgspec.structs.replace(stats, num_waiting=stats.num_waiting + len(self._held),
                                            num_requests=stats.num_requests + len(self._held))
        return stats

    # ----------------------------------------------------------------- weights that change
    # The rule: a request runs on one set of weights. Requests in flight when a change is
    # asked for finish first (pause "wait", and before update_weights or sleep) or are
    # aborted (pause "abort"); requests that arrive meanwhile are held and run after it.
    # Every change of weights, and a sleep (the KV cache's contents go), empties the
    # prefix cache. The executor's collective_rpc runs the change on every rank.
    #
    # In its own process the core takes these as control calls (wire.Control), in order,
    # between steps: ``ready_for`` says whether the first may run yet (holding new
    # requests while those in flight drain), ``run_control`` runs it.

    def ready_for(self, control: Control) -> bool:
        """Whether ``control`` may run now. A pause in mode wait, a weight update and a
        sleep first let the requests in flight finish: until they have, new requests
        are held (by the pause, from now on) and this is False; the caller steps and
        asks again."""
        if isinstance(control, PauseGeneration) and control.mode == "wait":
            self.paused = True
        elif not isinstance(control, (UpdateWeights, Sleep)) or (
                isinstance(control, UpdateWeights) and control.lora_name is not None):
            return True  # (a LoRA adapter's update holds nothing: update_weights)
        self.draining = not self.is_drained
        return not self.draining

    def run_control(self, control: Control) -> Any:
        """Run one control call; its result (a pause's: the aborted requests' outputs).
        Succeeded or not, the drain it waited for is over: what it held runs now unless
        the engine is paused or asleep."""
        try:
            if self.config.parallel.experts_across_replicas and (
                    isinstance(control, UpdateWeights)
                    or isinstance(control, Sleep) and control.level > 1):
                # each replica's ranks hold part of every replica's experts, and the
                # replicas drain at different times: one would free or change experts
                # the others still run
                raise ValueError(f"{control.__struct_config__.tag} is not supported yet with "
                                 "expert parallel across data-parallel replicas")
            match control:
                case PauseGeneration(mode=mode):
                    return self.pause_generation(mode)
                case ResumeGeneration():
                    return self.resume_generation()
                case UpdateWeights(path=path, lora_name=lora_name):
                    return self.update_weights(path, lora_name)
                case Sleep(level=level):
                    return self.sleep(level)
                case WakeUp():
                    return self.wake_up()
                case ResetPrefixCache():
                    return self.reset_prefix_cache()
                case CollectiveRPC(method=method, args=args, kwargs=kwargs):
                    return self.collective_rpc(method, args, kwargs)
                case GetStatus():
                    return self.status()
            raise TypeError(f"{type(control).__name__} is not a control call")
        finally:
            self.draining = False
            self.release_held()

    @property
    def is_holding(self) -> bool:
        """New requests are held, not scheduled."""
        return self.paused or self.sleep_level > 0 or self.draining

    @property
    def is_drained(self) -> bool:
        """No request that was admitted before the hold is left."""
        return not self.scheduler.has_unfinished_requests()

    def pause_generation(self, mode: str = "wait") -> list[EngineCoreOutput]:
        """Hold new requests; with ``abort``, end every request in flight with finish
        reason ``abort`` (their outputs are returned); with ``wait`` the caller keeps
        stepping until ``is_drained``."""
        if mode not in ("wait", "abort"):
            raise ValueError(f"pause mode must be 'wait' (let running requests finish) or "
                             f"'abort' (end them), got {mode!r}")
        self.paused = True
        if mode == "wait":
            return []
        request_ids = list(self.scheduler.requests)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        return [EngineCoreOutput(req_id=request_id, new_token_ids=[],
                                 finish_reason=RequestStatus.FINISHED_ABORTED.finish_reason.value)
                for request_id in request_ids]

    def resume_generation(self) -> None:
        self.paused = False
        self.release_held()

    def update_weights(self, path: str | None = None,
                       lora_name: str | None = None) -> dict[str, Any]:
        """Load new weights on every rank from a checkpoint directory, a .gguf file or an
        ipc manifest (None: reload the last checkpoint); raises ValueError or
        FileNotFoundError, weights unchanged, if they do not fit. Then the prefix cache
        is emptied. A sleeping engine (level 2) gets its weights from here and wakes.

        With ``lora_name``: that LoRA adapter's weights from its PEFT directory ``path``
        (loom/lora.py), now, between steps. Nothing is drained or held and the prefix
        cache is kept: the requests on the base and on other adapters never see the
        change; the adapter's own running requests take its new weights from the next
        step, and its later ones come with a new ``lora_id`` (the caller's: LLM, the
        API server), which keys their prefix blocks apart from the old weights' ones."""
        if lora_name is not None:
            if not path:
                raise ValueError(f"updating LoRA adapter {lora_name!r} needs path: its new "
                                 "PEFT directory")
            if not self.config.model.enable_lora:
                raise ValueError("lora_name needs an engine started with enable_lora")
            return self.executor.collective_rpc(
                "update_weights", {"path": path, "lora_name": lora_name})[0]
        self._check_drained("update weights")
        result = self._weights_rpc("update_weights", {"path": path})
        self.reset_prefix_cache()
        if self.sleep_level:
            self.wake_up()
        return result

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Free the KV cache (level 1) or the KV cache and the weights (level 2) on every
        rank; requests are held until ``wake_up``."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (free the KV cache) or 2 (free the KV "
                             f"cache and the weights), got {level}")
        self._check_drained("sleep")
        if self.sleep_level >= level:
            return {"level": self.sleep_level, "kv_cache_bytes_freed": 0}
        result = self.executor.collective_rpc("sleep", {"level": level})[0]
        self.sleep_level = level
        self.reset_prefix_cache()  # the cache's contents are gone
        return result

    def wake_up(self) -> dict[str, Any]:
        """Reallocate the KV cache and reload freed weights (from the last checkpoint
        loaded); held requests then run unless generation is paused."""
        result = self.executor.collective_rpc("wake_up")[0] if self.sleep_level else {}
        self.sleep_level = 0
        self.release_held()
        return result

    def status(self) -> dict[str, Any]:
        return {"paused": self.paused, "is_sleeping": self.sleep_level > 0,
                "sleep_level": self.sleep_level, "num_held": len(self._held)}

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, the KV offload tier's too; False (nothing done)
        while a request holds blocks."""
        return self.scheduler.kv_cache.reset_prefix_cache()

    def collective_rpc(self, method: str, args: list[Any] | tuple = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Run a worker method on every rank, between steps; each rank's result."""
        return self.executor.collective_rpc(method, kwargs, args=tuple(args))

    def update_weights_from_tensors(self, named_tensors: list) -> dict[str, Any]:
        """(checkpoint name, tensor) pairs, any subset of the weights, for a worker in
        this process (UniProcExecutor); worker processes get them through shared memory
        (``LLM.update_weights_from_tensors``)."""
        self._check_drained("update weights")
        result = self._weights_rpc("update_weights_from_tensors",
                                   {"named_tensors": named_tensors})
        self.reset_prefix_cache()
        if self.sleep_level:
            self.wake_up()
        return result

    def _weights_rpc(self, method: str, kwargs: dict[str, Any]) -> Any:
        """A weight update on every rank; one that failed mid-copy left the ranks without
        weights (``WeightsLostError``): the engine sleeps at level 2 from then on, holding
        requests, until an update succeeds or ``wake_up``."""
        try:
            return self.executor.collective_rpc(method, kwargs)[0]
        except WeightsLostError:
            self.sleep_level = 2
            self.reset_prefix_cache()
            raise

    def _check_drained(self, what: str) -> None:
        if not self.is_drained:
            raise RuntimeError(f"cannot {what} while {self.scheduler.get_num_unfinished_requests()}"
                               " request(s) are in flight; pause generation first (mode wait "
                               "or abort)")

    def release_held(self) -> None:
        """Schedule the held requests, unless something still holds them."""
        if self.is_holding:
            return
        held, self._held = self._held, []
        for request in held:
            self.scheduler.add_request(request)

    def shutdown(self) -> None:
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None


def _dummy_step() -> SchedulerOutput:
    """A step with no tokens whose ranks still enter every MoE all-to-all."""
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=[],
                           num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                           finished_req_ids=[], dummy_forward=True)
