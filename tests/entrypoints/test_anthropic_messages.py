"""Anthropic's Messages API through the official anthropic SDK pointed at ``loom serve``:
greedy text equal to the chat route's for the same conversation, whole and streamed;
tool_use out (tool_choice any) and tool_result back in; count_tokens as the template
renders; bad input answered in Anthropic's error shape; the API key as x-api-key."""

from __future__ import annotations

import anthropic
import pytest

KEY = "sk-messages"
GREEDY = {"temperature": 0}  # the SDK's own arguments no longer carry sampling settings
MESSAGES = [{"role": "user", "content": "Say something."}]
TOOL = {"name": "get_weather", "description": "the weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                         "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--enable-auto-tool-choice",
                        "--tool-call-parser", "hermes",
                        "--structured-outputs-disable-any-whitespace", "--served-model-name", "tiny",
                        api_key=KEY)
    yield server
    server.kill()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def chat_text(server, messages, max_tokens=12, **extra) -> dict:
    response = server.openai().chat.completions.create(
        model="tiny", messages=messages, max_tokens=max_tokens, temperature=0, **extra)
    return response


def test_text_whole_and_streamed_equals_the_chat_route(server, client):
    want = chat_text(server, [{"role": "system", "content": "Be brief."}, *MESSAGES])
    message = client.messages.create(model="tiny", system="Be brief.", messages=MESSAGES,
                                     max_tokens=12, extra_body=GREEDY)
    assert message.role == "assistant" and message.type == "message"
    assert message.content[0].type == "text"
    assert message.content[0].text == want.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[
        want.choices[0].finish_reason]
    assert message.usage.input_tokens == want.usage.prompt_tokens
    assert message.usage.output_tokens == want.usage.completion_tokens
    with client.messages.stream(model="tiny", system=[{"type": "text", "text": "Be brief."}],
                                messages=MESSAGES, max_tokens=12, extra_body=GREEDY) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == message.content[0].text == final.content[0].text
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_tool_use_out_and_tool_result_in(client):
    message = client.messages.create(model="tiny", messages=MESSAGES, max_tokens=64,
                                     extra_body=GREEDY, tools=[TOOL],
                                     tool_choice={"type": "any"})
    use = next(block for block in message.content if block.type == "tool_use")
    assert message.stop_reason == "tool_use" and use.name == "get_weather"
    assert use.input in ({"city": "Paris"}, {"city": "Oslo"})
    with client.messages.stream(model="tiny", messages=MESSAGES, max_tokens=64,
                                extra_body=GREEDY, tools=[TOOL],
                                tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    streamed_use = next(block for block in final.content if block.type == "tool_use")
    assert streamed_use.input == use.input and final.stop_reason == "tool_use"
    answer = client.messages.create(model="tiny", max_tokens=4, extra_body=GREEDY, tools=[TOOL],
                                    messages=[*MESSAGES,
                                              {"role": "assistant", "content": message.content},
                                              {"role": "user", "content": [{
                                                  "type": "tool_result",
                                                  "tool_use_id": use.id, "content": "Sunny"}]}])
    assert answer.content and answer.usage.input_tokens > message.usage.input_tokens


def test_count_tokens_is_the_rendered_prompt(server, client):
    counted = client.messages.count_tokens(model="tiny", system="Be brief.", messages=MESSAGES)
    want = chat_text(server, [{"role": "system", "content": "Be brief."}, *MESSAGES], 1)
    assert counted.input_tokens == want.usage.prompt_tokens


def test_bad_input_in_anthropic_s_error_shape(server, client):
    with pytest.raises(anthropic.BadRequestError) as error:
        client.messages.create(model="tiny", messages=[], max_tokens=4)
    assert "messages" in str(error.value)
    with server.http() as http:
        for body in ({"messages": MESSAGES}, {"messages": MESSAGES, "max_tokens": 0},
                     {"messages": [{"role": "robot", "content": "x"}], "max_tokens": 4}):
            response = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
            assert response.status_code == 400, response.text
            shape = response.json()
            assert shape["type"] == "error" and shape["error"]["type"] == \
                "invalid_request_error" and shape["error"]["message"]
        response = http.post("/v1/messages", content=b"{not json",
                             headers={"x-api-key": KEY, "content-type": "application/json"})
        assert response.status_code == 400 and response.json()["type"] == "error"
        for response in (http.get("/v1/messages", headers={"x-api-key": KEY}),  # 405
                         http.post("/v1/messages", json={"messages": MESSAGES},
                                   headers={"x-api-key": "wrong", "authorization": ""})):
            assert response.status_code in (401, 405), response.text
            assert response.json()["type"] == "error", response.text
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", messages=MESSAGES, max_tokens=4)
