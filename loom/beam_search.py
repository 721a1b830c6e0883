"""Beam search over the engine, as vLLM's ``LLM.beam_search`` runs it: every step, each
live beam of each prompt asks the engine for one token and its top ``2 * beam_width``
logprobs (the prefix cache makes each ask a one-token step), the candidates are scored by
their cumulative logprob, and the best ``beam_width`` live on; a beam that ends with an
eos token (unless ``ignore_eos``) is complete. At the end, complete and live beams are
ranked by ``cum_logprob / len ** length_penalty`` (transformers' ``BeamSearchScorer``
rule) and the best ``beam_width`` returned.

    beams [a, b], width 2: candidates a+x, a+y, b+x, b+z ... -> the two best sums live on
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from loom.sampling_params import SamplingParams


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's: ``beam_width`` beams, up to ``max_tokens`` each; ``length_penalty`` the
    exponent of the length a beam's cumulative logprob is divided by when ranked."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")


@dataclass
class BeamSearchSequence:
    tokens: list[int]  # the prompt's, then the generated ones
    cum_logprob: float = 0.0
    num_generated: int = 0
    text: str | None = None
    finished: bool = False


@dataclass
class BeamSearchOutput:
    sequences: list[BeamSearchSequence] = field(default_factory=list)  # best first


# (token lists, SamplingParams) -> per list: [(token id, logprob), ...] best first
StepFn = Callable[[list[list[int]], SamplingParams], list[list[tuple[int, float]]]]


class BeamSearch:
    """The search's state, driven by a caller that runs the engine: ``asks()`` gives the
    token lists to step (every live beam of every prompt), ``advance`` takes each one's
    top candidates; ``done`` says when to stop, ``outputs()`` ranks the beams. The offline
    ``beam_search`` and the server drive it alike."""

    def __init__(self, prompts: Sequence[list[int]], params: BeamSearchParams,
                 eos_token_ids: frozenset[int]) -> None:
        self.params, self.eos_token_ids = params, eos_token_ids
        self.ask = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2 * params.beam_width,
                                  ignore_eos=True)
        self.live = [[BeamSearchSequence(list(prompt))] for prompt in prompts]
        self.complete: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.steps = 0

    @property
    def done(self) -> bool:
        return self.steps >= self.params.max_tokens or not any(self.live)

    def asks(self) -> list[list[int]]:
        return [beam.tokens for beams in self.live for beam in beams]

    def advance(self, answers: list[list[tuple[int, float]]]) -> None:
        """``answers``: for each of ``asks()``, in order, its candidates (token, logprob)."""
        width, answers = self.params.beam_width, iter(answers)
        for index, beams in enumerate(self.live):
            candidates = [
                BeamSearchSequence(beam.tokens + [token_id], beam.cum_logprob + logprob,
                                   beam.num_generated + 1)
                for beam in beams for token_id, logprob in next(answers)]
            candidates.sort(key=lambda beam: beam.cum_logprob, reverse=True)
            self.live[index] = []
            for beam in candidates[:width]:
                if not self.params.ignore_eos and beam.tokens[-1] in self.eos_token_ids:
                    beam.finished = True
                    self.complete[index].append(beam)
                else:
                    self.live[index].append(beam)
        self.steps += 1

    def outputs(self) -> list[BeamSearchOutput]:
        penalty = self.params.length_penalty
        return [BeamSearchOutput(sorted(
                    complete + beams, reverse=True,
                    key=lambda beam: beam.cum_logprob / max(beam.num_generated, 1) ** penalty
                )[:self.params.beam_width])
                for beams, complete in zip(self.live, self.complete)]


def beam_search(prompts: Sequence[list[int]], params: BeamSearchParams, step: StepFn,
                eos_token_ids: frozenset[int]) -> list[BeamSearchOutput]:
    """Beam search from each prompt's token ids; ``step`` runs one token of each beam."""
    search = BeamSearch(prompts, params, eos_token_ids)
    while not search.done:
        search.advance(step(search.asks(), search.ask))
    return search.outputs()
