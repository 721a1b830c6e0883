"""Memory measurements for sizing the KV cache.

CPU: the process's resident set; the activation peak is read from the kernel's
high-water mark (VmHWM), reset just before the profiled step. CUDA: the caching
allocator's counters.
"""

from __future__ import annotations

import ctypes
import ctypes.util

import psutil


def keep_freed_memory() -> bool:
    """Have glibc keep freed heap memory mapped for reuse; False where not glibc.

    A step allocates and frees the same activations every time. glibc's defaults
    move its mmap threshold with the sizes it sees and give the heap's free top back
    to the kernel past a trim threshold, so the next step's allocations page-fault
    again (about 2,500 faults, 10 MB of fresh pages, per step of 256 mixed requests).
    Fixed at the largest mmap threshold (32 MiB) and a 1 GiB trim threshold, freed
    memory is reused; the process's resident set stays at its high-water mark.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


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

