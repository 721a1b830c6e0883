"""Sampler: turn one row of logits per request into the next token, vLLM v1 semantics.

Each step the model runner hands over ``logits`` (B, V) float32, one row per request
(the position that samples), and a ``SamplingMetadata`` built once for the step. The
stages run in this order, each skipped when no row in the batch needs it:

    raw logits ─┬─> logprobs = log_softmax(raw logits)            (only if a row asked)
                └─> logit_bias, min_tokens (-inf on stop ids), bad words, allowed_token_ids
                        (or the one token a reasoning budget forces) ─> penalties
                        ├─> greedy rows: argmax                   (all greedy: done)
                        └─> random rows: / temperature ─> min_p ─> top_k, top_p ─> sample

Logprobs are those of the raw model output (vLLM v1's default ``raw_logprobs``): they do
not see bias, penalties, temperature or filtering, so they answer "how likely did the
model think this token was". Where a raw logit is -inf, its logprob is reported as
``LOGPROB_FLOOR`` (-9999.0, what vLLM's OpenAI server reports for -inf) so every value is
finite and JSON-safe.

A request is greedy when temperature < 1e-5 or top_k == 1; its token is exactly the argmax
of the processed logits. Random rows sample by inverting the CDF: one uniform u per row,
the token is the first whose cumulative probability (vocabulary in id order) exceeds u.
With top_k/top_p the kept set is found among each row's largest logits (``torch.topk``
of 256, then 4,096 candidates, a full sort only for rows whose kept set is larger),
never by sorting the whole vocabulary. A request with a seed draws
its u from its own generator, so its tokens do not depend on which requests share the
batch or where it sits; all other rows draw from the global RNG in one call.

The caller's ``logits`` tensor is never modified.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loom.kernels import native_ops_for
from loom.model.layers.scratch import scratch
from loom.sampling_params import SamplingParams, forced_thinking_token

_SAMPLING_EPS = 1e-5  # temperature below this is greedy (as in vLLM)
LOGPROB_FLOOR = -9999.0  # reported in place of a -inf logprob


@dataclass
class SamplingMetadata:
    """Everything the sampler needs for one step; tensors are (B,) on the logits' device.

    Values for greedy rows are neutral (temperature 1, no top_k / top_p / min_p) so the
    random path can run over the whole batch; their result is replaced by the argmax.
    """

    temperature: torch.Tensor  # (B,) float32, 1.0 on greedy rows
    top_p: torch.Tensor  # (B,) float32, 1.0 = disabled
    top_k: torch.Tensor  # (B,) int64, vocab_size = disabled
    min_p: torch.Tensor  # (B,) float32, 0.0 = disabled
    presence_penalty: torch.Tensor  # (B,) float32
    frequency_penalty: torch.Tensor  # (B,) float32
    repetition_penalty: torch.Tensor  # (B,) float32
    is_greedy: torch.Tensor  # (B,) bool

    all_greedy: bool
    all_random: bool
    no_top_p: bool  # flags over the random rows only
    no_top_k: bool
    no_temperature: bool  # every temperature is 1.0: nothing to divide by
    no_min_p: bool
    no_penalties: bool
    no_repetition_penalty: bool

    generators: dict[int, torch.Generator]  # row -> generator, random rows with a seed only

    # Penalty inputs, only when a row has a penalty (else None). Padded with vocab_size,
    # which lands in a spare column that is dropped.
    output_token_ids: list[list[int]]
    output_token_ids_padded: torch.Tensor | None  # (B, max_output_len) int64
    prompt_token_ids_padded: torch.Tensor | None  # (B, max_prompt_len) int64, repetition only

    # Sparse (row, token) edits, flattened over the batch; None when there are none.
    # (row, token) pairs -> -inf: stop ids of rows still under min_tokens, and the last
    # tokens of bad words whose other tokens end the row's text
    min_tokens_rows: torch.Tensor | None  # (N,) int64
    min_tokens_token_ids: torch.Tensor | None  # (N,) int64
    logit_bias_rows: torch.Tensor | None  # (M,) int64
    logit_bias_token_ids: torch.Tensor | None  # (M,) int64
    logit_bias_values: torch.Tensor | None  # (M,) float32
    # custom logits processors (layers/logits_processors.py) and what they read: each
    # row's params and output so far
    logits_processors: Sequence[Any]
    params: Sequence[SamplingParams]
    allowed_rows: torch.Tensor | None  # (A,) int64: rows with allowed_token_ids
    allowed_mask: torch.Tensor | None  # (A, V) bool: True where that row may sample

    max_num_logprobs: int | None  # largest SamplingParams.logprobs in the batch; None if none

    @property
    def num_reqs(self) -> int:
        return self.temperature.shape[0]

    @property
    def needs_logits_processing(self) -> bool:
        return (not self.no_penalties or self.min_tokens_rows is not None
                or self.logit_bias_rows is not None or self.allowed_rows is not None
                or bool(self.logits_processors))

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: list[list[int]],
        stop_ids_for_min_tokens: Sequence[Collection[int]],
        generators: dict[int, torch.Generator],
        vocab_size: int,
        device: torch.device | str,
        logits_processors: Sequence[Any] = (),
    ) -> SamplingMetadata:
        """Build the step's metadata for rows ``0 .. len(params) - 1``.

        ``stop_ids_for_min_tokens[i]`` are the ids masked while row i has fewer than
        ``params[i].min_tokens`` output tokens (eos unless ignore_eos, plus
        stop_token_ids); ids outside the vocabulary are ignored. ``generators`` maps a
        row to its request's generator, which must live on ``device``.
        """
        num_reqs = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(stop_ids_for_min_tokens)
                == num_reqs):
            raise ValueError(
                f"SamplingMetadata.build got {num_reqs} params but {len(prompt_token_ids)} "
                f"prompts, {len(output_token_ids)} outputs and {len(stop_ids_for_min_tokens)} "
                "stop-id sets; pass one of each per row")
        is_greedy = [p.temperature < _SAMPLING_EPS or p.top_k == 1 for p in params]
        random_params = [p for p, greedy in zip(params, is_greedy) if not greedy]

        def floats(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        temperature = [1.0 if greedy else p.temperature for p, greedy in zip(params, is_greedy)]
        top_k = [vocab_size if greedy or p.top_k <= 0 else min(p.top_k, vocab_size)
                 for p, greedy in zip(params, is_greedy)]
        top_p = [1.0 if greedy else p.top_p for p, greedy in zip(params, is_greedy)]
        min_p = [0.0 if greedy else p.min_p for p, greedy in zip(params, is_greedy)]

        no_repetition_penalty = all(p.repetition_penalty == 1.0 for p in params)
        no_penalties = no_repetition_penalty and all(
            p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 for p in params)
        output_padded = prompt_padded = None
        if not no_penalties:
            output_padded = _pad(output_token_ids, vocab_size, device)
            if not no_repetition_penalty:
                prompt_padded = _pad(prompt_token_ids, vocab_size, device)

        # (row, token) pairs masked to -inf: stop ids under min_tokens, bad words' last
        # tokens where their other tokens have just been produced
        min_tokens_rows: list[int] = []
        min_tokens_ids: list[int] = []
        for row, (p, stop_ids) in enumerate(zip(params, stop_ids_for_min_tokens)):
            if len(output_token_ids[row]) < p.min_tokens:
                ids = [t for t in stop_ids if 0 <= t < vocab_size]
                min_tokens_rows += [row] * len(ids)
                min_tokens_ids += ids
            if p.bad_words_token_ids:
                ids = banned_by_bad_words(p.bad_words_token_ids, prompt_token_ids[row],
                                          output_token_ids[row])
                min_tokens_rows += [row] * len(ids)
                min_tokens_ids += ids
        # rows that may sample only some tokens: a forced one (the reasoning budget's),
        # else their allowed_token_ids
        allowed: dict[int, list[int]] = {}
        for row, p in enumerate(params):
            forced = (forced_thinking_token(p, prompt_token_ids[row], output_token_ids[row])
                      if p.think_forced_ids else None)
            if forced is not None:
                allowed[row] = [forced]
            elif p.allowed_token_ids is not None:
                allowed[row] = [t for t in p.allowed_token_ids if t < vocab_size]
        allowed_rows = list(allowed)
        allowed_mask = None
        if allowed_rows:  # (A, V): True where the row may sample the token
            allowed_mask = torch.zeros(len(allowed_rows), vocab_size, dtype=torch.bool,
                                       device=device)
            for index, row in enumerate(allowed_rows):
                allowed_mask[index, torch.tensor(allowed[row], dtype=torch.int64,
                                                 device=device)] = True

        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        for row, p in enumerate(params):
            for token_id, bias in (p.logit_bias or {}).items():
                token_id = int(token_id)  # JSON object keys may arrive as strings
                if not 0 <= token_id < vocab_size:
                    raise ValueError(
                        f"logit_bias names token {token_id} but the vocabulary has "
                        f"{vocab_size} tokens (ids 0..{vocab_size - 1}); remove it")
                bias_rows.append(row)
                bias_ids.append(token_id)
                bias_values.append(bias)

        def longs_or_none(values: list[int]) -> torch.Tensor | None:
            return torch.tensor(values, dtype=torch.int64, device=device) if values else None

        requested = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            temperature=floats(temperature),
            top_p=floats(top_p),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
            min_p=floats(min_p),
            presence_penalty=floats([p.presence_penalty for p in params]),
            frequency_penalty=floats([p.frequency_penalty for p in params]),
            repetition_penalty=floats([p.repetition_penalty for p in params]),
            is_greedy=torch.tensor(is_greedy, dtype=torch.bool, device=device),
            all_greedy=all(is_greedy),
            all_random=not any(is_greedy),
            no_top_p=all(p.top_p >= 1.0 for p in random_params),
            no_temperature=all(p.temperature == 1.0 for p in random_params),
            no_top_k=all(p.top_k <= 0 or p.top_k >= vocab_size for p in random_params),
            no_min_p=all(p.min_p <= 0.0 for p in random_params),
            no_penalties=no_penalties,
            no_repetition_penalty=no_repetition_penalty,
            generators={row: g for row, g in generators.items() if not is_greedy[row]},
            output_token_ids=output_token_ids,
            output_token_ids_padded=output_padded,
            prompt_token_ids_padded=prompt_padded,
            min_tokens_rows=longs_or_none(min_tokens_rows),
            min_tokens_token_ids=longs_or_none(min_tokens_ids),
            logit_bias_rows=longs_or_none(bias_rows),
            logit_bias_token_ids=longs_or_none(bias_ids),
            logit_bias_values=floats(bias_values) if bias_values else None,
            logits_processors=tuple(logits_processors),
            params=list(params),
            allowed_rows=longs_or_none(allowed_rows),
            allowed_mask=allowed_mask,
            max_num_logprobs=max(requested) if requested else None,
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # (B,) int64
    # Only when some row asked for logprobs; k = max_num_logprobs, rows asking fewer slice.
    logprob_token_ids: torch.Tensor | None  # (B, 1 + k) int64: sampled token, then top-k ids
    logprobs: torch.Tensor | None  # (B, 1 + k) float32, finite (LOGPROB_FLOOR for -inf)
    sampled_token_ranks: torch.Tensor | None  # (B,) int64, 1 = the model's most likely token


class Sampler(nn.Module):
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        super().__init__()
        self.logprobs_mode = logprobs_mode  # ModelConfig.logprobs_mode

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()  # (B, V)
        wanted = metadata.max_num_logprobs is not None
        reported = None  # what logprobs report, per the mode
        if wanted and self.logprobs_mode == "raw_logprobs":
            reported = torch.log_softmax(logits, dim=-1)
        elif wanted and self.logprobs_mode == "raw_logits":
            reported = logits.clone()

        logits = self.process_logits(logits, metadata)

        if metadata.all_greedy:
            sampled = greedy_argmax(logits)
        else:
            sampled = self._sample_random(logits, metadata)  # leaves `logits` as it was
            if not metadata.all_random:
                sampled = torch.where(metadata.is_greedy, greedy_argmax(logits), sampled)

        if not wanted:
            return SamplerOutput(sampled, None, None, None)
        if reported is None:  # processed: what each row's token was drawn from
            reported = self.processed_logits(logits, metadata)
            if self.logprobs_mode == "processed_logprobs":
                reported = torch.log_softmax(reported, dim=-1)
        token_ids, logprobs, ranks = gather_logprobs(reported, sampled,
                                                     metadata.max_num_logprobs)
        return SamplerOutput(sampled, token_ids, logprobs, ranks)

    @staticmethod
    def processed_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The logits each row's token is drawn from, from the processed ``logits``:
        themselves for greedy rows; / temperature, min_p, and -inf outside the top-k /
        top-p set for sampled rows (greedy rows carry neutral values there). A new
        tensor."""
        if metadata.all_greedy:
            return logits.clone()
        probs = Sampler.sampling_probs(logits, metadata)
        kept = probs > 0
        return torch.where(kept, Sampler._scaled(logits, metadata), float("-inf"))

    @staticmethod
    def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Custom logits processors, logit_bias, masks and penalties: what greedy rows take
        the argmax of.
        Returns ``logits`` itself when nothing applies, else a new tensor."""
        if metadata.needs_logits_processing:
            logits = logits.clone()
            for processor in metadata.logits_processors:
                logits = processor.apply(logits, metadata.params, metadata.output_token_ids)
            logits = apply_logit_bias_and_min_tokens(logits, metadata)
            if not metadata.no_penalties:
                logits = apply_penalties(logits, metadata)
        return logits

    @staticmethod
    def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """The distribution random rows sample from: processed logits / temperature,
        then min_p, top_k and top_p, softmaxed. (B, V), not ``logits``: a new tensor,
        or the process's "sampling_probs" scratch buffer (layers/scratch.py), valid
        until the next ``sampling_probs`` call."""
        logits = Sampler._scaled(logits, metadata)
        if metadata.no_top_k and metadata.no_top_p:
            # into a buffer kept across steps: a fresh (256, 49152) tensor page-faults
            # for 15 ms (layers/scratch.py)
            return torch.softmax(logits, dim=-1,
                                 out=scratch("sampling_probs", logits.shape, logits.dtype,
                                             logits.device))
        probs = torch.zeros_like(logits)
        for rows, values, ids in top_k_top_p_candidates(logits, *Sampler._filters(metadata)):
            probs[rows] = probs[rows].scatter_(1, ids, torch.softmax(values, dim=-1))
        return probs

    @staticmethod
    def _scaled(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Logits / temperature, then min_p: the "scaled_logits" scratch buffer (see
        sampling_probs), or ``logits`` itself when both are no-ops (x / 1.0 == x)."""
        if metadata.no_temperature and metadata.no_min_p:
            return logits
        logits = torch.div(logits, metadata.temperature.unsqueeze(1),
                           out=scratch("scaled_logits", logits.shape, logits.dtype,
                                       logits.device))
        if not metadata.no_min_p:
            logits = apply_min_p(logits, metadata.min_p)
        return logits

    @staticmethod
    def _filters(metadata: SamplingMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return (None if metadata.no_top_k else metadata.top_k,
                None if metadata.no_top_p else metadata.top_p)

    @staticmethod
    def _sample_random(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        # The CDF runs over the vocabulary in id order, as the rejection sampler's does,
        # so that a seeded row samples the same token on either path.
        uniform = row_uniforms(logits.shape[0], metadata.generators, logits.device)
        return inverse_cdf(Sampler.sampling_probs(logits, metadata), uniform)


def banned_by_bad_words(sequences: list[list[int]], prompt_token_ids: Sequence[int],
                        output_token_ids: Sequence[int]) -> list[int]:
    """The last token of each bad word's sequence whose other tokens end the text so far
    (prompt and output, as transformers' NoBadWordsLogitsProcessor reads its input ids);
    a one-token bad word always."""
    banned = []
    for sequence in sequences:
        head = sequence[:-1]
        if not head:
            banned.append(sequence[-1])
            continue
        tail = list(output_token_ids[-len(head):])
        if len(tail) < len(head):  # the text so far reaches back into the prompt
            tail = list(prompt_token_ids[len(prompt_token_ids) - (len(head) - len(tail)):]) \
                + tail
        if tail == head:
            banned.append(sequence[-1])
    return banned


def apply_logit_bias_and_min_tokens(logits: torch.Tensor,
                                    metadata: SamplingMetadata) -> torch.Tensor:
    """Add each row's logit_bias, then mask stop ids of rows under min_tokens, bad words'
    tokens, and every token outside a row's allowed_token_ids; in place."""
    if metadata.logit_bias_rows is not None:
        logits.index_put_((metadata.logit_bias_rows, metadata.logit_bias_token_ids),
                          metadata.logit_bias_values, accumulate=True)
    if metadata.min_tokens_rows is not None:
        logits[metadata.min_tokens_rows, metadata.min_tokens_token_ids] = float("-inf")
    if metadata.allowed_rows is not None:
        rows = metadata.allowed_rows
        logits[rows] = logits[rows].masked_fill(~metadata.allowed_mask, float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt and output), then frequency and presence (output only); in place.

    repetition: a seen token's logit is divided by the penalty if positive, else multiplied.
    frequency:  logit -= frequency_penalty * (times the token was generated)
    presence:   logit -= presence_penalty * (token was generated at least once)
    """
    num_reqs, vocab_size = logits.shape
    output_ids = metadata.output_token_ids_padded  # (B, max_output_len), pad = vocab_size
    output_counts = torch.zeros(num_reqs, vocab_size + 1, dtype=logits.dtype,
                                device=logits.device)
    output_counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    output_counts = output_counts[:, :vocab_size]  # (B, V)
    output_seen = output_counts > 0

    if not metadata.no_repetition_penalty:
        prompt_seen = torch.zeros(num_reqs, vocab_size + 1, dtype=torch.bool,
                                  device=logits.device)
        prompt_seen.scatter_(1, metadata.prompt_token_ids_padded, True)
        seen = prompt_seen[:, :vocab_size] | output_seen
        penalty = metadata.repetition_penalty.unsqueeze(1).expand_as(logits)
        scale = torch.where(logits > 0, penalty.reciprocal(), penalty)
        logits = torch.where(seen, logits * scale, logits)

    logits -= metadata.frequency_penalty.unsqueeze(1) * output_counts
    logits -= metadata.presence_penalty.unsqueeze(1) * output_seen
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, float("-inf"))


CANDIDATE_SIZES = (256, 4096)  # top-k sizes tried for the kept set before a full sort


def top_k_top_p_candidates(logits: torch.Tensor, top_k: torch.Tensor | None,
                           top_p: torch.Tensor | None
                           ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each row's kept set under top_k, then top_p, as candidates: a list of
    ``(rows, values, ids)`` groups covering every row once, ``values`` (r, K) the rows'
    K largest logits in descending order with -inf where dropped, ``ids`` their token ids
    (rows that filter nothing come as they are: all V logits, unsorted).

    top_k keeps every token tied with the k-th largest; top_p renormalises over what
    top_k kept and keeps the smallest top set whose mass reaches top_p (a token stays
    while the mass strictly above it is below top_p, so the most likely always stays).
    top_k == vocab_size and top_p == 1.0 are no-ops. A row is settled with K candidates
    when its kept set provably ends inside them; the rest retry with more, and finally
    with all V (a full sort of those rows only).
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    neg_inf = float("-inf")
    log_norm = torch.logsumexp(logits, dim=-1) if top_p is not None else None
    pending = torch.arange(num_rows, device=device)
    groups = []
    # rows that filter nothing keep their logits as they are, unsorted
    unfiltered = torch.ones(num_rows, dtype=torch.bool, device=device)
    if top_k is not None:
        unfiltered &= top_k >= vocab_size
    if top_p is not None:
        unfiltered &= top_p >= 1.0
    if bool(unfiltered.any()):
        rows = unfiltered.nonzero().squeeze(1)
        all_ids = torch.arange(vocab_size, device=device).expand(rows.shape[0], -1)
        groups.append((rows, logits[rows], all_ids))
        pending = (~unfiltered).nonzero().squeeze(1)
        if pending.numel() == 0:
            return groups
    for size in [k for k in CANDIDATE_SIZES if k < vocab_size] + [vocab_size]:
        rows = pending
        values, ids = logits[rows].topk(size, dim=-1)  # descending
        limited = top_k[rows] < vocab_size if top_k is not None else None
        if top_k is not None:
            k = top_k[rows]
            kth = values.gather(1, (k.clamp(max=size) - 1).unsqueeze(1))  # (r, 1)
            values = values.masked_fill(values < kth, neg_inf)
            # a limited row's kept set ends inside the candidates when its k-th largest
            # is among them and the last candidate fell below it (was not tied)
            top_k_inside = ~limited | ((k <= size) & (values[:, -1] == neg_inf))
        if top_p is not None:
            norm = log_norm[rows]
            if top_k is not None:  # limited rows renormalise over what top_k kept
                norm = torch.where(limited, torch.logsumexp(values, dim=-1), norm)
            probs = torch.exp(values - norm.unsqueeze(1))
            mass_above = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            values = values.masked_fill(mass_above >= top_p[rows].unsqueeze(1), neg_inf)
            # the top_p set ends inside the candidates once their mass reaches top_p
            reached = probs.sum(dim=-1) >= top_p[rows]
        if size == vocab_size:
            settled = torch.ones(rows.shape[0], dtype=torch.bool, device=device)
        elif top_p is None:  # top_k only: unlimited rows keep the whole vocabulary
            settled = top_k_inside & limited
        elif top_k is None:
            settled = reached
        else:
            settled = top_k_inside & (limited | reached)
        if bool(settled.all()):
            groups.append((rows, values, ids))
            break
        done = settled.nonzero().squeeze(1)
        if done.numel():
            groups.append((rows[done], values[done], ids[done]))
        pending = rows[~settled]
    return groups


_ARGMAX_CHUNK = 256


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of (R, N) logits: the same index in every case (a row's
    first largest value; its first NaN if it has one), found faster on the CPU.

    ATen's CPU argmax walks a row one element at a time: ~200 us for a 49k vocabulary
    on one core, about 35x its vectorised ``amax``, and a batch-1 decode step pays it
    for every token. loom's ``argmax_rows`` kernel reads each row once in 16 lanes;
    without the kernels, ``two_level_argmax``."""
    if not logits.is_cpu or logits.shape[-1] <= 4 * _ARGMAX_CHUNK:
        return logits.argmax(dim=-1)
    ops = native_ops_for(logits.device, logits.dtype)
    if ops is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
        return ops.argmax_rows(logits)
    return two_level_argmax(logits)


def two_level_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` of (R, N) logits in ATen's vectorised ops: the largest
    of each chunk of 256 (``amax``, NaN propagating), the first chunk holding the row's
    largest (argmax over N / 256 values), and the first largest inside that chunk. A
    row padded to whole chunks gets -inf, which never comes before a real value."""
    num_rows, width = logits.shape
    pad = -width % _ARGMAX_CHUNK
    if pad:
        logits = torch.nn.functional.pad(logits, (0, pad), value=float("-inf"))
    elif logits.stride(-1) != 1:
        logits = logits.contiguous()
    chunks = logits.view(num_rows, -1, _ARGMAX_CHUNK)  # (R, C, 256)
    chunk = chunks.amax(dim=-1).argmax(dim=-1)  # (R,)
    inside = chunks.gather(1, chunk.view(num_rows, 1, 1).expand(num_rows, 1, _ARGMAX_CHUNK))
    return chunk * _ARGMAX_CHUNK + inside.squeeze(1).argmax(dim=-1)


def row_uniforms(num_rows: int, generators: dict[int, torch.Generator],
                 device: torch.device | str) -> torch.Tensor:
    """One U[0, 1) draw per row (float64); rows in ``generators`` draw from their own."""
    uniform = torch.empty(num_rows, dtype=torch.float64, device=device)
    if len(generators) < num_rows:
        uniform.uniform_()
    for row, generator in generators.items():
        uniform[row:row + 1].uniform_(generator=generator)
    return uniform


_CDF_CHUNK = 256


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` (R, N), non-negative and not necessarily normalised, the
    first index whose cumulative probability exceeds ``uniform`` times the row's total;
    zero-probability entries are never chosen.

    Two levels, so that no running sum spans the whole row: sums of chunks of 256
    (float32, then a float64 running sum over the chunks) pick the chunk, a float64
    running sum inside it picks the entry. One read of ``probs`` and O(R * 256) more,
    where a float64 cumsum of a 49k vocabulary costs a large batch tens of ms."""
    num_rows, width = probs.shape
    if width <= _CDF_CHUNK:
        cdf = probs.double().cumsum_(dim=-1)
        target = (uniform * cdf[:, -1]).unsqueeze(1)
        return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=width - 1)
    pad = -width % _CDF_CHUNK
    if pad:
        probs = torch.nn.functional.pad(probs, (0, pad))
    chunks = probs.view(num_rows, -1, _CDF_CHUNK)  # (R, C, 256)
    chunk_cdf = chunks.sum(dim=-1).double().cumsum_(dim=-1)  # (R, C)
    target = uniform * chunk_cdf[:, -1]  # (R,)
    chunk = torch.searchsorted(chunk_cdf, target.unsqueeze(1), right=True).squeeze(1)
    chunk.clamp_(max=chunk_cdf.shape[1] - 1)
    before = torch.where(chunk > 0, chunk_cdf.gather(1, (chunk - 1).clamp(min=0).unsqueeze(1))
                         .squeeze(1), torch.zeros_like(target))
    rows = torch.arange(num_rows, device=probs.device)
    inside = chunks[rows, chunk].double().cumsum_(dim=-1)  # (R, 256)
    offset = torch.searchsorted(inside, (target - before).unsqueeze(1), right=True).squeeze(1)
    # rounding can put the target at the chunk's very end: take its last positive entry
    last_positive = (_CDF_CHUNK - 1) - (chunks[rows, chunk] > 0).flip(-1).int().argmax(dim=-1)
    offset = torch.minimum(offset, last_positive)
    return (chunk * _CDF_CHUNK + offset).clamp_(max=width - 1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                    num_logprobs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, 1 + k) ids and logprobs, sampled token first, then the top-k; and its rank."""
    sampled_logprobs = logprobs.gather(1, token_ids.unsqueeze(1))  # (B, 1)
    ranks = (logprobs >= sampled_logprobs).sum(dim=-1)  # (B,) 1 = most likely
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)  # (B, k)
    ids = torch.cat([token_ids.unsqueeze(1), top_ids], dim=1)
    values = torch.cat([sampled_logprobs, top_logprobs], dim=1).clamp_(min=LOGPROB_FLOOR)
    return ids, values, ranks


def _pad(token_ids: Sequence[Sequence[int]], pad_id: int,
         device: torch.device | str) -> torch.Tensor:
    width = max(1, max((len(ids) for ids in token_ids), default=0))
    rows = [list(ids) + [pad_id] * (width - len(ids)) for ids in token_ids]
    return torch.tensor(rows, dtype=torch.int64, device=device)
