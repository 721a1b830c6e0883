"""EngineCore: the scheduler and the executor in one loop. One ``step()`` is:

    schedule() -> SchedulerOutput -> every rank executes -> rank 0's ModelRunnerOutput
    -> update_from_output() -> EngineCoreOutputs

It imports no torch: the executor it drives is handed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from loom.config import EngineConfig
from loom.core.scheduler import Scheduler
from loom.core.wire import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from loom.request import Request, RequestStatus

if TYPE_CHECKING:
    from loom.tokenizer import Tokenizer


class ExecutorLike(Protocol):
    """loom.executor.base.Executor, handed in (it is not core code)."""

    def initialize(self) -> int: ...
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...
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
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks,
                                   config.speculative, config.early_stop)

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer: Tokenizer | None = None) -> EngineCore:
        """The executor ``config.parallel`` asks for (worker processes for more than one
        rank or with ``distributed_executor_backend="mp"``, else the worker in-process)
        and a grammar manager, which loads the model's tokenizer the first time a
        request needs a grammar unless ``tokenizer`` is given. Imports stay lazy, so an
        engine core driving worker processes never imports torch or transformers."""
        from loom.executor import make_executor
        from loom.structured_output import StructuredOutputManager

        def tokenizer_factory() -> Tokenizer:
            if tokenizer is not None:
                return tokenizer
            from loom.tokenizer import load_tokenizer

            return load_tokenizer(config.model.model, config.model.tokenizer,
                                  config.model.chat_template)

        vocab_size = config.model.vocab_size or (len(tokenizer.hf) if tokenizer is not None else 0)
        structured_output = StructuredOutputManager(config.structured_outputs, tokenizer_factory,
                                                    vocab_size)
        return cls(config, make_executor(config), structured_output)

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None and self.structured_output is None:
            raise ValueError("this engine was built without structured outputs support")
        self.scheduler.add_request(request)
        if self.structured_output is not None:
            self.structured_output.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_by_stop_string(self, request_id: str, stop: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_STOPPED, stop)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        if self.structured_output is None:
            scheduler_output = self.scheduler.schedule()
            runner_output = self.executor.execute_model(scheduler_output)
            return self.scheduler.update_from_output(scheduler_output, runner_output)
        failed = self._finish_failed_grammars()
        scheduler_output = self.scheduler.schedule()
        self._attach_grammar_bitmask(scheduler_output)
        if (scheduler_output.is_empty and not scheduler_output.finished_req_ids
                and self.scheduler.has_unfinished_requests()):
            # Only requests whose grammar is compiling are left: wait for one, briefly.
            self.structured_output.wait_for_compiles(0.05)
            return failed
        runner_output = self.executor.execute_model(scheduler_output)
        return failed + self.scheduler.update_from_output(scheduler_output, runner_output)

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
        return self.scheduler.get_stats()

    def shutdown(self) -> None:
        if self.structured_output is not None:
            self.structured_output.shutdown()
        self.executor.shutdown()
