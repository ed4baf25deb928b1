"""The DeepSpeed baseline's process watcher and its failure rows (CPU; deepspeed not needed)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

from megatrain_cli.bench import deepspeed as dsb
from megatrain_cli.bench import deepspeed_child as dsr

PY = sys.executable


def _py(code: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(code)]


def test_monitor_streams_output_and_records_peak_rss():
    lines = []
    code = """
        import time
        chunks = []
        for i in range(6):
            chunks.append(bytearray(40 << 20))  # zero-filled: resident at once
            print(f"allocated {(i + 1) * 40} MiB", flush=True)
            time.sleep(0.1)
        time.sleep(0.5)
    """
    res = dsb.run_monitored(_py(code), log=lines.append, host_floor_bytes=0, poll_s=0.05)
    assert res.returncode == 0 and not res.killed_for_memory and not res.timed_out
    assert lines[-1] == "allocated 240 MiB" and res.stdout_tail[-1] == "allocated 240 MiB"
    assert res.peak_rss_bytes > 200 << 20  # 240 MiB allocated, plus the interpreter
    assert res.last_rss_bytes > 0 and res.min_available_bytes > 0


def test_monitor_counts_the_childs_children():
    code = f"""
        import subprocess, sys
        subprocess.run([{PY!r}, "-c", "import time; b = bytearray(300 << 20); time.sleep(2.5)"], check=True)
    """
    res = dsb.run_monitored(_py(code), log=lambda _: None, host_floor_bytes=0, poll_s=0.05)
    assert res.returncode == 0
    assert res.peak_rss_bytes > 300 << 20  # the grandchild's 300 MiB is in the tree's peak


def test_monitor_kills_below_the_memory_floor():
    res = dsb.run_monitored(_py("import time; time.sleep(30)"), log=lambda _: None, host_floor_bytes=1 << 60)
    assert res.killed_for_memory and res.returncode == -9
    assert res.elapsed_s < 10 and res.peak_rss_bytes > 0


def test_monitor_kills_on_timeout_and_keeps_stderr():
    code = """
        import sys, time
        print("about to hang", file=sys.stderr, flush=True)
        time.sleep(30)
    """
    res = dsb.run_monitored(_py(code), log=lambda _: None, host_floor_bytes=0, timeout_s=1.0)
    assert res.timed_out and res.returncode == -9 and res.elapsed_s < 10
    assert res.stderr_tail == ["about to hang"]


def test_bench_deepspeed_killed_for_memory_is_a_row():
    logged = []
    r = dsb.bench_deepspeed("tiny", 2, 64, 1, log=logged.append, host_floor_bytes=1 << 60, timeout_s=60)
    assert r.name == "deepspeed" and r.model == "tiny" and r.batch == 2 and r.seq == 64
    assert r.tokens_per_s == 0 and r.step_time_s == 0
    assert r.notes.startswith("killed: host MemAvailable fell below 1073741824.0 GiB")
    assert "at child peak RSS" in r.notes and r.host_peak_rss_bytes > 0
    assert any("no result: killed" in line for line in logged)


def test_bench_deepspeed_not_installed(monkeypatch, tmp_path):
    # deepspeed hidden from the child, installed or not: a sitecustomize on its path blocks the import
    # (a None in sys.modules: find_spec answers None, import raises ImportError).
    (tmp_path / "sitecustomize.py").write_text('import sys\nsys.modules["deepspeed"] = None\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    r = dsb.bench_deepspeed("tiny", 2, 64, 1, log=lambda _: None, timeout_s=60)
    assert r.tokens_per_s == 0 and r.notes.startswith("deepspeed is not installed")


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is not None, reason="deepspeed is installed here")
def test_bench_deepspeed_really_not_installed():
    assert subprocess.run([PY, "-c", "import deepspeed"], capture_output=True).returncode != 0
    r = dsb.bench_deepspeed("tiny", 2, 64, 1, log=lambda _: None, timeout_s=60)
    assert r.tokens_per_s == 0 and r.notes.startswith("deepspeed is not installed")


def test_bench_deepspeed_failure_carries_stderr():
    r = dsb.bench_deepspeed("tiny", 2, 64, 0, log=lambda _: None, timeout_s=60)  # --steps 0: argparse error
    assert r.tokens_per_s == 0 and r.notes.startswith("failed (exit 2)")
    assert "--steps must be >= 1" in r.notes


def test_synthetic_tokens_are_bench_s():
    from megatrain_cli.bench.loop import synthetic_batch

    for s in range(3):
        mb = synthetic_batch(1024, 2, 16, seed=s * 97)
        assert (dsr.synthetic_ids(1024, 2, 16, seed=s * 97) == mb.input_ids).all()


def test_ds_config_is_zero3_offload_with_pinned_cpu():
    cfg = dsr.ds_config(8)
    z = cfg["zero_optimization"]
    assert z["stage"] == 3 and z["overlap_comm"] and z["contiguous_gradients"]
    assert z["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert z["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert cfg["bf16"] == {"enabled": True} and cfg["gradient_clipping"] == 1.0
    assert cfg["train_batch_size"] == cfg["train_micro_batch_size_per_gpu"] == 8
    assert all(isinstance(v, int) for k, v in z.items() if k.endswith(("size", "threshold", "parameters", "distance")))
    assert "ZeRO-3" in dsr.config_summary(cfg)


def test_host_memory_reads_this_machine():
    mem = dsb.HostMemory()
    assert 0 < mem.available() <= mem.total
