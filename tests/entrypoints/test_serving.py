"""The OpenAI API of a real `loom serve` on a tiny random model, through the official
client and raw HTTP."""

from __future__ import annotations

import json
import math
import signal
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import psutil
import pytest
from loom_server import TINY_SERVER_ARGS, LoomServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", MODEL,
                        "--disable-log-requests")
    yield server
    assert server.terminate() == 0, server.output()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def sse_events(response: httpx.Response) -> list:
    """The JSON payloads of an event stream, then the string "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ----------------------------------------------------------------- plain routes

def test_models_version_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with server.http() as http:
        assert http.get("/health").status_code == 200
        assert http.get("/version").json()["version"]
        missing = http.get("/v1/nothing")
        assert missing.status_code == 404
        assert missing.json()["error"]["type"] == "invalid_request_error"


def test_small_responses_do_not_wait_for_delayed_acks(server):
    # Without TCP_NODELAY a response written in two parts waits >= 40 ms for the
    # client's delayed ACK; a loopback round trip is well under a millisecond.
    with server.http() as http:
        http.get("/version")
        times = []
        for _ in range(15):
            started = time.perf_counter()
            http.get("/version")
            times.append(time.perf_counter() - started)
    assert statistics.median(times) < 0.030, times


def test_completion_prompt_forms(client):
    text = client.completions.create(model=MODEL, prompt="hello world", max_tokens=5,
                                     temperature=0, extra_body={"ignore_eos": True})
    assert text.object == "text_completion" and len(text.choices) == 1
    assert text.usage.completion_tokens == 5
    assert text.choices[0].finish_reason == "length"

    ids = client.completions.create(model=MODEL, prompt=[60, 61, 62, 63], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert ids.usage.prompt_tokens == 4 and ids.usage.completion_tokens == 3

    id_batch = client.completions.create(model=MODEL, prompt=[[70, 71, 72], [73]], max_tokens=2,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert id_batch.usage.prompt_tokens == 4 and len(id_batch.choices) == 2

    batch = client.completions.create(model=MODEL, prompt=["hello", "world"], n=2,
                                      max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.usage.completion_tokens == 16
    # greedy: both sequences of one prompt agree
    assert batch.choices[0].text == batch.choices[1].text
    assert batch.choices[2].text == batch.choices[3].text
    # the batch's first prompt alone gives the same text
    alone = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert alone.choices[0].text == batch.choices[0].text


def test_echo(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0,
                                    echo=True, extra_body={"ignore_eos": True})
    assert out.choices[0].text.startswith("hello")


def test_completion_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, prompt="the quick brown fox", max_tokens=24, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                  max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    assert full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"


def test_chat_content_parts_equal_string(client):
    kwargs = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    as_string = client.chat.completions.create(
        messages=[{"role": "user", "content": "hello\nworld"}], **kwargs)
    as_parts = client.chat.completions.create(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"},
                                               {"type": "text", "text": "world"}]}], **kwargs)
    assert as_parts.choices[0].message.content == as_string.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


def test_stream_n_and_include_usage(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count"}], n=3, max_tokens=6,
        temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert all(c.usage is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 18
    texts, finishes = {}, {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert sorted(texts) == [0, 1, 2] and finishes == {0: "length", 1: "length", 2: "length"}


def test_completion_stream_include_usage_raw(server):
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True, "n": 2,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 8
    assert all("usage" in e and e["usage"] is None for e in events[:-2])
    assert {e["choices"][0]["index"] for e in events[:-2]} == {0, 1}


def test_max_tokens_defaults_to_context_limit(client):
    prompt = [65] * 500  # max_model_len is 512: at most 12 tokens left
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=None, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 12 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a " * 240}], temperature=0,
        extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 512


# ----------------------------------------------------------------- sampling parameters

def test_completion_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=5, temperature=0,
                                    logprobs=3, extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.text_offset[0] == 0
    for value, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        assert math.isfinite(value) and value <= 0
        assert 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(value)  # greedy picks the most likely


def test_chat_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert math.isfinite(entry.logprob) and len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())
    streamed = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
    tokens = [e.token for c in streamed for e in (c.choices[0].logprobs.content
                                                  if c.choices and c.choices[0].logprobs else [])]
    assert tokens == [e.token for e in content]


def test_logit_bias_forces_a_token(client):
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, temperature=0,
                                    logprobs=0, logit_bias={"70": 100},
                                    extra_body={"ignore_eos": True})
    tokens = out.choices[0].logprobs.tokens
    assert len(set(tokens)) == 1 and len(tokens) == 4


def test_seed_reproducible(client):
    kwargs = dict(model=MODEL, prompt="once upon", max_tokens=12, temperature=1.0, seed=1234,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_top_k_one_is_greedy(client):
    kwargs = dict(model=MODEL, prompt="once upon", max_tokens=8)
    greedy = client.completions.create(temperature=0, extra_body={"ignore_eos": True}, **kwargs)
    top1 = client.completions.create(temperature=1.0, extra_body={"ignore_eos": True,
                                                                  "top_k": 1}, **kwargs)
    assert top1.choices[0].text == greedy.choices[0].text
    min_p = client.completions.create(temperature=1.0, extra_body={"ignore_eos": True,
                                                                   "min_p": 1.0}, **kwargs)
    assert min_p.choices[0].text == greedy.choices[0].text


def test_penalties_accepted(client):
    out = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=8, temperature=0, presence_penalty=1.5,
        frequency_penalty=1.0, extra_body={"repetition_penalty": 1.3, "ignore_eos": True})
    assert out.usage.completion_tokens == 8


def test_min_tokens_ignore_eos_and_stop_token_ids(client):
    eos = {"2": 100}  # the tiny tokenizer's <|im_end|>; forced, it ends generation at once
    kwargs = dict(model=MODEL, prompt="hello", max_tokens=10, temperature=0, logit_bias=eos)
    assert client.completions.create(**kwargs).usage.completion_tokens == 1
    # six tokens that may not be eos, then eos (which counts, as in vLLM)
    assert client.completions.create(extra_body={"min_tokens": 6}, **kwargs
                                     ).usage.completion_tokens == 7
    assert client.completions.create(extra_body={"ignore_eos": True}, **kwargs
                                     ).usage.completion_tokens == 10
    forced = dict(model=MODEL, prompt="hello", max_tokens=10, temperature=0,
                  logit_bias={"70": 100})
    out = client.completions.create(extra_body={"stop_token_ids": [70]}, **forced)
    choice = out.choices[0]
    assert out.usage.completion_tokens == 1
    assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == 70


def test_stop_string(client):
    kwargs = dict(model=MODEL, prompt="the end of", max_tokens=16, temperature=0,
                  extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0].text
    assert len(full) >= 6
    stop = full[3:5]
    cut = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert cut.finish_reason == "stop" and cut.model_extra["stop_reason"] == stop
    assert cut.text == full[:full.index(stop)]
    streamed = list(client.completions.create(stop=stop, stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_concurrent_requests_match_sequential(client):
    prompts = [f"prompt number {i}" for i in range(8)]

    def run(prompt):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True}
                                         ).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        concurrent = list(pool.map(run, prompts))
    assert concurrent == [run(p) for p in prompts]


# ----------------------------------------------------------------- errors

_LONG = "a" * 600
ERROR_CASES = [
    # (path, raw body or JSON, status, param, code)
    ("/v1/completions", b"{not json", 400, None, None),
    ("/v1/completions", b"[1, 2]", 400, None, None),
    ("/v1/completions", {"max_tokens": 4}, 400, "prompt", None),
    ("/v1/completions", {"prompt": 5}, 400, "prompt", None),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400,
     "stream_options", None),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "n": 129}, 400, "n", None),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ("/v1/completions", {"prompt": "hi", "top_k": -5}, 400, "top_k", None),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, 400, "min_p", None),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty", None),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": -3}, 400, "frequency_penalty",
     None),
    ("/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty",
     None),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop", None),
    ("/v1/completions", {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, 400, "min_tokens",
     None),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 500}}, 400, "logit_bias", None),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [256]}, 400, "stop_token_ids", None),
    ("/v1/completions", {"prompt": [1, 999]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": [[5], [2**70]]}, 400, "prompt", None),
    ("/v1/completions", {"prompt": ""}, 400, "prompt", None),
    ("/v1/completions", {"prompt": []}, 400, "prompt", None),
    ("/v1/completions", {"prompt": _LONG}, 400, "prompt", "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 600}, 400, "prompt",
     "context_length_exceeded"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-9"}, 404, "model", "model_not_found"),
    ("/v1/chat/completions", {"max_tokens": 4}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages",
     None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 21, "logprobs": True}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 2}, 400, "top_logprobs", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": _LONG}]}, 400,
     "messages", "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_completion_tokens": 1000}, 400, "messages",
     "context_length_exceeded"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "temperature": float("nan")}, 400, "temperature", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "model": "nope"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("path,body,status,param,code", ERROR_CASES,
                         ids=[f"{i}-{c[3]}" for i, c in enumerate(ERROR_CASES)])
def test_invalid_requests_are_4xx_naming_the_field(server, path, body, status, param, code):
    with server.http() as http:
        if isinstance(body, bytes):
            response = http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            # json.dumps writes NaN, which the server must refuse
            response = http.post(path, content=json.dumps(body),
                                 headers={"content-type": "application/json"})
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["message"]
        assert error["param"] == param, error
        assert error["code"] == code, error
        assert http.get("/health").status_code == 200


def test_openai_client_sees_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=10_000)
    assert info.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user",
                                                                  "content": "hi"}])


# ----------------------------------------------------------------- load, disconnects, metrics

def test_stream_disconnect_aborts_and_frees_blocks(server):
    body = {"model": MODEL, "prompt": "go on", "max_tokens": 500, "stream": True,
            "ignore_eos": True}
    generated_before = server.metric("vllm:generation_tokens_total")
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        next(response.iter_lines())
    # Closed after the first event (no query in between: the tiny model may finish 500
    # tokens in well under a second, sooner than a busy client reads 3 events):
    # aborted at once, its blocks freed. The in-process route tests prove the abort
    # without a race (test_routes_in_process.py).
    assert server.wait_for_metric("vllm:num_requests_running", 0, timeout=2) == 0
    assert server.wait_for_metric("vllm:kv_cache_usage_perc", 0, timeout=2) == 0
    assert server.metric("vllm:generation_tokens_total") - generated_before < 500


def test_non_stream_disconnect_aborts(server):
    body = json.dumps({"model": MODEL, "prompt": "go on", "max_tokens": 500, "n": 4,
                       "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    # The tiny model can write 4 x 500 tokens between two polls of /metrics, and a loaded
    # host's polls are slow: the engine (core and worker) is frozen while the request goes
    # in, thawed in slices of 20 ms until the four sequences are seen running, and frozen
    # again while the client hangs up, so they cannot finish first.
    engine = psutil.Process(server.proc.pid).children(recursive=True)

    def signal_engine(signum: int) -> None:
        for process in engine:
            process.send_signal(signum)

    for _ in range(3):  # a try whose sequences all finished before they were seen: again
        generated_before = server.metric("vllm:generation_tokens_total")
        signal_engine(signal.SIGSTOP)
        try:
            with socket.create_connection((host, int(port))) as raw:
                raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Type: application/json\r\n"
                            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                deadline = time.monotonic() + 120
                while True:
                    caught = server.metric("vllm:num_requests_running") == 4
                    written = server.metric("vllm:generation_tokens_total") - generated_before
                    if caught or written >= 4 * 500:
                        break
                    assert time.monotonic() < deadline, (
                        f"in 120 s the four sequences were neither seen running nor finished "
                        f"({written:g} tokens written)")
                    signal_engine(signal.SIGCONT)
                    time.sleep(0.02)
                    signal_engine(signal.SIGSTOP)
                    time.sleep(0.1)  # frozen: the step's stats on their way to the API server
        finally:
            signal_engine(signal.SIGCONT)
        if caught:
            break
        assert _wait_for_metric(server, "vllm:num_requests_running", 0) == 0
    assert caught, "the four sequences were never seen running"
    # the client hung up before its answer: all four sequences are aborted at once
    assert _wait_for_metric(server, "vllm:num_requests_running", 0) == 0
    assert _wait_for_metric(server, "vllm:kv_cache_usage_perc", 0) == 0
    assert server.metric("vllm:generation_tokens_total") - generated_before < 4 * 500


def _wait_for_metric(server: LoomServer, name: str, value: float,
                     timeout: float = 120.0) -> float:
    """``name``'s value once it is ``value``; fails saying what it waited for if it is
    not within ``timeout`` seconds."""
    current = server.wait_for_metric(name, value, timeout=timeout)
    assert current == value, f"{name} was still {current:g}, not {value:g}, after {timeout:g} s"
    return current


def test_metrics(server, client):
    client.completions.create(model=MODEL, prompt="metrics please", max_tokens=4,
                              extra_body={"ignore_eos": True})
    with server.http() as http:
        response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket",
                 "vllm:time_per_output_token_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket"):
        assert f"{name}{{" in text, name
    assert server.metric("vllm:prompt_tokens_total") > 0
    assert server.metric("vllm:generation_tokens_total") >= 4
    assert server.metric("vllm:time_to_first_token_seconds_count") > 0
    # the same prompt twice hits the prefix cache
    for _ in range(2):
        client.completions.create(model=MODEL, prompt="x" * 40, max_tokens=1)
    assert server.metric("vllm:prefix_cache_hits_total") > 0
