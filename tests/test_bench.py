"""`megatrain bench` on the CPU with the tiny preset: the timed step loop every path shares
(bench/loop.run_timed_steps) runs the steps a plain engine runs, and `--layers` runs a model of that many
layers and says so in the result, the table and the JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain_cli.bench.loop import synthetic_batch
from megatrain_cli.bench.result import BenchResult, format_table, model_label
from megatrain_cli.bench.runner import run_bench
from megatrain_cli.bench.settings import BenchRun, bench_model_config, bench_recipe
from megatrain_cli.engine.step import Engine
from megatrain_cli.models.loader import build_store
from megatrain_cli.recipe import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def cpu_recipe(*overrides: str, preset: str = "tiny", batch: int = 2, seq: int = 32, accum: int = 1):
    """recipes/bench.yaml on the CPU in fp32 (as bench ran there before the recipe), with this shape."""
    return bench_recipe([f"model.preset={preset}", "model.dtype=fp32", "engine.device=cpu",
                         f"train.micro_batch_size={batch}", f"train.seq_len={seq}", f"train.grad_accum={accum}",
                         *overrides])


def plain_engine_losses(preset: str, batch: int, seq: int, *, accum: int = 1, steps: int, layers: int | None = None):
    """Every step's loss of a plain engine (no pipelined optimizer, no plan) on the bench's store and batches."""
    config = bench_model_config(cpu_recipe(preset=preset, seq=seq), layers)
    engine = Engine(build_store(config, torch.float32, seed=0),
                    TrainConfig(steps=steps, lr=1e-5, max_grad_norm=1.0, grad_accum=accum, micro_batch_size=batch,
                                seq_len=seq), device=torch.device("cpu"))
    losses = [engine.step([synthetic_batch(config.vocab_size, batch, seq, seed=s * 97 + k) for k in range(accum)],
                          1e-5).loss for s in range(steps)]
    engine.close()
    return losses


def capture_engines(monkeypatch) -> list[Engine]:
    from megatrain_cli.engine import step as engine_step

    engines, real_step = [], engine_step.Engine.step
    monkeypatch.setattr(engine_step.Engine, "step",
                        lambda self, *a, **k: engines.append(self) or real_step(self, *a, **k))
    return engines


def test_bench_engine_runs_the_plain_engines_steps(monkeypatch):
    engines = capture_engines(monkeypatch)
    lines = []
    res = run_bench(cpu_recipe(batch=2, seq=32, accum=2), BenchRun(steps=2, warmup=1), log=lines.append)
    assert res.model == "tiny" and res.steps == 2 and res.batch == 4 and res.seq == 32
    assert res.losses == pytest.approx(plain_engine_losses("tiny", 2, 32, accum=2, steps=3), rel=1e-5)
    assert res.step_time_s > 0 and res.tokens_per_s == pytest.approx(4 * 32 / res.step_time_s)
    assert set(res.split) == {"forward", "head", "backward", "optimizer", "wait_optimizer", "gpu_stall_on_weights"}
    assert res.extrapolated == {} and "h2d_layer_transfers=" in res.notes
    assert [line.split(":")[0] for line in lines if line.startswith("[bench] step")] == \
        ["[bench] step 0 (warm-up)", "[bench] step 1", "[bench] step 2"]
    # The short-context path has no per-layer clock (no extra syncs).
    assert engines[0].on_op is None


def test_bench_engine_layers_runs_that_many_layers_and_says_so(monkeypatch):
    engines = capture_engines(monkeypatch)
    res = run_bench(cpu_recipe(batch=2, seq=32), BenchRun(steps=1, warmup=1, layers=2), log=lambda m: None)
    assert engines[0].adapter.num_layers == 2 and res.model == "tiny[2 of 4 layers]"
    assert res.losses == pytest.approx(plain_engine_losses("tiny", 2, 32, steps=2, layers=2), rel=1e-5)
    table = format_table([res])
    assert "tiny[2 of 4 layers]" in table
    header, row = table.splitlines()
    w = len(res.model) + 1  # the model column widens to the longest name
    assert header[11:11 + w] == "model".ljust(w) and row[11:11 + w] == res.model + " "
    assert model_label("tiny", 4) == "tiny" and model_label("tiny", None) == "tiny"
    with pytest.raises(ValueError, match="layers must be >= 1"):
        bench_model_config(cpu_recipe(), 0)


def test_format_table_keeps_its_layout_for_preset_names():
    r = BenchResult(name="megatrain", model="7b", batch=8, seq=4096, steps=3, step_time_s=1.0, tokens_per_s=1.0,
                    model_tflops=1.0, executed_tflops=1.0, peak_device_bytes=0, host_rss_bytes=0)
    assert format_table([r]).splitlines()[1].startswith("megatrain  7b     8x4096")


def megatrain_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatrain_cli", "bench", "--model", "tiny", "--device", "cpu",
                           "--steps", "1", "logging.dashboard='off'", "model.dtype=fp32", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def test_bench_cli_layers_in_json_and_refused_where_it_cannot_apply():
    p = megatrain_bench("--seq", "32", "--batch", "2", "--layers", "3", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    (res,) = json.loads(p.stdout)
    assert res["model"] == "tiny[3 of 4 layers]" and res["steps"] == 1
    p = megatrain_bench("--layers", "0")
    assert p.returncode == 2 and "--layers" in p.stderr and "Traceback" not in p.stderr
    p = megatrain_bench("--layers", "2", "--baseline", "deepspeed")
    assert p.returncode == 2 and "DeepSpeed" in p.stderr


def test_steady_state_is_the_mean_of_the_timed_steps_after_the_first():
    from megatrain_cli.bench.loop import TimedSteps

    assert TimedSteps(step_times=[1.0]).steady_step_s() is None
    assert TimedSteps(step_times=[3.5, 4.5, 4.6]).steady_step_s() == pytest.approx(4.55)
    res = run_bench(cpu_recipe(batch=2, seq=32), BenchRun(steps=3, warmup=1), log=lambda m: None)
    assert res.steady_step_time_s > 0 and "steady state (timed steps 2..3" in res.notes
    one = run_bench(cpu_recipe(batch=2, seq=32), BenchRun(steps=1, warmup=1), log=lambda m: None)
    assert one.steady_step_time_s == 0.0 and "steady state" not in one.notes


def test_old_bench_flags_are_answered_with_the_recipe_key_that_replaced_them():
    """bench's settings flags became recipe keys (issue #17): an old command line fails with its fix,
    a value it took is not mistaken for the recipe, and unknown options are refused too."""
    from megatrain_cli.bench.settings import split_args

    recipe, overrides, problems = split_args(["--checkpoint-interval", "2", "engine.sdpa=flash", "--device-cast",
                                              "--no-speculation", "my.yaml", "--max-gpu-mem=24GiB", "--fast"])
    assert recipe == "my.yaml" and overrides == ["engine.sdpa=flash"]
    assert problems == ["--checkpoint-interval: now a recipe key: engine.checkpoint_interval=N",
                        "--device-cast: removed (the feature is gone)",
                        "--no-speculation: now a recipe key: engine.speculate_optimizer=false",
                        "--max-gpu-mem: now a recipe key: engine.max_gpu_mem=24GiB",
                        "--fast: no such option of `megatrain bench` (engine settings are recipe keys, key.sub=value; "
                        "`megatrain bench --help` lists them)"]


def test_a_bench_row_records_the_probe_and_the_planners_prediction(tmp_path):
    """BenchRun(predict=True), as `megatrain bench` runs: the probe (cached in the folder given) and the
    planner's predicted step for the plan that ran, for the step the run was (clipped here: random init),
    beside the measured one; a second row reuses the cached probe."""
    lines = []
    run = BenchRun(steps=2, warmup=1, predict=True, probe_cache=str(tmp_path))
    res = run_bench(cpu_recipe(batch=2, seq=32), run, log=lines.append)
    pred = res.predicted
    assert pred["clipped"] == all(n > 1.0 for n in res.grad_norms) and len(res.grad_norms) == 2
    assert pred["step_s"] > 0 and set(pred["phases"]) == {"forward", "head", "backward", "serial"}
    assert pred["probe"]["adamw_params_per_s"] > 0 and pred["layer"]["tokens"] == 64
    assert any(line.startswith(f"[bench] predicted {pred['step_s']:.3f} s/step") for line in lines)
    assert "predicted by the planner" in format_table([res])
    cached = list(tmp_path.glob("*.json"))
    assert len(cached) == 1
    before = cached[0].stat().st_mtime_ns
    again = run_bench(cpu_recipe(batch=2, seq=32), run, log=lambda m: None)
    assert again.predicted["probe"] == pred["probe"] and cached[0].stat().st_mtime_ns == before


@pytest.mark.parametrize("device,index", [(torch.device("cuda"), 3), (torch.device("cuda", 1), 1)])
def test_max_gpu_mem_caps_the_allocator_of_an_indexed_device(monkeypatch, device, index):
    """`bench engine.max_gpu_mem=24GiB` on CUDA crashed after its plan: the planner's torch.device('cuda') has
    no index, which set_per_process_memory_fraction refuses. Here torch.cuda stands in, checking as torch does."""
    from torch.cuda._utils import _get_device_index

    from megatrain_cli.bench.runner import cap_device_memory

    capped = []

    class Props:
        total_memory = 96 * 2**30

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, d: capped.append((fraction, _get_device_index(d))))
    cap_device_memory(24 * 2**30, device)
    assert capped == [(0.25, index)]
