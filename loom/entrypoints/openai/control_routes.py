"""The control plane: routes that change what the engine serves, for RL loops.

Off unless ``--enable-control-endpoints`` (or the seed's ``--dynamic-load-weight``);
behind ``--api-key`` like every route. Each is one ``AsyncLLM.control`` call into the
engine core, which runs it between steps:

    POST /update_weights      {"path": DIR | .gguf | ipc manifest}  new weights, same shapes
                              (with "lora_name": that LoRA adapter's, from its PEFT
                              directory, at once: nothing held, the base untouched)
    POST /pause_generation    {"mode": "wait" | "abort"}   hold new requests; running ones
                              finish (wait) or end with finish_reason "abort"
    POST /resume_generation   run what was held
    POST /sleep               {"level": 1 | 2}   free the KV cache (and the weights)
    POST /wake_up
    GET  /is_sleeping         {"is_sleeping": bool}
    POST /reset_prefix_cache  {"reset": bool}   false while requests hold blocks
    /clear_load_weight        FastDeploy's: free the weights (sleep level 2)
    /update_model_weight      FastDeploy's: load weights (body or query "path", default:
                              the last checkpoint loaded) and wake up

A failed call answers OpenAI's error envelope: 400 for the caller's fault (a path with no
weights, a tensor that does not fit: the old weights keep serving), 409 for a call
the engine's state refuses, 500 otherwise. With data parallel (``DPAsyncLLM``) a call
succeeds only if it did on every replica; one that failed on some replicas only is a
500 with code ``replicas_differ`` naming each replica's outcome; /is_sleeping is true
only if every replica sleeps, each replica's state under ``replicas``.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from loom.async_llm import AsyncLLM, ControlError
from loom.entrypoints.openai.errors import OpenAIError, RequestError
from loom.lora import AdapterError, read_adapter_config


def add_control_routes(app: FastAPI, engine: AsyncLLM,
                       default_weights_path: str | None = None) -> None:
    """``default_weights_path``: what an update without a path loads (None: the last
    checkpoint loaded; --load-strategy ipc: the model directory, for its manifest)."""

    async def call(control: str, **kwargs: Any) -> Any:
        try:
            return await engine.control(control, **kwargs)
        except ControlError as error:
            if error.exc_type in ("ValueError", "FileNotFoundError"):
                raise RequestError(str(error)) from None
            if error.exc_type == "RuntimeError":
                raise OpenAIError(409, str(error), code="conflict") from None
            if error.exc_type == "PartialFailure":  # data parallel: the replicas now differ
                raise OpenAIError(500, str(error), "server_error",
                                  code="replicas_differ") from None
            raise OpenAIError(500, f"{control} failed: {error}", "server_error") from None

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        body = await _body(request)
        if body.get("lora_name") is not None:
            return await update_lora(body, body["lora_name"], load_inplace=True)
        path = body.get("path", default_weights_path)
        if path is not None and not isinstance(path, str):
            raise RequestError("path must be a string: a checkpoint directory, a .gguf file "
                               "or a loom ipc manifest", param="path")
        started = time.perf_counter()
        result = await call("update_weights", path=path)
        return JSONResponse({"success": True, "seconds": time.perf_counter() - started,
                             **(result or {})})

    @app.post("/pause_generation")
    async def pause_generation(request: Request) -> JSONResponse:
        body = await _body(request)
        mode = body.get("mode", request.query_params.get("mode", "wait"))
        if mode not in ("wait", "abort"):
            raise RequestError(f"mode must be 'wait' or 'abort', got {mode!r}", param="mode")
        await call("pause_generation", mode=mode)
        return JSONResponse({"success": True, "paused": True, "mode": mode})

    @app.post("/resume_generation")
    async def resume_generation() -> JSONResponse:
        await call("resume_generation")
        return JSONResponse({"success": True, "paused": False})

    @app.post("/sleep")
    async def sleep(request: Request) -> JSONResponse:
        body = await _body(request)
        level = body.get("level", request.query_params.get("level", 1))
        try:
            level = int(level)
        except (TypeError, ValueError):
            raise RequestError(f"level must be 1 or 2, got {level!r}", param="level") from None
        if level not in (1, 2):
            raise RequestError(f"level must be 1 or 2, got {level}", param="level")
        result = await call("sleep", level=level)
        return JSONResponse({"success": True, "is_sleeping": True, **(result or {})})

    @app.post("/wake_up")
    async def wake_up() -> JSONResponse:
        await call("wake_up")
        return JSONResponse({"success": True, "is_sleeping": False})

    @app.get("/is_sleeping")
    async def is_sleeping() -> JSONResponse:
        status = await call("status")
        answer = {"is_sleeping": status["is_sleeping"], "paused": status["paused"]}
        if "replicas" in status:  # data parallel: true above only if true of every replica
            answer["replicas"] = [{"is_sleeping": replica["is_sleeping"],
                                   "paused": replica["paused"]}
                                  for replica in status["replicas"]]
        return JSONResponse(answer)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> JSONResponse:
        return JSONResponse({"success": True, "reset": bool(await call("reset_prefix_cache"))})

    async def update_lora(body: dict[str, Any], name: Any, load_inplace: bool) -> JSONResponse:
        """LoRA adapter ``name`` (re)loaded from ``body``'s path (``lora_path`` or
        ``path``) on every rank; ``load_inplace``: it must be served already."""
        if not engine.config.model.enable_lora:
            raise RequestError("lora_name needs a server started with --enable-lora",
                               param="lora_name")
        if not isinstance(name, str) or not name:
            raise RequestError("lora_name must be a non-empty string", param="lora_name")
        if load_inplace and name not in engine.lora_names:
            raise OpenAIError(404, f"no LoRA adapter {name!r} is loaded to update in place",
                              "NotFoundError", param="lora_name")
        param = "lora_path" if "lora_path" in body else "path"
        path = body.get(param)
        if not isinstance(path, str) or not path:
            raise RequestError(f"{param} must be a PEFT adapter directory or a llama.cpp "
                               "LoRA .gguf file", param=param)
        try:  # checked here first: a bad adapter is the caller's 400, not a rank's error
            read_adapter_config(path, engine.config.model.max_lora_rank)
        except AdapterError as error:
            raise RequestError(str(error), param=param) from None
        started = time.perf_counter()
        try:
            await call("update_weights", path=path, lora_name=name)
        except RequestError as error:  # the adapter's fault (a rank's ValueError)
            raise RequestError(error.message, param=param) from None
        # a new load id: the adapter's later requests do not reuse its old prefix blocks
        engine.lora_names[name] = max(engine.lora_names.values(), default=0) + 1
        return JSONResponse({"success": True, "lora_name": name,
                             "seconds": time.perf_counter() - started})

    if engine.config.model.enable_lora:
        add_lora_routes(app, engine, update_lora, call)

    # FastDeploy's names, as its RL integrations call them.
    @app.get("/clear_load_weight")
    @app.post("/clear_load_weight")
    async def clear_load_weight() -> JSONResponse:
        await call("sleep", level=2)
        return JSONResponse({"success": True, "status": "cleared"})

    @app.get("/update_model_weight")
    @app.post("/update_model_weight")
    async def update_model_weight(request: Request) -> JSONResponse:
        body = await _body(request)
        path = body.get("path", request.query_params.get("path", default_weights_path))
        started = time.perf_counter()
        result = await call("update_weights", path=path)
        return JSONResponse({"success": True, "status": "normal",
                             "seconds": time.perf_counter() - started, **(result or {})})


def add_lora_routes(app: FastAPI, engine: AsyncLLM, update_lora: Any, call: Any) -> None:
    """vLLM's runtime LoRA routes (an engine started with --enable-lora; loom/lora.py):

        POST /v1/load_lora_adapter    {"lora_name", "lora_path", "load_inplace"}  loaded on
                                      every rank, then served; a name loaded already takes
                                      the new files in place (its requests in flight run
                                      on with them; vLLM asks for load_inplace: true for
                                      that, loom takes it either way)
        POST /v1/unload_lora_adapter  {"lora_name"}  no longer served; answers once the
                                      requests already running with it have finished
    """

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await _body(request)
        load_inplace = body.get("load_inplace", False)
        if not isinstance(load_inplace, bool):
            raise RequestError("load_inplace must be true or false", param="load_inplace")
        if "lora_path" not in body:
            raise RequestError("lora_path must be a PEFT adapter directory or a llama.cpp "
                               "LoRA .gguf file", param="lora_path")
        return await update_lora(body, body.get("lora_name"), load_inplace=False)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        body = await _body(request)
        name = body.get("lora_name")
        if name not in engine.lora_names:
            raise OpenAIError(404, f"no LoRA adapter {name!r} is loaded", "NotFoundError",
                              param="lora_name")
        engine.lora_names.pop(name)  # new requests naming it: 404 from here on
        await engine.wait_until_lora_idle(name)  # those running with it finish with it
        await call("collective_rpc", method="remove_lora", args=[name])
        return JSONResponse({"success": True, "lora_name": name})


async def _body(request: Request) -> dict[str, Any]:
    """The JSON object body, or {} for none; a 400 for anything else."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as error:
        raise RequestError(f"the body is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body
