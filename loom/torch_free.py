"""The API server process never imports torch; what it must know of torch, it learns
without importing it.

``loom serve``'s API server tokenizes, renders chat templates, validates requests and
streams text; the engine core schedules (neither needs a tensor); the workers run the
model. torch (about 250 MiB resident, and a second or more of CPU to import) is therefore
imported by the workers only. The API process calls :func:`forbid_torch` at its entry,
before anything imports ``transformers``: ``transformers`` then runs in the mode it has
when torch is not installed ("only tokenizers, configuration and file/data utilities can
be used"), which is all the API process uses of it, and any ``import torch`` there is an
ImportError, not 250 MiB more of resident memory that nobody notices. (One exception,
chosen by a flag: ``--structured-outputs-backend xgrammar`` checks each request with
xgrammar, which imports torch; docs/structured_outputs.md.)

What the configuration needs of torch, it asks here: :func:`torch_build` reads
``torch/version.py`` as text (is this a CUDA build?), and :func:`cuda_available` asks
``torch.cuda.is_available()`` in this process when torch may be imported here, else in a
short-lived child (:func:`call_with_torch`; only for a CUDA build, with ``--device auto``
or ``cuda``). Reading a GGUF file through transformers (a tokenizer's first conversion,
the config of an architecture loom does not read from the metadata itself) goes to such
a child too: transformers' GGUF reader imports torch.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import logging
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

# transformers' notice at import when it finds no torch, expected where torch is forbidden
_NO_TORCH_NOTICE = "PyTorch was not found"


def forbid_torch() -> None:
    """Make ``import torch`` fail in this process (``sys.modules['torch'] = None``), so
    ``transformers``, imported after this, runs without torch. Only at a process's entry,
    before torch or transformers is imported; a process that already imported either (an
    in-process caller, e.g. a test) keeps torch: transformers decides once, at import,
    whether torch is there."""
    if "torch" in sys.modules or "transformers" in sys.modules:
        return
    sys.modules["torch"] = None  # type: ignore[assignment]
    logging.getLogger("transformers").addFilter(_drop_no_torch_notice)


def torch_forbidden() -> bool:
    """Whether this process forbade torch (:func:`forbid_torch`)."""
    return "torch" in sys.modules and sys.modules["torch"] is None


def _drop_no_torch_notice(record: logging.LogRecord) -> bool:
    return _NO_TORCH_NOTICE not in record.getMessage()


@dataclass(frozen=True)
class TorchBuild:
    """The installed torch as its ``torch/version.py`` states it."""

    version: str
    cuda: str | None  # the CUDA version it is built for, None for a CPU (or ROCm) build
    hip: str | None  # the ROCm (HIP) version, None unless a ROCm build

    @property
    def has_gpu_support(self) -> bool:
        """Built for CUDA or ROCm: ``torch.cuda`` may find a device."""
        return self.cuda is not None or self.hip is not None


def torch_build() -> TorchBuild:
    """The installed torch's version and GPU support, read from ``torch/version.py``
    without importing torch (that file is plain assignments written by torch's build)."""
    try:
        path = importlib.metadata.distribution("torch").locate_file("torch/version.py")
        source = path.read_text()
    except (importlib.metadata.PackageNotFoundError, OSError) as error:
        raise ValueError(f"cannot find the installed torch's version.py ({error}); "
                         "is torch installed?") from None
    values = {}
    for node in ast.parse(source).body:
        target = (node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1
                  else node.target if isinstance(node, ast.AnnAssign) else None)
        if isinstance(target, ast.Name) and node.value is not None:
            try:
                values[target.id] = ast.literal_eval(node.value)
            except ValueError:  # not a literal: not one of the values read here
                continue
    return TorchBuild(version=str(values.get("__version__", "unknown")),
                      cuda=values.get("cuda"), hip=values.get("hip"))


def cuda_available() -> bool:
    """``torch.cuda.is_available()``: here, unless this process forbade torch; then in a
    child process (seconds: it imports torch)."""
    if not torch_forbidden():
        import torch

        return torch.cuda.is_available()
    return bool(call_with_torch("torch.cuda:is_available"))


# The child of call_with_torch: sys.path as its parent's, then module:function(*args);
# the result (or a ValueError's message) as JSON on the last line of stdout.
_CHILD = """
import importlib, json, sys
target, args, sys.path[:] = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
module, function = target.rsplit(":", 1)
try:
    answer = {"value": getattr(importlib.import_module(module), function)(*args)}
except (ValueError, FileNotFoundError) as error:
    answer = {"error": str(error)}
print(); print(json.dumps(answer))
"""


def call_with_torch(target: str, *args: Any) -> Any:
    """``target`` (``"module:function"``) called with ``args`` in a short-lived child
    process that may import torch, for the few things a process that forbade torch needs
    of code that imports it: is a CUDA device visible, and reading a GGUF file through
    transformers (its GGUF reader imports torch; loom/model/loader/hf_config.py and
    loom/tokenizer.py). Arguments and result are JSON; the child's memory is returned
    when it exits. A ValueError (or FileNotFoundError) in the child is a ValueError here
    with its message; any other failure a RuntimeError with the child's last words."""
    child = subprocess.run([sys.executable, "-c", _CHILD, target, json.dumps(args),
                            json.dumps(sys.path)], capture_output=True, text=True)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0 or not lines:
        raise RuntimeError(f"{target} failed in a child process (exit {child.returncode}): "
                           f"{child.stderr.strip()[-2000:]}")
    answer = json.loads(lines[-1])
    if "error" in answer:
        raise ValueError(answer["error"])
    return answer["value"]
