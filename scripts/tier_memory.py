"""What a `megatrain train` run holds in host memory, sampled from outside every 10 ms: the process's RSS split
as the kernel counts it (RssAnon: the tiles in memory; RssFile: file pages mapped in, the disk tier's among
them; RssShmem), and the machine's page cache (Cached in /proc/meminfo, which counts the tier's file pages
whether mapped or not). Peaks over the steady steps only (from step 1's line in output_dir/metrics.jsonl to the end; output_dir= is required), each
against the same run without the tier it is compared with. Used for docs/perf-notes.md ("The disk tier's
memory"); Linux only.

    python scripts/tier_memory.py -- recipes/tiny.yaml model.preset=0.5b train.steps=4 ...

Every argument after `--` goes to `megatrain train`. Costs: one run; the sampling reads two /proc files.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def _status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in FIELDS:
                out[key] = int(rest.split()[0]) << 10
    return out


def _cached() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Cached:"):
                return int(line.split()[1]) << 10
    return 0


def main(argv: list[str]) -> int:
    args = argv[argv.index("--") + 1:] if "--" in argv else argv
    cached0 = _cached()
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_cli", "train", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("output_dir=")))
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    peak = {k: 0 for k in (*FIELDS, "Cached+")}
    whole = dict(peak)
    while proc.poll() is None:
        try:
            now = {**_status(proc.pid), "Cached+": _cached() - cached0}
        except (FileNotFoundError, ProcessLookupError):
            break
        steady = (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").stat().st_size > 0  # step 1 logged
        for k, v in now.items():
            whole[k] = max(whole[k], v)
            if steady:
                peak[k] = max(peak[k], v)
        time.sleep(0.01)
    proc.wait()
    reader.join(timeout=5)
    if proc.returncode != 0:
        sys.stdout.write("".join(lines[-30:]))
        return proc.returncode
    mib = lambda d: "  ".join(f"{k} {v / 2**20:8.0f} MiB" for k, v in d.items())  # noqa: E731
    print("run, peaks over the steady steps:", mib(peak))
    print("run, peaks over the whole run:   ", mib(whole))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
