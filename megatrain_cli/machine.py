"""Facts about this machine, read where the kernel keeps them: memory (/proc, cgroup), CPUs, thread caps.

Every figure is read on each call (a few small file reads, no sampling thread), so a plan made after
the host store is built sees the memory the store took.

Host memory has several ceilings: what /proc/meminfo says is available, and the memory limit of every
cgroup this process sits in (v2 `memory.max`, v1 `memory.limit_in_bytes`, each ancestor included: a
container, a Slurm job step). The kernel kills a process that crosses any of them without a word, so
the planner compares with the smallest (`effective_host_limit`). Where the files are read from is
given by the module constants below (tests point them at simulated trees) or the functions' arguments.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

PROC_MEMINFO = Path("/proc/meminfo")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")  # this process's cgroup per hierarchy ("id:controllers:path")
CGROUP_ROOT = Path("/sys/fs/cgroup")  # v2 here (or under unified/ on a hybrid host), v1 memory under memory/
V1_UNLIMITED = 2**60  # v1 writes 'no limit' as 2**63 - 1 rounded down to a page


@dataclass(frozen=True)
class HostLimit:
    """One ceiling on this process's host memory: where it is read, its size and what is free under it."""

    source: str  # e.g. 'MemAvailable (/proc/meminfo)' or 'cgroup v2 memory.max (/sys/fs/cgroup/job/memory.max)'
    limit: int  # bytes: MemTotal, or the cgroup's limit
    available: int  # bytes that can still be allocated under it

    def describe(self) -> str:
        return f"{self.source}: {_gib(self.limit)} limit, {_gib(self.available)} free"


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**28 else f"{n / 2**20:.1f} MiB"


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


def meminfo_bytes(key: str, meminfo: Path | None = None) -> int:
    """One field of /proc/meminfo (given there in kB), in bytes; 0 when the field or the file is missing."""
    try:
        with open(meminfo or PROC_MEMINFO) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _read_int(path: Path) -> int | None:
    """A cgroup file holding one number; None when it is absent, unreadable or 'max' (no limit)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat_field(path: Path, *keys: str) -> int:
    """The first of `keys` found in a cgroup memory.stat file, 0 when none is."""
    try:
        fields = dict(line.split()[:2] for line in path.read_text().splitlines() if len(line.split()) >= 2)
    except OSError:
        return 0
    return next((int(fields[k]) for k in keys if k in fields and fields[k].isdigit()), 0)


def _cgroup_dirs(base: Path, path: str) -> list[Path]:
    """The cgroup directory of `path` under the mount `base` and each ancestor up to `base`, those that
    exist. A limit on any ancestor binds too; inside a container the mount is the container's own cgroup,
    so the host-side path does not exist below it and only `base` is found."""
    here = base / path.strip("/")
    dirs = [here, *here.parents]
    return [d for d in dirs[:dirs.index(base) + 1] if d.is_dir()] if base in dirs else []


def _limits_under(base: Path, path: str, version: int) -> list[HostLimit]:
    """One HostLimit per directory that sets a limit. Free under a limit is the limit less what the
    cgroup uses, page cache that the kernel can drop (inactive files) not counted as used."""
    max_file, usage_file, cache = (("memory.max", "memory.current", ("inactive_file",)) if version == 2 else
                                   ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                    ("total_inactive_file", "inactive_file")))
    found = []
    for d in _cgroup_dirs(base, path):
        limit = _read_int(d / max_file)
        if limit is None or limit >= V1_UNLIMITED:
            continue
        used = _read_int(d / usage_file) or 0
        used = max(0, used - _stat_field(d / "memory.stat", *cache))
        found.append(HostLimit(f"cgroup v{version} {max_file} ({d / max_file})", limit, max(0, limit - used)))
    return found


def cgroup_limits(self_cgroup: Path | None = None, root: Path | None = None) -> list[HostLimit]:
    """The memory limits of this process's cgroups, v2 and v1, every ancestor that sets one. Empty when
    there are none or /proc/self/cgroup cannot be read (not Linux)."""
    root = root or CGROUP_ROOT
    try:
        lines = (self_cgroup or PROC_SELF_CGROUP).read_text().splitlines()
    except OSError:
        return []
    found: list[HostLimit] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":  # the v2 (unified) hierarchy
            base = root if (root / "cgroup.controllers").is_file() else root / "unified"
            found += _limits_under(base, path, 2)
        elif "memory" in controllers.split(","):
            found += _limits_under(root / "memory", path, 1)
    return found


def host_limits(meminfo: Path | None = None, self_cgroup: Path | None = None,
                root: Path | None = None) -> list[HostLimit]:
    """Every ceiling on host memory: /proc/meminfo's MemAvailable first (left out where the kernel does
    not say it), then the cgroups'."""
    total, available = meminfo_bytes("MemTotal", meminfo), meminfo_bytes("MemAvailable", meminfo)
    proc = [HostLimit(f"MemAvailable ({meminfo or PROC_MEMINFO})", total, available)] if available else []
    return [*proc, *cgroup_limits(self_cgroup, root)]


def effective_host_limit(meminfo: Path | None = None, self_cgroup: Path | None = None,
                         root: Path | None = None) -> HostLimit:
    """The ceiling with the least free under it: the one a growing process hits first. Where none can be
    read (not Linux), a limit of 0 bytes named so: callers treat 0 free as 'unknown', never as 'full'."""
    limits = host_limits(meminfo, self_cgroup, root)
    return min(limits, key=lambda limit: limit.available) if limits else HostLimit("no memory limit known", 0, 0)


def available_host_bytes() -> int:
    """What can be allocated now without crossing any ceiling (effective_host_limit's free bytes); 0 when
    unknown."""
    return effective_host_limit().available


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which containers and taskset narrow)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def busy_note(loadavg: tuple[float, ...] | None = None, cpus: int | None = None) -> str:
    """A line for a probe about to time this host while other work runs on it ('' when idle or unknown): the
    1-minute load average against the usable CPUs. Busy figures come out low and stay cached."""
    try:
        load = (loadavg or os.getloadavg())[0]
    except (AttributeError, OSError):  # no load average on this platform (Windows), or none readable
        return ""
    cpus = cpus or usable_cpus()
    if load < max(2.0, 0.5 * cpus):
        return ""
    return (f"this machine is busy (1-minute load {load:.1f} on {cpus} CPUs): the host figures measured now come "
            "out low and are cached; run `megatrain plan RECIPE --reprobe` when it is idle")


def limit_this_thread(threads: int | None) -> None:
    """Cap the intra-op threads of the torch ops the CALLING thread starts (OpenMP team size is a
    per-thread setting: the packer and the optimizer worker each start their own regions, and
    uncapped both ask for every core). None leaves torch's default."""
    if threads is None:
        return
    if threads < 1:
        raise ValueError(f"a thread count must be >= 1, got {threads}")
    torch.set_num_threads(threads)
