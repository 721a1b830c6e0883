"""Benchmark prompts: ``random``, ``shared-prefix`` and ``sharegpt-synthetic``.

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
    return sharegpt_synthetic_requests(args.num_prompts, tokenizer, args.seed)
