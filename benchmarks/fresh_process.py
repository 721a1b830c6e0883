"""One benchmark figure in a fresh Python process: ``module.function(*args)`` of a
module in benchmarks/, its JSON result read back from the child's stdout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_in_child(module: str, function: str, *args: Any) -> dict:
    """``module.function(*args)`` (literal arguments) in a new interpreter; its result,
    a JSON-able dict. A child that fails ends the benchmark with its stderr's tail."""
    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
            f"import {module}; print('RESULT ' + json.dumps("
            f"{module}.{function}({', '.join(map(repr, args))})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{module}.{function}{args} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])
