"""StructuredOutputManager: the engine core's side of grammar-constrained decoding.

    add_request()        a request with ``structured_outputs`` gets a StructuredOutputRequest
                         whose matcher is compiled in a thread (llguidance drops the GIL);
                         the scheduler leaves it waiting until ``is_ready``, scheduling others
    grammar_bitmask()    before each step: one row of allowed-token bits per structured
                         request that samples in it -> bytes in SchedulerOutput
    accept_token()       after each step (Scheduler.update_from_output): advance the matcher;
                         True when the grammar is complete, which finishes the request

Compiled grammars are cached by (kind, spec, options); each request gets a copy of the
cached matcher. Matchers live on the Request, so they go when it goes.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.numpy
import numpy as np

from loom.config import StructuredOutputsConfig
from loom.sampling_params import thinking_left_open
from loom.structured_output.grammar import GrammarError, build_grammar
from loom.structured_output.token_table import ll_tokenizer

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
        self.matcher: llguidance.LLMatcher | None = None
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
        if not self.matcher.consume_token(token_id):
            raise GrammarError(f"the grammar rejected token {token_id}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        if self.phase == "thinking":
            return  # every token (the row is all ones)
        llguidance.numpy.fill_next_token_bitmask(self.matcher, bitmask, row)
        if self.phase == "may think":  # and <think>, which opens a free thinking
            start = self._think.think_start_id
            if start // 32 < bitmask.shape[1]:
                bitmask[row, start // 32] |= np.int32(np.uint32(1 << (start % 32)).view(np.int32))


class StructuredOutputManager:
    """Compiles grammars off the step path and builds each step's token bitmask.

    ``tokenizer_factory`` returns loom's ``Tokenizer`` (a fast Hugging Face tokenizer
    and its eos ids); it is called once, in the compile thread, on the first structured
    request, so an engine that never sees one pays nothing. ``vocab_size`` is the
    model's (the logits' width), which may exceed the tokenizer's.
    """

    def __init__(self, config: StructuredOutputsConfig, tokenizer_factory: Callable[[], object],
                 vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size
        self._tokenizer_factory = tokenizer_factory
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loom-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[str, Request] = {}

    # ----------------------------------------------------------------- requests

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        key = (params.kind, params.spec, params.disable_any_whitespace,
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

    def _compile(self, key: tuple, params) -> llguidance.LLMatcher:
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
                return template.deep_copy()
        grammar = build_grammar(params, self.config)
        template = llguidance.LLMatcher(self._tokenizer(), grammar, log_level=0)
        if template.is_error():
            raise GrammarError(f"invalid {params.kind}: {template.get_error().strip()}")
        with self._lock:
            self._cache[key] = template
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return template.deep_copy()

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            tokenizer = self._tokenizer_factory()
            self._ll_tokenizer = ll_tokenizer(tokenizer.hf,
                                              max(self.vocab_size, len(tokenizer.hf)),
                                              sorted(tokenizer.eos_token_ids))
        return self._ll_tokenizer
