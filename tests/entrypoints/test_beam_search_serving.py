"""use_beam_search over the server (vLLM's): n beams of each prompt, best first, the
same as LLM.beam_search offline on the same model (which equals transformers',
tests/e2e/test_decoding_controls.py); streaming it, or n beams needing more than
--max-logprobs logprobs a step, is a 400 naming the field."""

from __future__ import annotations

from loom import LLM
from loom.beam_search import BeamSearchParams

PROMPTS = [[5, 9, 40, 77, 120, 3], [200, 17, 17, 64]]


def test_beam_search_over_the_server_equals_offline(start_server, tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=512)
    try:
        offline = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS],
                                  BeamSearchParams(beam_width=3, max_tokens=6,
                                                   ignore_eos=True))
    finally:
        llm.shutdown()
    server = start_server()
    with server.http() as client:
        response = client.post("/v1/completions", json={
            "prompt": PROMPTS, "n": 3, "max_tokens": 6, "use_beam_search": True,
            "ignore_eos": True, "temperature": 0})
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert [choice["text"] for choice in choices] == \
            [beam.text for result in offline for beam in result.sequences]
        assert [choice["index"] for choice in choices] == list(range(6))
        for body, param in (({"stream": True}, "stream"), ({"n": 11}, "n")):
            response = client.post("/v1/completions", json={
                "prompt": "hi", "n": 3, "max_tokens": 4, "use_beam_search": True, **body})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
