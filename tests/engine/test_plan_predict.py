"""The measured planner (issue #22): the predictor's arithmetic on hand-made probe figures, the probe's cache,
and `megatrain plan` on the tiny recipe. CPU only, except the two tests marked cuda (the probe's GPU parts):
`python3 -m pytest -q -m cuda tests/engine/test_plan_predict.py` on the GPU machine."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatrain_cli.engine.plan import predict as pr
from megatrain_cli.engine.plan import probe as pb
from megatrain_cli.engine.plan.predict import Candidate, ModelFigures, StepShape, predict
from megatrain_cli.engine.plan.probe import LayerTiming, MachineFigures
from tests.helpers_bad_inputs import TINY, megatrain, refused

FIG = MachineFigures(host="h", gpu="G", torch="t", h2d_gbps=50.0, d2h_gbps=50.0, duplex_gbps=40.0,
                     adamw_params_per_s=5e9, adamw_under_dma_params_per_s=3e9, adamw_kernel="cpp",
                     emit_params_per_s=6e9, emit_under_dma_params_per_s=4e9, cast_elems_per_s=10e9,
                     gemm_tflops=800.0, device_gbps=4000.0)
LAYER = LayerTiming(forward_s=0.030, backward_s=0.060, tokens=32768, device="cuda")
MODEL = ModelFigures(num_layers=8, layer_params=2e8, head_params=int(5e8), embed_params=int(5e8),
                     lm_head_params=int(5e8), hidden=4096, width=2)
SHAPE = StepShape(micro_batch_size=8, seq_len=4096, grad_accum=2)
# A GPU-bound machine (host and link far faster than the compute): every phase is GPU time alone.
QUICK = dataclasses.replace(FIG, h2d_gbps=1e4, d2h_gbps=1e4, duplex_gbps=1e4, adamw_params_per_s=1e13,
                            adamw_under_dma_params_per_s=1e13, emit_params_per_s=1e13,
                            emit_under_dma_params_per_s=1e13, cast_elems_per_s=1e13)
SMALL = dict(tile_bytes=1 << 20, link_bytes=1 << 20, gemm_n=256, reps=1)  # a probe in well under a second


def test_all_layers_resident_leave_nothing_on_the_link():
    streamed = predict(FIG, LAYER, MODEL, SHAPE, Candidate(4, 0, 0))
    resident = predict(FIG, LAYER, MODEL, SHAPE, Candidate(4, 0, MODEL.num_layers))
    head_h2d = MODEL.head_params * 2 / 50e9
    assert resident.parts["pcie"] == 0.0  # no layer crosses, nor the head (resident with them)
    assert streamed.parts["pcie"] > 10 * head_h2d
    # no layer waits for the host or the link: the forward is the GPU's, all micro-batches
    assert resident.phases["forward"] == pytest.approx(MODEL.num_layers * LAYER.forward_s * 2)
    assert resident.parts["host"] < streamed.parts["host"] / 3
    assert resident.total is not None and streamed.total is not None


def test_doubling_the_link_halves_the_pcie_term():
    fast = dataclasses.replace(FIG, h2d_gbps=100.0, d2h_gbps=100.0, duplex_gbps=80.0)
    for cand in (Candidate(4, 0, 0), Candidate(2, 1, 3), Candidate(1, 0, 0, path="memory-lean", offloaded_checkpoints=5)):
        slow_p, fast_p = predict(FIG, LAYER, MODEL, SHAPE, cand), predict(fast, LAYER, MODEL, SHAPE, cand)
        assert fast_p.parts["pcie"] == pytest.approx(slow_p.parts["pcie"] / 2)


def test_recompute_adds_the_forward_of_the_recomputed_layers():
    quick = QUICK
    blocks = 2  # 8 layers, interval 4
    none_kept = predict(quick, LAYER, MODEL, SHAPE, Candidate(4, 0, 0))
    one_kept = predict(quick, LAYER, MODEL, SHAPE, Candidate(4, 1, 0))
    all_kept = predict(quick, LAYER, MODEL, SHAPE, Candidate(4, blocks, 0))
    f = LAYER.forward_s * SHAPE.grad_accum
    assert none_kept.phases["backward"] - all_kept.phases["backward"] == pytest.approx(8 * f)
    assert one_kept.phases["backward"] - all_kept.phases["backward"] == pytest.approx(4 * f)
    assert none_kept.parts["gpu"] - all_kept.parts["gpu"] == pytest.approx(8 * f)
    assert none_kept.phases["forward"] == pytest.approx(all_kept.phases["forward"])


def test_the_engines_own_op_timings_drive_the_gpu_terms():
    """A recomputed layer costs its forward WITH autograd in the backward, a kept block's forward is that
    recorded forward too, the head is the probed head, and the step's fixed work is counted once."""
    timed = dataclasses.replace(LAYER, recorded_s=0.040, head_s=0.050, fixed_s=0.005)
    a, layers = SHAPE.grad_accum, MODEL.num_layers
    none_kept = predict(QUICK, timed, MODEL, SHAPE, Candidate(4, 0, 0))
    all_kept = predict(QUICK, timed, MODEL, SHAPE, Candidate(4, 2, 0))
    assert none_kept.phases["backward"] - all_kept.phases["backward"] == pytest.approx(layers * 0.040 * a)
    assert all_kept.phases["backward"] == pytest.approx(layers * 0.060 * a + 0.005 * a)
    assert all_kept.phases["forward"] - none_kept.phases["forward"] == pytest.approx(layers * (0.040 - 0.030) * a)
    assert none_kept.phases["head"] == pytest.approx(0.050 * a)
    untimed_head = predict(QUICK, LAYER, MODEL, SHAPE, Candidate(4, 0, 0))  # an older cache: the FLOP-rate head
    assert untimed_head.phases["head"] == pytest.approx(6 * MODEL.lm_head_params * 8 * 4096 * a /
                                                        (6 * MODEL.layer_params * LAYER.tokens / 0.090))


def test_a_rebuilt_checkpoint_costs_one_more_layer_forward():
    lean = Candidate(1, 0, 0, path="long-context", offloaded_checkpoints=2)
    rebuilt = dataclasses.replace(lean, rebuilt_checkpoints=3)
    a, b = predict(QUICK, LAYER, MODEL, SHAPE, lean), predict(QUICK, LAYER, MODEL, SHAPE, rebuilt)
    assert b.phases["backward"] - a.phases["backward"] == pytest.approx(3 * LAYER.forward_s * SHAPE.grad_accum)


def test_a_clipped_step_waits_for_the_host_update_in_the_forward():
    slow_host = dataclasses.replace(FIG, emit_params_per_s=1e9, emit_under_dma_params_per_s=1e9)
    clipped = predict(slow_host, LAYER, MODEL, SHAPE, Candidate(4, 0, 0))
    free = predict(slow_host, LAYER, MODEL, dataclasses.replace(SHAPE, clipped=False), Candidate(4, 0, 0))
    assert clipped.phases["forward"] == pytest.approx(MODEL.num_layers * MODEL.layer_params / 1e9)  # host-bound
    assert free.phases["forward"] == pytest.approx(MODEL.num_layers * LAYER.forward_s * 2)  # GPU-bound


def test_coded_moments_are_priced_at_their_own_measured_rate():
    """bf16 / int8 moments update in one pass whose coding is arithmetic: its probed params/s price it (the
    session-14 7B int8 step ran 2.3x the bytes-based prediction); a probe without that rate falls back to bytes."""
    shape = dataclasses.replace(SHAPE, moments="int8")
    host_bound = dataclasses.replace(FIG, adamw_params_per_s=1e9, adamw_under_dma_params_per_s=1e9)  # 26 GB/s

    def forward(rate):
        fig = host_bound if rate is None else dataclasses.replace(
            host_bound, state_params_per_s={"int8": rate}, state_under_dma_params_per_s={"int8": rate})
        return predict(fig, LAYER, MODEL, shape, Candidate(4, 0, 0)).phases["forward"]

    layer_params, cast = MODEL.layer_params, MODEL.layer_params / FIG.cast_elems_per_s
    assert forward(1e9) == pytest.approx(MODEL.num_layers * (layer_params / 1e9 + cast))  # each layer waits for it
    assert forward(1e9) - forward(2e9) == pytest.approx(MODEL.num_layers * layer_params * (1 / 1e9 - 1 / 2e9))
    by_bytes = 26e9 / pr.state_update_bytes("int8")  # params/s of 18 bytes each at the fp32 pass's 26 GB/s
    assert forward(None) == pytest.approx(forward(by_bytes))  # no rate: its bytes, as before
    assert forward(None) < forward(1e9)
    # bf16 masters rounded stochastically: their own rate where probed, else the moments' own
    sr = dataclasses.replace(shape, masters="bf16-stochastic")
    both = dataclasses.replace(host_bound, state_params_per_s={"int8": 2e9, "int8+bf16-stochastic": 1e9})
    only = dataclasses.replace(host_bound, state_params_per_s={"int8": 1e9})
    assert predict(both, LAYER, MODEL, sr, Candidate(4, 0, 0)).phases["forward"] == pytest.approx(forward(1e9))
    assert predict(only, LAYER, MODEL, sr, Candidate(4, 0, 0)).phases["forward"] == pytest.approx(forward(1e9))


def test_unknown_gpu_parts_leave_a_lower_bound():
    cpu_machine = MachineFigures(host="h", gpu=None, torch="t", adamw_params_per_s=1e9, cast_elems_per_s=1e9)
    p = predict(cpu_machine, None, MODEL, SHAPE, Candidate(4, 0, 0))
    assert p.total is None and p.phases["forward"] is None and p.parts["gpu"] is None
    assert "layer timing" in p.unknown and "h2d_gbps" in p.unknown
    assert p.lower_bound > 0  # the host's share is known


# ---------------------------------------------------------------- the probe's cache
def _count_machine_probes(monkeypatch) -> list:
    calls = []
    real = pb.measure_machine

    def counted(**kw):
        calls.append(kw)
        return real(**kw)

    monkeypatch.setattr(pb, "measure_machine", counted)
    return calls


def test_probe_cache_is_written_reused_and_remeasured(tmp_path, monkeypatch):
    calls = _count_machine_probes(monkeypatch)
    first = pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL)
    assert first.measured == ["machine"] and first.path.parent == tmp_path and first.path.is_file()
    assert first.path.name == f"{pb.cache_key()}.json"
    assert first.machine.adamw_params_per_s > 0 and first.machine.cast_elems_per_s > 0
    assert sorted(first.machine.state_params_per_s) == ["bf16", "bf16+bf16-stochastic", "int8",
                                                       "int8+bf16-stochastic"]
    assert all(v > 0 for v in first.machine.state_params_per_s.values())
    if not torch.cuda.is_available():
        assert first.machine.gpu is None and first.machine.h2d_gbps is None and "gemm_tflops" in first.machine.unknown()
    again = pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL)
    assert again.measured == [] and again.machine == first.machine and len(calls) == 1
    fresh = pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL, reprobe=True)
    assert fresh.measured == ["machine"] and len(calls) == 2
    assert fresh.machine.measured_at >= first.machine.measured_at
    assert pb.load_or_probe(cache_dir=tmp_path).machine == fresh.machine  # the re-measured figures were kept


def test_a_damaged_cache_is_measured_again(tmp_path, monkeypatch):
    calls = _count_machine_probes(monkeypatch)
    (tmp_path / f"{pb.cache_key()}.json").write_text("{not json")
    assert pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL).measured == ["machine"] and len(calls) == 1


@pytest.fixture(scope="module")
def tiny_adapter():
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.setup import model_config

    r = load_recipe(TINY)
    return ModelAdapter(model_config(r, load_tokenizer(r.model)))


def test_layer_timing_is_cached_by_shape_and_tokens(tmp_path, tiny_adapter):
    from megatrain_cli.engine.layer_probe import measure_layer

    args = dict(micro_batch_size=2, seq_len=32, dtype=torch.float32, device=torch.device("cpu"), cache_dir=tmp_path,
                machine_args=SMALL, measure_layer=measure_layer)
    first = pb.load_or_probe(tiny_adapter, **args)
    assert first.measured == ["machine", "layer"]
    lt = first.layer
    assert lt.tokens == 64 and min(lt.forward_s, lt.recorded_s, lt.backward_s, lt.head_s, lt.fixed_s) > 0
    assert pb.load_or_probe(tiny_adapter, **args).measured == []
    longer = pb.load_or_probe(tiny_adapter, **{**args, "seq_len": 64})
    assert longer.measured == ["layer"] and longer.layer.tokens == 128
    other_chunk = pb.load_or_probe(tiny_adapter, **{**args, "loss_chunk_tokens": 16})  # the head runs otherwise
    assert other_chunk.measured == ["layer"]
    assert pb.load_or_probe(tiny_adapter, **{**args, "measure_layer": None, "seq_len": 16}).layer is None
    # a CUDA recipe planned on a machine without CUDA: the layer stays unknown, nothing is measured
    if not torch.cuda.is_available():
        gpu = pb.load_or_probe(tiny_adapter, **{**args, "device": torch.device("cuda")})
        assert gpu.layer is None and gpu.measured == []


# ---------------------------------------------------------------- megatrain plan
def test_plan_command_prints_the_choice_and_the_table(tmp_path):
    pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL)  # the machine figures: cached, small and quick
    result = megatrain("plan", TINY, "--probe-cache", tmp_path, "train.micro_batch_size=2", "train.seq_len=64")
    out = result.output
    assert result.exit_code == 0, out
    assert "chosen plan: engine.checkpoint_interval=" in out and "predicted step:" in out
    assert "interval" in out and "s/step" in out and "resident" in out and "dev GiB" in out
    rows = [line for line in out.splitlines() if line.rstrip().endswith(("yes", "no"))]
    assert len(rows) >= 2 and rows[0].startswith("*")
    assert "the engine's ops at 128 tokens on cpu, per layer: forward" in out  # timed at the recipe's shape
    assert "Traceback" not in out


@pytest.mark.parametrize("args,culprit", [
    (["/no/such/recipe.yaml"], "recipe.yaml"),
    ([TINY, "engine.checkpoint_interval=lots"], "engine.checkpoint_interval"),
    ([TINY, "engine.no_such_key=1"], "no_such_key"),
], ids=["missing-file", "bad-value", "unknown-key"])
def test_plan_bad_recipe_is_one_message(tmp_path, args, culprit):
    refused(megatrain("plan", *args, "--probe-cache", tmp_path), 2, culprit)


def test_choose_ranks_feasible_first_and_includes_the_recipe(tiny_adapter):
    from megatrain_cli.recipe import load_recipe

    r = load_recipe(TINY, ["engine.device=cpu"])
    fig = MachineFigures(host="h", gpu=None, torch="t", adamw_params_per_s=1e9, cast_elems_per_s=1e9)
    layer = LayerTiming(forward_s=0.01, backward_s=0.02, tokens=2048, device="cpu")
    preds = pr.choose(r, tiny_adapter, torch.device("cpu"), fig, layer)
    totals = [p.total for p in preds if p.fits]
    assert totals == sorted(totals) and len(totals) >= 2
    assert any(p.candidate.checkpoint_interval == r.engine.checkpoint_interval for p in preds)
    assert all(p.candidate.resident_layers == 0 for p in preds)  # no resident layers on the CPU


# ---------------------------------------------------------------- on the GPU
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_probe_measures_the_device(tmp_path):
    fig = pb.load_or_probe(cache_dir=tmp_path, machine_args=dict(link_bytes=64 << 20, gemm_n=4096)).machine
    assert fig.gpu and not fig.unknown()
    for v in (fig.h2d_gbps, fig.d2h_gbps, fig.duplex_gbps, fig.gemm_tflops, fig.device_gbps,
              fig.adamw_under_dma_params_per_s):
        assert v and v > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_plan_predicts_a_whole_step(tmp_path, tiny_adapter):
    from megatrain_cli.recipe import load_recipe

    from megatrain_cli.engine.layer_probe import measure_layer

    probe = pb.load_or_probe(tiny_adapter, micro_batch_size=2, seq_len=256, dtype=torch.bfloat16,
                             loss_chunk_tokens=8192, device=torch.device("cuda"), cache_dir=tmp_path, machine_args=dict(gemm_n=4096),
                             measure_layer=measure_layer)
    assert probe.layer is not None and probe.layer.device == "cuda" and probe.layer.forward_s > 0
    assert probe.layer.head_s > 0 and probe.layer.recorded_s > 0
    r = load_recipe(TINY, ["engine.device=cuda", "model.dtype=bf16", "train.micro_batch_size=2", "train.seq_len=256"])
    preds = pr.choose(r, tiny_adapter, torch.device("cuda"), probe.machine, probe.layer)
    assert preds[0].fits and preds[0].total is not None and preds[0].total > 0
    result = megatrain("plan", TINY, "--probe-cache", tmp_path, "engine.device=cuda", "model.dtype=bf16",
                       "train.micro_batch_size=2", "train.seq_len=256")
    assert result.exit_code == 0, result.output
    assert "chosen plan:" in result.output and "?" not in result.output.split("chosen plan:")[1]


def test_train_reads_the_cached_probe_and_measures_nothing(tmp_path, monkeypatch):
    """train and --dry-run: no cached probe -> the line says how to get one (and nothing is measured); once
    `plan` or `bench` cached one for this shape, the predicted step of the plan train runs, and the end-of-run
    line compares it with the measured mean."""
    from megatrain_cli.engine.plan import probe as probe_mod
    from megatrain_cli.engine.plan.step_plan import plan_step
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.recipe import load_recipe
    from megatrain_cli.train.predicted import against, describe, prediction
    from megatrain_cli.train.setup import model_config

    r = load_recipe(TINY, ["engine.device=cpu"])
    adapter = ModelAdapter(model_config(r))
    device = torch.device("cpu")
    plan = plan_step(r, adapter, device)
    measured = []
    monkeypatch.setattr(probe_mod, "measure_machine", lambda **k: measured.append(k) or FIG)
    assert prediction(r, adapter, device, plan, cache_dir=tmp_path) is None
    assert describe(None).startswith("planner: no probe of this machine cached; `megatrain plan RECIPE`")
    assert not measured
    from megatrain_cli.engine.layer_probe import measure_layer

    probe_mod.load_or_probe(adapter, measure_layer=measure_layer, **probe_mod.recipe_shape(r, device, plan),
                            cache_dir=tmp_path)
    assert len(measured) == 1
    pred = prediction(r, adapter, device, plan, cache_dir=tmp_path)
    assert pred is not None and pred.total > 0 and len(measured) == 1
    assert describe(pred).startswith(f"planner: predicted {pred.total:.3f} s/step for this plan")
    assert against(pred, 2 * pred.total, 5) == (f"mean step {2 * pred.total:.3f} s over 5 steps; the planner "
                                                f"predicted {pred.total:.3f} s (-50%)")
    assert against(None, 1.0, 5) == ""


def test_dry_run_prints_the_planners_line():
    res = megatrain("train", TINY, "--dry-run", "engine.device=cpu")
    assert res.exit_code == 0, res.output
    assert [line for line in res.output.splitlines() if line.startswith("planner: ")]


def test_the_engine_probe_runs_a_lean_plan_without_its_checkpoint_placement():
    """A long-context recipe's probe: the recipe's lean pieces (MLP chunk, lean norms, loss chunk) run on the
    cut model, whose one layer has none of the full plan's offloaded or dropped checkpoints."""
    from megatrain_cli.engine.layer_probe import measure_layer
    from megatrain_cli.engine.plan.lean import GiB, plan_long_context
    from megatrain_cli.models.adapter import ModelAdapter
    from tests.reference import tiny_config

    config = tiny_config("Qwen2ForCausalLM", layers=5, hidden=32, inter=96)
    plan = plan_long_context(config, 32, batch=2, device_budget_bytes=GiB, dtype=torch.float32, mlp_chunk_tokens=24,
                             chunk_mlp=True, loss_chunk_tokens=7, offload=True, lean_norms=True, device_type="cpu",
                             drop=2)
    assert plan.dropped_checkpoints == (1, 3) and plan.offloaded_checkpoints == 3
    lt = measure_layer(ModelAdapter(config), micro_batch_size=2, seq_len=32, dtype=torch.float32,
                       device=torch.device("cpu"), lean=plan, reps=1)
    assert lt.tokens == 64 and min(lt.forward_s, lt.recorded_s, lt.backward_s, lt.head_s) > 0


def test_a_busy_host_is_named_before_its_probe(tmp_path, monkeypatch):
    """A probe timed while other work loads the host caches low figures (a session-15 GPU smoke run's did, and a
    7B bench was then predicted at 4x its step): the probe says so, with the fix, before it measures."""
    from megatrain_cli import machine

    assert machine.busy_note((1.9, 0, 0), 2) == "" and machine.busy_note((7.9, 0, 0), 16) == ""
    busy = machine.busy_note((8.0, 0, 0), 16)
    assert busy == ("this machine is busy (1-minute load 8.0 on 16 CPUs): the host figures measured now come out "
                    "low and are cached; run `megatrain plan RECIPE --reprobe` when it is idle")
    for load, said in ((0.3, False), (64.0, True)):
        monkeypatch.setattr(machine.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        lines = []
        pb.load_or_probe(cache_dir=tmp_path / str(load), machine_args=SMALL, log=lines.append)
        named = [line for line in lines if "busy" in line]
        assert named == ([f"probe: {machine.busy_note((64.0, 0, 0))}"] if said else []), lines
        if said:  # before the first host figure is timed
            assert lines[lines.index(named[0]) + 1].startswith("probe: host AdamW"), lines


def test_bench_probes_into_the_folder_it_is_given(tmp_path):
    out = tmp_path / "bench.json"
    result = megatrain("bench", "--model", "tiny", "--device", "cpu", "model.dtype=fp32", "--seq", "32", "--batch",
                       "1", "--steps", "1", "--probe-cache", tmp_path / "probe", "--output", out,
                       "logging.dashboard=off")
    assert result.exit_code == 0, result.output
    assert [p.name for p in (tmp_path / "probe").iterdir()] == [f"{pb.cache_key()}.json"]
