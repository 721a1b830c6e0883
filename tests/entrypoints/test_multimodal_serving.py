"""Images through ``loom serve`` (loom/entrypoints/chat_images.py, serving_chat.py) on a
tiny random Qwen2.5-VL, with OpenAI's SDK: an image_url part (a data: URL, a local file)
gives the greedy tokens LLM.generate gives with multi_modal_data, full and streamed, and
usage, /tokenize and the Messages and Responses APIs count its tokens; a video_url part
gives the tokens of the frames loom samples from it (on a tiny Qwen3-VL too, whose
timestamps the API process writes); every bad image
is a 400 naming the messages while a request in flight runs on; the chat page sends an
image. Offline, LLM.chat takes the same parts and PIL images. A text-only model answers
an image part with a 400 (in process, over ScriptedEngine).
"""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import zlib

import httpx
import numpy as np
import openai
import psutil
import pytest
from PIL import Image

import test_web_ui

from loom import LLM, SamplingParams

QUESTION = "what is in the picture"
MAX_TOKENS = 8
LIMIT = 2  # --limit-mm-per-prompt
browser = test_web_ui.browser  # Chromium through selenium; skips where it is not installed


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG that claims width x height pixels and holds none: refused from its header."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data)))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2,
                                                            0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


# Seeds whose greedy replies decode to text without U+FFFD: the text compared shows
# every token.
IMAGE = random_image(56, 84, seed=3)
OTHER_IMAGE = random_image(112, 112, seed=1)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


def mp4_bytes(num_frames: int, seed: int, size: int = 56, fps: int = 4) -> bytes:
    """A video of random frames (MPEG-4 in MP4, written by PyAV)."""
    import av

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as output:
        stream = output.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(num_frames):
            pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def user(*parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from vlm_checkpoints import make_tiny_qwen2_5_vl

    return make_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2_5_vl"))


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("media")
    (path / "picture.png").write_bytes(png_bytes(IMAGE))
    return path


@pytest.fixture(scope="module")
def server(model_dir, media_dir):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    server = LoomServer(model_dir, *TINY_SERVER_ARGS, "--dtype", "float32",
                        "--served-model-name", "tiny-vl", "--limit-mm-per-prompt",
                        json.dumps({"image": LIMIT}), "--allowed-local-media-path",
                        str(media_dir))
    yield server
    server.kill()


@pytest.fixture(scope="module")
def offline(model_dir, media_dir):
    """The offline engine's answers, to hold the server to."""
    with LLM(model_dir, dtype="float32", max_model_len=512, enable_warm_up=False,
             allowed_local_media_path=str(media_dir)) as llm:
        yield llm


def offline_generate(llm: LLM, images: list[Image.Image]):
    """LLM.generate on the template's text for ``images`` then QUESTION, with the images
    as multi_modal_data: the reference every image path is held to."""
    text = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [*({"type": "image"} for _ in images),
                                      {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    [output] = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                            SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return output


# ----------------------------------------------------------------- the images' tokens

def test_an_image_gives_the_offline_tokens(server, offline, media_dir):
    from vlm_checkpoints import IMAGE_PAD_ID

    want = offline_generate(offline, [IMAGE])
    reply = want.outputs[0]
    assert "\ufffd" not in reply.text and len(reply.token_ids) == MAX_TOKENS
    assert offline_generate(offline, [OTHER_IMAGE]).outputs[0].text != reply.text
    num_image_tokens = want.prompt_token_ids.count(IMAGE_PAD_ID)
    assert num_image_tokens == (56 // 28) * (84 // 28)  # 14-pixel patches merged 2 x 2
    client = server.openai()
    for url in (data_url(png_bytes(IMAGE)), "picture.png", f"file://{media_dir}/picture.png"):
        answer = client.chat.completions.create(
            model="tiny-vl", messages=user(image_part(url)), max_tokens=MAX_TOKENS,
            temperature=0)
        assert answer.choices[0].message.content == reply.text, url
        assert answer.usage.prompt_tokens == len(want.prompt_token_ids)
        assert answer.usage.completion_tokens == len(reply.token_ids)

    chunks = list(client.chat.completions.create(
        model="tiny-vl", messages=user(image_part(data_url(png_bytes(IMAGE)))),
        max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.text
    assert chunks[-1].usage.prompt_tokens == len(want.prompt_token_ids)

    counted = httpx.post(f"{server.url}/tokenize", timeout=60, json={
        "model": "tiny-vl", "messages": user(image_part(data_url(png_bytes(IMAGE))))}).json()
    assert counted["tokens"] == want.prompt_token_ids
    assert counted["count"] == len(want.prompt_token_ids)


def test_two_images_in_order(server, offline):
    want = offline_generate(offline, [IMAGE, OTHER_IMAGE])
    swapped = offline_generate(offline, [OTHER_IMAGE, IMAGE])
    assert want.prompt_token_ids != swapped.prompt_token_ids  # the sizes differ
    answer = server.openai().chat.completions.create(
        model="tiny-vl", max_tokens=MAX_TOKENS, temperature=0,
        messages=user(image_part(data_url(png_bytes(IMAGE))),
                      image_part(data_url(png_bytes(OTHER_IMAGE)))))
    assert answer.choices[0].message.content == want.outputs[0].text
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids)


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory):
    """A tiny random Qwen3-VL's server and offline engine, for its videos (each pair of
    frames behind its timestamp, written in the API process)."""
    from loom_server import TINY_SERVER_ARGS, LoomServer
    from vlm_checkpoints import make_tiny_qwen3_vl

    model_dir = make_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3_vl"))
    server = LoomServer(model_dir, *TINY_SERVER_ARGS, "--dtype", "float32",
                        "--served-model-name", "tiny-vl")
    try:
        with LLM(model_dir, dtype="float32", max_model_len=512,
                 enable_warm_up=False) as offline:
            yield server, offline
    finally:
        server.kill()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_video_gives_the_offline_tokens(family, request):
    """A video_url part (an MP4 data URL): the frames loom samples from it
    (media.load_video: 6 frames, all of them, at 4 a second) as multi_modal_data give
    the same greedy tokens offline; over the server, whole and streamed; /tokenize and
    usage count its tokens; LLM.chat takes the part too. Qwen2.5-VL, and Qwen3-VL,
    whose prompt holds a timestamp per pair of frames."""
    from vlm_checkpoints import VIDEO_PAD_ID

    from loom.multimodal.media import MediaPolicy, load_video

    if family == "qwen3_vl":
        server, offline = request.getfixturevalue("qwen3_vl")
    else:
        server, offline = request.getfixturevalue("server"), request.getfixturevalue("offline")

    url = data_url(mp4_bytes(6, seed=5), "video/mp4")
    frames, metadata = load_video(url, MediaPolicy())
    assert len(frames) == 6 and metadata["fps"] == pytest.approx(4.0)
    text = offline.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": QUESTION}]}],
        tokenize=False, add_generation_prompt=True)
    [want] = offline.generate({"prompt": text, "multi_modal_data": {"video": (frames, metadata)}},
                              SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                              use_tqdm=False)
    # 6 frames -> 3 pairs of 56 x 56 (4 x 4 patches of 14, merged 2 x 2); for Qwen3-VL of
    # 64 x 64 (4 x 4 patches of 16), each pair behind its time: 0.125 s, 0.625, 1.125
    assert want.prompt_token_ids.count(VIDEO_PAD_ID) == 3 * 4
    if family == "qwen3_vl":
        prompt = offline.get_tokenizer().decode(want.prompt_token_ids,
                                                skip_special_tokens=False)
        assert prompt.count("<|vision_end|>") == 3
        assert "<0.1 seconds><|vision_start|>" in prompt and "<1.1 seconds>" in prompt
    reply = want.outputs[0]
    client = server.openai()
    answer = client.chat.completions.create(model="tiny-vl", messages=user(video_part(url)),
                                            max_tokens=MAX_TOKENS, temperature=0)
    assert answer.choices[0].message.content == reply.text
    assert answer.usage.prompt_tokens == len(want.prompt_token_ids)
    chunks = list(client.chat.completions.create(
        model="tiny-vl", messages=user(video_part(url)), max_tokens=MAX_TOKENS,
        temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.text
    counted = httpx.post(f"{server.url}/tokenize", timeout=60,
                         json={"model": "tiny-vl", "messages": user(video_part(url))}).json()
    assert counted["tokens"] == want.prompt_token_ids
    [chat] = offline.chat(user(video_part(url)),
                          SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert chat.outputs[0].token_ids == reply.token_ids
    # an image beside the video, each in its place
    both = client.chat.completions.create(
        model="tiny-vl", messages=user(image_part(data_url(png_bytes(IMAGE))), video_part(url)),
        max_tokens=MAX_TOKENS, temperature=0)
    # the image adds its 2 x 3 rows between <|vision_start|> and <|vision_end|>
    assert both.usage.prompt_tokens == len(want.prompt_token_ids) + 6 + 2


def test_offline_chat_takes_image_parts(offline, media_dir):
    want = offline_generate(offline, [IMAGE]).outputs[0].token_ids
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for part in (image_part(data_url(png_bytes(IMAGE))),
                 image_part(str(media_dir / "picture.png")),
                 {"type": "image_pil", "image_pil": IMAGE},
                 {"type": "image", "image": IMAGE}):
        [output] = offline.chat(user(part), params, use_tqdm=False)
        assert output.outputs[0].token_ids == want, part["type"]
    with pytest.raises(ValueError, match="outside the allowed local media directory"):
        offline.chat(user(image_part("/etc/hostname")), params, use_tqdm=False)
    with pytest.raises(ValueError, match="remote images are off"):
        offline.chat(user(image_part("https://example.com/cat.png")), params, use_tqdm=False)
    with pytest.raises(ValueError, match="messages.0.content.0: an image_pil part"):
        offline.chat(user({"type": "image_pil", "image_pil": "cat.png"}), params,
                     use_tqdm=False)


def test_messages_and_responses_apis_take_images(server, offline):
    want = offline_generate(offline, [IMAGE])
    encoded = base64.b64encode(png_bytes(IMAGE)).decode()
    body = {"model": "tiny-vl", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{
        "role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": encoded}},
            {"type": "text", "text": QUESTION}]}]}
    message = httpx.post(f"{server.url}/v1/messages", timeout=60, json=body).json()
    assert message["content"][0]["text"] == want.outputs[0].text, message
    assert message["usage"]["input_tokens"] == len(want.prompt_token_ids)
    counted = httpx.post(f"{server.url}/v1/messages/count_tokens", timeout=60, json=body)
    assert counted.json() == {"input_tokens": len(want.prompt_token_ids)}
    response = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "model": "tiny-vl", "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": [{
            "role": "user", "content": [
                {"type": "input_image", "image_url": data_url(png_bytes(IMAGE))},
                {"type": "input_text", "text": QUESTION}]}]}).json()
    assert response["output"][0]["content"][0]["text"] == want.outputs[0].text, response
    assert response["usage"]["input_tokens"] == len(want.prompt_token_ids)


# ----------------------------------------------------------------- bad images

BAD_IMAGES = [
    ("not an image", [image_part(data_url(b"hello world"))], "the bytes are not an image"),
    ("corrupt base64", [image_part("data:image/png;base64,@@@@")], "base64 is corrupt"),
    ("a text data URL", [image_part(data_url(b"hi", "text/plain"))], "is not an image"),
    ("too many", [image_part(data_url(png_bytes(IMAGE)))] * (LIMIT + 1),
     f"at most {LIMIT} are allowed (--limit-mm-per-prompt)"),
    ("over the pixel cap", [image_part(data_url(png_header_only(8000, 8000)))],
     "64,000,000 pixels, over this server's limit"),
    ("remote", [image_part("https://example.com/cat.png")], "remote images are off"),
    ("a file outside the directory", [image_part("/etc/hostname")],
     "outside the allowed local media directory"),
    ("a missing file", [image_part("missing.png")], "no file missing.png"),
    ("an aspect ratio the processor refuses",
     [image_part(data_url(png_bytes(Image.new("RGB", (600, 2)))))], "aspect ratio"),
    ("another modality", [{"type": "input_audio", "input_audio": {"data": "x"}}],
     "messages.0.content.0: a content part is"),
    ("not a video", [video_part(data_url(png_bytes(IMAGE), "video/mp4"))],
     "video_url: the bytes are not a video in a container loom reads"),
    ("a video without a url", [{"type": "video_url", "video_url": {}}], "a content part is"),
    ("no url", [{"type": "image_url", "image_url": {}}], "a content part is"),
]


def test_bad_images_are_400s_and_the_server_keeps_serving(server):
    client = server.openai()
    # A long reply in flight meanwhile, streamed: it must run to its end.
    in_flight = iter(client.completions.create(
        model="tiny-vl", prompt="hello", max_tokens=400, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert next(in_flight).choices
    for what, parts, message in BAD_IMAGES:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as raised:
                client.chat.completions.create(model="tiny-vl", messages=user(*parts),
                                               max_tokens=MAX_TOKENS, stream=stream)
            assert raised.value.status_code == 400, what
            assert raised.value.param == "messages", what
            assert message in raised.value.message, (what, raised.value.message)
        counted = httpx.post(f"{server.url}/tokenize", timeout=60,
                             json={"messages": user(*parts)})
        assert counted.status_code == 400, what
        assert counted.json()["error"]["param"] == "messages", what
    assert list(in_flight)[-1].usage.completion_tokens == 400
    good = client.chat.completions.create(model="tiny-vl", max_tokens=2,
                                          messages=user(image_part(data_url(png_bytes(IMAGE)))))
    assert good.usage.completion_tokens == 2


# ----------------------------------------------------------------- a text-only model

def test_a_text_only_model_answers_an_image_with_a_400(tmp_path):
    from fastapi.testclient import TestClient
    from scripted_engine import ScriptedEngine
    from tokenizer_fixtures import make_tiny_tokenizer

    from loom.entrypoints.openai.server import ServerState, build_app
    from loom.tokenizer import load_tokenizer

    tokenizer_dir = make_tiny_tokenizer(str(tmp_path))
    engine = ScriptedEngine.on(load_tokenizer(tokenizer_dir), tokenizer_dir)
    with TestClient(build_app(ServerState(engine, "tiny", None, 1.0))) as client:
        for path in ("/v1/chat/completions", "/tokenize"):
            response = client.post(path, json={"messages": user(image_part(
                data_url(png_bytes(IMAGE))))})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "messages"
            assert "this model is text-only: it takes no images" in error["message"]
        assert engine.requests == {}
        assert client.post("/v1/chat/completions", json={"messages": user()}).status_code == 200


# ----------------------------------------------------------------- the chat page

def test_chat_page_sends_an_image(server, offline, media_dir, browser):
    want = offline_generate(offline, [IMAGE])
    page = test_web_ui.Page(browser, f"{server.url}/", None, None)
    browser.get(page.url)
    page.wait(lambda: "tiny-vl" in page.by_id("status").text, 30, "the model in the status")
    page.set_settings(temperature="0", max_tokens=str(MAX_TOKENS))
    page.by_id("image-input").send_keys(str(media_dir / "picture.png"))
    page.wait(lambda: browser.execute_script(
        "return document.querySelectorAll('#attachments img').length") == 1, 10,
        "the image's thumbnail")
    page.type_and_send(QUESTION)
    reply = page.wait_for_reply("done")
    assert f"prompt {len(want.prompt_token_ids)} tokens" in reply["figures"], reply
    sent = browser.execute_script(
        "return [...document.querySelectorAll('#conversation .message.user img')]"
        ".map(image => image.src)")
    assert sent == [data_url(png_bytes(IMAGE))]
    assert browser.execute_script(
        "return document.getElementById('attachments').hidden") is True


# ----------------------------------------------------------------- shared memory
# Large arrays travel to the engine core and the ranks through shared-memory rings
# (loom/ipc/shm_ring.py), on by default: every test above used them.


def ring_positions(pids: list[int]) -> dict[str, int]:
    """The images' rings these processes own, each with its writer's position (bytes
    written so far, tails skipped included)."""
    return {name: int(np.fromfile(f"/dev/shm/{name}", dtype=np.int64, count=3)[2])
            for name in os.listdir("/dev/shm")
            if "-mm-" in name and any(name.startswith(f"loom-{pid}-") for pid in pids)}


def loom_segments(pids: list[int]) -> set[str]:
    return {name for name in os.listdir("/dev/shm")
            if any(name.startswith(f"loom-{pid}-") for pid in pids)}


def server_pids(server) -> list[int]:
    return [server.proc.pid] + [p.pid for p in psutil.Process(server.proc.pid).children(True)]


def ask_two_images(server) -> tuple[str, int]:
    answer = server.openai().chat.completions.create(
        model="tiny-vl", max_tokens=MAX_TOKENS, temperature=0,
        messages=user(image_part(data_url(png_bytes(IMAGE))),
                      image_part(data_url(png_bytes(OTHER_IMAGE)))))
    return answer.choices[0].message.content, answer.usage.completion_tokens


def test_shared_memory_on_and_off_give_the_same_tokens(server, model_dir):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    shared = ask_two_images(server)
    rings = ring_positions(server_pids(server))
    # The API process's ring to the core and the core's to its rank, both written.
    assert sorted(name.rsplit("-", 1)[1] for name in rings) == ["input", "ranks"], rings
    assert all(position > 0 for position in rings.values()), rings

    inline = LoomServer(model_dir, *TINY_SERVER_ARGS, "--dtype", "float32",
                        "--served-model-name", "tiny-vl", "--mm-shm-cache-size-mib", "0")
    try:
        pids = server_pids(inline)
        assert ask_two_images(inline) == shared
        assert ring_positions(pids) == {}
        assert inline.terminate() == 0
    finally:
        inline.close()
    assert loom_segments(pids) == set()


@pytest.mark.parametrize("stop", ["SIGTERM", "a worker SIGKILLed"])
def test_no_segment_is_left_when_the_server_stops(model_dir, stop):
    from loom_server import TINY_SERVER_ARGS, LoomServer

    server = LoomServer(model_dir, *TINY_SERVER_ARGS, "--dtype", "float32",
                        "--served-model-name", "tiny-vl")
    try:
        pids = server_pids(server)
        ask_two_images(server)
        assert len(ring_positions(pids)) == 2
        processes = [psutil.Process(pid) for pid in pids]
        if stop == "SIGTERM":
            assert server.terminate() == 0
        else:
            server.worker_processes()[0].kill()
            assert server.proc.wait(60) != 0  # the engine fails, the server exits
        psutil.wait_procs(processes, timeout=30)  # the resource tracker too
        # Each ring's owner unlinked it: multiprocessing's resource tracker (the last
        # resort, at the API process's exit) found nothing to clean up.
        assert "leaked shared_memory" not in server.output()
    finally:
        server.close()
    assert loom_segments(pids) == set()
