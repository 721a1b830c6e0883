"""SamplingParams: how to pick each next token and when to stop, validated at construction.

The fields and their meanings follow vLLM (and through it the OpenAI API). It is a
msgspec Struct so it crosses the engine → worker boundary without pickle.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

# The sampler divides logits by the temperature and by (or multiplies them with) the
# repetition penalty in float32. Past these bounds a logit overflows to inf or a masked
# -inf one becomes NaN (-inf / inf, -inf * 0) and the row samples garbage; inside them
# every real logit stays finite. (A temperature of 1e6 is already uniform sampling.)
_MAX_TEMPERATURE = 1e6
_MIN_REPETITION_PENALTY, _MAX_REPETITION_PENALTY = 1e-6, 1e6


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Constrain the output to a grammar: exactly one of ``json`` (a JSON schema, as a
    dict or its JSON text), ``regex``, ``choice`` (one of these strings), ``grammar``
    (EBNF/GBNF or Lark) or ``json_object`` (any JSON object). vLLM's names.

    ``disable_any_whitespace`` forbids free whitespace in JSON (one space after ``:``
    and ``,`` is still emitted compactly); ``disable_additional_properties`` makes
    objects without ``additionalProperties`` closed. ``None``: the server default.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError("structured_outputs", "needs exactly one of json, regex, "
                                      f"choice, grammar or json_object, got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(
                isinstance(c, str) for c in self.choice)):
            raise SamplingParamsError("structured_outputs",
                                      "choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which constraint: json, regex, choice, grammar or json_object."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    @property
    def spec(self) -> str:
        """The constraint as text: what the grammar cache is keyed by (with ``kind``)."""
        value = getattr(self, self.kind) if self.kind != "json_object" else "{}"
        return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name


class GrammarAfterThinking(msgspec.Struct, frozen=True):
    """Structured outputs that constrain only the answer of a thinking model: the
    thinking (from the prompt's open <think>, or the output's opening one) is free, and
    the grammar starts after </think>. The chat server sets it where a reasoning parser
    is configured and the tokenizer has these tokens."""

    think_start_id: int
    think_end_id: int


def longest_prompt(max_model_len: int, pooled: bool) -> int:
    """The most prompt tokens a request may bring: a generated token needs a place after
    the prompt, while a pooled prompt is all there is (as vLLM allows)."""
    return max_model_len if pooled else max_model_len - 1


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A pooling request (an engine started with ``--task embed``, ``score`` or
    ``classify``): its prompt is prefilled and pooled into one vector, nothing is
    generated. vLLM's names.

    ``task``: ``embed`` (the prompt's hidden states pooled as the model's pooler config
    says: last token, mean or first token), ``score`` (the probability of the yes token
    against the no token after the prompt, ``classifier_token_ids``, which the API side
    resolves from the model's pooler config) or ``classify`` (a sequence classifier's
    label probabilities). ``normalize``: L2-normalize the
    embedding (None: as the model's pooler config says). ``dimensions``: keep the first
    this many values (Matryoshka models only), normalized after cutting.
    ``token_type_start``: a cross-encoder's pair (BERT), the position where the
    document's token type 1 begins (the API side sets it from the tokenizer's pair
    encoding, ``pooling.cross_encoder_pair``); None: every token of type 0.
    """

    task: str = "embed"
    normalize: bool | None = None
    dimensions: int | None = None
    classifier_token_ids: tuple[int, int] | None = None  # (no, yes)
    token_type_start: int | None = None

    def __post_init__(self) -> None:
        _check(self.task in ("embed", "score", "classify"), "pooling.task",
               f"must be embed, score or classify, got {self.task!r}")
        if self.dimensions is not None:
            _check(isinstance(self.dimensions, int) and self.dimensions >= 1, "dimensions",
                   f"must be a positive integer, got {self.dimensions!r}")
        if self.token_type_start is not None:
            _check(type(self.token_type_start) is int and self.token_type_start >= 0,
                   "pooling.token_type_start",
                   f"must be a position (0 or more), got {self.token_type_start!r}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # top-k logprobs of each sampled token (plus the sampled one)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None: any.
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's bad_words): the last token of each of their token
    # sequences is masked wherever the tokens before it have just been produced. The
    # InputProcessor tokenizes them into ``bad_words_token_ids`` (each word as written and
    # with a leading space, as vLLM does); transformers' NoBadWordsLogitsProcessor does the
    # same with token ids.
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # A reasoning budget (vLLM's thinking_token_budget, FastDeploy's reasoning_max_tokens):
    # at most this many tokens after the start of thinking, then the end of thinking is
    # forced (after the engine's budget message, if it has one). None: the engine's
    # default (--reasoning-budget); -1: unlimited; 0: no thinking.
    thinking_token_budget: int | None = None
    # Set by the InputProcessor from the tokenizer for a budget it enforces: the ids of
    # <think> and </think>, and what is forced once the budget is spent (the message's
    # tokens, then </think>).
    think_start_id: int | None = None
    think_forced_ids: list[int] | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    grammar_after_thinking: GrammarAfterThinking | None = None
    # vLLM's request priority under --scheduling-policy priority: lower runs first (and
    # is preempted last); ties by arrival. vLLM passes it beside the params, loom in them.
    priority: int = 0
    # Settings for custom logits processors (vLLM's extra_args; --logits-processors)
    extra_args: dict[str, Any] | None = None
    # Prefill/decode disaggregation, vLLM's field: {"do_remote_decode": true} on a prefill
    # instance; on a decode instance what the prefill instance answered (loom/core/kv_transfer.py).
    kv_transfer_params: dict[str, Any] | None = None
    # A pooling request (loom's carrier of vLLM's PoolingParams): prefilled and pooled,
    # finished with its vector and no generated token; the other fields do not apply.
    pooling: PoolingParams | None = None
    # The LoRA adapter this request runs with (loom/lora.py), by name; None: the base.
    # ``lora_id`` tells loads of one name apart (vLLM's lora_int_id): the prefix cache
    # keys blocks by both, so an adapter loaded again never hits its old blocks.
    lora_name: str | None = None
    lora_id: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, "n", f"must be at least 1, got {self.n}")
        _check(0.0 <= self.temperature <= _MAX_TEMPERATURE, "temperature",
               f"must be in [0, {_MAX_TEMPERATURE:g}], got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be -1 (disabled), 0 (disabled) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"must be in [-2, 2], got {self.frequency_penalty}")
        _check(_MIN_REPETITION_PENALTY <= self.repetition_penalty <= _MAX_REPETITION_PENALTY,
               "repetition_penalty", f"must be in [{_MIN_REPETITION_PENALTY:g}, "
               f"{_MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "must be non-negative token ids")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                # at most the engine's max_logprobs (InputProcessor.validate_params)
                _check(value >= 0, name, f"must be at least 0, got {value}")
        if self.allowed_token_ids is not None:
            _check(bool(self.allowed_token_ids) and all(
                isinstance(t, int) and t >= 0 for t in self.allowed_token_ids),
                "allowed_token_ids", "must be a non-empty list of token ids")
        _check(type(self.priority) is int, "priority",
               f"must be an integer, got {self.priority!r}")
        if self.thinking_token_budget is not None:
            _check(isinstance(self.thinking_token_budget, int)
                   and self.thinking_token_budget >= -1, "thinking_token_budget",
                   f"must be -1 (unlimited), 0 (no thinking) or positive, got "
                   f"{self.thinking_token_budget!r}")
        if self.bad_words is not None:
            _check(all(isinstance(w, str) and w.strip() for w in self.bad_words), "bad_words",
                   "must be a list of non-empty strings")
        if self.bad_words_token_ids is not None:
            _check(all(isinstance(s, list) and s and all(isinstance(t, int) and t >= 0
                                                         for t in s)
                       for s in self.bad_words_token_ids), "bad_words_token_ids",
                   "must be a list of non-empty lists of token ids")
        if self.logit_bias:
            for token_id, bias in self.logit_bias.items():
                _check(-100.0 <= bias <= 100.0, "logit_bias",
                       f"bias for token {token_id} must be in [-100, 100], got {bias}")
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", f"must be an integer, got {self.seed!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def clone(self, **changes) -> SamplingParams:
        return msgspec.structs.replace(self, **changes)


class SamplingParamsError(ValueError):
    """A SamplingParams value out of its range: ``field`` names it, ``problem`` says what
    is wrong with it (str(): "SamplingParams.<field> <problem>")."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"SamplingParams.{field} {problem}")
        self.field = field
        self.problem = problem


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise SamplingParamsError(field, message)


def forced_thinking_token(params: SamplingParams, prompt_token_ids: Sequence[int],
                          output_token_ids: Sequence[int]) -> int | None:
    """The token the reasoning budget forces next, or None. Read from the text so far
    alone (so preemption, prefix caching and a decode instance of a P/D pair need no
    state): the thinking is the output from its start if the prompt's last <think> is
    open, else from the output's first <think>; each token of it counts, the forced ones
    too; once the budget is spent, the forced tokens (the budget message's, then
    </think>) come in turn, until </think> ends it (a <think> after that is text).

        budget 2, forced [m, </think>]: a b | m </think> | the answer ...
    """
    forced = params.think_forced_ids
    if not forced or params.thinking_token_budget is None or params.thinking_token_budget < 0:
        return None
    start, end = params.think_start_id, forced[-1]
    if thinking_left_open(prompt_token_ids, start, end):
        thought = list(output_token_ids)
    elif start in output_token_ids:
        thought = list(output_token_ids[list(output_token_ids).index(start) + 1:])
    else:
        return None
    if end in thought:
        return None
    spent = len(thought) - params.thinking_token_budget
    return forced[spent] if 0 <= spent < len(forced) else None


def thinking_left_open(prompt_token_ids: Sequence[int], start: int | None, end: int) -> bool:
    """The prompt's last <think> has no </think> after it (the template opened it): the
    reasoning budget, the grammar after the thinking and the chat route's reasoning
    parser all read the prompt so."""
    for token_id in reversed(prompt_token_ids):
        if token_id == end:
            return False
        if token_id == start:
            return True
    return False
