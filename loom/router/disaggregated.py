"""``loom router --prefill URL --decode URL``: prefill/decode pairs behind one front
(docs/disaggregation.md).

    client ──▶ router ── 1. the request, not streamed, n = 1, with kv_transfer_params
                  │        {"do_remote_decode": true} ──▶ a prefill backend
                  │      ◀── its answer's kv_transfer_params (where the KV blocks are)
                  └──── 2. the client's request as it came, plus those params
                           ──▶ a decode backend, whose answer (streamed or not) is relayed

Each hop chooses among its own pool by load and prefix affinity (``BackendPool``), so
any prefill backend pairs with any decode backend (they must run the same model, block
size and tensor-parallel size: the decode backend refuses the params otherwise). The
client sees the decode backend's answer unchanged; its kv_transfer_params never reach it.

Failures: a prefill backend that cannot be reached is marked down and the next one
tried; one that answers an error (a 400 for a bad request, say) has that answer
relayed to the client as it is; a decode backend that cannot be reached is marked down
and the next one tried with the same params (any decode backend can pull them). If the
prefill backend dies after answering, the decode backend's pull fails and the client
gets its error (a 500, or an error event when streaming).
"""

from __future__ import annotations

import json

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from loom.router.backends import Backend, BackendPool
from loom.router.proxy import error_response, forwarded_headers
from loom.router.router import Router, no_backend_response, prompt_keys


class DisaggregatedRouter(Router):
    """``pool`` holds the decode backends (full servers: /v1/models, /tokenize go
    there), ``prefill_pool`` the prefill ones."""

    def __init__(self, prefill_pool: BackendPool, decode_pool: BackendPool) -> None:
        super().__init__(decode_pool)
        self.prefill_pool = prefill_pool

    async def _generate(self, request: Request) -> Response:
        read = await self._json_body(request)
        if isinstance(read, Response):
            return read
        _, parsed = read
        keys = prompt_keys(parsed)
        answer = await self._prefill(request, parsed, keys)
        if isinstance(answer, Response):
            return answer  # no prefill backend, or its error, for the client as it is
        decode_body = json.dumps({**parsed, "kv_transfer_params": answer}).encode()
        return await self.forward(request, decode_body, lambda exclude: self.pool.choose(
            keys, exclude=exclude))

    async def _prefill(self, request: Request, parsed: dict, keys) -> dict | Response:
        """The prefill hop; the answer's kv_transfer_params, or the response to give the
        client instead."""
        # The prompt once (n = 1): the decode backend samples the n sequences, each from
        # the transferred prompt. Prompt logprobs (echo with logprobs) are computed there.
        prefill_body = {key: value for key, value in parsed.items()
                        if key not in ("stream_options", "best_of")}
        prefill_body.update(stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
        headers = forwarded_headers(request.headers)
        url_path = request.url.path
        tried: list[Backend] = []
        while True:
            try:
                backend, ticket = self.prefill_pool.choose(keys, exclude=tried)
            except LookupError:
                return no_backend_response(self.prefill_pool)
            self.metrics.requests.labels(backend.url, "prefill:" + ticket.reason).inc()
            try:
                answer = await self.prefill_pool.client.post(
                    f"{backend.url}{url_path}", json=prefill_body, headers=headers)
            except (httpx.ConnectError, httpx.ConnectTimeout) as error:
                self._prefill_failed(backend, f"{type(error).__name__}: {error}")
                tried.append(backend)  # the request never arrived: try another
                continue
            except httpx.HTTPError as error:
                self._prefill_failed(backend, f"{type(error).__name__}: {error}")
                return error_response(502, f"the prefill backend {backend.url} failed: "
                                      f"{type(error).__name__}: {error}", "server_error",
                                      "backend_failed")
            finally:
                self.prefill_pool.release(ticket)
            if answer.status_code != 200:
                return Response(answer.content, status_code=answer.status_code,
                                media_type="application/json")
            params = answer.json().get("kv_transfer_params")
            if not isinstance(params, dict):
                return error_response(502, f"the prefill backend {backend.url} answered "
                                      "without kv_transfer_params; is it a loom serve "
                                      "--splitwise-role prefill instance?", "server_error",
                                      "backend_failed")
            return params

    def _prefill_failed(self, backend: Backend, reason: str) -> None:
        self.metrics.failures.labels(backend.url).inc()
        self.prefill_pool.mark_down(backend, reason)

    async def health(self, _: Request) -> Response:
        prefill, decode = self.prefill_pool.describe(), self.pool.describe()
        up = [sum(b["healthy"] for b in pool) for pool in (prefill, decode)]
        serving = all(up)  # a request needs one of each
        complete = up[0] == len(prefill) and up[1] == len(decode)
        status = "ok" if complete else "degraded" if serving else "unavailable"
        return JSONResponse({"status": status, "prefill": prefill, "decode": decode},
                            status_code=200 if serving else 503)
