"""Benchmark prompts: ``random``, ``shared-prefix``, ``sharegpt-synthetic`` and ``repeat``.

Every dataset is seeded and returns ``SampleRequest``s: prompt text, its token ids
when a tokenizer was given, the prompt length and the number of tokens to generate
(sent as ``max_tokens`` with ``ignore_eos``, so outputs have exactly that length).

With a tokenizer, prompts are random non-special token ids decoded to text and
trimmed so that the text re-encodes to the target length (as vLLM's random dataset
does). Without one, prompts are random lowercase pseudo-words, one per target token;
the server's ``usage.prompt_tokens`` then gives the true length where it reports it.

``sharegpt-synthetic`` draws lengths from log-normal distributions shaped like the
ShareGPT conversations vLLM benchmarks with (long right tail, median well below the
mean): input median 100 tokens, sigma 1.1 (mean ~180); output median 150, sigma 0.9
(mean ~225); clipped to [4, 1024] each and to 2,048 together, vLLM's own filter for
ShareGPT. The text itself is random, as in ``random``.

``repeat`` is a workload where speculative drafts help: each request asks the model to
copy a passage of synthetic Python (seeded identifiers and numbers in a few function
shapes), "Repeat the following code exactly: ...", as one user message under the
tokenizer's chat template. Prompt lookup (n-gram) then finds what the model writes in the
prompt. The prompt is about the input length, template included (the passage ends at a
whole line); without a tokenizer, the plain message at about 4 characters per token.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any, Protocol

import numpy as np

SHAREGPT_INPUT_MEDIAN, SHAREGPT_INPUT_SIGMA = 100, 1.1
SHAREGPT_OUTPUT_MEDIAN, SHAREGPT_OUTPUT_SIGMA = 150, 0.9
SHAREGPT_MIN_LEN, SHAREGPT_MAX_LEN, SHAREGPT_MAX_TOTAL = 4, 1024, 2048


class TokenizerLike(Protocol):
    """Either loom's ``Tokenizer`` or a Hugging Face tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


@dataclasses.dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int
    prompt_token_ids: list[int] | None = None
    # The request as one user message, for chat endpoints, where ``prompt`` is that
    # message under the chat template (``repeat``); None: send ``prompt``.
    chat_message: str | None = None


class PromptMaker:
    """Random prompts of a given token length, from a tokenizer's vocabulary or pseudo-words."""

    def __init__(self, tokenizer: TokenizerLike | None, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        if tokenizer is not None:
            hf = getattr(tokenizer, "hf", tokenizer)
            special = set(getattr(hf, "all_special_ids", []) or [])
            ids = [i for i in range(len(hf)) if i not in special]
            # Tokens that are a fragment of a UTF-8 character decode to U+FFFD, which
            # re-encodes to other tokens: draw only tokens that are whole text.
            texts = hf.batch_decode([[i] for i in ids])
            self.token_pool = np.array([i for i, text in zip(ids, texts)
                                        if text and "\ufffd" not in text])
        else:
            letters = np.array(list(string.ascii_lowercase))
            self.words = ["".join(rng.choice(letters, size=int(n)))
                          for n in rng.integers(2, 8, size=2000)]

    def make(self, length: int) -> tuple[str, list[int] | None]:
        """(text, token ids) of ``length`` tokens; ids are None without a tokenizer."""
        if self.tokenizer is None:
            return " ".join(self.rng.choice(self.words, size=length)), None
        ids = self.rng.choice(self.token_pool, size=length).tolist()
        # Decoding and re-encoding merges or splits tokens: top up and trim until the
        # text encodes to exactly `length` tokens (a few rounds at most in practice).
        for _ in range(8):
            text = self._decode(ids)
            ids = self._encode(text)
            if len(ids) == length:
                return text, ids
            if len(ids) > length:
                ids = ids[:length]
            else:
                ids += self.rng.choice(self.token_pool, size=length - len(ids)).tolist()
        text = self._decode(ids)
        return text, self._encode(text)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


REPEAT_INSTRUCTION = "Repeat the following code exactly, without any comment:\n\n"
_WORDS = ("count", "total", "items", "value", "index", "result", "buffer", "score", "limit",
          "offset", "name", "key", "node", "path", "size", "step", "left", "right", "queue",
          "table", "price", "weight", "record", "entry", "line", "token", "width", "level",
          "depth", "cache", "batch", "owner", "label", "range", "delta", "state", "color")
_FUNCTIONS = (
    "def {f}({a}, {b}):\n    {c} = []\n    for {i} in range(len({a})):\n"
    "        if {a}[{i}] % {n} == {m}:\n            {c}.append({a}[{i}] * {b})\n"
    "    return {c}\n",
    "def {f}({a}):\n    {c} = {{}}\n    for {i} in {a}:\n        {c}[{i}] = {c}.get({i}, 0) + {n}\n"
    "    return sorted({c}.items(), key=lambda pair: pair[1])\n",
    "class {F}:\n    def __init__(self, {a}, {b}={n}):\n        self.{a} = {a}\n"
    "        self.{b} = {b}\n\n    def {f}(self, {i}):\n"
    "        return self.{a} * {i} + self.{b} - {m}\n",
    "def {f}({a}, {b}={n}):\n    {c} = 0\n    while {a} > {b}:\n        {a} //= {m} + 1\n"
    "        {c} += 1\n    return {c}\n",
    "def {f}({a}, {b}):\n    if not {a}:\n        return {b}\n"
    "    {c} = {a}[len({a}) // 2]\n    return [{i} for {i} in {a} if {i} < {c}] + [{c}] * {m}\n",
)


class RepeatPromptMaker:
    """Prompts asking to copy a passage of synthetic code, ``make(length)`` as PromptMaker."""

    def __init__(self, tokenizer: TokenizerLike | None, rng: np.random.Generator) -> None:
        self.tokenizer = tokenizer
        self.rng = rng
        hf = getattr(tokenizer, "hf", tokenizer)
        self.template = hf if getattr(hf, "chat_template", None) else None

    def make(self, length: int) -> tuple[str, list[int] | None]:
        text, ids, _ = self.make_with_message(length)
        return text, ids

    def make_with_message(self, length: int) -> tuple[str, list[int] | None, str]:
        """(prompt text, its ids or None, the user message) of about ``length`` tokens:
        functions until the prompt reaches it, then whole lines cut back to fit."""
        lines: list[str] = []
        while self._size(lines) < length:
            lines += ([""] if lines else []) + self._function().splitlines()
        while len(lines) > 1 and self._size(lines) > length:
            lines.pop()
        message = self._message(lines)
        text = self._prompt(message)
        return text, (self._ids(text) if self.tokenizer is not None else None), message

    def _function(self) -> str:
        words = self.rng.choice(len(_WORDS), size=10)
        names = [_WORDS[int(words[2 * j])] + "_" + _WORDS[int(words[2 * j + 1])]
                 for j in range(5)]
        f, a, b, c, i = names
        numbers = self.rng.integers(2, 100, size=2)
        shape = _FUNCTIONS[int(self.rng.integers(len(_FUNCTIONS)))]
        return shape.format(f=f, F="".join(part.title() for part in f.split("_")), a=a, b=b,
                            c=c, i=i, n=int(numbers[0]), m=int(numbers[1]))

    @staticmethod
    def _message(lines: list[str]) -> str:
        return REPEAT_INSTRUCTION + "\n".join(lines).rstrip() + "\n"

    def _prompt(self, message: str) -> str:
        if self.template is None:
            return message
        return self.template.apply_chat_template([{"role": "user", "content": message}],
                                                 tokenize=False, add_generation_prompt=True)

    def _ids(self, text: str) -> list[int]:
        # The template writes any BOS itself.
        return list(self.tokenizer.encode(text, add_special_tokens=self.template is None))

    def _size(self, lines: list[str]) -> int:
        """Tokens of the prompt with these passage lines (without a tokenizer, estimated)."""
        prompt = self._prompt(self._message(lines))
        if self.tokenizer is None:
            return -(-len(prompt) // 4)
        return len(self._ids(prompt))


def _lengths(rng: np.random.Generator, count: int, mean_len: int, range_ratio: float) -> np.ndarray:
    """Uniform integers in [mean * (1 - r), mean * (1 + r)], at least 1 (vLLM's rule)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    low = max(1, int(mean_len * (1 - range_ratio)))
    high = max(low, int(mean_len * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=count)


def random_requests(num_requests: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    tokenizer: TokenizerLike | None = None, seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    input_lens = _lengths(rng, num_requests, input_len, range_ratio)
    output_lens = _lengths(rng, num_requests, output_len, range_ratio)
    requests = []
    for in_len, out_len in zip(input_lens, output_lens):
        text, ids = maker.make(int(in_len))
        requests.append(SampleRequest(text, len(ids) if ids is not None else int(in_len),
                                      int(out_len), ids))
    return requests


def shared_prefix_requests(num_requests: int, prefix_len: int, suffix_len: int, output_len: int,
                           num_prefixes: int = 1, tokenizer: TokenizerLike | None = None,
                           seed: int = 0) -> list[SampleRequest]:
    """``num_prefixes`` prefixes shared round-robin, each request with its own suffix."""
    if num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    maker = PromptMaker(tokenizer, rng)
    prefixes = [maker.make(prefix_len) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_requests):
        prefix_text, prefix_ids = prefixes[i % num_prefixes]
        suffix_text, suffix_ids = maker.make(suffix_len)
        text = prefix_text + " " + suffix_text
        if tokenizer is None:
            requests.append(SampleRequest(text, prefix_len + suffix_len, output_len))
        else:
            # Keep the shared prefix's exact ids so prefix caches see identical tokens.
            ids = prefix_ids + suffix_ids
            requests.append(SampleRequest(text, len(ids), output_len, ids))
    order = rng.permutation(num_requests)
    return [requests[i] for i in order]


def sharegpt_lengths(num_requests: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input lengths, output lengths) with the ShareGPT-like shape in the module docstring."""
    rng = np.random.default_rng(seed)
    inputs = np.empty(num_requests, dtype=np.int64)
    outputs = np.empty(num_requests, dtype=np.int64)
    filled = 0
    while filled < num_requests:
        ins = np.round(rng.lognormal(np.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA,
                                     num_requests)).astype(np.int64)
        outs = np.round(rng.lognormal(np.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA,
                                      num_requests)).astype(np.int64)
        keep = ((ins >= SHAREGPT_MIN_LEN) & (ins <= SHAREGPT_MAX_LEN) & (outs >= SHAREGPT_MIN_LEN)
                & (outs <= SHAREGPT_MAX_LEN) & (ins + outs <= SHAREGPT_MAX_TOTAL))
        take = min(int(keep.sum()), num_requests - filled)
        inputs[filled:filled + take] = ins[keep][:take]
        outputs[filled:filled + take] = outs[keep][:take]
        filled += take
    return inputs, outputs


def sharegpt_synthetic_requests(num_requests: int, tokenizer: TokenizerLike | None = None,
                                seed: int = 0) -> list[SampleRequest]:
    input_lens, output_lens = sharegpt_lengths(num_requests, seed)
    maker = PromptMaker(tokenizer, np.random.default_rng(seed + 1))
    requests = []
    for in_len, out_len in zip(input_lens, output_lens):
        text, ids = maker.make(int(in_len))
        requests.append(SampleRequest(text, len(ids) if ids is not None else int(in_len),
                                      int(out_len), ids))
    return requests


def repeat_requests(num_requests: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, tokenizer: TokenizerLike | None = None,
                    seed: int = 0) -> list[SampleRequest]:
    rng = np.random.default_rng(seed)
    maker = RepeatPromptMaker(tokenizer, rng)
    input_lens = _lengths(rng, num_requests, input_len, range_ratio)
    output_lens = _lengths(rng, num_requests, output_len, range_ratio)
    requests = []
    for in_len, out_len in zip(input_lens, output_lens):
        text, ids, message = maker.make_with_message(int(in_len))
        prompt_len = len(ids) if ids is not None else -(-len(text) // 4)
        requests.append(SampleRequest(text, prompt_len, int(out_len), ids, chat_message=message))
    return requests


def make_requests(args, tokenizer: TokenizerLike | None) -> list[SampleRequest]:
    """The requests the dataset flags in ``add_dataset_args`` describe."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if args.dataset_name == "random":
        return random_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, tokenizer, args.seed)
    if args.dataset_name == "shared-prefix":
        return shared_prefix_requests(args.num_prompts, args.prefix_len, args.suffix_len,
                                      args.random_output_len, args.num_prefixes, tokenizer,
                                      args.seed)
    if args.dataset_name == "repeat":
        return repeat_requests(args.num_prompts, args.random_input_len, args.random_output_len,
                               args.random_range_ratio, tokenizer, args.seed)
    return sharegpt_synthetic_requests(args.num_prompts, tokenizer, args.seed)
