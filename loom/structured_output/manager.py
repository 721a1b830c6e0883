"""StructuredOutputManager: the engine core's side of grammar-constrained decoding.

    add_request()        a request with ``structured_outputs`` gets a StructuredOutputRequest
                         whose matcher is compiled in a thread, by the backend that serves
                         it (constraint.backend_for: llguidance, grammar.py, or xgrammar,
                         xgrammar_backend.py); the scheduler leaves it waiting until
                         ``is_ready``, scheduling others
    grammar_bitmask()    before each step: one row of allowed-token bits per structured
                         request that samples in it -> bytes in SchedulerOutput
    accept_token()       after each step (Scheduler.update_from_output): advance the matcher;
                         True when the grammar is complete, which finishes the request

Compiled grammars are cached by (backend, kind, spec, options); each request gets its own
matcher from the cached one. Matchers live on the Request, so they go when it goes. With
``--structured-outputs-backend auto``, a grammar xgrammar fails to compile is compiled by
llguidance (which the API side already checked it with).

A matcher of either backend (``GuidanceMatcher``, ``XgrammarMatcher``) has
``accept_token(id) -> bool`` (False: rejected), ``is_terminated()`` (the grammar allows
nothing but a stop token, or took one), ``fill_bitmask(bitmask, row)`` (int32 words, bit
t % 32 of word t // 32 allows token t) and ``error()``.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import numpy as np

from loom.config import StructuredOutputsConfig
from loom.sampling_params import thinking_left_open
from loom.structured_output.constraint import GrammarError, backend_for
from loom.structured_output.grammar import GuidanceBackend

if TYPE_CHECKING:
    from loom.request import Request

logger = logging.getLogger(__name__)

_CACHE_SIZE = 256  # compiled grammars kept


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row: bit j of word i allows token 32 * i + j."""
    return (vocab_size + 31) // 32


class StructuredOutputRequest:
    """One request's grammar: compiling (a future), then a matcher, or a compile error."""

    def __init__(self, future: Future, after_thinking: Any = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        self._future: Future | None = future
        self.matcher: Any = None  # a GuidanceMatcher or an XgrammarMatcher
        self.error: str | None = None
        # A thinking model's answer only (SamplingParams.grammar_after_thinking): the
        # phase the output is in, "thinking" (free, until </think>), "may think" (the
        # first token: <think> opens a free thinking, anything else is the answer's), or
        # "answer" (the grammar's).
        self._think = after_thinking
        self.phase = "answer"
        if after_thinking is not None:
            open_in_prompt = thinking_left_open(prompt_token_ids or [],
                                                after_thinking.think_start_id,
                                                after_thinking.think_end_id)
            self.phase = "thinking" if open_in_prompt else "may think"

    @property
    def is_ready(self) -> bool:
        if self._future is not None and self._future.done():
            try:
                self.matcher = self._future.result()
            except Exception as error:  # noqa: BLE001 — reported as this request's error
                self.error = str(error) or type(error).__name__
            self._future = None
        return self.matcher is not None

    @property
    def failed(self) -> bool:
        return not self.is_ready and self.error is not None

    def accept_token(self, token_id: int) -> bool:
        """Advance past a sampled token; True when the grammar allows nothing more.

        A token the grammar rejects (it cannot be sampled under the mask, but eos with
        ``ignore_eos`` or a speculative token could be) raises GrammarError.
        """
        if self.phase == "thinking":
            if token_id == self._think.think_end_id:
                self.phase = "answer"
            return False
        if self.phase == "may think":
            self.phase = "answer"
            if token_id == self._think.think_start_id:
                self.phase = "thinking"
                return False
        if not self.matcher.accept_token(token_id):
            error = self.matcher.error()
            raise GrammarError(f"the grammar rejected token {token_id}" +
                               (f": {error}" if error else ""))
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self.phase == "thinking":
            return  # every token (the row is all ones)
        self.matcher.fill_bitmask(bitmask, row)
        if self.phase == "may think":  # and <think>, which opens a free thinking
            start = self._think.think_start_id
            if start // 32 < bitmask.shape[1]:
                bitmask[row, start // 32] |= np.int32(np.uint32(1 << (start % 32)).view(np.int32))


class StructuredOutputManager:
    """Compiles grammars off the step path and builds each step's token bitmask.

    ``tokenizer_factory`` returns loom's ``Tokenizer`` (a fast Hugging Face tokenizer
    and its eos ids); it is called once, in the compile thread, on the first structured
    request, so an engine that never sees one pays nothing; so is each backend's setup
    (and xgrammar's import, which imports torch) on its first request. ``vocab_size`` is
    the model's (the logits' width), which may exceed the tokenizer's.
    """

    def __init__(self, config: StructuredOutputsConfig, tokenizer_factory: Callable[[], object],
                 vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._tokenizer_factory = tokenizer_factory
        self._loaded_tokenizer: Any = None
        self._backends: dict[str, Any] = {}  # name -> GuidanceBackend | XgrammarBackend
        self._xgrammar_missing: str | None = None  # auto without an importable xgrammar
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-grammar")
        self._lock = threading.Lock()
        # key -> (the backend, its compiled grammar)
        self._cache: OrderedDict[tuple, tuple[Any, Any]] = OrderedDict()
        self._compiling: dict[str, Request] = {}

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        backend = backend_for(params, self.config)
        if backend == "xgrammar" and self._xgrammar_missing is not None:
            backend = "guidance"
        key = (backend, params.kind, params.spec, params.disable_any_whitespace,
               params.disable_additional_properties)
        future = self._executor.submit(self._compile, key, params)
        request.structured_output_request = StructuredOutputRequest(
            future, request.sampling_params.grammar_after_thinking, request.prompt_token_ids)
        self._compiling[request.request_id] = request

    def take_failed(self) -> list[tuple[Request, str]]:
        """Requests whose grammar failed to compile since the last call, with the error."""
        failed = []
        for request_id, request in list(self._compiling.items()):
            so = request.structured_output_request
            if request.is_finished or so.is_ready:
                del self._compiling[request_id]
            elif so.error is not None:
                del self._compiling[request_id]
                failed.append((request, so.error))
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a compile in flight (when nothing else can run)."""
        pending = [future for r in self._compiling.values()
                   if (future := r.structured_output_request._future) is not None
                   and not future.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def grammar_bitmask(self, requests: list[Request]) -> bytes:
        """Rows of allowed-token bits, one per request in order, as int32 little-endian."""
        bitmask = np.full((len(requests), bitmask_words(self.vocab_size)), -1, dtype="<i4")
        for row, request in enumerate(requests):
            request.structured_output_request.fill_bitmask(bitmask, row)
        return bitmask.tobytes()

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ----------------------------------------------------------------- compile thread

    def _compile(self, key: tuple, params) -> Any:
        """A matcher for ``params`` by backend ``key[0]``, from the cache or compiled."""
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                backend, compiled = cached
                return backend.matcher(compiled)
        backend, compiled = self._compile_by(key[0], params)
        with self._lock:
            self._cache[key] = (backend, compiled)
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return backend.matcher(compiled)

    def _compile_by(self, name: str, params) -> tuple[Any, Any]:
        if name == "xgrammar":
            try:
                backend = self._backend("xgrammar")
                return backend, backend.compile(params)
            except (GrammarError, ImportError) as error:
                if self.config.backend != "auto":
                    raise GrammarError(f"xgrammar: {error}") from None
                if isinstance(error, ImportError):
                    self._xgrammar_missing = str(error)
                    logger.warning("structured outputs: xgrammar cannot be imported here "
                                   "(%s); llguidance serves every request", error)
                else:
                    logger.info("structured outputs: xgrammar cannot compile this %s (%s); "
                                "llguidance serves it", params.kind, error)
        backend = self._backend("guidance")
        return backend, backend.compile(params)

    def _backend(self, name: str) -> Any:
        if name not in self._backends:
            if self._loaded_tokenizer is None:
                self._loaded_tokenizer = self._tokenizer_factory()
            if name == "xgrammar":
                from loom.structured_output.xgrammar_backend import XgrammarBackend

                backend_class = XgrammarBackend
            else:
                backend_class = GuidanceBackend
            self._backends[name] = backend_class(self._loaded_tokenizer, self.vocab_size,
                                                 self.config)
        return self._backends[name]
