"""Decoding controls vLLM users reach for, token-exact against transformers: bad_words
(transformers' NoBadWordsLogitsProcessor on the same token sequences) and
allowed_token_ids (every other token masked), greedy, batched with a plain request."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import NoBadWordsLogitsProcessor

from loom import LLM, SamplingParams
from loom.input_processor import bad_words_token_ids

PROMPTS = [[5, 9, 40, 77, 120, 3], [200, 17, 17, 64]]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def engines(tiny_llama):
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128, seed=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    yield llm, model
    llm.shutdown()


def hf_greedy(model, prompt: list[int], processor) -> list[int]:
    """Argmax over the full sequence each step, after ``processor`` (scores (1, V))."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0, -1:].float()
            ids.append(int(processor(torch.tensor([ids]), logits).argmax()))
    return ids[len(prompt):]


def loom_greedy(llm, params: list[SamplingParams]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def test_bad_words_equal_transformers_no_bad_words_processor(engines):
    llm, model = engines
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    free = loom_greedy(llm, [plain, plain])
    tokenizer = llm.engine.tokenizer
    # a word the model says unconstrained (two tokens that encode back to themselves),
    # and one of the other prompt's tokens alone
    word = next(text for start in range(1, NEW_TOKENS - 1)
                if (text := tokenizer.decode(free[0][start:start + 2])).strip()
                and tokenizer.encode(text.lstrip(), add_special_tokens=False)
                == free[0][start:start + 2])
    words = [word, tokenizer.decode(free[1][3:4])]
    sequences = bad_words_token_ids(words, tokenizer)
    assert any(len(s) > 1 for s in sequences)
    banned = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                            bad_words=words)
    got = loom_greedy(llm, [banned, plain])
    processor = NoBadWordsLogitsProcessor(sequences, eos_token_id=None)
    assert got[0] == hf_greedy(model, PROMPTS[0], processor)
    assert got[0] != free[0] and got[1] == free[1]  # the ban changed it; the other is free
    got = loom_greedy(llm, [plain, banned])
    assert got[1] == hf_greedy(model, PROMPTS[1], processor) and got[0] == free[0]


def test_allowed_token_ids_equal_masking_every_other_token(engines):
    llm, model = engines
    allowed = [7, 30, 31, 99, 150, 201]
    vocab = model.config.vocab_size
    params = [SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)]
    got = loom_greedy(llm, params)
    others = NoBadWordsLogitsProcessor([[t] for t in range(vocab) if t not in allowed],
                                       eos_token_id=None)
    assert set(got[0]) <= set(allowed)
    assert got[0] == hf_greedy(model, PROMPTS[0], others)
    assert got[1] == hf_greedy(model, PROMPTS[1], lambda ids, scores: scores)


def test_priorities_under_the_priority_policy_change_no_tokens(tiny_llama, engines):
    """--scheduling-policy priority with one sequence at a time: each prompt still gets
    exactly its greedy tokens (the order is the scheduler's, tests/core/
    test_scheduler_priority.py); under fcfs a priority is refused, naming the fix."""
    from loom.input_processor import InvalidInputError

    llm, _ = engines
    plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = loom_greedy(llm, [plain, plain])
    with pytest.raises(InvalidInputError, match="--scheduling-policy priority"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], plain, use_tqdm=False, priority=[1])
    ordered = LLM(tiny_llama, dtype="float32", max_model_len=128, max_num_seqs=1,
                  scheduling_policy="priority")
    try:
        out = ordered.generate([{"prompt_token_ids": p} for p in PROMPTS], plain,
                               use_tqdm=False, priority=[5, -1])
    finally:
        ordered.shutdown()
    assert [list(o.outputs[0].token_ids) for o in out] == want


BAN_PROCESSOR = '''
import torch


class BanTokens:
    """Bans the tokens a request lists in extra_args["ban"]."""

    def apply(self, logits, params, output_token_ids):
        for row, p in enumerate(params):
            for token_id in (p.extra_args or {}).get("ban", []):
                logits[row, token_id] = float("-inf")
        return logits
'''


def test_a_custom_logits_processor_loaded_by_name(tiny_llama, engines, tmp_path, monkeypatch):
    """--logits-processors module:Class, constructed at start-up and applied to the batch:
    a row's extra_args reach it; its tokens equal transformers' with the same bans; a
    row without settings is untouched. A name that cannot be found is one line."""
    _, model = engines
    (tmp_path / "loom_test_ban.py").write_text(BAN_PROCESSOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="no module named 'nowhere_at_all'"):
        LLM(tiny_llama, dtype="float32", max_model_len=128,
            logits_processors=("nowhere_at_all:Ban",))
    llm = LLM(tiny_llama, dtype="float32", max_model_len=128,
              logits_processors=("loom_test_ban:BanTokens",))
    try:
        plain = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        free = loom_greedy(llm, [plain, plain])
        banned = free[0][:3]
        got = loom_greedy(llm, [plain.clone(extra_args={"ban": banned}), plain])
    finally:
        llm.shutdown()
    processor = NoBadWordsLogitsProcessor([[t] for t in banned], eos_token_id=None)
    assert got[0] == hf_greedy(model, PROMPTS[0], processor) and got[0] != free[0]
    assert not set(banned) & set(got[0]) and got[1] == free[1]


@pytest.mark.parametrize("width", [2, 3])
def test_beam_search_equals_transformers(engines, width):
    """LLM.beam_search: the best beams, best first, token for token as transformers'
    beam search gives them (no eos, length penalty 1)."""
    from loom.beam_search import BeamSearchParams

    llm, model = engines
    model.generation_config.eos_token_id = None
    out = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                          BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True))
    for prompt, result in zip(PROMPTS, out):
        with torch.inference_mode():
            hf = model.generate(torch.tensor([prompt]), num_beams=width,
                                num_return_sequences=width, max_new_tokens=8,
                                do_sample=False, early_stopping=False, length_penalty=1.0,
                                pad_token_id=0)
        want = [row[len(prompt):].tolist() for row in hf]
        got = [sequence.tokens[len(prompt):] for sequence in result.sequences]
        assert got == want
        assert result.sequences[0].text == llm.get_tokenizer().decode(got[0])
    with pytest.raises(ValueError, match="beam_width must be a positive integer"):
        BeamSearchParams(beam_width=0, max_tokens=4)
