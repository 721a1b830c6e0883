import math

import pytest
import torch

from loom.kernels import native_ops
from loom.model.layers.sampler import (
    LOGPROB_FLOOR,
    Sampler,
    SamplingMetadata,
    apply_penalties,
    greedy_argmax,
    two_level_argmax,
)
from loom.sampling_params import SamplingParams

VOCAB = 32


def build(params, *, prompts=None, outputs=None, stop_ids=None, generators=None, vocab=VOCAB):
    num_reqs = len(params)
    return SamplingMetadata.build(
        params,
        prompts if prompts is not None else [[] for _ in range(num_reqs)],
        outputs if outputs is not None else [[] for _ in range(num_reqs)],
        stop_ids if stop_ids is not None else [[] for _ in range(num_reqs)],
        generators or {},
        vocab,
        "cpu",
    )


def sample(logits, params, **kwargs):
    return Sampler()(logits, build(params, vocab=logits.shape[-1], **kwargs))


def chi2_sf(statistic: float, dof: int) -> float:
    """Survival function of the chi-square distribution (closed forms for integer dof)."""
    half = statistic / 2.0
    if dof % 2 == 0:
        return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(dof // 2))
    total, term = 0.0, math.sqrt(statistic)  # x^(1/2) / 1
    for i in range(1, (dof - 1) // 2 + 1):
        total += term
        term *= statistic / (2 * i + 1)
    return math.erfc(math.sqrt(half)) + math.sqrt(2 / math.pi) * math.exp(-half) * total


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    statistic = ((counts.double() - expected) ** 2 / expected).sum().item()
    return chi2_sf(statistic, counts.numel() - 1)


def test_chi2_sf_matches_tables():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(9.488, 4) == pytest.approx(0.05, abs=1e-4)
    assert chi2_sf(24.322, 7) == pytest.approx(1e-3, rel=1e-3)
    assert chi2_sf(14.067, 7) == pytest.approx(0.05, abs=1e-4)


# --- greedy -----------------------------------------------------------------------------


def test_greedy_is_argmax_and_does_not_touch_logits():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = sample(logits, [SamplingParams(temperature=0.0)] * 6)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None and out.logprob_token_ids is None
    assert out.sampled_token_ranks is None
    assert torch.equal(logits, before)


@pytest.mark.parametrize("width", [1000, 1024, 49152, 50000])
def test_greedy_argmax_equals_torch_argmax(width):
    """The two-level argmax gives torch.argmax's index: the first largest on ties (within
    a chunk, across chunks, across rows), -inf rows and masked vocabularies, the first
    NaN, widths that are and are not whole chunks, a column slice of wider logits."""
    gen = torch.Generator().manual_seed(width)
    logits = torch.randn(12, width, generator=gen)
    logits[1, [7, 300, width - 1]] = 50.0  # ties in different chunks
    logits[2, [256, 257]] = 50.0  # a tie inside one chunk
    logits[3] = float("-inf")  # nothing left: index 0
    logits[4, :] = float("-inf")
    logits[4, width - 1] = -1e30  # the only finite value is the last
    logits[5, [5, width // 2]] = float("nan")
    logits[6, width // 2] = float("nan")
    logits[6, 3] = 100.0
    logits[7] = 1.0  # all equal
    logits[8, :width - 1] = float("-inf")  # only the padded tail chunk holds a value
    logits[9] = logits[9].round()  # many ties
    wide = torch.cat([logits, torch.randn(12, 77, generator=gen)], dim=1)[:, :width]
    ops = native_ops()
    paths = [greedy_argmax, two_level_argmax]
    if ops is not None:  # the kernel on each path this build has
        for isa in ops.isas():
            paths.append(lambda x, isa=isa: (ops.set_isa(isa), ops.argmax_rows(x))[1])
    previous = ops.isa() if ops is not None else None
    try:
        for case in (logits, wide, logits[:1], logits[10:], logits[:, :40]):
            for path in paths:
                assert torch.equal(path(case), case.argmax(dim=-1))
    finally:
        if ops is not None:
            ops.set_isa(previous)


def test_temperature_zero_tiny_and_top_k_one_equal_greedy_in_mixed_batch():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.5, top_k=1),
        SamplingParams(temperature=1e-6),
        SamplingParams(temperature=0.7, top_p=0.5),
    ]
    before = logits.clone()
    for _ in range(20):
        out = sample(logits, params).sampled_token_ids
        for row in (0, 2, 3):
            assert out[row] == logits[row].argmax()
    assert torch.equal(logits, before)


# --- logits processing ------------------------------------------------------------------


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    eos, stop = 3, 7
    logits = torch.zeros(2, VOCAB)
    logits[:, eos] = 10.0
    logits[:, stop] = 9.0
    logits[:, 11] = 8.0
    params = [SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[stop])] * 2
    stop_ids = [{eos, stop}, {eos, stop}]
    out = sample(logits, params, outputs=[[1], [1, 2, 5]], stop_ids=stop_ids)
    assert out.sampled_token_ids.tolist() == [11, eos]  # row 1 already has 3 tokens


def test_logit_bias():
    logits = torch.zeros(2, VOCAB)
    logits[:, 4] = 5.0
    params = [SamplingParams(temperature=0.0, logit_bias={9: 6.0}),
              SamplingParams(temperature=0.0, logit_bias={4: -100.0, 20: 1.0})]
    assert sample(logits, params).sampled_token_ids.tolist() == [9, 20]


def test_logit_bias_outside_vocab_is_rejected():
    with pytest.raises(ValueError, match="logit_bias names token 99"):
        build([SamplingParams(logit_bias={99: 1.0})])


def test_penalties_match_hand_computed_reference():
    vocab = 6
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
                           [1.0, 1.0, -1.0, -1.0, 0.0, 4.0],
                           [0.3, 0.2, 0.1, 0.0, -0.1, -0.2]])
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(repetition_penalty=1.5),
              SamplingParams()]
    prompts = [[0, 1], [2, 2, 5], [0, 1, 2]]
    outputs = [[3, 3, 1], [], [4, 4]]
    metadata = build(params, prompts=prompts, outputs=outputs, vocab=vocab)

    expected = logits.clone()
    for row, p in enumerate(params):
        seen = set(prompts[row]) | set(outputs[row])
        for token in range(vocab):
            value = expected[row, token].item()
            if token in seen:
                value = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
            count = outputs[row].count(token)
            value -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            expected[row, token] = value
    # row 0 by hand: token 3 (3.0, output twice) -> 3.0 / 2 - 0.5 * 2 - 0.25 = 0.25
    assert expected[0, 3].item() == pytest.approx(0.25)
    assert expected[1, 2].item() == pytest.approx(-1.5)  # prompt-only, negative: * 1.5

    actual = apply_penalties(logits.clone(), metadata)
    torch.testing.assert_close(actual, expected)


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0)]
    assert sample(logits, params, outputs=[[0]]).sampled_token_ids.tolist() == [1]
    assert sample(logits, params, outputs=[[1]]).sampled_token_ids.tolist() == [0]


# --- seeded sampling --------------------------------------------------------------------


def test_seeded_request_is_independent_of_batch_composition():
    steps = 50
    logits_gen = torch.Generator().manual_seed(123)
    step_logits = [torch.randn(VOCAB, generator=logits_gen) * 2 for _ in range(steps)]
    target = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, seed=42)
    sampler = Sampler()

    def run(row: int, num_reqs: int) -> list[int]:
        generators = {row: torch.Generator().manual_seed(42)}
        if num_reqs > 1:  # another seeded request in the batch, at a different row
            generators[(row + 1) % num_reqs] = torch.Generator().manual_seed(7)
        params = [SamplingParams(temperature=1.3, min_p=0.05)] * num_reqs
        params[row] = target
        tokens = []
        for step in range(steps):
            logits = torch.randn(num_reqs, VOCAB)
            logits[row] = step_logits[step]
            metadata = build(params, generators=generators)
            tokens.append(sampler(logits, metadata).sampled_token_ids[row].item())
        return tokens

    alone = run(0, 1)
    assert len(set(alone)) > 1  # actually random, not a degenerate argmax
    assert run(3, 5) == alone
    torch.manual_seed(999)  # a different global RNG state must not matter either
    assert run(1, 5) == alone


# --- distributions ----------------------------------------------------------------------

NUM_SAMPLES = 20_000
EIGHT_LOGITS = torch.tensor([1.2, 0.3, -0.5, 2.0, 0.0, -1.0, 0.8, 1.5])


def sample_counts(params: SamplingParams, logits: torch.Tensor = EIGHT_LOGITS) -> torch.Tensor:
    torch.manual_seed(0)
    batch = logits.expand(NUM_SAMPLES, -1).contiguous()
    tokens = sample(batch, [params] * NUM_SAMPLES).sampled_token_ids
    return torch.bincount(tokens, minlength=logits.numel())


def test_sampling_follows_softmax():
    counts = sample_counts(SamplingParams(temperature=1.0))
    assert chi2_pvalue(counts, torch.softmax(EIGHT_LOGITS, -1)) > 1e-3


def test_sampling_follows_softmax_with_temperature():
    counts = sample_counts(SamplingParams(temperature=0.6))
    assert chi2_pvalue(counts, torch.softmax(EIGHT_LOGITS / 0.6, -1)) > 1e-3


def test_seeded_generator_sampling_follows_softmax():
    sampler = Sampler()
    metadata = build([SamplingParams(temperature=1.0, seed=5)],
                     generators={0: torch.Generator().manual_seed(5)}, vocab=8)
    logits = EIGHT_LOGITS.unsqueeze(0)
    tokens = [sampler(logits, metadata).sampled_token_ids.item() for _ in range(4000)]
    counts = torch.bincount(torch.tensor(tokens), minlength=8)
    assert chi2_pvalue(counts, torch.softmax(EIGHT_LOGITS, -1)) > 1e-3


def assert_samples_renormalised(counts: torch.Tensor, kept: list[int], scaled: torch.Tensor):
    excluded = [t for t in range(counts.numel()) if t not in kept]
    assert counts[excluded].sum().item() == 0, f"sampled excluded tokens: {counts.tolist()}"
    assert (counts[kept] > 0).all()
    if len(kept) > 1:
        probs = torch.softmax(scaled[kept], -1)
        assert chi2_pvalue(counts[kept], probs) > 1e-3


# softmax(EIGHT_LOGITS) sorted: 3 (.328), 7 (.199), 0 (.148), 6 (.099), 1 (.060), 4 (.044),
# 2 (.027), 5 (.016)
@pytest.mark.parametrize("params, kept", [
    (SamplingParams(top_k=3), [3, 7, 0]),
    (SamplingParams(top_k=100), list(range(8))),  # larger than the vocabulary: no-op
    (SamplingParams(top_k=-1), list(range(8))),
    (SamplingParams(top_p=0.6), [3, 7, 0]),  # .328 + .199 < .6 <= + .148
    (SamplingParams(top_p=0.3), [3]),
    (SamplingParams(min_p=0.25), [3, 7, 0, 6]),  # >= .25 * .328 = .082
    (SamplingParams(top_k=4, top_p=0.7), [3, 7, 0]),  # renormalised over 4: .42, .25, .19
    (SamplingParams(top_k=5, min_p=0.4), [3, 7, 0]),
])
def test_filters_exclude_tokens_and_renormalise(params, kept):
    counts = sample_counts(params)
    assert_samples_renormalised(counts, kept, EIGHT_LOGITS)


def test_filters_apply_after_temperature():
    params = SamplingParams(temperature=0.5, min_p=0.15)
    scaled = EIGHT_LOGITS / 0.5
    probs = torch.softmax(scaled, -1)
    kept = [t for t in range(8) if probs[t] >= 0.15 * probs.max()]
    assert kept == [0, 3, 7]  # at temperature 1 min_p=0.15 would also keep 6 and 1
    assert_samples_renormalised(sample_counts(params), kept, scaled)


def test_mixed_filters_per_row():
    logits = EIGHT_LOGITS.expand(4, -1).contiguous()
    params = [SamplingParams(top_k=1, temperature=1.0), SamplingParams(top_k=2),
              SamplingParams(top_p=0.3), SamplingParams()]
    seen = [set() for _ in params]
    torch.manual_seed(0)
    for _ in range(300):
        for row, token in enumerate(sample(logits, params).sampled_token_ids.tolist()):
            seen[row].add(token)
    assert seen[0] == {3} and seen[1] == {3, 7} and seen[2] == {3}
    assert seen[3] == set(range(8))


# --- logprobs ---------------------------------------------------------------------------


def test_logprobs_shapes_values_and_ranks():
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    logits[2, 10:] = float("-inf")  # e.g. a padded vocabulary
    params = [SamplingParams(temperature=0.0, logprobs=5), SamplingParams(logprobs=2),
              SamplingParams(temperature=1.0, logprobs=0), SamplingParams(temperature=2.0)]
    out = sample(logits, params)
    expected = torch.log_softmax(logits, -1)
    sampled = out.sampled_token_ids

    assert out.logprob_token_ids.shape == (4, 6) and out.logprobs.shape == (4, 6)
    assert out.logprobs.dtype == torch.float32 and torch.isfinite(out.logprobs).all()
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], expected.gather(1, sampled[:, None])[:, 0])
    top = expected.topk(5, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values.clamp(min=LOGPROB_FLOOR))
    assert (out.logprobs[2, 1:] > LOGPROB_FLOOR).all()

    assert out.sampled_token_ranks[0] == 1  # greedy
    for row in range(4):
        rank = (expected[row] >= expected[row, sampled[row]]).sum()
        assert out.sampled_token_ranks[row] == rank


def test_logprobs_are_of_raw_logits_and_finite_when_masked():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = float("-inf")
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 50.0},
                             repetition_penalty=1.3)]
    out = sample(logits, params, prompts=[[1, 2]])
    assert out.sampled_token_ids.item() == 5
    assert out.logprobs[0, 0].item() == pytest.approx(-math.log(VOCAB - 1))  # bias not seen
    assert out.sampled_token_ranks.item() == VOCAB - 1  # tied with every finite token

    out = sample(logits, [SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: 5.0})])
    assert out.sampled_token_ids.item() == 1  # -inf + 5 is still -inf
    assert out.logprob_token_ids.shape == (1, 1)

    biased = [SamplingParams(temperature=0.0, logprobs=0, logit_bias={0: 5.0}, min_tokens=1)]
    logits = torch.full((1, VOCAB), -1e30)
    logits[0, 0] = float("-inf")
    logits[0, 1] = 0.0
    out = sample(logits, biased, stop_ids=[[1]])
    assert torch.isfinite(out.logprobs).all()


def test_metadata_skip_flags():
    m = build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.1)] * 2)
    assert m.all_greedy and not m.all_random
    assert m.no_top_k and m.no_top_p and m.no_min_p and m.no_penalties
    assert not m.needs_logits_processing
    assert m.max_num_logprobs is None
    m = build([SamplingParams(top_k=0), SamplingParams(top_k=4, logprobs=3),
               SamplingParams(logprobs=7, presence_penalty=0.5)])
    assert m.all_random and not m.no_top_k and m.no_top_p and m.no_min_p
    assert m.top_k.tolist() == [VOCAB, 4, VOCAB]
    assert not m.no_penalties and m.no_repetition_penalty
    assert m.prompt_token_ids_padded is None
    assert m.max_num_logprobs == 7
    seeded = build([SamplingParams(temperature=0.0, seed=1), SamplingParams(seed=2)],
                   generators={0: torch.Generator(), 1: torch.Generator()})
    assert list(seeded.generators) == [1]  # greedy rows never advance their generator


# --- top_k / top_p over a real-sized vocabulary -----------------------------------------


def reference_top_k_top_p(logits, top_k, top_p):
    """The definition, by one full ascending sort (what the sampler avoids doing)."""
    sorted_logits, sorted_ids = logits.sort(dim=-1)
    vocab_size = logits.shape[-1]
    kth_largest = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
    sorted_logits.masked_fill_(sorted_logits < kth_largest, float("-inf"))
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum_(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits.masked_fill_(drop, float("-inf"))
    return logits.clone().scatter_(1, sorted_ids, sorted_logits)


def apply_top_k_top_p(logits, top_k, top_p):
    """The logits with -inf on every token top_k/top_p drop, from the sampler's candidates."""
    from loom.model.layers.sampler import top_k_top_p_candidates

    out = torch.full_like(logits, float("-inf"))
    for rows, values, ids in top_k_top_p_candidates(logits, top_k, top_p):
        out[rows] = out[rows].scatter_(1, ids, values)
    return out


def test_candidate_filtering_equals_full_sort_reference():
    """Rows that settle among 256 candidates, among 4,096, and only with all V; ties at
    the k-th largest; -inf entries; limited and unlimited rows in one batch."""
    vocab = 10_000
    torch.manual_seed(0)
    base = torch.randn(vocab, dtype=torch.float64)
    cases = [  # (logits row, top_k, top_p)
        (base * 8, vocab, 0.9),          # peaked: settles at 256
        (base * 1.5, vocab, 0.9),        # needs 4,096
        (base * 0.1, vocab, 0.999),      # nearly flat: full sort
        (base * 3, 300, 1.0),            # k above 256
        (base * 3, 5_000, 0.95),         # k above 4,096
        (base * 3, 50, 0.8),             # both, settles at 256
        (torch.where(base > 0, base, -math.inf) * 2, vocab, 0.99),  # -inf half
        (torch.cat([torch.full((10,), 5.0), base[10:]]), 4, 1.0),  # ties at the k-th largest
        (torch.cat([torch.full((300,), 5.0), base[300:]]), 100, 1.0),  # ties past 256
        (base, vocab, 1.0),              # no filtering in a filtered batch
    ]
    logits = torch.stack([row for row, _, _ in cases]).float()
    top_k = torch.tensor([k for _, k, _ in cases])
    top_p = torch.tensor([p for _, _, p in cases], dtype=torch.float32)
    got = apply_top_k_top_p(logits, top_k, top_p)
    expected = reference_top_k_top_p(logits, top_k, top_p)
    kept, kept_expected = got > float("-inf"), expected > float("-inf")
    for row in range(len(cases)):
        assert torch.equal(kept[row], kept_expected[row]), f"case {row}"
    assert torch.equal(got[kept], logits[kept])  # kept logits are untouched
    # the same cases through the top_k-only and top_p-only paths
    got = apply_top_k_top_p(logits, top_k, None)
    assert torch.equal(got > float("-inf"),
                       reference_top_k_top_p(logits, top_k, torch.ones(len(cases))) > float("-inf"))
    got = apply_top_k_top_p(logits, None, top_p)
    assert torch.equal(got > float("-inf"), reference_top_k_top_p(
        logits, torch.full((len(cases),), vocab), top_p) > float("-inf"))


def test_sampling_with_top_p_follows_filtered_softmax_on_a_large_vocab():
    vocab = 5_000
    torch.manual_seed(1)
    logits = torch.randn(1, vocab) * 4
    params = [SamplingParams(top_p=0.5)]
    counts = torch.zeros(vocab)
    for _ in range(40):
        tokens = sample(logits.expand(250, -1).contiguous(), params * 250).sampled_token_ids
        counts += torch.bincount(tokens, minlength=vocab)
    probs = torch.softmax(reference_top_k_top_p(logits, torch.tensor([vocab]),
                                                torch.tensor([0.5]))[0], -1)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    assert chi2_pvalue(counts[kept], probs[kept]) > 1e-3


@pytest.mark.parametrize("width", [7, 256, 1000, 49152])
def test_inverse_cdf_equals_one_running_sum(width):
    from loom.model.layers.sampler import inverse_cdf

    torch.manual_seed(width)
    probs = torch.softmax(torch.randn(64, width) * 3, dim=-1)
    probs[:, ::3] = 0.0  # zero-probability entries are never picked
    uniform = torch.rand(64, dtype=torch.float64)
    cdf = probs.double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (uniform * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    got = inverse_cdf(probs, uniform)
    assert torch.equal(got, expected)
    assert not torch.any(got % 3 == 0)


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs",
                                  "processed_logits"])
def test_logprobs_modes(mode):
    """--logprobs-mode: raw values are the model's; processed ones what each row's token
    is drawn from: the greedy row's biased logits, the sampled row's logits / temperature
    with everything outside its top-k at -inf (reported as the floor)."""
    torch.manual_seed(0)
    logits = torch.randn(2, VOCAB) * 3
    params = [SamplingParams(temperature=0.0, logprobs=3, logit_bias={5: 50.0}),
              SamplingParams(temperature=0.5, top_k=2, logprobs=3, seed=1)]
    out = Sampler(mode)(logits.clone(), build(params, generators={
        1: torch.Generator().manual_seed(1)}))
    biased = logits.clone()
    biased[0, 5] += 50.0
    processed = torch.stack([biased[0], logits[1] / 0.5])
    kept = logits[1].topk(2).indices
    processed[1, [t for t in range(VOCAB) if t not in kept.tolist()]] = float("-inf")
    expected = {"raw_logprobs": torch.log_softmax(logits, dim=-1), "raw_logits": logits,
                "processed_logits": processed,
                "processed_logprobs": torch.log_softmax(processed, dim=-1)}[mode]
    expected = expected.clamp(min=LOGPROB_FLOOR)
    assert out.sampled_token_ids[0] == 5 and out.sampled_token_ids[1] in kept
    for row in range(2):
        ids = out.logprob_token_ids[row]
        torch.testing.assert_close(out.logprobs[row], expected[row, ids])
        assert ids[1:].tolist() == expected[row].topk(3).indices.tolist()
