"""The chat page at GET / (loom/entrypoints/openai/web_ui.py and static/).

In process: the route, its content type and Content-Security-Policy, the API key it does
not need (while /v1 does), --disable-web-ui. In Debian's Chromium, headless, driven by
selenium, against a real ``loom serve`` on a tiny random checkpoint under --api-key and
--root-path: the key dialog, settings, a reply streamed token by token with its figures,
Stop (the running gauge returns to 0), a prompt longer than the context (the server's
message shown), reload, markdown without XSS, a new conversation, Escape, phone width,
an unreachable server. Screenshots of the page (after a reply; at phone width) are
written outside git, to .pytest_cache/d/web_ui/ (pytest's cache; tmp_path without it),
and the run prints where.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import threading
import time
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient
from loom_server import LoomServer, make_tiny_model_dir
from scripted_engine import ScriptedEngine
from tokenizer_fixtures import make_tiny_tokenizer

from loom.cli import build_parser
from loom.entrypoints.openai.server import ServerState, _LoadingSwitch, build_app
from loom.tokenizer import load_tokenizer

API_KEY = "web-ui-secret"


# ----------------------------------------------------------------- in process

@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> ScriptedEngine:
    tokenizer_dir = make_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny-tokenizer")))
    return ScriptedEngine.on(load_tokenizer(tokenizer_dir), tokenizer_dir)


def app_client(engine: ScriptedEngine, api_key: str | None = None, web_ui: bool = True,
               root_path: str = "") -> TestClient:
    state = ServerState(engine, "tiny", api_key=api_key, shutdown_timeout=1.0)
    state.web_ui = web_ui
    return TestClient(build_app(state), root_path=root_path)


def csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_page_is_one_html_response_whose_policy_runs_only_its_own_code(engine):
    with app_client(engine) as client:
        response = client.get("/")
        assert response.status_code == 200
        assert response.headers["content-type"] == "text/html; charset=utf-8"
        page = response.text
        assert page.startswith("<!doctype html>") and '<html lang="en">' in page
        [script] = re.findall(r"<script>(.*?)</script>", page, re.S)
        [style] = re.findall(r"<style>(.*?)</style>", page, re.S)
        assert 'src="' not in page and 'href="style.css"' not in page  # nothing else to fetch
        assert '"/v1' not in script  # relative URLs only, so --root-path works
        policy = dict(part.split(" ", 1) for part in
                      response.headers["content-security-policy"].split("; "))
        assert policy["script-src"] == csp_hash(script)
        assert policy["style-src"] == csp_hash(style)
        assert policy["default-src"] == "'none'" and policy["connect-src"] == "'self'"
        assert client.head("/").status_code == 200
        assert "/" not in client.get("/openapi.json").json()["paths"]


def test_page_needs_no_key_but_the_api_does(engine):
    with app_client(engine, api_key=API_KEY) as client:
        assert client.get("/").status_code == 200
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}
                          ).status_code == 200


def test_page_under_root_path(engine):
    with app_client(engine, api_key=API_KEY, root_path="/llm") as client:
        assert client.get("/llm/").status_code == 200
        assert client.get("/llm/v1/models").status_code == 401


def test_page_answers_while_the_model_loads():
    # It then says the model is loading and retries v1/models until it has loaded.
    # (No `with`: uvicorn serves the switch with lifespan off.)
    client = TestClient(_LoadingSwitch(web_ui=True))
    assert client.get("/").headers["content-type"] == "text/html; charset=utf-8"
    assert client.get("/v1/models").status_code == 503
    assert TestClient(_LoadingSwitch(web_ui=False)).get("/").status_code == 503


def test_disable_web_ui(engine):
    assert build_parser().parse_args(["serve", "--disable-web-ui"]).disable_web_ui
    assert not build_parser().parse_args(["serve"]).disable_web_ui
    with app_client(engine, api_key=API_KEY, web_ui=False) as client:
        response = client.get("/")
        assert response.status_code == 404
        assert response.json()["error"]["message"] == "no route GET /"


# ----------------------------------------------------------------- in Chromium

# Long enough that a reply of this many tokens is still streaming when Stop is pressed
# (the tiny model makes ~500 tokens/s here); the tiny checkpoint says 512, rotary
# positions do not care.
MAX_MODEL_LEN = 4096
REPLY_WAIT_S = 90.0


def _find(*names: str) -> str | None:
    return next((path for name in names if (path := shutil.which(name))), None)


CHROMIUM = _find("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = _find("chromedriver") or (
    "/usr/bin/chromedriver" if os.access("/usr/bin/chromedriver", os.X_OK) else None)


@pytest.fixture
def browser():
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("Chromium and its WebDriver (chromedriver) are not installed: "
                    "apt-get install chromium chromium-driver (.ci/run does)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in the test extra")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--window-size=1000,900", "--disable-extensions", "--no-first-run"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


@pytest.fixture
def long_context_model_dir(tmp_path_factory) -> str:
    path = make_tiny_model_dir(str(tmp_path_factory.mktemp("tiny-llama-long")))
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["max_position_embeddings"] = MAX_MODEL_LEN
    with open(config_path, "w") as f:
        json.dump(config, f)
    return path


class PrefixProxy:
    """A reverse proxy serving ``upstream`` under ``prefix`` and stripping it before
    forwarding, as the one in front of ``loom serve --root-path PREFIX`` does; anything
    outside the prefix is a 404. One request per connection (it asks upstream for
    Connection: close), bytes piped both ways as they come, so streams stream and a
    client that leaves closes the upstream connection too."""

    def __init__(self, upstream: str, prefix: str) -> None:
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname, parts.port)
        self.prefix = prefix
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._handle, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def close(self) -> None:
        """Stop listening (a new connection is refused) and stop the loop."""
        if self.loop.is_running():
            asyncio.run_coroutine_threadsafe(self._close(), self.loop).result(10)
            self.loop.call_soon_threadsafe(self.loop.stop)

    async def _close(self) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        request_line, *header_lines = head.decode("latin-1").split("\r\n")
        method, target, version = request_line.split(" ")
        if not (target + "/").startswith(self.prefix + "/"):
            await _answer(writer, b"404 Not Found")
            return
        target = target[len(self.prefix):] or "/"
        headers = [line for line in header_lines
                   if line and not line.lower().startswith("connection:")]
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            await _answer(writer, b"502 Bad Gateway")
            return
        upstream_writer.write("\r\n".join([f"{method} {target} {version}", *headers,
                                            "Connection: close", "", ""]).encode("latin-1"))
        await asyncio.gather(_pipe(reader, upstream_writer), _pipe(upstream_reader, writer))


async def _answer(writer: asyncio.StreamWriter, status: bytes) -> None:
    writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    await writer.drain()
    writer.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


LAST_REPLY = """
const replies = document.querySelectorAll('#conversation .message.assistant');
const reply = replies[replies.length - 1];
return reply ? {state: reply.dataset.state, text: reply.querySelector('.content').textContent,
                 figures: reply.querySelector('.figures').textContent} : null;
"""


class Page:
    """The chat page in the browser, as a user drives it."""

    def __init__(self, driver, url: str, screenshot_dir, capsys) -> None:
        self.driver = driver
        self.url = url
        self.screenshot_dir = screenshot_dir
        self.capsys = capsys

    def wait(self, condition, timeout: float = 30.0, what: str = ""):
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.02).until(
            lambda _: condition(), message=f"waited {timeout:g} s for {what}")

    def by_id(self, element_id: str):
        from selenium.webdriver.common.by import By

        return self.driver.find_element(By.ID, element_id)

    def last_reply(self) -> dict | None:
        return self.driver.execute_script(LAST_REPLY)

    def messages(self) -> list[tuple[str, str]]:
        return [(item["role"], item["state"]) for item in self.driver.execute_script(
            "return [...document.querySelectorAll('#conversation .message')].map("
            "m => ({role: m.classList[1], state: m.dataset.state}))")]

    def type_and_send(self, text: str, key=None) -> None:
        from selenium.webdriver.common.keys import Keys

        prompt = self.by_id("prompt")
        prompt.send_keys(text)
        prompt.send_keys(key or Keys.ENTER)

    def set_settings(self, **fields: str) -> None:
        self.by_id("open-settings").click()
        self.wait(lambda: self.by_id("settings").get_attribute("open") is not None, 10, "settings")
        for element_id, value in fields.items():
            field = self.by_id(element_id.replace("_", "-"))
            field.clear()
            field.send_keys(value)
        assert self.by_id("settings-error").text == ""
        self.by_id("close-settings").click()
        self.wait(lambda: self.by_id("settings").get_attribute("open") is None, 10,
                  "settings closed")

    def wait_for_reply(self, state: str = "done", timeout: float = REPLY_WAIT_S) -> dict:
        return self.wait(lambda: (reply := self.last_reply()) and reply["state"] == state and reply,
                         timeout, f"a reply in state {state!r}")

    def watch_streaming(self) -> list[str]:
        """The reply's text in two distinct states while it is still streaming."""
        seen: list[str] = []

        def grew() -> bool:
            reply = self.last_reply()
            if reply and reply["state"] == "streaming" and reply["text"] and (
                    not seen or reply["text"] != seen[-1]):
                seen.append(reply["text"])
            return len(seen) >= 2

        self.wait(grew, REPLY_WAIT_S, "the reply to grow while streaming")
        return seen

    def screenshot(self, name: str) -> None:
        path = self.screenshot_dir / name
        self.driver.save_screenshot(str(path))
        with self.capsys.disabled():
            print(f"\nweb UI screenshot: {path}")


@pytest.fixture
def screenshot_dir(request, tmp_path):
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    return cache.mkdir("web_ui") if cache is not None else tmp_path


def test_chat_page_in_chromium(browser, long_context_model_dir, screenshot_dir, capsys):
    from selenium.webdriver.common.keys import Keys

    started = time.monotonic()
    server = LoomServer(long_context_model_dir, "--kv-cache-memory", "64MiB", "--max-model-len",
                        str(MAX_MODEL_LEN), "--root-path", "/llm", api_key=API_KEY)
    ready = time.monotonic()
    proxy = PrefixProxy(server.url, "/llm")
    try:
        page = Page(browser, f"{proxy.url}/llm/", screenshot_dir, capsys)
        browser.get(page.url)

        # The API answers 401 without the key: the page asks for it.
        page.wait(lambda: page.by_id("key-dialog").get_attribute("open") is not None, 30,
                  "the API key dialog")
        page.by_id("api-key").send_keys(API_KEY + Keys.ENTER)
        page.wait(lambda: f"context {MAX_MODEL_LEN:,} tokens" in page.by_id("status").text, 30,
                  "the model's name and context in the status line")

        # A reply of 48 tokens exactly (ignore_eos from the extra fields), then its figures.
        page.set_settings(seed="7", temperature="0.8", max_tokens="48",
                          extra='{"ignore_eos": true}')
        page.by_id("prompt").send_keys("Hello", Keys.SHIFT + Keys.ENTER + Keys.NULL, "world")
        assert page.by_id("prompt").get_attribute("value") == "Hello\nworld"  # Shift+Enter: a line
        page.by_id("prompt").send_keys(Keys.ENTER)
        reply = page.wait_for_reply("done")
        assert reply["text"]
        assert re.search(r"time to first token \d+ ms · [\d.]+ tokens/s · prompt \d+ tokens · "
                         r"completion 48 tokens$", reply["figures"]), reply["figures"]
        assert page.messages() == [("user", "done"), ("assistant", "done")]
        assert browser.execute_script(
            "return document.querySelector('#conversation .message.user .content').textContent"
        ) == "Hello\nworld"
        page.screenshot("reply.png")

        # A long reply, seen growing token by token, then Stop: the server aborts it.
        page.set_settings(max_tokens=str(MAX_MODEL_LEN - 200))
        page.type_and_send("Tell me a long story")
        first, second = page.watch_streaming()[:2]
        assert first != second
        assert server.wait_for_metric("vllm:num_requests_running", 1, timeout=10) == 1
        page.by_id("stop").click()
        stopped = page.wait_for_reply("stopped", 30)
        assert stopped["text"].endswith("Stopped.") and "time to first token" in stopped["figures"]
        assert server.wait_for_metric("vllm:num_requests_running", 0, timeout=30) == 0
        assert page.by_id("send").is_displayed() and not page.by_id("stop").is_displayed()

        # A prompt longer than the context: the server's message, and the text given back.
        too_long = "x" * (MAX_MODEL_LEN + 100)
        browser.execute_script("document.getElementById('prompt').value = arguments[0]", too_long)
        page.by_id("prompt").send_keys(Keys.ENTER)
        failed = page.wait_for_reply("error", 30)
        assert f"but max_model_len is {MAX_MODEL_LEN}; shorten it" in failed["text"], failed
        assert page.by_id("prompt").get_attribute("value") == too_long
        page.by_id("prompt").clear()

        # Reload: the conversation is still there (the failed turn is not), the key too.
        browser.refresh()
        page.wait(lambda: f"context {MAX_MODEL_LEN:,}" in page.by_id("status").text, 30,
                  "reconnected after reload")
        assert page.by_id("key-dialog").get_attribute("open") is None
        assert page.messages() == [("user", "done"), ("assistant", "done"),
                                   ("user", "done"), ("assistant", "stopped")]

        # Markdown from a model is rendered as elements, never as HTML.
        hostile = ("# Title\n**bold** and `<b>code</b>` and [a link](https://example.com/x) "
                   "[bad](javascript:window.xss=1)\n<img src=x onerror=\"window.xss=1\">\n\n"
                   "```python\nprint('<script>window.xss=1</script>')\n```\n- one\n- two")
        browser.execute_script("sessionStorage.setItem('loom.conversation', arguments[0])",
                               json.dumps([{"role": "user", "content": "<i>hi</i>"},
                                           {"role": "assistant", "content": hostile}]))
        browser.refresh()
        page.wait(lambda: len(page.messages()) == 2, 30, "the stored conversation")
        rendered = browser.execute_script("""
            const conversation = document.getElementById('conversation');
            const reply = conversation.querySelector('.message.assistant .content');
            const text = (selector) => reply.querySelector(selector).textContent;
            return {
              heading: text('h3'), strong: text('strong'), inlineCode: text('p code'),
              code: text('pre code'), items: reply.querySelectorAll('li').length,
              links: [...reply.querySelectorAll('a')].map(a => a.href),
              markup: conversation.querySelectorAll('img, script, b, i').length,
              xss: window.xss === undefined ? null : window.xss,
              user: conversation.querySelector('.message.user .content').textContent};""")
        assert rendered == {
            "heading": "Title", "strong": "bold", "inlineCode": "<b>code</b>",
            "code": "print('<script>window.xss=1</script>')", "items": 2,
            "links": ["https://example.com/x"], "markup": 0, "xss": None, "user": "<i>hi</i>"}

        # A new conversation, then a reply stopped by Escape.
        page.by_id("new-chat").click()
        assert page.messages() == []
        assert browser.execute_script("return sessionStorage.getItem('loom.conversation')") == "[]"
        page.type_and_send("Once more, at length")
        page.watch_streaming()
        page.by_id("prompt").send_keys(Keys.ESCAPE)
        page.wait_for_reply("stopped", 30)
        assert server.wait_for_metric("vllm:num_requests_running", 0, timeout=30) == 0

        # Every request the page made stayed under the root path.
        urls = browser.execute_script(
            "return performance.getEntriesByType('resource').map(entry => entry.name)")
        assert urls and all(url.startswith(page.url) for url in urls), urls

        # Phone width: nothing wider than the screen.
        browser.set_window_size(390, 844)
        assert browser.execute_script(
            "return document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        page.screenshot("phone.png")

        # The server gone: the page says it cannot reach it.
        proxy.close()
        server.kill()
        page.type_and_send("Are you there?")
        gone = page.wait_for_reply("error", 30)
        assert "Cannot reach the server" in gone["text"], gone
    finally:
        proxy.close()
        server.close()
        with capsys.disabled():
            print(f"\nbrowser test: server ready in {ready - started:.1f} s, "
                  f"the page's steps took {time.monotonic() - ready:.1f} s")
