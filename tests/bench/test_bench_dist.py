"""`megatrain bench --gpus 2` on the CPU: two processes on gloo, tiny preset (megatrain_cli/bench/ranks.py).

The report has its keys and adds its ranks up as it says, and the two ranks train as the single-process
engine does on the same global batch (the same loop with --gpus 1 and twice the micro-batches per step).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain_cli.bench.ranks import bench_ranks
from megatrain_cli.bench.settings import BenchRun, bench_recipe

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--device", "cpu", "--seq", "64", "--batch", "2", "--steps", "2", "engine.kernels=torch",
        "model.dtype=fp32"]
REPORT_KEYS = {"name", "model", "batch", "seq", "steps", "step_time_s", "tokens_per_s", "model_tflops",
               "peak_device_bytes", "host_rss_bytes", "bytes_per_param", "losses", "world", "streamer",
               "tokens_per_s_per_gpu", "host_rss_bytes_per_param", "params", "grad_norms", "per_rank"}
RANK_KEYS = {"rank", "device", "step_time_s", "peak_device_bytes", "host_rss_bytes", "host_peak_rss_bytes",
             "host_tile_bytes", "pinned_bytes", "h2d_gbps", "d2h_gbps", "gpu_stall_on_weights_s", "threads", "split"}


def megatrain(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain_cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_two_rank_bench_reports_its_ranks_and_trains_as_one_process(tmp_path):
    out = tmp_path / "bench.json"
    p = megatrain("bench", "--gpus", "2", *TINY, "--output", out)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "dp x2" in p.stdout and "[bench] step 2" in p.stderr
    two = json.loads(out.read_text())
    assert REPORT_KEYS <= two.keys()
    assert two["world"] == 2 and two["streamer"] == "DistStreamer" and two["batch"] == 4 and two["seq"] == 64
    ranks = two["per_rank"]
    assert [r["rank"] for r in ranks] == [0, 1] and all(RANK_KEYS <= r.keys() for r in ranks)
    assert two["host_rss_bytes"] == sum(r["host_rss_bytes"] for r in ranks)
    assert two["host_rss_bytes_per_param"] == pytest.approx(two["host_rss_bytes"] / two["params"])
    assert two["step_time_s"] == max(r["step_time_s"] for r in ranks)
    assert two["steady_step_time_s"] == max(r["steady_step_time_s"] for r in ranks) > 0  # 2 timed steps
    assert "steady state (timed steps 2..2)" in two["notes"]
    assert two["tokens_per_s"] == pytest.approx(4 * 64 / two["step_time_s"])
    assert two["tokens_per_s_per_gpu"] == pytest.approx(two["tokens_per_s"] / 2)
    # Each rank holds half of the host state: the tiles add up to one process's 16 bytes/param (fp32 on CPU).
    assert 16 <= two["bytes_per_param"] < 16.5 and all(r["host_tile_bytes"] > 0 for r in ranks)

    one = bench_ranks(bench_recipe(["model.preset=tiny", "train.micro_batch_size=2", "train.seq_len=64",
                                    "train.grad_accum=2", "engine.device=cpu", "engine.kernels=torch",
                                    "model.dtype=fp32"]), BenchRun(steps=2), 1, log=lambda _: None)
    assert one["world"] == 1 and one["streamer"] == "WeightStreamer" and one["batch"] == 4
    assert len(two["losses"]) == 3  # the warm-up step and the two timed ones
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5)
    assert two["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)


def test_bench_gpus_refuses_the_options_it_does_not_take():
    p = megatrain("bench", "--gpus", "2", *TINY, "--baseline", "native")
    assert p.returncode == 2
    assert "--gpus: not with --baseline" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("fault", ["SIGINT-to-the-launcher", "SIGKILL-to-a-rank"])
def test_the_bench_launcher_and_its_ranks_end_as_one(tmp_path, fault):
    """bench --gpus 2 runs under train/supervise.py's launcher: Ctrl-C ends every rank at once (exit 130, no
    message: a bench has nothing to save), a killed rank is named and takes the other down; no process of
    the run is left either way."""
    from tests.train.test_launcher_faults import assert_all_gone, descendants

    err = tmp_path / "stderr"
    with open(err, "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "megatrain_cli", "bench", "--gpus", "2", "--model", "tiny",
                                 "--device", "cpu", "--seq", "64", "--batch", "2", "--steps", "1000",
                                 "engine.kernels=torch", "model.dtype=fp32"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=stderr)
    deadline = time.monotonic() + 180
    while "[bench] step 1" not in err.read_text():
        assert proc.poll() is None, err.read_text()[-3000:]
        assert time.monotonic() < deadline, "no step within 180 s"
        time.sleep(0.1)
    pids = descendants(proc.pid)
    ranks = [p for p in pids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(ranks) == 2, pids
    if fault == "SIGINT-to-the-launcher":
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, err.read_text()[-3000:]
        assert "error" not in err.read_text().split("[bench] step 1")[-1]
    else:
        os.kill(ranks[1], signal.SIGKILL)
        assert proc.wait(timeout=60) == 128 + signal.SIGKILL, err.read_text()[-3000:]
        assert re.search(r"error: rank [01] was killed by SIGKILL; stopping rank [01]\n", err.read_text())
    assert_all_gone(pids)
    assert "Traceback" not in err.read_text()
