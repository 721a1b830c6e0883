"""Prefill/decode disaggregation through real ``loom serve`` processes (docs/disaggregation.md):
the client's request goes to the prefill server with ``kv_transfer_params:
{"do_remote_decode": true}``, then, with the prefill server's answer, to the decode
server, which streams the completion; what the client sees equals the decode server
serving the request alone. Failures: a prefill server killed mid-transfer fails only
the request being transferred (an error to its client) while the decode server serves
on and returns to zero blocks in use; blocks nobody pulls are freed on the prefill side
after kv_hold_timeout_s."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
from test_router import RouterProcess

PROMPT = "The quick brown fox jumps over the lazy dog. " * 3
BODY = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
# What else a client may ask of completions, each compared with the decode server alone:
# logprobs (the first token's come from the decode side's own step), n = 2 seeded
# samples, echo with logprobs (the prompt's, computed on the prefill side), a batch.
EXTRA_BODIES = [
    {**BODY, "max_tokens": 5, "logprobs": 3},
    {**BODY, "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 11, "logprobs": 1},
    {**BODY, "max_tokens": 3, "echo": True, "logprobs": 2},
    {**BODY, "prompt": [PROMPT, "Pack my box with five dozen liquor jugs."], "max_tokens": 4},
    {**BODY, "max_tokens": 4, "n": 2, "best_of": 2, "temperature": 0.7, "seed": 3},
]


def assert_same_choices(got: dict, want: dict) -> None:
    """Texts equal; logprobs' tokens and top tokens equal, values within float32 noise
    (the decode side computes the last prompt position alone, the other in a batch)."""
    assert len(got["choices"]) == len(want["choices"])
    for a, b in zip(got["choices"], want["choices"]):
        text = "text" if "text" in b else "message"  # completions or chat
        assert (a["index"], a[text], a["finish_reason"]) == (b["index"], b[text],
                                                            b["finish_reason"])
        if b.get("logprobs") is None:
            assert a.get("logprobs") is None
            continue
        if "tokens" in b["logprobs"]:  # completions
            assert a["logprobs"]["tokens"] == b["logprobs"]["tokens"]
            assert a["logprobs"]["text_offset"] == b["logprobs"]["text_offset"]
            assert _close(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])
            for x, y in zip(a["logprobs"]["top_logprobs"], b["logprobs"]["top_logprobs"]):
                assert (x is None) == (y is None)
                assert x is None or (list(x) == list(y) and _close(list(x.values()),
                                                                   list(y.values())))
        else:  # chat
            for x, y in zip(a["logprobs"]["content"], b["logprobs"]["content"]):
                assert x["token"] == y["token"] and _close([x["logprob"]], [y["logprob"]])
                assert [t["token"] for t in x["top_logprobs"]] == [
                    t["token"] for t in y["top_logprobs"]]
    assert got["usage"] == want["usage"]


def _close(xs: list, ys: list) -> bool:
    return len(xs) == len(ys) and all(
        (x is None and y is None) or abs(x - y) < 1e-4 for x, y in zip(xs, ys))


def through_prefill(prefill, body: dict) -> dict:
    """What the router does first: the prefill server's kv_transfer_params."""
    answer = httpx.post(f"{prefill.base_url}/completions", timeout=60, json={
        **body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}})
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def stream_text(server, body: dict, errors: list[str] | None = None) -> tuple[str, list[str]]:
    """Stream a completion; its text and finish reasons (an error event becomes
    finish reason "error", its message appended to ``errors``)."""
    text, reasons = "", []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={**body, "stream": True}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                reasons.append("error")
                if errors is not None:
                    errors.append(event["error"]["message"])
                continue
            for choice in event["choices"]:
                text += choice["text"]
                if choice["finish_reason"]:
                    reasons.append(choice["finish_reason"])
    return text, reasons


def start_side_by_side(start_server, *servers: tuple[tuple[str, ...], dict | None]) -> list:
    """``start_server(*flags, env=env)`` for each (flags, env), all at once: a start is
    mostly one process importing at a time, and there are two cores."""
    with ThreadPoolExecutor(len(servers)) as pool:
        return list(pool.map(lambda server: start_server(*server[0], env=server[1]), servers))


def test_completions_through_prefill_and_decode_equal_one_server(start_server):
    prefill, decode = start_side_by_side(
        start_server, (("--splitwise-role", "prefill"), None),
        (("--kv-transfer-config", '{"kv_role": "kv_consumer"}'), None))
    alone = httpx.post(f"{decode.base_url}/completions", json=BODY, timeout=60).json()
    # By hand, what the router does:
    params = through_prefill(prefill, BODY)
    assert params["remote_num_tokens"] == alone["usage"]["prompt_tokens"]
    answer = httpx.post(f"{decode.base_url}/completions", timeout=60,
                        json={**BODY, "kv_transfer_params": params}).json()
    assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
    assert answer["usage"] == alone["usage"]
    # Through `loom router --prefill --decode`: the OpenAI API as it is.
    router = RouterProcess(args=("--prefill", prefill.url, "--decode", decode.url))
    try:
        health = router.wait_for_health(lambda body: body["status"] == "ok")
        assert [b["url"] for b in health["prefill"]] == [prefill.url]
        answer = httpx.post(f"{router.url}/v1/completions", json=BODY, timeout=60).json()
        assert answer["choices"][0]["text"] == alone["choices"][0]["text"]
        assert "kv_transfer_params" not in answer
        text, reasons = stream_text(router, BODY)  # chunk by chunk, the first token first
        assert text == alone["choices"][0]["text"] and reasons == ["length"]
        # Chat with the openai client, streamed and not.
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        chat = {"model": model, "max_tokens": 8, "temperature": 0.0,
                "messages": [{"role": "user", "content": "hello there, how are you?"}]}
        alone_chat = decode.openai().chat.completions.create(**chat)
        assert (client.chat.completions.create(**chat).choices[0].message.content
                == alone_chat.choices[0].message.content)
        streamed = "".join(chunk.choices[0].delta.content or ""
                           for chunk in client.chat.completions.create(**chat, stream=True)
                           if chunk.choices)
        assert streamed == alone_chat.choices[0].message.content
        # Everything else a client may ask, equal to the decode server alone.
        for body in EXTRA_BODIES:
            want = httpx.post(f"{decode.base_url}/completions", json=body, timeout=60).json()
            got = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
            assert got.status_code == 200, got.text
            assert_same_choices(got.json(), want)
        chat_body = {**chat, "logprobs": True, "top_logprobs": 2, "n": 2, "seed": 5,
                     "temperature": 0.9}
        want = httpx.post(f"{decode.base_url}/chat/completions", json=chat_body,
                          timeout=60).json()
        got = httpx.post(f"{router.url}/v1/chat/completions", json=chat_body, timeout=60)
        assert_same_choices(got.json(), want)
        # A grammar constrains the decode side's tokens from the first one on.
        chat_body = {**chat, "max_tokens": 12, "response_format": {"type": "json_object"}}
        want = httpx.post(f"{decode.base_url}/chat/completions", json=chat_body,
                          timeout=60).json()
        got = httpx.post(f"{router.url}/v1/chat/completions", json=chat_body, timeout=60)
        assert got.status_code == 200, got.text
        assert_same_choices(got.json(), want)
        assert want["choices"][0]["message"]["content"].startswith("{")
    finally:
        router.close()
    # What cannot work is a 400 naming the field: a prefill server computes the prompt
    # once (the router sends n = 1), a decode server takes only a prefill's answer.
    answer = httpx.post(f"{prefill.base_url}/completions", timeout=60, json={
        **BODY, "n": 2, "kv_transfer_params": {"do_remote_decode": True}})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "n"
    answer = httpx.post(f"{decode.base_url}/completions", timeout=60, json={
        **BODY, "kv_transfer_params": {**params, "remote_num_tokens": 3}})
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "kv_transfer_params"
    assert "computed 3 prompt tokens" in answer.json()["error"]["message"]
    for server in (prefill, decode):
        assert server.wait_for_metric("loom:kv_blocks_in_use", 0) == 0
        assert server.wait_for_metric("loom:engine_requests", 0) == 0


def test_prefill_killed_mid_transfer_fails_only_that_request(start_server):
    stalled, healthy, decode = start_side_by_side(
        start_server, (("--splitwise-role", "prefill"), {"LOOM_TEST_STALL_KV_SEND": "1"}),
        (("--splitwise-role", "prefill"), None), (("--splitwise-role", "decode"), None))
    doomed_params = through_prefill(stalled, BODY)
    result, errors = {}, []

    def doomed():
        result["doomed"] = stream_text(decode, {**BODY, "kv_transfer_params": doomed_params},
                                       errors)

    thread = threading.Thread(target=doomed)
    thread.start()
    # The decode server is pulling: half the blocks are there, the rest never come.
    assert decode.wait_for_metric("vllm:num_requests_waiting", 1) == 1
    time.sleep(0.3)
    stalled.kill()
    thread.join(30)
    assert result["doomed"] == ("", ["error"])
    assert "KV transfer from the prefill instance failed" in errors[0]
    # The decode server serves on, disaggregated and alone.
    text, reasons = stream_text(decode, {**BODY, "kv_transfer_params": through_prefill(
        healthy, BODY)})
    alone = httpx.post(f"{decode.base_url}/completions", json=BODY, timeout=60).json()
    assert text == alone["choices"][0]["text"] and reasons == ["length"]
    assert decode.wait_for_metric("loom:kv_blocks_in_use", 0) == 0
    assert decode.wait_for_metric("loom:engine_requests", 0) == 0
    assert healthy.wait_for_metric("loom:kv_blocks_in_use", 0) == 0


def test_blocks_nobody_pulls_are_freed_after_the_hold_timeout(start_server):
    """A decode instance that died before pulling: the prefill side frees the blocks."""
    prefill = start_server("--splitwise-role", "prefill", "--kv-transfer-config",
                           '{"kv_hold_timeout_s": 1.0}')
    params = through_prefill(prefill, BODY)
    assert prefill.metric("loom:kv_blocks_in_use") == len(params["remote_block_ids"])
    assert prefill.wait_for_metric("loom:kv_blocks_in_use", 0, timeout=5) == 0
    assert "no decode instance took its" in prefill.output()
