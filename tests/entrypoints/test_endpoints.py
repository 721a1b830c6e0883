"""/tokenize, /detokenize, /ping, /openapi.json, /docs, CORS, TLS and --root-path.

Most tests run the app in this process (build_app over a real, unstarted AsyncLLM: the
routes here need its tokenizer, never its engine core); TLS, the root path behind
uvicorn and the chat prompt count against /v1/chat/completions run on a real server.
"""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import tempfile

import httpx
import pytest
from fastapi.testclient import TestClient
from loom_server import REPO_ROOT, TINY_SERVER_ARGS, LoomServer

from loom.async_llm import AsyncLLM
from loom.engine_args import make_engine_config
from loom.entrypoints.openai.server import HttpOptions, ServerState, build_app
from loom.tokenizer import load_tokenizer

MODEL = "tiny"
KEY = "sk-endpoints"
ORIGIN = "https://app.example"
TEXT = "hello world 😀 你好 café"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 😀"}]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def app(tiny_model_dir, tmp_path_factory):
    config = make_engine_config(tiny_model_dir, max_model_len=512, served_model_name=MODEL)
    with pytest.MonkeyPatch.context() as patch:
        # The engine core's socket directory, never used: in pytest's temporary tree.
        patch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("sockets")))
        engine = AsyncLLM(config)
    state = ServerState(engine, MODEL, api_key=KEY, shutdown_timeout=1.0)
    state.http_options = HttpOptions(allowed_origins=(ORIGIN,), allow_credentials=True)
    return build_app(state)


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, headers=AUTH) as client:
        yield client


@pytest.fixture(scope="module")
def anonymous(app):
    """No API key, as a browser's preflight or a health probe comes."""
    with TestClient(app) as client:
        yield client


# ----------------------------------------------------------------- /tokenize, /detokenize

@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_tokenize_completion_and_detokenize_round_trip(client, tokenizer, add_special_tokens):
    response = client.post("/tokenize", json={"model": MODEL, "prompt": TEXT,
                                              "add_special_tokens": add_special_tokens,
                                              "return_token_strs": True})
    assert response.status_code == 200, response.text
    body = response.json()
    expected = tokenizer.encode(TEXT, add_special_tokens=add_special_tokens)
    assert body == {"count": len(expected), "max_model_len": 512, "tokens": expected,
                    "token_strs": tokenizer.hf.convert_ids_to_tokens(expected)}
    assert len(body["tokens"]) > len(TEXT.split())  # the emoji and CJK take several tokens
    back = client.post("/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200, back.text
    assert back.json() == {"prompt": TEXT}


def test_tokenize_without_token_strs_and_detokenize_keeps_special_tokens(client, tokenizer):
    body = client.post("/tokenize", json={"prompt": "<|im_start|>user"}).json()
    assert body["token_strs"] is None
    assert body["tokens"][0] == 1  # <|im_start|>
    assert client.post("/detokenize", json=body).json()["prompt"] == "<|im_start|>user"


def test_tokenize_chat_is_the_chat_prompt(client, tokenizer):
    body = client.post("/tokenize", json={"messages": MESSAGES, "return_token_strs": True}).json()
    assert body["tokens"] == tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert body["count"] == len(body["tokens"])
    assert "".join(body["token_strs"]).endswith("assistantĊ")  # "\n" in byte-level form
    prompt = client.post("/detokenize", json=body).json()["prompt"]
    assert prompt.endswith("<|im_start|>assistant\n") and "Hi 😀" in prompt

    without = client.post("/tokenize", json={"messages": MESSAGES,
                                             "add_generation_prompt": False}).json()
    assert body["tokens"][:without["count"]] == without["tokens"]
    assert without["count"] < body["count"]


def test_tokenize_chat_options_reach_the_template(client, tokenizer):
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{{ flavour }}"
    body = client.post("/tokenize", json={
        "messages": MESSAGES, "chat_template": template,
        "chat_template_kwargs": {"flavour": "!"}}).json()
    assert body["tokens"] == tokenizer.encode("[system]Be brief.[user]Hi 😀!",
                                              add_special_tokens=False)
    # continue_final_message leaves the last (assistant) turn open for the model to go on.
    partial = [*MESSAGES, {"role": "assistant", "content": "Hello"}]
    continued = client.post("/tokenize", json={
        "messages": partial, "add_generation_prompt": False,
        "continue_final_message": True}).json()
    assert tokenizer.decode(continued["tokens"], skip_special_tokens=False).endswith(
        "<|im_start|>assistant\nHello")


@pytest.mark.parametrize("path, body, status, param, fragment", [
    ("/detokenize", {"tokens": [3, 256]}, 400, "tokens", "tokens[1] = 256 is outside the vocabulary [0, 256)"),
    ("/detokenize", {"tokens": [3, -1]}, 400, "tokens", "greater than or equal to 0"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "valid array"),
    ("/detokenize", {}, 400, "tokens", "required"),
    ("/detokenize", {"model": "other", "tokens": [3]}, 404, "model", "`other` does not exist"),
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model", "`other` does not exist"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "valid string"),
    ("/tokenize", {}, 400, "prompt", "required"),
    ("/tokenize", {"messages": []}, 400, "messages", "at least 1 item"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, None,
     "continue_final_message and add_generation_prompt cannot both be true"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ nope( }}"}, 400, "messages",
     "the chat template failed"),
])
def test_bad_requests_are_openai_errors(client, path, body, status, param, fragment):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_body_that_is_not_json_is_a_400(client):
    for path in ("/tokenize", "/detokenize"):
        response = client.post(path, content=b"{not json")
        assert response.status_code == 400
        assert "not valid JSON" in response.json()["error"]["message"]


def test_tokenize_needs_the_api_key(anonymous):
    response = anonymous.post("/tokenize", json={"prompt": "x"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"


# ----------------------------------------------------------------- /ping, /openapi.json, /docs

def test_ping_answers_like_health_without_a_key(anonymous):
    for method in ("GET", "POST"):
        assert anonymous.request(method, "/ping").status_code == 200
    assert anonymous.get("/health").status_code == 200


def test_openapi_lists_every_route_with_its_request_body(anonymous, app):
    response = anonymous.get("/openapi.json")
    assert response.status_code == 200
    schema = response.json()
    routes = {(method, route.path) for route in app.routes if getattr(route, "include_in_schema", False)
              for method in route.methods}
    listed = {(method.upper(), path) for path, operations in schema["paths"].items()
              for method in operations}
    assert listed == routes - {("HEAD", path) for _, path in routes}
    assert {("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/ping"), ("POST", "/ping"),
            ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
            ("GET", "/v1/models"), ("GET", "/health")} <= listed
    components = schema["components"]["schemas"]
    for path, models in {"/v1/completions": ["CompletionRequest"],
                         "/v1/chat/completions": ["ChatCompletionRequest"],
                         "/tokenize": ["TokenizeCompletionRequest", "TokenizeChatRequest"],
                         "/detokenize": ["DetokenizeRequest"]}.items():
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        refs = [ref["$ref"] for ref in body.get("anyOf", [body])]
        assert refs == [f"#/components/schemas/{model}" for model in models]
        for model in models:
            assert components[model]["properties"], model
    assert "messages" in components["ChatCompletionRequest"]["required"]
    assert "temperature" in components["CompletionRequest"]["properties"]
    tokenized = schema["paths"]["/tokenize"]["post"]["responses"]["200"]["content"]
    assert tokenized["application/json"]["schema"]["$ref"].endswith("/TokenizeResponse")
    # Every reference resolves.
    for ref in _refs(schema):
        assert ref.removeprefix("#/components/schemas/") in components, ref
    # --api-key: Swagger UI's "Authorize" sends it as a bearer token.
    assert schema["security"] == [{"apiKey": []}]
    assert schema["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        return [node["$ref"]] if "$ref" in node else [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_docs_serve_swagger_ui(anonymous):
    response = anonymous.get("/docs")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "swagger-ui" in response.text and "'/openapi.json'" in response.text


# ----------------------------------------------------------------- CORS

def test_cors_preflight_of_an_allowed_origin_needs_no_key(anonymous):
    response = anonymous.options("/v1/chat/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == ORIGIN
    assert response.headers["access-control-allow-credentials"] == "true"
    assert "POST" in response.headers["access-control-allow-methods"]
    assert response.headers["access-control-allow-headers"] == "authorization, content-type"


def test_cors_headers_on_responses_including_a_401(client, anonymous):
    ok = client.get("/v1/models", headers={"Origin": ORIGIN})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    refused = anonymous.get("/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN  # the page can read why


def test_cors_does_not_echo_an_origin_not_allowed(client, anonymous):
    evil = "https://evil.example"
    preflight = anonymous.options("/v1/models", headers={
        "Origin": evil, "Access-Control-Request-Method": "GET"})
    assert preflight.status_code == 400
    assert "access-control-allow-origin" not in preflight.headers
    response = client.get("/v1/models", headers={"Origin": evil})
    assert response.status_code == 200  # not a browser: served, but no CORS grant
    assert "access-control-allow-origin" not in response.headers


def test_plain_options_without_preflight_headers_still_needs_the_key(anonymous):
    assert anonymous.options("/v1/models").status_code == 401


# ----------------------------------------------------------------- --root-path (in process)

def test_root_path_is_known_to_routes_guard_and_docs(app):
    # What uvicorn --root-path hands the app: the prefix in root_path and in path.
    with TestClient(app, root_path="/llm") as behind_proxy:
        assert behind_proxy.get("/llm/v1/models", headers=AUTH).status_code == 200
        assert behind_proxy.get("/llm/health").status_code == 200  # unguarded with the prefix
        assert behind_proxy.get("/llm/ping").status_code == 200
        assert behind_proxy.get("/llm/v1/models").status_code == 401
        assert "'/llm/openapi.json'" in behind_proxy.get("/llm/docs").text
        assert behind_proxy.get("/llm/openapi.json").json()["servers"] == [{"url": "/llm"}]


# ----------------------------------------------------------------- a real server: TLS, root path

@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("TLS tests need the openssl command to make a certificate; it is not on PATH")
    directory = tmp_path_factory.mktemp("tls")
    key, cert = str(directory / "key.pem"), str(directory / "cert.pem")
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", key, "-out", cert, "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
                   check=True, capture_output=True)
    return key, cert


@pytest.fixture(scope="module")
def tls_server(tiny_model_dir, certificate):
    key, cert = certificate
    server = LoomServer(tiny_model_dir, *TINY_SERVER_ARGS, "--served-model-name", MODEL,
                        "--disable-log-requests", "--ssl-keyfile", key, "--ssl-certfile", cert,
                        "--root-path", "/llm", api_key=KEY)
    yield server
    assert server.terminate() == 0, server.output()


def test_tls_server_serves_https_only(tls_server, certificate):
    assert tls_server.url.startswith("https://127.0.0.1:")
    trusted = ssl.create_default_context(cafile=certificate[1])
    with httpx.Client(base_url=tls_server.url, headers=AUTH, verify=trusted, timeout=60) as http:
        assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
        tokens = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
        assert http.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": TEXT}
        # Default CORS: any origin.
        preflight = http.options("/v1/models", headers={
            "Origin": "https://anywhere.example", "Access-Control-Request-Method": "GET"})
        assert preflight.headers["access-control-allow-origin"] == "*"
    with pytest.raises(httpx.ConnectError):  # the certificate is not trusted by default
        httpx.get(f"{tls_server.url}/health", timeout=10)
    plain = tls_server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"{plain}/health", timeout=10)


def test_real_server_root_path_and_chat_token_count(tls_server, certificate):
    trusted = ssl.create_default_context(cafile=certificate[1])
    with httpx.Client(base_url=tls_server.url, headers=AUTH, verify=trusted, timeout=60) as http:
        # The proxy strips /llm before forwarding; links the app makes carry it.
        assert http.get("/v1/models").status_code == 200
        assert http.get("/ping", headers={"Authorization": ""}).status_code == 200
        assert http.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
        assert "'/llm/openapi.json'" in http.get("/docs").text
        count = http.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
        chat = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == count


# ----------------------------------------------------------------- flags

@pytest.mark.parametrize("flags, fragment", [
    (["--allowed-origins", "https://a.example"], "argument --allowed-origins: must be a JSON list"),
    (["--allowed-methods", '"GET"'], "argument --allowed-methods: must be a JSON list"),
    (["--ssl-keyfile", "/nonexistent/key.pem"], "argument --ssl-keyfile: no such file"),
    (["--ssl-keyfile", "{cert}"], "--ssl-keyfile needs --ssl-certfile"),
    (["--ssl-certfile", "{cert}", "--ssl-cert-reqs", "2"], "--ssl-cert-reqs 1 or 2 needs --ssl-ca-certs"),
    (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{cert}"], "cannot use --ssl-certfile"),
])
def test_bad_server_flags_exit_2_with_one_line(tiny_model_dir, certificate, flags, fragment):
    flags = [flag.format(cert=certificate[1]) for flag in flags]
    result = subprocess.run([sys.executable, "-m", "loom.cli", "serve", tiny_model_dir, *flags],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], result.stderr
    assert "loading" not in result.stdout  # refused before the model loads


def test_flags_reach_http_options():
    from loom.cli import build_parser

    args = build_parser().parse_args(["serve", "--allowed-origins", json.dumps([ORIGIN]),
                                      "--allowed-headers", '["authorization"]',
                                      "--allow-credentials", "--root-path", "/llm"])
    assert HttpOptions.from_args(args) == HttpOptions(allowed_origins=(ORIGIN,),
                                                      allowed_headers=("authorization",),
                                                      allow_credentials=True)
    assert args.root_path == "/llm"
    defaults = build_parser().parse_args(["serve"])
    assert HttpOptions.from_args(defaults) == HttpOptions()
