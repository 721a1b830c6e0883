"""How `loom bench serve` reads a stream: which chunks count, where token counts come from."""

from __future__ import annotations

import asyncio
import json

import httpx

from loom.bench.datasets import SampleRequest
from loom.bench.serve import OpenAIStreamClient


def sse(*events) -> bytes:
    lines = [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
    return "".join(lines).encode()


def run(body: bytes, chat: bool = False, status: int = 200, tokenizer=None):
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = json.loads(request.content)
        return httpx.Response(status, content=body)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            endpoint = "/v1/chat/completions" if chat else "/v1/completions"
            sender = OpenAIStreamClient(client, "http://x" + endpoint, "m", endpoint, 0.0,
                                        True, tokenizer)
            return await sender.send(SampleRequest("hello", 5, 3))

    return asyncio.run(go()), seen["body"]


def text_chunk(text, finish=None):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}


def test_completion_stream_with_usage_and_a_closing_empty_chunk():
    # llama-server: one chunk per token, then an empty-text chunk with finish_reason and usage.
    body = sse(text_chunk("a"), text_chunk("b"), text_chunk("c"),
               {**text_chunk("", "length"),
                "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
    result, request = run(body)
    assert result.success and result.generated_text == "abc"
    assert result.output_len == 3 and result.prompt_len == 7
    assert len(result.itl) == 2  # the closing empty chunk is no token gap
    assert result.latency >= result.ttft > 0
    assert request["ignore_eos"] is True and request["max_tokens"] == 3
    assert request["stream"] and request["stream_options"] == {"include_usage": True}
    assert request["prompt"] == "hello"


def test_chat_stream_counts_the_role_chunk_as_first_and_falls_back_to_chunk_count():
    body = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
               {"choices": [{"index": 0, "delta": {"content": "Hi"}}]},
               {"choices": [{"index": 0, "delta": {"content": " there"}}]})
    result, request = run(body, chat=True)
    assert request["messages"] == [{"role": "user", "content": "hello"}]
    assert result.success and result.generated_text == "Hi there"
    assert len(result.itl) == 2
    assert result.output_len == 2  # no usage, no tokenizer: chunks with text


def test_without_usage_the_tokenizer_counts_output_tokens():
    class Words:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    result, _ = run(sse(text_chunk("one two"), text_chunk(" three")), tokenizer=Words())
    assert result.output_len == 3


def test_http_errors_and_empty_streams_fail_the_request():
    result, _ = run(b'{"error": "busy"}', status=503)
    assert not result.success and result.error.startswith("HTTP 503")
    result, _ = run(sse({"usage": {"completion_tokens": 0}}))
    assert not result.success and "without a chunk" in result.error


def test_an_error_event_in_the_stream_fails_the_request_with_its_message():
    result, _ = run(sse(text_chunk("a"), {"error": {"message": "engine is dead"}}))
    assert not result.success and result.error.endswith("engine is dead")
