"""loom's native CPU kernels, compiled on first use.

``native_ops()`` returns the extension module built from every source in ``csrc/``,
one kernel family per file as in vLLM's ``csrc/cpu/``: ``layernorm.cpp`` (RMSNorm, fused
residual add), ``activation.cpp`` (SiLU*mul), ``pos_encoding.cpp`` (rotary),
``cache.cpp`` (KV-cache write), ``attention.cpp`` (paged attention),
``segment_attention.cpp`` (a vision tower's attention within windows and images, bf16
on AVX512-BF16 CPUs only; PyTorch's SDPA elsewhere), ``bf16_gemm.cpp``
(the bf16 matmul of linear layers), ``experts.cpp`` (a MoE layer's routed experts in
one call), ``replay.cpp`` (a recorded forward run again, ``loom/model/kernel_replay.py``),
``torch_bindings.cpp`` (the Python module), with the shared helpers in
``common.h``. It is None when the module cannot be had: ``LOOM_NATIVE_KERNELS=0``, no
C++ compiler, or a failed build (logged once). Callers keep a PyTorch path for None,
which is also what runs on CUDA.

The bf16 SiLU*mul, paged attention and the LoRA kernels (``lora.cpp``) have an
AVX512-BF16 path beside the generic one, and ``quantized_linear`` an AVX512-BF16 kernel
beside its AVX2 one (CPUs with AVX2, FMA and F16C but not AVX512-BF16: AMD Zen 2 and 3,
Intel before Sapphire Rapids); the build takes the AVX-512 one on CPUs that have it.
``set_isa("generic" | "avx512")`` on the module switches between them at run time, for
tests only (tests/model/test_kernel_paths.py, test_quantization.py and
test_lora_slots.py run both); serving never calls it. ``bf16_linear`` has its
AVX512-BF16 path only.

The build takes about a minute (announced on stderr) and is cached per source hash
and machine in ``$LOOM_CACHE_DIR/kernels`` (default ``~/.cache/loom/kernels``);
processes started at once (tensor-parallel ranks) wait on one build through a file lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import time
from pathlib import Path
from types import ModuleType

from loom.envs import settings

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# OpenMP: at::parallel_for runs on torch's OpenMP pool only when the extension is
# built with it (without, every "parallel" loop silently runs on one thread); the
# extension links the libgomp torch already loaded.
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fopenmp-simd", "-ffp-contract=off"]
# Wall time of a first build on a 2-core x86 machine with AVX-512: ~90 s of compiler CPU
# time over eight files, run in parallel by ninja (benchmarks/cpu_kernels.md).
_BUILD_ESTIMATE = "a minute and a half on 2 cores"
_UNSET = object()
_module: object = _UNSET
_CPU = None  # torch.device("cpu"), made at the first native_ops_for


def _sources() -> list[Path]:
    """Every C++ file in csrc/, compiled into the one module; torch_bindings.cpp, the
    slowest to compile, first: ninja starts jobs in this order."""
    return sorted(_CSRC.glob("*.cpp"), key=lambda path: (path.name != "torch_bindings.cpp",
                                                         path.name))


def _build_dir() -> Path:
    """The cache directory of this build: keyed by every file in csrc/ (sources and
    headers, names and contents), the flags, torch's version and the CPU."""
    root = settings().cache_dir / "kernels"
    import torch

    files = sorted(path for path in _CSRC.iterdir() if path.suffix in (".cpp", ".h"))
    key = hashlib.sha256(b"".join(path.name.encode() + b"\0" + path.read_bytes() + b"\0"
                                  for path in files)
                         + " ".join(_FLAGS).encode()
                         + f"{torch.__version__}{platform.machine()}".encode()
                         + _cpu_flags().encode()).hexdigest()[:16]
    return root / key


def _cpu_flags() -> str:
    """The CPU's feature flags (part of the cache key: the build uses -march=native)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the ninja wheel's binary sits in the environment's
    bin directory, which is not on PATH when the environment is not activated."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def native_ops() -> ModuleType | None:
    global _module
    if _module is _UNSET:
        _module = _load()
    return _module  # type: ignore[return-value]


def native_ops_for(device, dtype) -> ModuleType | None:
    """The kernels if they apply to tensors on ``device`` in ``dtype`` (the CPU, float32
    or bfloat16), else None: the one check every caller makes before the native path."""
    import torch

    global _CPU
    if _CPU is None:
        _CPU = torch.device("cpu")
    # `device != cpu` first: a torch.device's .type builds its string through a C++
    # ostringstream (~0.5 us, and a decode step asks several times)
    if (device != _CPU and device.type != "cpu") or dtype not in (torch.float32, torch.bfloat16):
        return None
    return native_ops()


@contextlib.contextmanager
def _exclusive_build(build_dir: Path):
    """One loom process builds or loads a build directory at a time, by an flock that the
    kernel releases when its holder dies. torch's own build lock is a plain file: a build
    killed mid-way (a timeout, Ctrl-C, the OOM killer) leaves it behind, and every later
    load waits for it forever. Holding the flock, any such file is stale: remove it."""
    with open(build_dir / "loom-build.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            stale.unlink(missing_ok=True)
            logger.warning("removed the lock of a kernel build that was killed mid-way (%s)",
                           stale)
        yield


def _import_built(path: Path) -> ModuleType:
    """A build already in the cache, imported as is. Its directory is keyed by the
    sources' contents, so whichever checkout built it, it is this source's build;
    torch's ``load`` would compile it again whenever its recorded source paths differ
    (another checkout of the same sources, a fresh CI clone)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("loom_cpu_ops", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load() -> ModuleType | None:
    if not settings().native_kernels:
        return None
    try:
        build_dir = _build_dir()
        build_dir.mkdir(parents=True, exist_ok=True)
        first_use = not (build_dir / "loom_cpu_ops.so").exists()
        if first_use:
            from loom.progress import progress

            progress(f"compiling native CPU kernels (first use, about {_BUILD_ESTIMATE}; "
                     f"cached in {build_dir.parent}) ...")
            started = time.monotonic()
        with _exclusive_build(build_dir):
            built = build_dir / "loom_cpu_ops.so"
            module = None
            if built.exists():
                try:
                    module = _import_built(built)
                except ImportError as exc:  # a link killed mid-way leaves a truncated .so
                    logger.warning("the cached kernel build %s does not load (%s); building "
                                   "it again", built, exc)
                    built.unlink()
            if module is None:
                # torch's build tools import setuptools (a few tenths of a second): only
                # a build pays for them, not every process that loads the cached module
                from torch.utils.cpp_extension import load

                _put_ninja_on_path()
                module = load(name="loom_cpu_ops", sources=[str(path) for path in _sources()],
                              build_directory=str(build_dir), extra_include_paths=[str(_CSRC)],
                              extra_cflags=_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
        if first_use:
            progress(f"native CPU kernels compiled in {time.monotonic() - started:.0f} s")
        module.set_bf16_amx(settings().amx)
        module.set_batch_invariant(settings().batch_invariant)
        return module
    except Exception as exc:  # no compiler, build error: fall back to PyTorch ops
        lines = [line for line in str(exc).splitlines() if line.strip()]
        detail = " | ".join(([lines[0]] + [line for line in lines if "error" in line][:3])
                            if lines else [type(exc).__name__])
        logger.warning("loom native CPU kernels unavailable, using PyTorch ops: %s", detail)
        return None
