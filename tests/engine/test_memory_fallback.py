"""The memory-lean fallback: a step whose short-context plan (engine/plan.make_plan) does not fit the
device budget takes the long-context machinery at any shape (batch > 1, several micro-batches, short
sequences) instead of being refused: checkpoint interval 1, a smaller loss chunk, the MLP chunked only where
that helps, checkpoints in pinned host memory as needed (long_context.plan_memory_lean).

The 14B figures are arithmetic over the preset's shape (nothing allocated); the runs are the tiny preset
on the CPU, where an explicit device budget drives the plan as on a GPU.
"""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatrain_cli.engine.plan.lean import GiB, plan_long_context, plan_memory_lean
from megatrain_cli.engine.plan.lean_terms import ModelShape, layer_saved_bytes
from megatrain_cli.engine.plan.memory import device_problem, make_plan
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.presets import PRESETS
from megatrain_cli.store.tiles import HostStore

ROOT = Path(__file__).resolve().parents[2]


def preset_adapter(name: str, vocab: int | None = None) -> ModelAdapter:
    p = PRESETS[name]
    return ModelAdapter(p.hf_config(vocab_size=vocab or p.vocab_size or 1024, max_position_embeddings=4096))


# ---------------------------------------------------------------------------------------------- 14B arithmetic
@pytest.fixture(scope="module")
def qwen14b():
    adapter = preset_adapter("14b")
    return adapter, HostStore(adapter, torch.bfloat16, allocate=False).host_bytes()


def short_plan_14b(adapter, **overrides):
    """bench's short-context plan for 14B at 8 x 4096 (its defaults: interval 4, 8192-token loss chunks)."""
    args = dict(micro_batch_size=8, seq_len=4096, grad_accum=1, checkpoint_interval=4, grad_slabs=12,
                loss_chunk_tokens=8192)
    return make_plan(adapter, torch.bfloat16, **{**args, **overrides})


def test_14b_at_8x4096_fits_24gib_on_the_memory_lean_path(qwen14b):
    adapter, store_bytes = qwen14b
    budget = 24 * GiB
    for interval in (4, 2, 1):  # no checkpoint interval makes the short-context plan fit
        assert device_problem(short_plan_14b(adapter, checkpoint_interval=interval), device=torch.device("cuda"),
                              device_budget=budget)
    # The 2-GPU machine: 251 GiB of host memory, 193 GiB of it the host store.
    plan = plan_memory_lean(adapter, seq_len=4096, micro_batch_size=8, grad_accum=1, dtype=torch.bfloat16,
                            device_type="cuda", device_budget=budget, loss_chunk_tokens=8192,
                            store_bytes_to_come=store_bytes, host_available=251 * GiB)
    assert plan.fits and plan.label == "memory-lean" and plan.checkpoint_interval == 1
    assert plan.tokens == 8 * 4096 and plan.micro_tokens == 8 * 4096
    assert 0 < plan.offloaded_checkpoints < plan.num_checkpoints == 48
    assert plan.predicted_peak <= 0.95 * budget < 24 * GiB
    assert store_bytes + plan.host_pinned_bytes <= 251 * GiB - 8 * GiB  # the engine's 7.2 GiB pinned + margin
    assert plan.host_pinned_bytes <= 40 * GiB
    # The loss chunk was halved before checkpoints were offloaded: each halving spares ~3 checkpoints.
    assert plan.loss_chunk_tokens < 8192
    assert plan.render().startswith("memory-lean plan: 8 x 4096 tokens; device budget   24.00 GiB")

    # Without the host memory for the checkpoints it recomputes some from the one before instead, and says so.
    starved = plan_memory_lean(adapter, seq_len=4096, micro_batch_size=8, grad_accum=1, dtype=torch.bfloat16,
                               device_type="cuda", device_budget=budget, loss_chunk_tokens=8192,
                               store_bytes_to_come=store_bytes, host_available=store_bytes + 12 * GiB)
    assert starved.fits and starved.dropped_checkpoints and starved.host_pinned_bytes <= starved.host_budget
    assert starved.offloads_wanted * starved.checkpoint_bytes > starved.host_budget
    assert "checkpoints recomputed from the one before" in starved.summary()


def test_lean_plan_terms_agree_with_the_short_plan(qwen14b):
    """Same shape, same quantities, one model (lean_terms): the checkpoints are the short plan's at interval 1
    (every micro-batch's hidden states, per layer), one recomputed layer's saved tensors its recompute term."""
    adapter, _ = qwen14b
    for mbs, accum in ((8, 1), (4, 2), (1, 8)):
        short = make_plan(adapter, torch.bfloat16, micro_batch_size=mbs, seq_len=4096, grad_accum=accum,
                          checkpoint_interval=1, grad_slabs=12, loss_chunk_tokens=4096)
        lean = plan_long_context(adapter, 4096, batch=mbs, grad_accum=accum, device_budget_bytes=200 * GiB,
                                 chunk_mlp=False, offload=False, loss_chunk_tokens=4096)
        assert lean.num_checkpoints * lean.checkpoint_bytes == short.device["activation checkpoints (estimate)"]
        saved = sum(layer_saved_bytes(ModelShape.of(adapter), lean.tokens, 2, mlp_chunked=False,
                                      lean_norms=False).values())
        assert saved == short.device["recomputed block activations (estimate)"]  # make_plan's recompute term
        assert sum(v for k, v in lean.phases["layer backward, MLP half"].items() if k in
                   layer_saved_bytes(ModelShape.of(adapter), 1, 2, mlp_chunked=False, lean_norms=False)) == saved

    # Micro-batches are the engine's inner loop: the step's tokens set the checkpoints and the recorded layer,
    # one micro-batch's tokens the head's chunk, SDPA's backward and the forward's temporaries.
    def plan(mbs, accum):
        return plan_long_context(adapter, 4096, batch=mbs, grad_accum=accum, device_budget_bytes=200 * GiB,
                                 chunk_mlp=False, offload=False, loss_chunk_tokens=32768)

    one, two = plan(8, 1), plan(4, 2)
    assert one.checkpoint_bytes == two.checkpoint_bytes and one.tokens == two.tokens == 2 * two.micro_tokens
    sdpa = next(k for k in one.phases["layer backward, attention half"] if k.startswith("SDPA backward"))
    assert two.phases["layer backward, attention half"][sdpa] * 2 == one.phases["layer backward, attention half"][sdpa]
    assert two.loss_chunk_tokens == 16384 == one.loss_chunk_tokens // 2  # a chunk never spans micro-batches
    assert two.phases["layer backward, MLP half"]["MLP intermediates"] == \
        one.phases["layer backward, MLP half"]["MLP intermediates"]


def test_resident_layers_are_a_term_of_the_lean_plan_and_leave_its_choices_alone(qwen14b):
    """The lean plan counts the resident layers beside it (the one device figure is its predicted peak): the
    same choices as a plan for what they leave of the budget, every figure up by exactly their bytes."""
    adapter, store_bytes = qwen14b
    resident = 20 * GiB
    args = dict(seq_len=4096, micro_batch_size=8, grad_accum=1, dtype=torch.bfloat16, device_type="cuda",
                loss_chunk_tokens=8192, store_bytes_to_come=store_bytes, host_available=store_bytes + 64 * GiB)
    beside = plan_memory_lean(adapter, device_budget=44 * GiB, resident_bytes=resident, **args)
    alone = plan_memory_lean(adapter, device_budget=24 * GiB, **args)
    assert alone.fits and 0 < alone.offloaded_checkpoints  # the test's point: a budget that makes it choose
    assert beside.fixed["resident layers + head (master, moments, weights, gradient)"] == resident
    assert (beside.offloaded_checkpoints, beside.mlp_chunk_tokens, beside.loss_chunk_tokens, beside.fits) == \
        (alone.offloaded_checkpoints, alone.mlp_chunk_tokens, alone.loss_chunk_tokens, alone.fits)
    assert beside.predicted_peak - alone.predicted_peak == beside.usable - alone.usable == resident
    assert beside.budget == 44 * GiB and "resident layers + head" in beside.render()


# ---------------------------------------------------------------------------------------------- bench
BATCH, SEQ, ACCUM = 2, 32, 2


def offloading_bench_budget() -> tuple[int, object]:
    """A device budget under the tiny bench's short-context plan whose memory-lean plan offloads 2 of the 4
    checkpoints (the bench's own planners, fp32 on CPU): one checkpoint under the peak of the plan that
    offloads none (the first offloaded checkpoint only pays for the one in flight)."""
    adapter = preset_adapter("tiny")
    args = dict(seq_len=SEQ, micro_batch_size=BATCH, grad_accum=ACCUM, dtype=torch.float32, device_type="cpu",
                loss_chunk_tokens=8192)
    free = plan_memory_lean(adapter, device_budget=GiB, **args)
    budget = int((free.predicted_peak - free.checkpoint_bytes) / 0.95) + 1
    lean = plan_memory_lean(adapter, device_budget=budget, **args)
    short = make_plan(adapter, torch.float32, micro_batch_size=BATCH, seq_len=SEQ, grad_accum=ACCUM,
                      checkpoint_interval=4, grad_slabs=12, loss_chunk_tokens=8192, device_type="cpu")
    assert lean.fits and lean.offloaded_checkpoints == 2 and short.device_total > 0.95 * budget
    return budget, lean


def bench_tiny(monkeypatch, *overrides: str):
    """The bench on the tiny preset (fp32 on CPU, 2 x 32 tokens, 2 micro-batches, 1 warm-up + 2 steps, recipe
    `overrides`) over a store we keep: (store, result, log lines, the engine that ran)."""
    from megatrain_cli.bench.runner import run_bench
    from megatrain_cli.bench.settings import BenchRun, bench_recipe
    from megatrain_cli.engine import step as engine_step
    from megatrain_cli.models.loader import build_store

    p = PRESETS["tiny"]
    store = build_store(p.hf_config(vocab_size=1024, max_position_embeddings=4096), torch.float32, seed=0)
    engines, real_step = [], engine_step.Engine.step
    monkeypatch.setattr(engine_step.Engine, "step",
                        lambda self, *a, **k: engines.append(self) or real_step(self, *a, **k))
    lines = []
    r = bench_recipe(["model.preset=tiny", "model.dtype=fp32", "engine.device=cpu", f"train.micro_batch_size={BATCH}",
                      f"train.seq_len={SEQ}", f"train.grad_accum={ACCUM}", *overrides])
    res = run_bench(r, BenchRun(steps=2), store=store, log=lines.append)
    return store, res, lines, engines[0]


def test_bench_falls_back_to_the_memory_lean_path_and_trains_like_the_ordinary_one(monkeypatch):
    budget, lean = offloading_bench_budget()
    ref_store, ref, _, ref_engine = bench_tiny(monkeypatch)
    assert ref_engine.plan.lean is None and ref_engine.interval == 4 and "memory-lean" not in ref.notes

    store, res, lines, engine = bench_tiny(monkeypatch, f"engine.max_gpu_mem={budget}B")
    text = "\n".join(lines)
    assert "memory-lean plan: 2 x 32 tokens x 2 micro-batches" in text and "memory-lean path (" in text
    assert res.notes.startswith("memory-lean path: checkpoint interval 1")
    assert "2 of 4 checkpoints offloaded" in res.notes
    assert "checkpoint_interval=1" in res.notes and "keep_blocks=0" in res.notes
    assert engine.interval == 1 and engine.keep_blocks == frozenset() and engine.chunk == lean.loss_chunk_tokens
    assert engine.plan.lean.offloaded_checkpoints == 2
    # Both offloaded checkpoints of both micro-batches went out and came back, every step (3 with the warm-up).
    moved = 3 * 2 * ACCUM * BATCH * SEQ * 128 * 4
    assert engine.offloader.d2h_bytes == engine.offloader.h2d_bytes == moved and engine.offloader.late_gets == 0

    assert res.losses == pytest.approx(ref.losses, rel=1e-5)
    for name, tile in ref_store.tiles.items():
        torch.testing.assert_close(store.tiles[name].master, tile.master, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name}: {m}")


def test_bench_refuses_when_the_lean_plan_does_not_fit_either_or_without_the_fallback(monkeypatch):
    from megatrain_cli.bench.runner import DoesNotFit

    budget, _ = offloading_bench_budget()
    with pytest.raises(DoesNotFit, match="device memory: the plan needs") as err:
        bench_tiny(monkeypatch, f"engine.max_gpu_mem={budget}B", "engine.memory_fallback=false")
    assert "memory-lean" not in str(err.value)
    with pytest.raises(DoesNotFit) as err:
        bench_tiny(monkeypatch, "engine.max_gpu_mem=1MiB")
    assert "device memory: the plan needs about" in str(err.value)
    assert "memory-lean path: predicted device peak" in str(err.value)


def test_bench_cli_takes_the_lean_path_and_its_flag_refuses(tmp_path):
    budget, _ = offloading_bench_budget()
    args = [sys.executable, "-m", "megatrain_cli", "bench", "--model", "tiny", "--device", "cpu", "--seq", str(SEQ),
            "--batch", str(BATCH), "--grad-accum", str(ACCUM), "--steps", "1", "logging.dashboard='off'",
            "model.dtype=fp32", f"engine.max_gpu_mem={budget}B"]
    p = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "notes (megatrain): memory-lean path: checkpoint interval 1" in p.stdout
    p = subprocess.run([*args, "engine.memory_fallback=false"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3 and "device memory" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------------------------- train
def tiny_recipe(*extra: str):
    from megatrain_cli.recipe import load_recipe

    return load_recipe(ROOT / "recipes" / "tiny.yaml", ["engine.device=cpu", "train.grad_accum=2", *extra])


def lean_train_budget() -> int:
    """engine.max_gpu_mem under the tiny recipe's short-context plan (8 x 256 tokens, 2 micro-batches)
    whose memory-lean plan fits by offloading 2 checkpoints (see offloading_bench_budget)."""
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.train.setup import model_config

    r = tiny_recipe()
    adapter = ModelAdapter(model_config(r, load_tokenizer(r.model)))
    free = plan_memory_lean(adapter, seq_len=256, micro_batch_size=8, grad_accum=2, dtype=torch.float32,
                            device_type="cpu", device_budget=GiB)
    return int((free.predicted_peak - free.checkpoint_bytes) / 0.95) + 1


def test_dry_run_prints_the_memory_lean_path(capsys):
    from megatrain_cli.train.loop import run_training

    assert run_training(tiny_recipe(f"engine.max_gpu_mem={lean_train_budget()}B"), dry_run=True) == 0
    out = capsys.readouterr().out
    assert "path: memory-lean engine (the short-context plan needs about" in out
    assert "checkpoint interval 1" in out and "2 of 4 checkpoints offloaded" in out
    assert "memory-lean plan: 8 x 256 tokens x 2 micro-batches" in out and "fits" in out
    assert out.index("memory plan for") < out.index("path: memory-lean") < out.index("memory-lean plan:")
    assert "would not fit" not in out
    # One device figure: the lean plan's; the memory plan above it holds the host figures only.
    assert "device, peak" not in out and "replaces them" not in out

    # The recipe as it is (no budget on CPU): the short-context path.
    assert run_training(tiny_recipe(), dry_run=True) == 0
    out = capsys.readouterr().out
    assert "path: short-context engine" in out and "device, peak (estimate)" in out


def test_train_runs_the_memory_lean_path_or_refuses_with_both_plans(tmp_path, capsys):
    from megatrain_cli.train.loop import run_training

    out = tmp_path / "lean"
    common = ["train.steps=1", "eval.enabled=false", "logging.dashboard=plain", "logging.every_n_steps=1",
              "checkpoint.every_n_steps=null", "checkpoint.export_final=false"]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        code = run_training(tiny_recipe(*common, f"engine.max_gpu_mem={lean_train_budget()}B", f"output_dir={out}"))
    assert code == 0, log.getvalue()
    assert "memory-lean path: 2 of 4 checkpoints in host memory" in log.getvalue()
    assert (out / "metrics.jsonl").read_text().strip()

    nofit = tmp_path / "nofit"
    assert run_training(tiny_recipe(*common, "engine.max_gpu_mem=1MiB", f"output_dir={nofit}")) == 3
    err = capsys.readouterr().err
    assert "the short-context plan needs about" in err and "the memory-lean plan does not fit either" in err
    assert "predicted device peak" in err and "--force" in err
    assert not (nofit / "metrics.jsonl").exists()
