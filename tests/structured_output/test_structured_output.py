"""Grammar validation, the engine core's grammar manager and the worker's bitmask, on the
tiny byte-level tokenizer, and the engine core's scheduling of grammar requests with a
fake executor that samples only allowed tokens."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
import torch
from fake_runner import FakeRunner, assert_empty

from loom.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, StructuredOutputsConfig
from loom.core.engine_core import EngineCore
from loom.request import Request
from loom.sampling_params import SamplingParams, StructuredOutputsParams
from loom.structured_output import (GrammarError, StructuredOutputManager,
                                    validate_structured_outputs)
from loom.structured_output.bitmask import apply_grammar_bitmask
from loom.structured_output.manager import bitmask_words

VOCAB = 256


# ----------------------------------------------------------------- validation

BACKENDS = ["guidance", "xgrammar"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "string", "pattern": "^[a-z]+$"}'),
    StructuredOutputsParams(regex=r"\d{3}-[a-z]+"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ")"'),  # GBNF
    StructuredOutputsParams(json_object=True),
])
def test_valid_constraints_compile(params, backend):
    validate_structured_outputs(params, StructuredOutputsConfig(backend=backend))


def test_lark_grammars_are_llguidance_s():
    lark = StructuredOutputsParams(grammar='start: "a" B\nB: /[0-9]+/')
    validate_structured_outputs(lark, StructuredOutputsConfig(backend="guidance"))
    with pytest.raises(GrammarError, match="xgrammar does not support Lark grammars"):
        validate_structured_outputs(lark, StructuredOutputsConfig(backend="xgrammar"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("params, fragment", [
    (StructuredOutputsParams(json={"type": "nonsense"}), "nonsense"),
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "array", "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputsParams(regex="[a-"), "regex"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "undefined_rule"),
])
def test_malformed_or_unsupported_constraints_are_grammar_errors(params, fragment, backend):
    with pytest.raises(GrammarError, match=fragment):
        validate_structured_outputs(params, StructuredOutputsConfig(backend=backend))


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


# ----------------------------------------------------------------- manager and bitmask

def _manager(tokenizer, **config) -> StructuredOutputManager:
    return StructuredOutputManager(StructuredOutputsConfig(**config), lambda: tokenizer, VOCAB)


def _request(req_id: str, params: StructuredOutputsParams | None, max_tokens: int = 64,
             prompt=(5, 6, 7)) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens,
                                                        structured_outputs=params),
                   frozenset({2, 0}))


def _allowed(bitmask: bytes, row: int) -> set[int]:
    words = np.frombuffer(bitmask, dtype="<i4").reshape(-1, bitmask_words(VOCAB))[row]
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits)[:VOCAB].tolist())


@pytest.mark.parametrize("backend", BACKENDS)
def test_manager_masks_follow_the_grammar_and_finish_it(tiny_tokenizer, backend):
    manager = _manager(tiny_tokenizer, backend=backend)
    request = _request("r", StructuredOutputsParams(choice=["yes", "no"]))
    manager.add_request(request)
    manager.wait_for_compiles(10)
    so = request.structured_output_request
    assert so.is_ready
    allowed = _allowed(manager.grammar_bitmask([request]), 0)
    first_tokens = {tiny_tokenizer.encode(text, add_special_tokens=False)[0] for text in ("y", "n")}
    assert first_tokens <= allowed and len(allowed) <= 4
    complete = [so.accept_token(t) for t in tiny_tokenizer.encode("no", add_special_tokens=False)]
    assert complete[-1] and not any(complete[:-1])
    manager.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_manager_caches_compiled_grammars(tiny_tokenizer, backend):
    manager = _manager(tiny_tokenizer, backend=backend)
    params = StructuredOutputsParams(regex="[a-c]{2}")
    first, second = _request("a", params), _request("b", params)
    for request in (first, second):
        manager.add_request(request)
    manager.wait_for_compiles(10)
    manager.wait_for_compiles(10)
    assert first.structured_output_request.is_ready and second.structured_output_request.is_ready
    assert len(manager._cache) == 1
    # Each request has its own matcher state.
    token_a = tiny_tokenizer.encode("a", add_special_tokens=False)[0]
    first.structured_output_request.accept_token(token_a)
    assert first.structured_output_request.matcher is not second.structured_output_request.matcher
    manager.shutdown()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_token_the_grammar_rejects_is_a_grammar_error(tiny_tokenizer, backend):
    manager = _manager(tiny_tokenizer, backend=backend)
    request = _request("r", StructuredOutputsParams(regex="[0-9]+"))
    manager.add_request(request)
    manager.wait_for_compiles(10)
    assert request.structured_output_request.is_ready
    with pytest.raises(GrammarError, match="rejected"):
        request.structured_output_request.accept_token(tiny_tokenizer.encode("x")[0])
    manager.shutdown()


def test_apply_grammar_bitmask_sets_disallowed_logits_to_minus_inf():
    vocab = 70
    words = bitmask_words(vocab)
    mask = np.zeros((2, words), dtype="<i4")
    mask[0, 0] = 0b101  # tokens 0 and 2
    mask[1, 2] = 1 << 3  # token 67
    logits = torch.randn(3, vocab)
    original = logits.clone()
    apply_grammar_bitmask(logits, [2, 0], mask.tobytes())
    assert torch.isfinite(logits[2]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [67]
    assert torch.equal(logits[1], original[1])  # an unconstrained row is untouched
    apply_grammar_bitmask(logits, [-1, -1], mask.tobytes())  # rows not sampling: no-op


# ----------------------------------------------------------------- engine core

class GrammarFollowingExecutor:
    """FakeRunner's bookkeeping, sampling the highest token the step's bitmask allows
    (an unconstrained request gets token 100 + its length)."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.num_blocks = num_blocks
        self.runner = FakeRunner()
        self.bitmasks: list[tuple[list[str], bytes | None]] = []
        self.scheduler = None

    def initialize(self) -> int:
        return self.num_blocks

    def execute_model(self, scheduler_output):
        self.bitmasks.append((list(scheduler_output.structured_output_req_ids),
                              scheduler_output.grammar_bitmask))
        rows = {req_id: row for row, req_id in enumerate(scheduler_output.structured_output_req_ids)}

        def next_token(req_id: str, num_tokens: int) -> int:
            if req_id in rows:
                return max(_allowed(scheduler_output.grammar_bitmask, rows[req_id]))
            return 100 + num_tokens % 50

        self.runner.next_token = next_token
        return self.runner.execute(scheduler_output, self.scheduler)

    def shutdown(self) -> None:
        pass


def _engine_core(tokenizer, executor, backend: str = "auto") -> EngineCore:
    config = EngineConfig(model=ModelConfig(model="unused", max_model_len=256, vocab_size=VOCAB),
                          cache=CacheConfig(block_size=4),
                          scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=256))
    core = EngineCore(config, executor, _manager(tokenizer, backend=backend))
    executor.scheduler = core.scheduler
    return core


def _run(core: EngineCore) -> dict[str, tuple[list[int], str | None, object]]:
    results: dict[str, tuple[list[int], str | None, object]] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(500):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            if out.finished:
                results[out.req_id] = (tokens[out.req_id], out.finish_reason, out.stop_reason)
    return results


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_core_constrains_grammar_requests_beside_plain_ones(tiny_tokenizer, backend):
    executor = GrammarFollowingExecutor()
    core = _engine_core(tiny_tokenizer, executor, backend)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 999}},
              "required": ["n"], "additionalProperties": False}
    core.add_request(_request("json", StructuredOutputsParams(json=schema,
                                                             disable_any_whitespace=True)))
    core.add_request(_request("regex", StructuredOutputsParams(regex="[a-c]{3}")))
    core.add_request(_request("plain", None, max_tokens=5))
    results = _run(core)
    decode = tiny_tokenizer.decode
    assert json.loads(decode(results["json"][0]))["n"] <= 999
    assert results["json"][1] == "stop"
    assert decode(results["regex"][0]) in {a + b + c for a in "abc" for b in "abc" for c in "abc"}
    assert results["regex"][1] == "stop"
    assert results["plain"][1] == "length" and len(results["plain"][0]) == 5
    # Bitmask rows only for the structured requests, and only in steps where they sample.
    for req_ids, bitmask in executor.bitmasks:
        assert "plain" not in req_ids
        assert (bitmask is None) == (not req_ids)
    assert_empty(core.scheduler)


def test_a_request_whose_grammar_compiles_does_not_stall_others(tiny_tokenizer):
    executor = GrammarFollowingExecutor()
    core = _engine_core(tiny_tokenizer, executor)
    gate = threading.Event()
    original_compile = core.structured_output._compile

    def slow_compile(key, params):
        gate.wait(10)
        return original_compile(key, params)

    core.structured_output._compile = slow_compile
    core.add_request(_request("slow", StructuredOutputsParams(regex="[a-c]{2}")))
    core.add_request(_request("plain", None, max_tokens=3))
    finished: dict[str, str] = {}
    for _ in range(20):
        for out in core.step():
            if out.finished:
                finished[out.req_id] = out.finish_reason
        if "plain" in finished:
            break
    assert finished == {"plain": "length"}  # done while the grammar was still compiling
    assert core.scheduler.waiting[0].request_id == "slow"
    gate.set()
    results = _run(core)
    assert results["slow"][1] == "stop" and len(tiny_tokenizer.decode(results["slow"][0])) == 2
    assert_empty(core.scheduler)


@pytest.mark.parametrize("backend", ["auto", *BACKENDS])
def test_a_grammar_that_fails_in_the_core_fails_only_its_request(tiny_tokenizer, backend):
    core = _engine_core(tiny_tokenizer, GrammarFollowingExecutor(), backend)
    core.add_request(_request("bad", StructuredOutputsParams(json={"type": "nonsense"})))
    core.add_request(_request("plain", None, max_tokens=2))
    results = _run(core)
    assert results["bad"][1] == "error" and "nonsense" in results["bad"][2]
    assert results["plain"][1] == "length"
    assert_empty(core.scheduler)


def test_engine_without_a_manager_refuses_grammar_requests():
    config = EngineConfig(model=ModelConfig(model="unused", max_model_len=64),
                          scheduler=SchedulerConfig(max_model_len=64))
    core = EngineCore(config, GrammarFollowingExecutor())
    with pytest.raises(ValueError, match="structured outputs"):
        core.add_request(_request("r", StructuredOutputsParams(regex="a")))
