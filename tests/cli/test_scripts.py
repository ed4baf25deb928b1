"""The measurement scripts behind docs/benchmarks.md run (tiny sizes, CPU): a broken script would cost a
GPU call to find out."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_bench_variants_runs_each_variant_with_its_engine_settings(tmp_path):
    out = tmp_path / "v.json"
    p = run("scripts/bench_variants.py", "--model", "tiny", "--seq", "64", "--batch", "2", "--steps", "2",
            "--out", str(out), "engine.device=cpu", "model.dtype=fp32", "--variant", "torch:engine.host_adamw=torch",
            "--variant", "cpp:engine.host_adamw=cpp,engine.defer_moments=false,engine.adamw_threads=1",
            "--variant", "short:train.seq_len=32,train.micro_batch_size=1")
    assert p.returncode == 0, p.stderr[-2000:]
    results = json.loads(out.read_text())
    assert list(results) == ["torch", "cpp", "short"]
    assert "host_adamw=torch" in results["torch"]["notes"]
    assert "host_adamw=cpp defer_moments=False" in results["cpp"]["notes"]
    assert (results["short"]["batch"], results["short"]["seq"]) == (1, 32)
    assert "steady state (timed steps 2..2" in results["torch"]["notes"]
    assert all(r["predicted"]["step_s"] > 0 for r in results.values())  # the planner's, for each plan that ran


def test_time_checkpoint_round_trips(tmp_path):
    out = tmp_path / "ckpt.json"
    p = run("scripts/time_checkpoint.py", "--model", "tiny", "--dir", str(tmp_path / "ckpt"), "--out", str(out))
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["round_trip_equal"] and result["checkpoint_bytes"] > 0 and result["load_s"] > 0


def test_packing_efficiency_prints_best_fit_greedy_and_the_bound():
    p = run("scripts/packing_efficiency.py", "--synthetic", "64,1.0", "--tokens", "20000", "--seq", "512")
    assert p.returncode == 0, p.stderr[-2000:]
    row = p.stdout.strip().splitlines()[-1].split("|")
    assert row[1].strip() == "synthetic log-normal mean 64 spread 1.0" and row[2].strip() == "512"
    best, greedy, bound = (int(cell.split()[0]) for cell in row[6:9])
    assert bound <= best <= greedy
