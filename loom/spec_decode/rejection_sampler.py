"""RejectionSampler: verify draft tokens against the target model, keeping its distribution.

A request with drafts ``d_1 .. d_s`` was fed ``[last token, d_1, .., d_s]`` in one forward,
so it has ``s + 1`` rows of logits: the row before ``d_j`` verifies it, the last row
samples the token after them all (the bonus). Rows are laid out

    rows 0 .. B-1        each request's last row (its bonus row; a request with no
                         drafts has only this one and samples from it as usual)
    rows B .. B+D-1      draft rows, request by request: the row verifying d_1, d_2, ...

Each row is processed exactly as the plain sampler would process it at that position
(its ``SamplingMetadata`` row sees the drafts before it as output tokens, for penalties
and min_tokens), giving the target distribution ``p``. Then, per request, in order:

    greedy:  accept d_j while d_j == argmax p_j; the first mismatch emits argmax p_j
    random:  accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); on a rejection emit
             a sample of normalize(max(p_j - q_j, 0)) and stop
    all accepted: emit a sample of p (the bonus row)

so every emitted token is distributed exactly as the target model would sample it
(Leviathan et al. 2023; Chen et al. 2023). Drafts from n-gram lookup or a greedy draft
model are deterministic, so ``q_j`` is one-hot: accept with probability ``p_j(d_j)``,
and on a rejection sample ``p_j`` without ``d_j``.

Randomness: a seeded request's row at position ``t`` re-seeds the request's generator
with ``(seed, t)`` and draws the uniform of the inverse-CDF sample first, then the
acceptance uniform; a row without drafts thus samples exactly the token the plain
sampler would (same uniform, same CDF over the vocabulary in id order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loom.model.layers.sampler import (Sampler, SamplingMetadata, gather_logprobs, greedy_argmax,
                                      inverse_cdf)


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts, then one sampled token
    # One entry per emitted token, request by request (only when asked for):
    logprob_token_ids: list[list[int]] | None  # [token, top_1, .., top_k]
    logprobs: list[list[float]] | None
    ranks: list[int] | None
    probs: list[float] | None  # the token's probability before top-k/top-p/min-p (early stop)


class RejectionSampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        # raw_logprobs or raw_logits (EngineConfig refuses the processed modes with
        # speculative decoding)
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 draft_token_ids: Sequence[Sequence[int]],
                 row_seeds: dict[int, tuple[torch.Generator, int]] | None = None,
                 draft_probs: torch.Tensor | None = None,
                 want_probs: bool = False) -> VerifyOutput:
        """``logits`` (B + D, V) in the layout above; ``metadata`` has the same rows;
        ``draft_token_ids[i]`` the drafts of request i (may be empty); ``row_seeds``
        row -> (generator, seed) for seeded random rows; ``draft_probs`` (D, V) the
        draft distribution of each draft row, None for deterministic drafts."""
        num_reqs = len(draft_token_ids)
        device = logits.device
        logits = logits.float()
        processed = Sampler.process_logits(logits, metadata)
        flat_drafts = [t for drafts in draft_token_ids for t in drafts]
        num_drafts = len(flat_drafts)
        draft_rows = torch.arange(num_reqs, num_reqs + num_drafts, device=device)
        drafts = torch.tensor(flat_drafts, dtype=torch.int64, device=device)

        target_argmax = greedy_argmax(processed)  # (B + D,)
        if metadata.all_greedy:
            accepted = target_argmax[draft_rows] == drafts
            emitted_if_stop = target_argmax
        else:
            probs = Sampler.sampling_probs(processed, metadata)  # (B + D, V)
            sample_uniform, uniform = self._uniforms(probs.shape[0], row_seeds or {},
                                                     probs.device)
            draft_p = probs[draft_rows]  # (D, V)
            p_of_draft = draft_p.gather(1, drafts.unsqueeze(1)).squeeze(1)
            if draft_probs is None:
                accepted = uniform[draft_rows] < p_of_draft
                recovered = draft_p.scatter(1, drafts.unsqueeze(1), 0.0)
            else:
                q_of_draft = draft_probs.gather(1, drafts.unsqueeze(1)).squeeze(1)
                accepted = uniform[draft_rows] * q_of_draft < p_of_draft
                recovered = (draft_p - draft_probs).clamp_(min=0.0)
            # Rounding can empty max(p - q, 0) where a rejection was (nearly) impossible.
            empty = recovered.sum(dim=-1) <= 0
            recovered[empty] = draft_p[empty]
            probs[draft_rows] = recovered  # unnormalised: inverse_cdf does not need it
            emitted_if_stop = inverse_cdf(probs, sample_uniform)
            if not metadata.all_random:
                is_greedy = metadata.is_greedy
                accepted = torch.where(is_greedy[draft_rows],
                                       target_argmax[draft_rows] == drafts, accepted)
                emitted_if_stop = torch.where(is_greedy, target_argmax, emitted_if_stop)

        accepted_list = accepted.tolist()
        stop_tokens = emitted_if_stop.tolist()
        token_ids: list[list[int]] = []
        emitted_rows: list[int] = []
        first_draft_row = num_reqs
        for i, req_drafts in enumerate(draft_token_ids):
            num_accepted = 0
            base = first_draft_row - num_reqs
            while num_accepted < len(req_drafts) and accepted_list[base + num_accepted]:
                num_accepted += 1
            rows = list(range(first_draft_row, first_draft_row + num_accepted))
            if num_accepted < len(req_drafts):
                last_row = first_draft_row + num_accepted  # the rejected draft's row
            else:
                last_row = i  # the bonus row
            token_ids.append(list(req_drafts[:num_accepted]) + [stop_tokens[last_row]])
            emitted_rows += rows + [last_row]
            first_draft_row += len(req_drafts)

        out = VerifyOutput(token_ids, None, None, None, None)
        if metadata.max_num_logprobs is None and not want_probs:
            return out
        rows = torch.tensor(emitted_rows, dtype=torch.int64, device=device)
        tokens = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64,
                              device=device)
        if metadata.max_num_logprobs is not None:
            reported = (logits[rows].float() if self.logprobs_mode == "raw_logits"
                        else torch.log_softmax(logits[rows], dim=-1))
            ids, values, ranks = gather_logprobs(reported, tokens, metadata.max_num_logprobs)
            out.logprob_token_ids, out.logprobs, out.ranks = (ids.tolist(), values.tolist(),
                                                              ranks.tolist())
        if want_probs:
            scaled = processed[rows] / metadata.temperature[rows].unsqueeze(1)
            out.probs = torch.softmax(scaled, dim=-1).gather(1, tokens.unsqueeze(1)) \
                .squeeze(1).tolist()
        return out

    @staticmethod
    def _uniforms(num_rows: int, row_seeds: dict[int, tuple[torch.Generator, int]],
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per row: the uniform of the inverse-CDF sample (float64, drawn first, as the
        plain sampler draws it) and the acceptance uniform (float32)."""
        sample_uniform = torch.empty(num_rows, dtype=torch.float64, device=device)
        uniform = torch.empty(num_rows, dtype=torch.float32, device=device)
        if len(row_seeds) < num_rows:
            sample_uniform.uniform_()
            uniform.uniform_()
        for row, (generator, seed) in row_seeds.items():
            generator.manual_seed(seed)
            sample_uniform[row:row + 1].uniform_(generator=generator)
            uniform[row] = torch.rand((), generator=generator, device=device)
        return sample_uniform, uniform
