"""Custom logits processors, loaded by name at start-up (``--logits-processors``, vLLM's).

A processor is a class, named as ``package.module:Class`` (or ``package.module.Class``),
constructed once per worker with no arguments. Each step, before logit bias, masks and
penalties, the sampler hands it the whole batch::

    apply(logits (B, V) float32, params: list[SamplingParams],
          output_token_ids: list[list[int]]) -> logits (B, V)

``params[i].extra_args`` carries row i's own settings (vLLM's ``extra_args``; the OpenAI
server's ``vllm_xargs``). It may change ``logits`` in place and return it. Greedy rows
take the argmax of what it returns, sampled rows draw from it.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # the API process checks the names without torch
    import torch

    from loom.sampling_params import SamplingParams


class LogitsProcessor(Protocol):
    def apply(self, logits: torch.Tensor, params: Sequence[SamplingParams],
              output_token_ids: Sequence[Sequence[int]]) -> torch.Tensor: ...


def split_name(name: str) -> tuple[str, str]:
    """``package.module:Class`` or ``package.module.Class`` -> (module, class)."""
    module, _, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not module or not attribute:
        raise ValueError(f"logits processor {name!r} is not a class name; give "
                         "package.module:Class")
    return module, attribute


def check_names(names: Sequence[str]) -> None:
    """That each named module can be found, without importing it (the API process runs
    no torch): a one-line ValueError naming the first that cannot."""
    for name in names:
        module, _ = split_name(name)
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ValueError(f"--logits-processors {name}: no module named {module!r} on "
                             "this Python path")


def load(names: Sequence[str]) -> list[Any]:
    """One instance of each named class (in a worker, at start-up)."""
    processors = []
    for name in names:
        module, attribute = split_name(name)
        cls = getattr(importlib.import_module(module), attribute, None)
        if cls is None or not callable(getattr(cls, "apply", None)):
            raise ValueError(f"--logits-processors {name}: {module} has no class {attribute} "
                             "with an apply(logits, params, output_token_ids) method")
        processors.append(cls())
    return processors
