"""What the processes of `loom serve` import: the engine core and the ranks build and
run the model from ModelConfig.hf_config's plain values, never importing transformers
(seconds of CPU in each process; docs/architecture.md, "Worker life cycle"); the API
server process never imports torch (loom/torch_free.py): only the ranks hold it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import psutil

# Loaded at start-up by every Python process given this directory on PYTHONPATH; in those
# multiprocessing spawned (the engine core, the worker ranks), `import transformers` fails
# naming what asked for it. The API process itself tokenizes with transformers.
_BLOCKER = '''
import sys

if "--multiprocessing-fork" in sys.argv:
    class _NoTransformers:
        def find_spec(self, name, path=None, target=None):
            if name == "transformers" or name.startswith("transformers."):
                raise ImportError(f"{name} imported in a spawned loom process")
            return None

    sys.meta_path.insert(0, _NoTransformers())
'''


def test_engine_core_and_ranks_serve_without_importing_transformers(start_server, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_BLOCKER)
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": python_path}
    # The blocker works: a process with spawn's flag cannot import transformers.
    spawned_like = subprocess.run([sys.executable, "-c", "import transformers",
                                   "--multiprocessing-fork"], env=env, capture_output=True,
                                  text=True, timeout=60)
    assert "transformers imported in a spawned loom process" in spawned_like.stderr

    server = start_server(env={"PYTHONPATH": python_path})
    assert server.worker_processes(), "loom serve runs its rank in a worker process"
    with server.http() as http:
        response = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8,
                                                      "temperature": 0, "ignore_eos": True})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 8
    assert "spawned loom process" not in server.output()


# In `loom serve`'s own process (not a spawned one): at exit, the names of the imported
# modules of torch and transformers, written to the file LOOM_TEST_MODULES_FILE names.
_RECORDER = '''
import atexit, json, os, sys

if "--multiprocessing-fork" not in sys.argv and "serve" in sys.argv:
    def _record():
        with open(os.environ["LOOM_TEST_MODULES_FILE"], "w") as f:
            json.dump(sorted(name for name, module in list(sys.modules.items())
                             if module is not None
                             and name.split(".")[0] in ("torch", "transformers")), f)

    atexit.register(_record)
'''


def maps_torch(process: psutil.Process) -> bool:
    """Whether torch's shared libraries are mapped into the process (libtorch_cpu.so,
    libc10.so, ...): any ``import torch`` maps them, and they stay."""
    with open(f"/proc/{process.pid}/maps") as f:
        return any("libtorch" in line or "libc10" in line for line in f)


def test_api_server_process_never_imports_torch(start_server, tmp_path):
    (tmp_path / "sitecustomize.py").write_text(_RECORDER)
    modules_file = tmp_path / "modules.json"
    python_path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    # llguidance: xgrammar (auto's choice for the JSON schema below) imports torch in the
    # engine core that compiles it (docs/structured_outputs.md)
    server = start_server("--structured-outputs-backend", "guidance",
                          env={"PYTHONPATH": python_path,
                               "LOOM_TEST_MODULES_FILE": str(modules_file)})
    messages = [{"role": "user", "content": "hello"}]
    with server.http() as http:
        # the chat template, a JSON schema (validated here, compiled by the engine core),
        # a grammar the API process refuses, a completion, /tokenize
        chat = http.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 8, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "object"}}}})
        assert chat.status_code == 200, chat.text
        bad = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 4,
                                                 "guided_regex": "(unclosed"})
        assert bad.status_code == 400 and "regex" in bad.json()["error"]["message"], bad.text
        completion = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8,
                                                        "temperature": 0, "ignore_eos": True})
        assert completion.json()["usage"]["completion_tokens"] == 8, completion.text
        tokenized = http.post("/tokenize", json={"messages": messages})
        assert tokenized.status_code == 200 and tokenized.json()["count"] > 0, tokenized.text
    [worker] = server.worker_processes()
    assert maps_torch(worker), "the check sees torch where it is: in the rank"
    assert not maps_torch(psutil.Process(server.proc.pid)), "the API server process has torch"
    assert not maps_torch(server.engine_core_process()), "the engine core has torch"
    assert server.terminate() == 0, server.output()
    modules = json.loads(modules_file.read_text())
    assert "transformers.tokenization_utils_base" in modules, "the API process tokenized"
    assert [name for name in modules if name.split(".")[0] == "torch"] == []
    assert "transformers.modeling_utils" not in modules
    assert "PyTorch was not found" not in server.output()
