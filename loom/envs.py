"""Every ``LOOM_*`` environment switch, read once into one frozen ``Settings``.

    from loom.envs import settings

    if settings().native_layers: ...

``settings()`` reads the environment at its first call and returns the same object
from then on, so a switch cannot change under a running engine. Read it at a process's
entry point (``loom`` CLI, ``run_worker_proc``, ``run_engine_core``) and pass what a
library call needs down to it. Worker and engine-core processes are spawned, not
forked: each is a fresh interpreter that reads its own (inherited) environment at its
entry.

Tests that set a variable re-read it: ``settings.cache_clear()`` after
``monkeypatch.setenv`` (and again once the patch is undone), or build one directly
with ``Settings.from_environ({"LOOM_NATIVE_LAYERS": "0"})``.

A switch is on unless set to 0 (also ``false``, ``no``, ``off``); an empty value
means unset. A value that is neither on nor off is an error naming the variable.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _default_cache_dir() -> Path:
    return Path.home() / ".cache" / "loom"


@dataclass(frozen=True)
class Settings:
    """One field per switch; ``metadata["env"]`` names its variable."""

    cpu_packed_weights: bool = field(default=True, metadata={"env": "LOOM_CPU_PACKED_WEIGHTS"})
    """Pack CPU bf16 linear weights for loom's ``bf16_linear`` after loading
    (``layers/linear.py``). 0 keeps the plain weights (oneDNN or ATen run them)."""

    native_layers: bool = field(default=True, metadata={"env": "LOOM_NATIVE_LAYERS"})
    """Replay a model's forward from loom's native kernels, recorded once per shape, where
    it applies (``loom/model/kernel_replay.py``). 0 runs the modules every step."""

    amx: bool = field(default=True, metadata={"env": "LOOM_AMX"})
    """Run matmuls of 8 rows or more on the CPU's AMX tiles where it has them and Linux
    grants them (``kernels/csrc/bf16_gemm.cpp``). 0 keeps them on the AVX-512 kernels."""

    batch_invariant: bool = field(default=True, metadata={"env": "LOOM_BATCH_INVARIANT"})
    """A request's greedy tokens do not depend on what else is in its step: every native
    CPU kernel gives a row the same bits whatever the other rows are (quantized matmuls
    take the integer path at every row count; bf16 matmuls stay off the AMX tiles, whose
    sums round in another order than the AVX-512 kernel's). 0 lets calls of 9 rows or
    more take the bf16 path and the tiles, faster on CPUs with AMX (vLLM's
    ``VLLM_BATCH_INVARIANT``, the other way round; README, "Greedy is greedy")."""

    native_kernels: bool = field(default=True, metadata={"env": "LOOM_NATIVE_KERNELS"})
    """Build and use the native CPU kernels (``loom/kernels``). 0: ``native_ops()`` is
    None and every caller takes its PyTorch path."""

    triton_matmuls: bool = field(default=False, metadata={"env": "LOOM_TRITON_MATMULS"})
    """Off by default. 1: on CUDA, quantized linear weights multiply through loom's Triton
    kernels, which read the packed weight (``layers/triton_linear.py``), and full-precision
    MoE experts through its fused MoE kernel (``layers/triton_moe.py``), instead of
    dequantizing per matmul / a matmul per expert. Proven only under Triton's interpreter
    on the CPU (with TRITON_INTERPRET=1 the switch applies to the CPU too: tests)."""

    cache_dir: Path = field(default_factory=_default_cache_dir,
                            metadata={"env": "LOOM_CACHE_DIR"})
    """loom's cache root: built kernels (``kernels/``), tokenizers converted from GGUF
    (``tokenizers/``), the downloaded default model (``models/``). Default
    ``~/.cache/loom``."""

    log_stats_interval_s: float = field(default=10.0,
                                        metadata={"env": "LOOM_LOG_STATS_INTERVAL"})
    """Seconds between ``loom serve``'s stats lines while busy (vLLM's
    ``VLLM_LOG_STATS_INTERVAL``; ``loom/stats_logger.py``)."""

    test_stall_worker_at_step: int | None = field(
        default=None, metadata={"env": "LOOM_TEST_STALL_WORKER_AT_STEP"})
    """Tests only: every rank's event loop blocks forever on this step, as a deadlocked
    collective would, while the process lives (the watchdog tests)."""

    test_stall_engine_at_step: int | None = field(
        default=None, metadata={"env": "LOOM_TEST_STALL_ENGINE_AT_STEP"})
    """Tests only: the engine core's loop blocks forever before this step."""

    test_stall_kv_send: bool = field(default=False, metadata={"env": "LOOM_TEST_STALL_KV_SEND"})
    """Tests only: a prefill rank sends half of each KV transfer's bytes over tcp, then
    blocks that transfer forever (the tests kill the instance mid-transfer)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every switch from ``environ`` (default ``os.environ``); unset ones keep
        their defaults."""
        environ = os.environ if environ is None else environ
        values = {}
        for spec in fields(cls):
            name = spec.metadata["env"]
            raw = environ.get(name, "").strip()
            if raw:
                values[spec.name] = _parse(name, raw, spec.type)
        return cls(**values)


def _parse(name: str, raw: str, type_name: str) -> bool | int | float | None | Path:
    if type_name == "bool":
        if raw.lower() in _TRUE:
            return True
        if raw.lower() in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r}: expected 1 or 0 (or unset for the default)")
    if type_name == "int | None":
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected a whole number") from None
        return value or None  # 0: off
    if type_name == "float":
        try:
            value = float(raw)
        except ValueError:
            value = float("nan")
        if not value > 0 or value == float("inf"):
            raise ValueError(f"{name}={raw!r}: expected a positive number of seconds")
        return value
    if type_name == "Path":
        return Path(raw).expanduser()
    raise TypeError(f"Settings has no parser for {type_name} ({name})")


@functools.cache
def settings() -> Settings:
    """This process's settings, read from its environment at the first call."""
    return Settings.from_environ()
