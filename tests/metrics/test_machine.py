"""Host memory ceilings: /proc/meminfo and cgroup v1 / v2 limits, read from simulated trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatrain_cli import machine
from megatrain_cli.machine import cgroup_limits, effective_host_limit, host_limits

GiB = 2**30
MEMINFO = "MemTotal:       {total} kB\nMemFree:         1000 kB\nMemAvailable:   {avail} kB\n"


def meminfo(tmp_path: Path, total_gib: float = 64, avail_gib: float = 60) -> Path:
    path = tmp_path / "meminfo"
    path.write_text(MEMINFO.format(total=int(total_gib * GiB / 1024), avail=int(avail_gib * GiB / 1024)))
    return path


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def cgroup_v2(tmp_path: Path, job: str, **files: str) -> tuple[Path, Path]:
    """A v2 mount with this process in `job`; files: {'job/memory.max': '...'} relative to the mount."""
    root = tmp_path / "cgroup"
    write(root / "cgroup.controllers", "cpu memory\n")
    for rel, text in files.items():
        write(root / rel, text)
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text(f"0::{job}\n")
    return self_cgroup, root


def test_no_cgroup_limit_leaves_meminfo(tmp_path):
    self_cgroup, root = cgroup_v2(tmp_path, "/job", **{"job/memory.max": "max\n"})
    limits = host_limits(meminfo(tmp_path), self_cgroup, root)
    assert [limit.source.split()[0] for limit in limits] == ["MemAvailable"]
    assert limits[0].limit == 64 * GiB and limits[0].available == 60 * GiB


def test_v2_limit_below_ram_is_the_effective_one(tmp_path):
    self_cgroup, root = cgroup_v2(tmp_path, "/job", **{"job/memory.max": f"{24 * GiB}\n",
                                                      "job/memory.current": f"{5 * GiB}\n",
                                                      "job/memory.stat": f"anon 1\ninactive_file {GiB}\n"})
    limit = effective_host_limit(meminfo(tmp_path), self_cgroup, root)
    assert limit.limit == 24 * GiB
    assert limit.available == 20 * GiB  # 24 - (5 used - 1 droppable page cache)
    assert "cgroup v2 memory.max" in limit.source and str(root / "job" / "memory.max") in limit.source
    assert "24.00 GiB limit, 20.00 GiB free" in limit.describe()


def test_v2_an_ancestors_limit_binds_too(tmp_path):
    # The job's own file says max; its parent (the Slurm allocation) sets 8 GiB.
    self_cgroup, root = cgroup_v2(tmp_path, "/slurm/job_7/step_0", **{
        "slurm/job_7/memory.max": f"{8 * GiB}\n", "slurm/job_7/memory.current": f"{GiB}\n",
        "slurm/job_7/step_0/memory.max": "max\n"})
    limit = effective_host_limit(meminfo(tmp_path), self_cgroup, root)
    assert (limit.limit, limit.available) == (8 * GiB, 7 * GiB)
    assert "job_7/memory.max" in limit.source


def test_v2_namespaced_container_reads_the_mount_root(tmp_path):
    # Inside a container the mount is the container's own cgroup: /proc/self/cgroup says '0::/'.
    self_cgroup, root = cgroup_v2(tmp_path, "/", **{"memory.max": f"{4 * GiB}\n", "memory.current": "0\n"})
    assert effective_host_limit(meminfo(tmp_path), self_cgroup, root).limit == 4 * GiB


def test_v2_on_a_hybrid_host_lives_under_unified(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "unified" / "job" / "memory.max", f"{3 * GiB}\n")
    (tmp_path / "self_cgroup").write_text("0::/job\n")
    (limit,) = cgroup_limits(tmp_path / "self_cgroup", root)
    assert limit.limit == 3 * GiB and "unified" in limit.source


def test_v1_limit_and_its_unlimited_value(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "memory" / "docker" / "abc" / "memory.limit_in_bytes", f"{16 * GiB}\n")
    write(root / "memory" / "docker" / "abc" / "memory.usage_in_bytes", f"{3 * GiB}\n")
    write(root / "memory" / "docker" / "abc" / "memory.stat", f"cache 5\ntotal_inactive_file {GiB}\n")
    write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # the root: no limit
    self_cgroup = tmp_path / "self_cgroup"
    self_cgroup.write_text("12:pids:/docker/abc\n4:memory:/docker/abc\n1:name=systemd:/docker/abc\n")
    (limit,) = cgroup_limits(self_cgroup, root)
    assert (limit.limit, limit.available) == (16 * GiB, 14 * GiB)
    assert "cgroup v1 memory.limit_in_bytes" in limit.source
    assert effective_host_limit(meminfo(tmp_path), self_cgroup, root) == limit


def test_v1_container_mount_without_the_host_path(tmp_path):
    # Docker on v1: /proc/self/cgroup names the host-side path, the mount holds only the container's cgroup.
    root = tmp_path / "cgroup"
    write(root / "memory" / "memory.limit_in_bytes", f"{2 * GiB}\n")
    (tmp_path / "self_cgroup").write_text("4:memory:/docker/0123abcd\n")
    (limit,) = cgroup_limits(tmp_path / "self_cgroup", root)
    assert limit.limit == 2 * GiB


def test_more_free_under_meminfo_than_under_the_cgroup_picks_the_cgroup(tmp_path):
    self_cgroup, root = cgroup_v2(tmp_path, "/job", **{"job/memory.max": f"{40 * GiB}\n",
                                                      "job/memory.current": f"{39 * GiB}\n"})
    limit = effective_host_limit(meminfo(tmp_path, total_gib=64, avail_gib=50), self_cgroup, root)
    assert limit.available == GiB and "cgroup" in limit.source
    # And a machine with less free than its cgroup allows is limited by the machine.
    limit = effective_host_limit(meminfo(tmp_path, total_gib=64, avail_gib=0.5), self_cgroup, root)
    assert limit.source.startswith("MemAvailable") and limit.available == GiB // 2


@pytest.mark.parametrize("content", ["", "garbage\n", "0::/gone\n"], ids=["empty", "garbage", "missing-dir"])
def test_unreadable_or_absent_cgroup_files_mean_no_limit(tmp_path, content):
    (tmp_path / "self_cgroup").write_text(content)
    assert cgroup_limits(tmp_path / "self_cgroup", tmp_path / "no-mount") == []
    assert cgroup_limits(tmp_path / "no-such-file", tmp_path) == []


def test_module_constants_are_where_the_defaults_read(tmp_path, monkeypatch):
    self_cgroup, root = cgroup_v2(tmp_path, "/job", **{"job/memory.max": f"{GiB}\n"})
    monkeypatch.setattr(machine, "PROC_MEMINFO", meminfo(tmp_path))
    monkeypatch.setattr(machine, "PROC_SELF_CGROUP", self_cgroup)
    monkeypatch.setattr(machine, "CGROUP_ROOT", root)
    assert machine.available_host_bytes() == GiB


def test_nothing_readable_means_unknown_not_full(tmp_path):
    # No /proc/meminfo (not Linux) and no cgroup: 0 free is 'unknown', and the planner skips the check.
    limit = effective_host_limit(tmp_path / "no-meminfo", tmp_path / "no-cgroup", tmp_path)
    assert (limit.limit, limit.available, limit.source) == (0, 0, "no memory limit known")
