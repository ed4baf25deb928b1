"""`--baseline deepspeed`: run DeepSpeed ZeRO-3 Offload (deepspeed_child.py) in a child process and
watch it.

A child process, because: its host memory (pinned partitions, fp32 master weights, Adam moments) goes
back to the OS the moment it ends; DeepSpeed's process-group and monkey-patching (zero.Init patches
torch.Tensor.__new__ and every nn.Module subclass) never touch ours; and when it runs the machine out
of host memory (a 7B model can, on a host that holds our 14 bytes/param) it is the child that dies, not us. We do
not leave that to the kernel: its OOM killer may pick the wrong process or take minutes while the
machine swaps or stalls. Instead the child's resident memory (its whole process tree) is sampled every
0.2 s (faster when memory runs low) and the child is SIGKILLed as soon as the host's available memory
falls below host_floor_bytes. The row that comes back then says so, with the peak it had reached.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from megatrain_cli.bench.deepspeed_child import EXIT_DEEPSPEED_BROKEN, EXIT_NO_DEEPSPEED
from megatrain_cli.bench.result import BenchResult, from_dict

GiB = 2**30
_PAGE = os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------- reading /proc and the cgroup
def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return None if text == "max" else int(text) if text.isdigit() else None


def _cgroup_dirs() -> list[tuple[str, Path]]:
    """Candidate memory-cgroup folders of this process: ('v2'|'v1', folder), most specific first."""
    dirs: list[tuple[str, Path]] = []
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        rel = rel.lstrip("/")
        if controllers == "":
            dirs.append(("v2", Path("/sys/fs/cgroup") / rel))
        elif "memory" in controllers.split(","):
            dirs.append(("v1", Path("/sys/fs/cgroup/memory") / rel))
    dirs += [("v2", Path("/sys/fs/cgroup")), ("v1", Path("/sys/fs/cgroup/memory"))]
    return dirs


def _cgroup_headroom(dirs: list[tuple[str, Path]], mem_total: int) -> int | None:
    """Bytes this cgroup may still use before its limit (reclaimable page cache counted as free),
    or None when no cgroup limit below the machine's memory applies."""
    for kind, d in dirs:
        if kind == "v2":
            limit, usage, stat_file, inactive_key = (_read_int(d / "memory.max"), _read_int(d / "memory.current"),
                                                     d / "memory.stat", "inactive_file")
        else:
            limit, usage, stat_file, inactive_key = (_read_int(d / "memory.limit_in_bytes"),
                                                     _read_int(d / "memory.usage_in_bytes"), d / "memory.stat",
                                                     "total_inactive_file")
        if limit is None or usage is None or limit >= mem_total:
            continue
        inactive = 0
        try:
            for line in stat_file.read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == inactive_key:
                    inactive = int(v)
        except (OSError, ValueError):
            pass
        return max(0, limit - usage + inactive)
    return None


class HostMemory:
    """What the host (or, under a tighter cgroup limit, our cgroup) can still give: MemAvailable, or
    the cgroup's headroom when that is smaller."""

    def __init__(self):
        self.total = _meminfo().get("MemTotal", 0)
        self._cgroups = _cgroup_dirs()

    def available(self) -> int:
        avail = _meminfo().get("MemAvailable", 0)
        cg = _cgroup_headroom(self._cgroups, self.total)
        return avail if cg is None else min(avail, cg)


def _rss(pid: int) -> int:
    """VmRSS of one process in bytes; 0 when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return 0


def _descendants(root: int) -> list[int]:
    """root and every process below it (one scan of /proc/*/stat)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the fields start after the last ')'
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) >= 2:
            children[int(fields[1])].append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


# ---------------------------------------------------------------- running a watched child
@dataclass
class MonitorResult:
    returncode: int | None  # None only if it could not be reaped
    killed_for_memory: bool = False
    timed_out: bool = False
    elapsed_s: float = 0.0
    peak_rss_bytes: int = 0  # the child's process tree, the largest sample
    last_rss_bytes: int = 0  # the last sample before it ended
    min_available_bytes: int = 0  # the lowest host available memory seen while it ran
    available_at_start_bytes: int = 0
    available_at_kill_bytes: int = 0
    stdout_tail: list = field(default_factory=list)
    stderr_tail: list = field(default_factory=list)


def run_monitored(cmd: list[str], *, env: dict | None = None, cwd: str | None = None,
                  log: Callable[[str], None] = print, host_floor_bytes: int = 4 << 30,
                  timeout_s: float = 1800.0, poll_s: float = 0.2, tail_lines: int = 40) -> MonitorResult:
    """Run cmd in a new session, stream its stdout and stderr lines through log, sample its process
    tree's RSS every poll_s (every poll_s / 10 once host memory is within 3x host_floor_bytes), and
    SIGKILL the whole session if the host's available memory falls below host_floor_bytes or it runs
    past timeout_s."""
    mem = HostMemory()
    res = MonitorResult(returncode=None)
    res.available_at_start_bytes = res.min_available_bytes = mem.available()
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", bufsize=1,
                            start_new_session=True)
    tails = {"out": collections.deque(maxlen=tail_lines), "err": collections.deque(maxlen=tail_lines)}
    log_lock = threading.Lock()

    def pump(stream, key):
        for line in stream:
            line = line.rstrip("\n")
            tails[key].append(line)
            with log_lock:
                log(line)
        stream.close()

    readers = [threading.Thread(target=pump, args=(proc.stdout, "out"), daemon=True),
               threading.Thread(target=pump, args=(proc.stderr, "err"), daemon=True)]
    for t in readers:
        t.start()

    def kill():
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child and everything it started (own session)
        except (ProcessLookupError, PermissionError):
            pass

    pids, last_scan = [proc.pid], 0.0
    while True:
        now = time.monotonic()
        if now - last_scan >= 1.0:
            pids, last_scan = _descendants(proc.pid), now
        rss = sum(_rss(p) for p in pids)
        done = proc.poll() is not None
        if rss and not done:  # a finished child reads 0: keep the last real sample
            res.last_rss_bytes = rss
            res.peak_rss_bytes = max(res.peak_rss_bytes, rss)
        if done:
            break
        avail = mem.available()
        res.min_available_bytes = min(res.min_available_bytes, avail)
        if avail < host_floor_bytes:
            res.killed_for_memory, res.available_at_kill_bytes = True, avail
            kill()
            break
        if now - t0 > timeout_s:
            res.timed_out = True
            kill()
            break
        time.sleep(poll_s / 10 if avail < 3 * host_floor_bytes else poll_s)
    try:
        res.returncode = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:  # unkillable (D state): leave it, say so
        res.returncode = None
    res.elapsed_s = time.monotonic() - t0
    for t in readers:
        t.join(timeout=5)
    res.stdout_tail, res.stderr_tail = list(tails["out"]), list(tails["err"])
    return res


# ---------------------------------------------------------------- the baseline
def _release_our_memory() -> None:
    """Give back what this process caches before the child starts: freed pinned host blocks stay in
    torch's host allocator cache (and count as used) until emptied."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            for fn in (getattr(getattr(torch, "accelerator", None), "empty_host_cache", None),
                       getattr(torch._C, "_host_emptyCache", None)):
                if fn is not None:
                    fn()
                    break
    except Exception:
        pass


def _self_rss() -> int:
    return _rss(os.getpid())


def _failed(preset: str, batch: int, seq: int, steps: int, notes: str, mon: MonitorResult | None) -> BenchResult:
    return BenchResult(name="deepspeed", model=preset, batch=batch, seq=seq, steps=steps, step_time_s=0.0,
                       tokens_per_s=0.0, model_tflops=0.0, executed_tflops=0.0, peak_device_bytes=0,
                       host_rss_bytes=mon.last_rss_bytes if mon else 0,
                       host_peak_rss_bytes=mon.peak_rss_bytes if mon else 0, notes=notes)


def bench_deepspeed(preset: str, batch: int, seq: int, steps: int, *, warmup: int = 1, log=print,
                    host_floor_bytes: int = 4 << 30, timeout_s: float = 1800.0, reentrant: bool = False,
                    python: str | None = None) -> BenchResult:
    """DeepSpeed ZeRO-3 Offload on the same model, batch and tokens as our engine's run, in a watched child.

    Always returns a BenchResult. tokens_per_s == 0 means no result; notes then say why: killed for
    host memory (with the child's peak RSS and when), timed out, deepspeed not installed, or the last
    lines of the child's stderr. host_peak_rss_bytes is the peak of the child's whole process tree.
    """
    _release_our_memory()
    repo_root = str(Path(__file__).resolve().parents[2])  # so the child finds megatrain_cli, installed or not
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([repo_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    mem = HostMemory()
    log(f"[deepspeed] starting the ZeRO-3 Offload baseline in a child process: host available "
        f"{mem.available() / GiB:.1f} of {mem.total / GiB:.1f} GiB, our RSS {_self_rss() / GiB:.1f} GiB, "
        f"kill floor {host_floor_bytes / GiB:.1f} GiB")
    with tempfile.TemporaryDirectory(prefix="megatrain-ds-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [python or sys.executable, "-u", "-m", "megatrain_cli.bench.deepspeed_child", "--model", preset,
               "--seq", str(seq), "--batch", str(batch), "--steps", str(steps), "--warmup", str(warmup),
               "--out", out] + (["--reentrant"] if reentrant else [])
        mon = run_monitored(cmd, env=env, log=log, host_floor_bytes=host_floor_bytes, timeout_s=timeout_s)
        peak, after = mon.peak_rss_bytes / GiB, mon.elapsed_s
        last_out = next((line for line in reversed(mon.stdout_tail) if line.startswith("[deepspeed]")), "")
        where = f"; last progress line: {last_out!r}" if last_out else ""
        if mon.killed_for_memory:
            notes = (f"killed: host MemAvailable fell below {host_floor_bytes / GiB:.1f} GiB "
                     f"({mon.available_at_kill_bytes / GiB:.1f} GiB left) at child peak RSS {peak:.1f} GiB "
                     f"after {after:.0f} s{where}")
        elif mon.timed_out:
            notes = f"killed: timed out after {timeout_s:.0f} s at child peak RSS {peak:.1f} GiB{where}"
        elif mon.returncode == EXIT_NO_DEEPSPEED:
            notes = ("deepspeed is not installed (pip install 'megatrain[deepspeed]', or the wheels in "
                     "shared/wheels on an offline machine)")
        elif mon.returncode == EXIT_DEEPSPEED_BROKEN:
            notes = "deepspeed failed to import: " + " | ".join(mon.stderr_tail[-3:])
        elif mon.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                data = json.load(f)
            res = from_dict(data)
            # the child's own VmHWM misses what it spawned (the cpu_adam JIT build); the sampled tree peak may miss
            # a short spike: report the larger
            res.host_peak_rss_bytes = max(res.host_peak_rss_bytes, mon.peak_rss_bytes)
            res.notes += (f"; child process: peak RSS {res.host_peak_rss_bytes / GiB:.1f} GiB, host available "
                          f"{mon.available_at_start_bytes / GiB:.1f} GiB at start, "
                          f"{mon.min_available_bytes / GiB:.1f} GiB at least, {after:.0f} s in all")
            return res
        elif mon.returncode is not None and mon.returncode < 0:
            sig = -mon.returncode
            name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else str(sig)
            guess = " (not by us: most likely the kernel's OOM killer)" if sig == signal.SIGKILL else ""
            notes = (f"killed by {name}{guess} at child peak RSS {peak:.1f} GiB after {after:.0f} s, host "
                     f"available at least {mon.min_available_bytes / GiB:.1f} GiB{where}")
        else:
            tail = " | ".join(line.strip() for line in mon.stderr_tail[-6:] if line.strip())
            notes = (f"failed (exit {mon.returncode}) at child peak RSS {peak:.1f} GiB after {after:.0f} s, host "
                     f"available at least {mon.min_available_bytes / GiB:.1f} GiB: {tail}")
    log(f"[deepspeed] no result: {notes}")
    return _failed(preset, batch, seq, steps, notes, mon)
