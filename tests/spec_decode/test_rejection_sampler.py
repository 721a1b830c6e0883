"""The rejection sampler keeps the target distribution exactly, for deterministic
(one-hot) drafts and for drafts sampled from a distribution q; greedy verification
accepts exactly the argmax prefix; seeded rows are reproducible and a row without
drafts samples what the plain sampler samples."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from loom.model.layers.sampler import Sampler, SamplingMetadata
from loom.sampling_params import SamplingParams
from loom.spec_decode.rejection_sampler import RejectionSampler

VOCAB = 6


def metadata_for(params: list[SamplingParams], outputs=None) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(params, [[] for _ in range(n)], outputs or [[] for _ in range(n)],
                                  [[] for _ in range(n)], {}, VOCAB, "cpu")


def layout(logits_per_row: torch.Tensor, num_reqs: int, num_drafts: int) -> torch.Tensor:
    """Bonus rows then draft rows, every row with the same logits."""
    return logits_per_row.expand(num_reqs * (num_drafts + 1), VOCAB).clone()


def assert_distributed_as(samples: list[int], expected: np.ndarray) -> None:
    counts = np.bincount(samples, minlength=VOCAB)
    keep = expected > 0
    assert counts[~keep].sum() == 0, f"tokens outside the support: {counts}"
    result = chisquare(counts[keep], expected[keep] / expected[keep].sum() * counts.sum())
    assert result.pvalue > 1e-3, f"counts {counts} vs p {expected} (p-value {result.pvalue:.2e})"


def target_probs(logits: torch.Tensor, params: SamplingParams) -> np.ndarray:
    meta = metadata_for([params])
    return Sampler.sampling_probs(logits.view(1, -1).float(), meta)[0].numpy().astype(np.float64)


LOGITS = torch.tensor([1.0, 0.2, -0.5, 0.7, -1.0, 0.1])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0),
                                    SamplingParams(temperature=0.7, top_k=4, top_p=0.9)],
                         ids=["plain", "temperature_top_k_top_p"])
def test_one_hot_drafts_keep_the_target_distribution(params):
    torch.manual_seed(0)
    num_reqs, drafts = 20000, [0, 3]  # a likely and a less likely draft
    p = target_probs(LOGITS, params)
    meta = metadata_for([params] * (num_reqs * 3))
    out = RejectionSampler()(layout(LOGITS, num_reqs, 2), meta, [drafts] * num_reqs)
    assert all(1 <= len(t) <= 3 for t in out.token_ids)
    assert_distributed_as([t[0] for t in out.token_ids], p)
    # Given the first draft was accepted, the next token is again distributed as p.
    assert_distributed_as([t[1] for t in out.token_ids if len(t) > 1], p)
    accept_rate = np.mean([len(t) > 1 for t in out.token_ids])
    assert abs(accept_rate - p[0]) < 0.02  # one-hot q: accept with probability p(draft)


def test_sampled_drafts_with_their_distribution_keep_the_target_distribution():
    torch.manual_seed(1)
    num_reqs = 20000
    params = SamplingParams(temperature=1.0)
    p = target_probs(LOGITS, params)
    q = torch.tensor([0.05, 0.4, 0.05, 0.1, 0.3, 0.1])
    drafts = torch.multinomial(q, num_reqs, replacement=True).tolist()
    meta = metadata_for([params] * (num_reqs * 2))
    out = RejectionSampler()(layout(LOGITS, num_reqs, 1), meta, [[d] for d in drafts],
                             draft_probs=q.expand(num_reqs, VOCAB))
    assert_distributed_as([t[0] for t in out.token_ids], p)


def test_greedy_accepts_the_argmax_prefix_then_corrects():
    logits = torch.full((5, VOCAB), -1.0)
    # rows: bonus of request 0, bonus of request 1, then request 0's draft rows (3)
    argmax_by_row = [4, 2, 1, 5, 0]
    for row, token in enumerate(argmax_by_row):
        logits[row, token] = 3.0
    meta = metadata_for([SamplingParams(temperature=0.0)] * 5)
    out = RejectionSampler()(logits, meta, [[1, 5, 3], []], want_probs=True)
    assert out.token_ids == [[1, 5, 0], [2]]  # third draft rejected: the argmax 0 instead
    meta = metadata_for([SamplingParams(temperature=0.0)] * 5)
    out = RejectionSampler()(logits, meta, [[1, 5, 0], []])
    assert out.token_ids == [[1, 5, 0, 4], [2]]  # all accepted, then the bonus token


def test_penalties_see_earlier_drafts():
    # Draft row j must apply the frequency penalty to the drafts before it.
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    logits = torch.tensor([[0.0, 3.0, 2.0, 0, 0, 0]] * 3)
    meta = metadata_for([params] * 3, outputs=[[1, 1], [], [1]])  # bonus, draft 1, draft 2
    out = RejectionSampler()(logits, meta, [[1, 1]])
    # draft 1 (no earlier output): argmax 1, accepted; draft 2 sees one 1: 3-2 < 2, so 2.
    assert out.token_ids == [[1, 2]]


def test_seeded_rows_are_reproducible_and_match_the_plain_sampler():
    params = SamplingParams(temperature=1.0, seed=11)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))

    def verify():
        generator = torch.Generator()
        meta = metadata_for([params] * 3)
        # request 0: one draft (rows 0 bonus, 2 draft); request 1: no drafts (row 1)
        return RejectionSampler()(logits, meta, [[2], []],
                                  row_seeds={0: (generator, 101), 1: (generator, 202),
                                             2: (generator, 100)}).token_ids

    assert verify() == verify()
    plain_generator = torch.Generator().manual_seed(202)
    plain = Sampler()(logits[1:2], SamplingMetadata.build(
        [params], [[]], [[]], [[]], {0: plain_generator}, VOCAB, "cpu"))
    assert verify()[1] == [int(plain.sampled_token_ids[0])]


def test_logprobs_and_probs_of_emitted_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.05, 0.05]] * 3))
    params = SamplingParams(temperature=0.0, logprobs=2)
    out = RejectionSampler()(logits, metadata_for([params] * 3), [[0, 1]], want_probs=True)
    assert out.token_ids == [[0, 0]]  # draft 0 accepted, draft 1 rejected -> argmax 0
    assert [ids[0] for ids in out.logprob_token_ids] == [0, 0]
    assert out.ranks == [1, 1]
    assert out.probs == pytest.approx([0.5, 0.5])
