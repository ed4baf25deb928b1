"""The `megatrain` command: parses arguments and hands over. No training logic lives here."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional

import typer

from megatrain_cli import __version__
from megatrain_cli.recipe import RecipeError, load_recipe, schema_help

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Full fine-tuning of large language models on one GPU; host memory holds the state.")
recipes_app = typer.Typer(no_args_is_help=True, help="List and copy the shipped recipes.")
app.add_typer(recipes_app, name="recipes")

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"


def _recipes_dir() -> Path:
    """Shipped recipes: the repo's recipes/ (editable install) or the copy inside the package."""
    packaged = Path(__file__).resolve().parent / "recipes"
    return RECIPES_DIR if RECIPES_DIR.is_dir() else packaged


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"megatrain {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             epilog="Recipe keys (override any as key.sub=value, delete as ~key.sub):\n\n"
                    + schema_help().replace("\n", "\n\n"))
def train(ctx: typer.Context,
          recipe: Path = typer.Argument(..., help="Recipe YAML (see `megatrain recipes ls`)."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved recipe and the memory "
                                       "plan, allocate nothing, exit."),
          force: bool = typer.Option(False, "--force", help="Run even when the pre-flight memory check "
                                     "says it will not fit."),
          gpus: Optional[int] = typer.Option(None, "--gpus", help="Data-parallel ranks (one GPU each; CPU "
                                             "processes on gloo without CUDA); train.grad_accum must be a "
                                             "multiple. Under torchrun: its WORLD_SIZE.")) -> None:
    """Train with RECIPE, then key=value overrides, e.g. `train.lr=1e-5 engine.checkpoint_interval=2`."""
    overrides = list(ctx.args)
    try:
        r = load_recipe(recipe, overrides)
    except RecipeError as err:
        _fail(str(err))
    if gpus is not None or "WORLD_SIZE" in os.environ:
        from megatrain_cli.train.launch import train as train_dist

        raise typer.Exit(train_dist(r, gpus, dry_run=dry_run, force=force))
    from megatrain_cli.train.loop import run_training

    code = run_training(r, dry_run=dry_run, force=force)
    raise typer.Exit(code)


@app.command()
def bench(model: str = typer.Option("7b", help="Preset: tiny, 0.5b, 1.5b, 3b, 7b, 14b, 32b, 72b, llama3-8b."),
          seq: str = typer.Option("4096", help="Tokens per sequence (512k = 524288)."),
          batch: int = typer.Option(8, help="Sequences per step."),
          steps: int = typer.Option(3, help="Timed steps (after one warm-up step)."),
          layers: Optional[int] = typer.Option(None, help="Run N layers instead of the preset's (same layer shape; "
                                               "the results say '7b[N of 28 layers]'). On the long-context path "
                                               "the whole model's step is extrapolated from the measured per-layer "
                                               "times and its memory plan is printed."),
          grad_accum: int = typer.Option(1, help="Micro-batches per step (batch each)."),
          checkpoint_interval: int = typer.Option(4, help="Layers per recompute block."),
          layer_slots: int = typer.Option(2, help="Device weight buffers for layers (>= 2)."),
          max_gpu_mem: Optional[str] = typer.Option(None, help="Device-memory budget, e.g. 24GiB."),
          baseline: Optional[str] = typer.Option(None, help="Also run: native, deepspeed, or both "
                                                 "(native,deepspeed)."),
          keep_activations: str = typer.Option("auto", help="Last blocks keeping their activations (no "
                                               "recompute): auto (fill the device budget) or N."),
          max_grad_norm: float = typer.Option(1.0, help="Clipping threshold (<= 0: no clipping)."),
          no_double_buffer: bool = typer.Option(False, "--no-double-buffer", help="Ablation: no prefetch of the next layer."),
          no_speculation: bool = typer.Option(False, "--no-speculation", help="Ablation: host AdamW waits for the gradient norm "
                                              "instead of starting as each layer's gradients land."),
          no_overlap_optimizer: bool = typer.Option(False, "--no-overlap-optimizer", help="Ablation: optimizer after the step, not "
                                                    "pipelined into the next forward."),
          device: str = typer.Option("cuda", help="cuda or cpu."),
          long_context: str = typer.Option("auto", help="Long-context path (tiled MLP, checkpoint offload): on, "
                                           "off, or auto (batch 1, no accumulation, seq >= 32k)."),
          sdpa: str = typer.Option("auto", help="Long-context SDPA backends: auto (cudnn, flash, efficient), or one."),
          kernels: str = typer.Option("auto", help="auto (Triton on CUDA), triton or torch (ablation)."),
          host_adamw: str = typer.Option("auto", help="Host AdamW code: auto (the C++ kernel where it compiles), "
                                         "cpp or torch (ablation)."),
          no_defer_moments: bool = typer.Option(False, "--no-defer-moments", help="Ablation: clipped steps' updates store weights and "
                                                "moments in one pass (no deferred moments pass)."),
          no_update_on_read: bool = typer.Option(False, "--no-update-on-read", help="Ablation: after a clipped step, host AdamW's worker "
                                                 "stores the new weights and the packer casts them (no update "
                                                 "applied by the packer as it streams)."),
          device_cast: bool = typer.Option(False, help="Experimental: DMA the page-locked fp32 masters and cast "
                                           "on the GPU (short-context path, one GPU; measured slower on the H200)."),
          no_memory_fallback: bool = typer.Option(False, "--no-memory-fallback", help="Refuse a step whose plan does not fit the device "
                                                  "budget instead of taking the memory-lean path (interval 1, "
                                                  "checkpoints in pinned host memory as needed)."),
          dashboard: str = typer.Option("auto", help="Live view: auto, rich, plain or off."),
          frame: Optional[Path] = typer.Option(None, help="Write the last step's dashboard frame (text) here."),
          as_json: bool = typer.Option(False, "--json", help="Print results as JSON."),
          output: Optional[Path] = typer.Option(None, help="Also write the JSON here."),
          gpus: Optional[int] = typer.Option(None, "--gpus", help="Data-parallel ranks, one GPU each (CPU "
                                             "processes on gloo with --device cpu); --batch is then per GPU. "
                                             "1: the single-GPU engine through the same loop. Under torchrun: "
                                             "its WORLD_SIZE."),
          dist_sync: bool = typer.Option(False, help="Ablation, with --gpus: the synchronous data-parallel "
                                         "path instead of the overlapped one.")) -> None:
    """Full training steps of a random-init preset on synthetic tokens, against a baseline."""
    import torch

    from megatrain_cli.bench import short as b
    from megatrain_cli.presets import PRESETS
    from megatrain_cli.recipe import parse_bytes

    if model not in PRESETS:
        _fail(f"unknown model preset '{model}' (known: {', '.join(PRESETS)})")
    if device == "cuda" and not torch.cuda.is_available():
        _fail("bench needs a CUDA GPU (use --device cpu for a functional run on a small preset)")
    if kernels not in ("auto", "torch", "triton"):
        _fail(f"--kernels: auto, torch or triton, got {kernels!r}")
    if host_adamw not in ("auto", "torch", "cpp"):
        _fail(f"--host-adamw: auto, cpp or torch, got {host_adamw!r}")
    baselines = [x.strip() for x in baseline.split(",")] if baseline else []
    if any(x not in ("native", "deepspeed") for x in baselines):
        _fail(f"unknown baseline '{baseline}' (native, deepspeed, or native,deepspeed)")
    if layers is not None and layers < 1:
        _fail(f"--layers: expected a number >= 1, got {layers}")
    if layers is not None and "deepspeed" in baselines:
        _fail("--layers does not reach the DeepSpeed baseline (its child process builds the whole preset)")
    budget = None
    if keep_activations != "auto" and not keep_activations.isdigit():
        _fail(f"--keep-activations: expected auto or a number, got {keep_activations!r}")
    if max_gpu_mem is not None:
        budget = parse_bytes(max_gpu_mem)
        if device == "cuda":  # on CPU the budget only drives the plan
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    from megatrain_cli.dashboard import MODES, Dashboard

    if dashboard not in MODES:
        _fail(f"--dashboard: one of {', '.join(MODES)}, got {dashboard!r}")
    seq_len = b.parse_tokens(seq)
    if gpus is not None or "WORLD_SIZE" in os.environ:
        from megatrain_cli.bench.ranks import DistBench

        _bench_ranks(gpus, DistBench(model=model, batch=batch, seq=seq_len, steps=steps, grad_accum=grad_accum,
                                     layers=layers, checkpoint_interval=checkpoint_interval,
                                     layer_slots=layer_slots, keep_activations=keep_activations if
                                     keep_activations == "auto" else int(keep_activations),
                                     max_grad_norm=max_grad_norm if max_grad_norm > 0 else None,
                                     device=device, kernels=kernels, overlap=not dist_sync),
                     ignored=[f for f, on in (("--baseline", baselines), ("--max-gpu-mem", max_gpu_mem),
                                              ("--frame", frame), ("--no-double-buffer", no_double_buffer),
                                              ("--no-speculation", no_speculation),
                                              ("--no-overlap-optimizer", no_overlap_optimizer),
                                              ("--long-context on", long_context == "on"),
                                              ("--device-cast", device_cast),
                                              ("--no-update-on-read", no_update_on_read)) if on],
                     as_json=as_json, output=output)
    if long_context == "on" or (long_context == "auto" and batch == 1 and grad_accum == 1 and seq_len >= 32768):
        if device_cast:
            _fail("--device-cast: the short-context path only (add --long-context off)")
        from megatrain_cli.bench.long_context import bench_long_context, format_extrapolation

        res = bench_long_context(model, seq_len, steps=steps, warmup=0, device_budget=budget, device=device,
                                 sdpa=sdpa, batch=batch, layers=layers, layer_slots=layer_slots,
                                 double_buffer=not no_double_buffer, overlap_optimizer=not no_overlap_optimizer,
                                 speculate=not no_speculation, kernels=kernels,
                                 update_on_read=not no_update_on_read,
                                 max_grad_norm=max_grad_norm if max_grad_norm > 0 else None,
                                 log=lambda m: typer.echo(m, err=True))
        extrapolated = f"\n{format_extrapolation(res.extrapolated)}" if res.extrapolated else ""
        typer.echo(b.to_json([res]) if as_json else f"{b.format_table([res])}\nnotes: {res.notes}{extrapolated}")
        if output:
            output.write_text(b.to_json([res]))
        raise typer.Exit(0 if res.tokens_per_s > 0 else 3)
    ds_result = None
    if "deepspeed" in baselines:
        # First, in a watched child process: DeepSpeed gets the host memory to itself (ours is not
        # allocated yet) and returns all of it when it exits (or is killed for memory).
        from megatrain_cli.bench.deepspeed import bench_deepspeed

        ds_result = bench_deepspeed(model, batch * grad_accum, seq_len, steps, log=lambda m: typer.echo(m, err=True),
                                    timeout_s=540)
    try:
        with Dashboard(dashboard, total_steps=steps + 1, title=f"megatrain bench {model}") as dash:
            results = [b.bench_engine(
                model, batch, seq_len, steps, grad_accum=grad_accum, checkpoint_interval=checkpoint_interval,
                layer_slots=layer_slots, double_buffer=not no_double_buffer,
                overlap_optimizer=not no_overlap_optimizer, speculate=not no_speculation, device_budget=budget,
                keep_activations=keep_activations if keep_activations == "auto" else int(keep_activations),
                max_grad_norm=max_grad_norm if max_grad_norm > 0 else None, device=device, kernels=kernels,
                memory_fallback=not no_memory_fallback, log=lambda m: typer.echo(m, err=True), dashboard=dash,
                frame_path=str(frame) if frame else None, layers=layers, device_cast=device_cast,
                update_on_read=not no_update_on_read)]
    except b.DoesNotFit as err:
        _fail(f"{err}\n(the plan above has each term; --max-gpu-mem sets the device budget)", 3)
    if "native" in baselines:
        results.append(b.bench_native(model, batch * grad_accum, seq_len, steps, layers=layers,
                                      log=lambda m: typer.echo(m, err=True)))
    if ds_result is not None:
        results.append(ds_result)
    lean_notes = [f"notes ({r.name}): {r.notes}" for r in results if r.notes.startswith("memory-lean path")]
    typer.echo(b.to_json(results) if as_json else "\n".join([b.format_table(results), *lean_notes]))
    if output:
        output.write_text(b.to_json(results))


def _bench_ranks(gpus: Optional[int], args, *, ignored: list, as_json: bool, output: Optional[Path]) -> None:
    """`bench --gpus N` (or under torchrun): megatrain_cli/bench_dist.py; rank 0 prints and writes."""
    from megatrain_cli.bench import short as b
    from megatrain_cli.bench.ranks import bench_dist

    if ignored:
        _fail(f"--gpus: not with {', '.join(ignored)} (one short-context engine per rank)")
    if gpus is not None and gpus < 1:
        _fail(f"--gpus must be >= 1, got {gpus}")
    try:
        report = bench_dist(args, gpus, log=lambda m: typer.echo(m, err=True))
    except (b.DoesNotFit, ValueError) as err:
        _fail(str(err), 3)
    if report is not None:  # rank 0, or the process that spawned the ranks
        text = json.dumps(report, indent=2)
        if as_json:
            typer.echo(text)
        else:
            result = b.BenchResult(**{k: report[k] for k in b.BenchResult.__dataclass_fields__})
            typer.echo(f"{b.format_table([result])}\nnotes: {result.notes}")
        if output:
            output.write_text(text)
    raise typer.Exit(0)


@app.command("eval")
def eval_cmd(model: str = typer.Option(..., "--model", help="HF model directory, a checkpoint's final/, or "
                                       "preset:NAME (random-init weights of a bench preset, e.g. preset:7b, to "
                                       "measure generation speed without a checkpoint: its answers are noise and "
                                       "every row runs to --max-new-tokens; prompts use the bundled tokenizer, the "
                                       "model keeps the preset's vocabulary (tiny: the tokenizer's), ids past the "
                                       "tokenizer decode to nothing)."),
             data: str = typer.Option("builtin:sample_math", help="Dataset (see the recipe's data.source)."),
             split: str = typer.Option("test", help="test (the seeded held-out split), train or all."),
             limit: Optional[int] = typer.Option(None, help="Evaluate at most N examples."),
             batch_size: int = typer.Option(8, help="Prompts per generation batch (streamed: tokens/s grows with "
                                            "it, each step streams the whole model once)."),
             max_new_tokens: int = typer.Option(256, help="Generation length limit."),
             mode: str = typer.Option("auto", help="resident (whole model on the device), streamed (weights stay "
                                      "in host memory, every layer streams to the device each step: models larger "
                                      "than the GPU; decoding is bound by the host link) or auto (resident when "
                                      "it fits in free device memory; resident on CPU)."),
             output_dir: Path = typer.Option(Path("."), help="Where results.json and predictions.jsonl go."),
             device: str = typer.Option("auto", help="auto, cpu or cuda.")) -> None:
    """Exact-match accuracy of greedy answers on math word problems (MetaMathQA / GSM8K style), with
    generated tokens/s, mode and wall time in results.json."""
    from megatrain_cli.eval.run import run_eval
    from megatrain_cli.eval.source import MODES, PRESET_PREFIX

    if not model.startswith(PRESET_PREFIX) and not Path(model).is_dir():
        _fail(f"model directory not found: {model}")
    if mode not in MODES:
        _fail(f"--mode: expected one of {', '.join(MODES)}, got {mode!r}")
    try:
        run_eval(model, data, split=split, limit=limit, batch_size=batch_size, max_new_tokens=max_new_tokens,
                 output_dir=str(output_dir), device=device, mode=mode)
    except ValueError as err:
        _fail(str(err))


@app.command()
def export(checkpoint: Path = typer.Argument(..., help="A step_N checkpoint directory."),
           out: Path = typer.Argument(..., help="Output directory (Hugging Face format)."),
           dtype: str = typer.Option("bf16", help="bf16 or fp32.")) -> None:
    """Export a training checkpoint as a Hugging Face model directory."""
    import torch

    from megatrain_cli.checkpoint import export_checkpoint

    if not checkpoint.is_dir():
        _fail(f"checkpoint not found: {checkpoint}")
    if dtype not in ("bf16", "fp32"):
        _fail(f"--dtype: expected bf16 or fp32, got {dtype!r}")
    try:
        path = export_checkpoint(checkpoint, out, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    except ValueError as err:  # CheckpointError: incomplete, corrupted or not a checkpoint
        _fail(str(err))
    typer.echo(f"exported {checkpoint} -> {path}")


@app.command()
def plot(run_dir: Path = typer.Argument(..., help="A training output_dir holding metrics.jsonl.")) -> None:
    """Draw loss and TFLOPS over steps into RUN_DIR/metrics.svg."""
    from megatrain_cli.plot import plot_run

    try:
        typer.echo(str(plot_run(str(run_dir))))
    except (FileNotFoundError, ValueError) as err:
        _fail(str(err))


@recipes_app.command("ls")
def recipes_ls() -> None:
    """List the shipped recipes with the command each opens with."""
    for path in sorted(_recipes_dir().glob("*.yaml")):
        first = path.read_text().splitlines()[0] if path.read_text() else ""
        typer.echo(f"{path.stem:<12} {first.lstrip('# ').strip()}")


@recipes_app.command("cp")
def recipes_cp(name: str = typer.Argument(..., help="Recipe name, e.g. qwen7b."),
               dest: Path = typer.Argument(..., help="Where to write the copy.")) -> None:
    """Copy a shipped recipe to DEST for editing."""
    src = _recipes_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if not src.is_file():
        known = ", ".join(p.stem for p in sorted(_recipes_dir().glob("*.yaml")))
        _fail(f"no shipped recipe named '{name}' (known: {known})")
    if dest.is_dir():
        dest = dest / src.name
    shutil.copyfile(src, dest)
    typer.echo(f"wrote {dest}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
