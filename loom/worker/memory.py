"""Memory measurements for sizing the KV cache, and committing it.

CPU: the process's resident set; the activation peak is read from the kernel's
high-water mark (VmHWM), reset just before the profiled step. CUDA: the caching
allocator's counters.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import threading
import time

import psutil

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14


def keep_freed_memory() -> bool:
    """Have glibc keep freed heap memory mapped for reuse; False where not glibc.

    A step allocates and frees the same activations every time. glibc's defaults
    move its mmap threshold with the sizes it sees and give the heap's free top back
    to the kernel past a trim threshold, so the next step's allocations page-fault
    again (about 2,500 faults, 10 MB of fresh pages, per step of 256 mixed requests).
    Fixed at the largest mmap threshold (32 MiB) and a 1 GiB trim threshold, freed
    memory is reused; the process's resident set stays at its high-water mark.

    Process-wide, so called only at the entry of a process that runs a CPU worker:
    ``run_worker_proc`` (each rank), ``run_engine_core`` when its worker runs in it
    (one rank, ``UniProcExecutor``), and the ``loom`` commands that run the engine in
    their own process (generate, chat, bench throughput|latency). A program that runs
    ``LLM`` in its own process on the CPU may call it at its start for the same steps.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def release_freed_memory() -> None:
    """Give the heap's free memory back to the kernel once (glibc's malloc_trim), e.g.
    the loader's float32 copies of the weights; keep_freed_memory stops glibc doing it
    on its own."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def process_rss() -> int:
    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """VmHWM in bytes, or ru_maxrss where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def cpu_available_memory() -> int:
    """Host memory available now, capped by a cgroup (v2 or v1) limit if one applies."""
    available = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(limit_file) as f:
                limit = f.read().strip()
            with open(usage_file) as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            available = min(available, max(0, int(limit) - usage))
        break
    return available



def populate_in_background(buffers: list[tuple[int, int]]) -> threading.Thread | None:
    """Fault in the pages of ``buffers`` ((address, bytes) each) from a daemon thread;
    returns it, or None where madvise(MADV_POPULATE_WRITE) is missing (not Linux >= 5.14).

    Memory that is never written stays unmapped, and the first write to each page
    faults: a KV cache left alone costs its first steps one fault per 4 KiB page
    (~0.25 s over the first 256 requests for 6 GiB). Writing zeros commits it but
    takes seconds at start-up, and cannot run beside the steps that write the cache.
    MADV_POPULATE_WRITE maps each page as a write would, without writing: what a page
    holds is unchanged, so steps may read and write the buffers meanwhile. Bytes
    outside whole pages at either end are left to fault on first use.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page = mmap.PAGESIZE
    ranges = [(-(-address // page) * page, (address + size) // page * page)
              for address, size in buffers]
    ranges = [(start, end) for start, end in ranges if end > start]
    if not ranges or madvise(ranges[0][0], 0, _MADV_POPULATE_WRITE) != 0:
        return None

    def populate() -> None:
        started = time.monotonic()
        chunk = 64 << 20  # ctypes drops the GIL for each call
        for start, end in ranges:
            for offset in range(start, end, chunk):
                if madvise(offset, min(chunk, end - offset), _MADV_POPULATE_WRITE) != 0:
                    logger.debug("populating the KV cache stopped: errno %d", ctypes.get_errno())
                    return
        logger.debug("KV cache pages populated in %.2fs", time.monotonic() - started)

    thread = threading.Thread(target=populate, name="kv-cache-populate", daemon=True)
    thread.start()
    return thread


def activation_bytes_estimate(hf_config, config) -> int:
    """Memory a step's activations may take, generously, without running one (CPU).

    Per scheduled token, float32 copies of the residual stream and its norm, Q, K, V,
    the attention output, and the MLP's gate, up and product; then the logits and
    the sampler's two workspaces per sequence; 64 MiB for everything else.

        SmolLM2-135M at 4,096 tokens: 129 + 38 + 64 = 231 MB (profiled: 77 MB)
    """
    hidden, intermediate = hf_config.hidden_size, hf_config.intermediate_size
    head_dim = getattr(hf_config, "head_dim", None) or hidden // hf_config.num_attention_heads
    qkv = (hf_config.num_attention_heads + 2 * hf_config.num_key_value_heads) * head_dim
    per_token = 4 * (3 * hidden + qkv + head_dim * hf_config.num_attention_heads
                     + 3 * intermediate)
    scheduler = config.scheduler
    per_sequence = 3 * 4 * hf_config.vocab_size
    return (scheduler.max_num_batched_tokens * per_token + scheduler.max_num_seqs * per_sequence
            + (64 << 20))
