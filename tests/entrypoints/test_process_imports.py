"""What the processes `loom serve` spawns import: the engine core and the ranks build and
run the model from ModelConfig.hf_config's plain values, never importing transformers
(seconds of CPU in each process; docs/architecture.md, "Worker life cycle")."""

from __future__ import annotations

import os
import subprocess
import sys

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
