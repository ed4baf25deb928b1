"""`megatrain plan RECIPE [key=value ...]`: the measured planner's answer for this machine.

The probe's figures (engine/plan/probe.py; cached per machine, measured first when missing, again with
--reprobe), every candidate plan the one planner says fits (engine/plan/predict.choose), the fastest by the
model (engine/plan/predict.py) with its overrides, and the runners-up as a table. Exit codes: 0 a plan fits,
2 bad input (as `train`), 3 no candidate fits this machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from megatrain_cli.engine.plan.predict import GiB, Prediction, choose, fmt_s, interval_label, overrides
from megatrain_cli.engine.plan.probe import MachineFigures, Probe, load_or_probe, recipe_shape
from megatrain_cli.recipe import Recipe
from megatrain_cli.train.predicted import data_images, vision_part

ROWS = 8  # runners-up shown: enough to see the trade-off, short enough to read


def _err(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_plan(r: Recipe, *, reprobe: bool = False, cache_dir: Path | None = None, clipped: bool = True,
             log=_err) -> int:
    """Probe (or read the cache), predict every candidate, print the choice and the table; the exit code."""
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.train import preflight
    from megatrain_cli.train.errors import TrainingError
    from megatrain_cli.train.model_files import check_model_dir
    from megatrain_cli.train.setup import resolve_device

    # The model's inputs only (what the plan reads); data and output folders are train's business.
    if r.model.path is not None:
        check_model_dir(r.model.path, "model.path", r.model.trust_remote_code)
    if r.model.tokenizer is not None and not Path(r.model.tokenizer).is_dir():
        raise TrainingError(f"model.tokenizer: {r.model.tokenizer} is not a folder", 2)
    preflight.check_tier_folder(r.store.disk)
    tokenizer = load_tokenizer(r.model)
    config = preflight.read_model_config(r, tokenizer)
    # As a dry run: plan for the recipe's device even on a machine without it (the GPU parts are unknown).
    device = torch.device("cuda") if r.engine.device == "cuda" else resolve_device(r.engine.device)
    adapter = ModelAdapter(config)
    announced = []

    def progress(line: str) -> None:
        if not announced:
            log("probing this machine (a few seconds; cached for the next plan, --reprobe measures again)")
            announced.append(True)
        log(f"  {line}")

    from megatrain_cli.engine.layer_probe import measure_layer, probe_memory_problem, to_measure
    from megatrain_cli.engine.plan.step_plan import plan_step

    try:  # the recipe as written: its lean plan (if any) is how the engine runs the probed layer
        as_written = plan_step(r, adapter, device)
    except ValueError:
        as_written = None  # no plan serves it: choose() below says why
    shape = recipe_shape(r, device, as_written, _packed_docs(r, tokenizer, log), data_images(r, adapter, log))
    machine, layer = to_measure(adapter, cache_dir=cache_dir, reprobe=reprobe, **shape)
    if machine or layer:
        # The cache is written after probing: one that cannot be is refused first, not after the measurement.
        from megatrain_cli.engine.plan.probe import default_cache_dir

        preflight.check_output_dir(cache_dir or default_cache_dir(), "--probe-cache")
    problem = probe_memory_problem(adapter, cache_dir=cache_dir, reprobe=reprobe, **shape)
    if problem:
        gpu = " (engine.device=cuda here plans for a GPU without timing the layer)" if device.type == "cpu" else ""
        raise TrainingError(f"megatrain plan: {problem}; nothing was probed. Run `megatrain plan` on the machine "
                            f"that will train it{gpu}, or lower train.seq_len / train.micro_batch_size; `megatrain "
                            f"train RECIPE --dry-run` gives the memory plan without probing", 3)
    if machine:  # the probe times the host AdamW kernel: a first compile is said, not silent
        from megatrain_cli.train import host_kernel

        host_kernel.prepare("auto", log=log)
    probe = load_or_probe(adapter, measure_layer=measure_layer, **shape, cache_dir=cache_dir, reprobe=reprobe,
                          log=progress)
    preds = choose(r, adapter, device, probe.machine, probe.layer, clipped=clipped)
    print(render(r, probe, preds, device))
    from megatrain_cli.engine.plan.memory import host_state_line
    from megatrain_cli.store.tiles import MASTER_DTYPES

    disk_state = as_written.disk_state if as_written is not None else None
    print(host_state_line(adapter, shape["dtype"], MASTER_DTYPES[r.train.master_weights], r.train.optimizer_state,
                          disk_state))
    if disk_state is not None:  # the tier's I/O against a probe of store.disk, beside the chosen plan's step
        from megatrain_cli.train.predicted import disk_lines

        for line in disk_lines(r, as_written, preds[0] if preds else None):
            print(line)
    if r.train.method != "sft" and as_written is not None:  # the method, its pair layout, its reference pass
        from megatrain_cli.train.predicted import method_lines

        print(method_lines(r, adapter, device, as_written, cache_dir=cache_dir))
    return 0 if preds and preds[0].fits else 3


def _packed_docs(r: Recipe, tokenizer, log) -> int | None:
    """Packed SFT rows are timed at their attention work: the data's rows built as `train` builds them, priced
    as docs_per_row equal documents (engine/plan/probe.py). None: one document per row."""
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.engine.plan.probe import docs_per_row

    if not r.data.packing or r.train.method != "sft":
        return None
    train, _ = split_examples(load_examples(r.data), r.data)
    data = build_train_data(train, tokenizer, r.data, r.train.seq_len, r.train.seed)
    docs = docs_per_row(data.attention_pairs_per_row(), r.train.seq_len)
    log(f"packed rows: {data.num_examples / max(1, data.num_rows):.1f} documents a row on average "
        f"({r.data.source}); their attention timed as {docs} equal documents a row")
    return docs


def render(r: Recipe, probe: Probe, preds: list[Prediction], device: torch.device) -> str:
    lines = [*probe_lines(probe.machine, probe), ""]
    t = r.train
    clipped = t.max_grad_norm is not None
    lines.append(f"step: {t.micro_batch_size} x {t.seq_len} tokens x {t.grad_accum} micro-batch(es) on {device.type}; "
                 f"predicted for {'a clipped step (updates wait for the gradient norm)' if clipped else 'no clipping'}")
    best = preds[0] if preds else None
    if best is None or not best.fits:
        lines.append("no candidate fits this machine:")
        for p in (preds[:1] or []):
            lines.extend(f"  - {problem}" for problem in p.problems)
    if best is not None:
        lines.append(f"chosen plan: {overrides(best.candidate, r)}" + ("" if best.total is not None else
                     "  (ranked by the known parts only: a guess until the GPU is probed)"))
        lines.append(f"predicted step: {_total(best)} s  ({_parts(best)})")
        lines.append("")
        lines.append(table(preds[:ROWS]))
    if probe.layer is None:
        lines.append(f"note: no {device.type} device here: the layer was not timed, GPU times are unknown ('?'); "
                     f"the totals are lower bounds (>=) over what is known")
    return "\n".join(lines)


def probe_lines(m: MachineFigures, probe: Probe) -> list[str]:
    def g(v, unit: str, scale: float = 1.0, fmt: str = ".1f") -> str:
        return "unknown" if v is None else f"{v * scale:{fmt}} {unit}"

    how = "measured now" if probe.measured else "cached"
    lines = [f"probe ({how}; {probe.path}):",
             f"  {m.host}, {m.gpu or 'no CUDA device'}, torch {m.torch}",
             f"  PCIe H2D {g(m.h2d_gbps, 'GB/s')}, D2H {g(m.d2h_gbps, 'GB/s')}, both at once "
             f"{g(m.duplex_gbps, 'GB/s each way')}",
             f"  host AdamW ({m.adamw_kernel}) {g(m.adamw_params_per_s, 'G params/s', 1e-9, '.2f')} "
             f"({m.host_gbps_at(0.0):.0f} GB/s), under DMA {g(m.adamw_under_dma_params_per_s, 'G params/s', 1e-9, '.2f')}; "
             f"update on read {g(m.emit_params_per_s, 'G params/s', 1e-9, '.2f')}; "
             f"cast fp32 -> bf16 {g(m.cast_elems_per_s, 'G elements/s', 1e-9, '.2f')}",
             "  host AdamW over coded moments: " + ", ".join(
                 f"{k} {g(v, 'G params/s', 1e-9, '.2f')} (under DMA "
                 f"{g(m.state_under_dma_params_per_s.get(k), 'G params/s', 1e-9, '.2f')})"
                 for k, v in sorted(m.state_params_per_s.items())) if m.state_params_per_s else
             "  host AdamW over coded moments: not measured (priced by their bytes)",
             f"  bf16 GEMM {g(m.gemm_tflops, 'TFLOP/s', 1.0, '.0f')}, device memory {g(m.device_gbps, 'GB/s', 1.0, '.0f')}"]
    if probe.layer is not None:
        lt = probe.layer
        head = "from the layer's FLOP rate" if lt.head_s is None else f"{lt.head_s * 1e3:.2f} ms"
        lines.append(f"  the engine's ops at {lt.tokens} tokens on {lt.device}, per layer: forward "
                     f"{lt.forward_s * 1e3:.2f} ms, with autograd {lt.recorded * 1e3:.2f} ms, backward "
                     f"{lt.backward_s * 1e3:.2f} ms; head {head}; inputs + embedding backward "
                     f"{lt.fixed_s * 1e3:.2f} ms")
    return lines


def _total(p: Prediction) -> str:
    return fmt_s(p.total) if p.total is not None else f">= {fmt_s(p.lower_bound)}"


def _parts(p: Prediction) -> str:
    ph, pa = p.phases, p.parts
    return (f"forward {fmt_s(ph['forward'])}, head {fmt_s(ph['head'])}, backward {fmt_s(ph['backward'])}, "
            f"not overlapped {fmt_s(ph['serial'])}{vision_part(ph)}; busy: GPU {fmt_s(pa['gpu'])}, "
            f"PCIe {fmt_s(pa['pcie'])}, host {fmt_s(pa['host'])}")


def table(preds: list[Prediction]) -> str:
    vlm = bool(preds) and "vision" in preds[0].phases  # a VLM: its tower's phase in a column of its own
    head = (f"{'':2}{'interval':>12} {'kept':>5} {'resident':>8} {'dev GiB':>8} {'s/step':>9} {'fwd':>7} {'head':>7} "
            f"{'bwd':>7} {'serial':>7}{' vision' if vlm else ''} {'GPU':>7} {'PCIe':>7} {'host':>7}  fits")
    rows = [head]
    for i, p in enumerate(preds):
        c, ph, pa = p.candidate, p.phases, p.parts
        vision = f"{fmt_s(ph.get('vision')):>6} " if vlm else ""
        rows.append(f"{'*' if i == 0 and p.fits else ' ':2}{interval_label(c):>12} {c.keep_blocks:>5} "
                    f"{c.resident_layers:>8} {p.device_bytes / GiB:8.2f} {_total(p):>9} {fmt_s(ph['forward']):>7} "
                    f"{fmt_s(ph['head']):>7} {fmt_s(ph['backward']):>7} {fmt_s(ph['serial']):>7} "
                    f"{vision}"
                    f"{fmt_s(pa['gpu']):>7} {fmt_s(pa['pcie']):>7} {fmt_s(pa['host']):>7}  "
                    f"{'yes' if p.fits else 'no'}")
    return "\n".join(rows)
