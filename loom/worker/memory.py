"""Memory measurements for sizing the KV cache.

CPU: the process's resident set; the activation peak is read from the kernel's
high-water mark (VmHWM), reset just before the profiled step. CUDA: the caching
allocator's counters.
"""

from __future__ import annotations

import psutil


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

