"""ERNIE 4.5 VL's thinking through ``loom serve --reasoning-parser ernie-45-vl`` on the
tiny random ERNIE 4.5 VL, with OpenAI's SDK and an image in the message.

The tiny checkpoint's template writes the generation prompt as the published one does:
``\\nAssistant: <think>`` where ``chat_template_kwargs`` sets ``enable_thinking`` true,
``\\nAssistant: <think>\\n\\n</think>\\n\\n`` where it is false or left out; ``<think>``
and ``</think>`` are tokens of its vocabulary. Its random weights never write
``</think>`` themselves, so a reasoning budget (``thinking_token_budget``, FastDeploy's
``reasoning_max_tokens``) has the engine write it after a few tokens of thinking: the
split the parser makes is of text the engine produced, held to the offline engine's
text for the same prompt and image, cut at its ``</think>``.
"""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from loom_server import TINY_SERVER_ARGS, LoomServer
from PIL import Image
from vlm_checkpoints import ERNIE_IMAGE_ID, ERNIE_THINK_END_ID, ERNIE_THINK_START_ID

from loom import LLM, SamplingParams

QUESTION = "what is in the picture"
MAX_TOKENS = 8
BUDGET = 3  # tokens of thinking before the engine writes </think>
# a seed whose thinking decodes without U+FFFD (the random model writes byte tokens
# that are parts of characters): the reasoning compared shows every token
IMAGE = Image.fromarray(np.random.default_rng(18).integers(0, 255, (56, 84, 3), dtype=np.uint8))


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return f"data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}"


MESSAGES = [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": data_url(IMAGE)}},
    {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from vlm_checkpoints import make_tiny_ernie4_5_vl

    return make_tiny_ernie4_5_vl(tmp_path_factory.mktemp("tiny-ernie4_5_vl"))


@pytest.fixture(scope="module")
def server(model_dir):
    server = LoomServer(model_dir, *TINY_SERVER_ARGS, "--dtype", "float32",
                        "--served-model-name", "tiny-ernie-vl", "--no-enable-warm-up",
                        "--reasoning-parser", "ernie-45-vl")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def offline(model_dir):
    """The offline engine's outputs for the template's text with the image, by
    enable_thinking: what the server's answers are held to."""
    answers = {}
    with LLM(model_dir, dtype="float32", max_model_len=512, enable_warm_up=False) as llm:
        for thinking in (True, False):
            text = llm.get_tokenizer().apply_chat_template(
                [{"role": "user", "content": [{"type": "image"},
                                              {"type": "text", "text": QUESTION}]}],
                tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
            [answers[thinking]] = llm.generate(
                {"prompt": text, "multi_modal_data": {"image": IMAGE}},
                SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                               thinking_token_budget=BUDGET), use_tqdm=False)
    return answers


def tokenize(server, **template_kwargs) -> list[int]:
    body = {"model": "tiny-ernie-vl", "messages": MESSAGES}
    if template_kwargs:
        body["chat_template_kwargs"] = template_kwargs
    response = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()["tokens"]


def chat(server, stream: bool, **template_kwargs) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a greedy chat completion, whole or streamed."""
    extra_body = {"chat_template_kwargs": template_kwargs, "ignore_eos": True,
                  "thinking_token_budget": BUDGET}
    client = server.openai()
    if not stream:
        message = client.chat.completions.create(
            model="tiny-ernie-vl", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
            extra_body=extra_body).choices[0].message
        return message.model_extra.get("reasoning_content"), message.content
    reasoning = content = ""
    for chunk in client.chat.completions.create(
            model="tiny-ernie-vl", messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0,
            stream=True, extra_body=extra_body):
        for choice in chunk.choices:
            reasoning += choice.delta.model_extra.get("reasoning_content") or ""
            content += choice.delta.content or ""
    return reasoning or None, content or None


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_on_splits_the_output_at_think_end(server, offline, model_dir, stream):
    """enable_thinking true: the prompt ends with an open <think>; the engine thinks for
    the budget's tokens, writes </think>, then answers; reasoning_content is the text
    before it and content the text after, as the offline output's text splits."""
    from loom.tokenizer import load_tokenizer

    want = offline[True]
    tokens = tokenize(server, enable_thinking=True)
    assert tokens == want.prompt_token_ids
    assert tokens.count(ERNIE_IMAGE_ID) == (56 // 28) * (84 // 28)
    assert load_tokenizer(model_dir).decode(tokens).endswith(
        f"{QUESTION}\nAssistant: <think>")
    assert tokens[-1] == ERNIE_THINK_START_ID and ERNIE_THINK_END_ID not in tokens

    output = want.outputs[0]
    assert list(output.token_ids).index(ERNIE_THINK_END_ID) == BUDGET
    reasoning, think_end, content = output.text.partition("</think>")
    assert think_end and reasoning and content and "\ufffd" not in reasoning
    assert chat(server, stream, enable_thinking=True) == (reasoning, content)


@pytest.mark.parametrize("template_kwargs", [{"enable_thinking": False}, {}])
def test_thinking_off_closes_it_in_the_prompt(server, offline, model_dir, template_kwargs):
    """enable_thinking false, or left out as the published template defaults: the prompt
    holds <think>\\n\\n</think>\\n\\n, the budget has nothing to end, and the whole output
    is content."""
    from loom.tokenizer import load_tokenizer

    want = offline[False]
    tokens = tokenize(server, **template_kwargs)
    assert tokens == want.prompt_token_ids
    assert load_tokenizer(model_dir).decode(tokens).endswith(
        f"{QUESTION}\nAssistant: <think>\n\n</think>\n\n")
    assert tokens.index(ERNIE_THINK_START_ID) < tokens.index(ERNIE_THINK_END_ID)
    output = want.outputs[0]
    assert ERNIE_THINK_END_ID not in output.token_ids and "</think>" not in output.text
    assert chat(server, False, **template_kwargs) == (None, output.text)

