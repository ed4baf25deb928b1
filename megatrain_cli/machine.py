"""Facts about this machine, read where the kernel keeps them: memory (/proc, cgroup), CPUs, thread caps.

Every figure is read on each call (a few small file reads, no sampling thread), so a plan made after
the host store is built sees the memory the store took.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

CGROUP_MEMORY_MAX = Path("/sys/fs/cgroup/memory.max")  # cgroup v2; absent or 'max' when unlimited


def host_rss_bytes() -> int:
    """Resident set size of this process: the second field of /proc/self/statm, in pages."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident set (VmHWM); 0 where /proc does not say."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def meminfo_bytes(key: str) -> int:
    """One field of /proc/meminfo (given there in kB), in bytes; 0 when the field is missing."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def host_memory_bytes() -> int:
    """Physical memory of the machine (MemTotal)."""
    return meminfo_bytes("MemTotal")


def available_host_bytes() -> int:
    """What can be allocated without swapping (MemAvailable)."""
    return meminfo_bytes("MemAvailable")


def cgroup_memory_limit() -> int | None:
    """This container's memory limit (cgroup v2 memory.max), None when there is none or it cannot be read."""
    try:
        text = CGROUP_MEMORY_MAX.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text)


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def limit_this_thread(threads: int | None) -> None:
    """Cap the intra-op threads of the torch ops the CALLING thread starts (OpenMP team size is a
    per-thread setting: the packer and the optimizer worker each start their own regions, and
    uncapped both ask for every core). None leaves torch's default."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"a thread count must be >= 1, got {threads}")
    torch.set_num_threads(threads)
