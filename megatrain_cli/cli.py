"""The `megatrain` command: parses arguments and hands over. No training logic lives here."""

from __future__ import annotations

import os
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from megatrain_cli import __version__
from megatrain_cli.eval.settings import MOVED_FLAGS as EVAL_MOVED_FLAGS
from megatrain_cli.recipe import load_recipe, schema_help
from megatrain_cli.train.errors import TrainingError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Full fine-tuning of large language models on one GPU; host memory holds the state.")
recipes_app = typer.Typer(no_args_is_help=True, help="List and copy the shipped recipes.")
app.add_typer(recipes_app, name="recipes")

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
# The --help epilogue of `train`, `bench` and `eval`: every recipe key with its type, default and doc.
# --help renders rich markup: the docs' brackets (`pip install 'megatrain[tensorboard]'`) are escaped, not eaten.
RECIPE_KEYS = ("Recipe keys (override any as key.sub=value, delete as ~key.sub):\n\n"
               + escape(schema_help()).replace("\n", "\n\n"))
EVAL_EPILOG = ("eval reads the recipe's data.*, eval.* and engine.device keys (the model is --model; the training "
               "keys are not read); the options describe the measurement. The settings flags eval had are now keys: "
               + ", ".join(f"{flag} -> {key.split(' ')[0]}" for flag, (_, key) in EVAL_MOVED_FLAGS.items())
               + ". eval.limit has the schema's default, 64 (the old --limit's was every example; eval.limit=null "
                 "evaluates the whole split).\n\n" + RECIPE_KEYS)


def _recipes_dir() -> Path:
    """Shipped recipes: the repo's recipes/ (editable install) or the copy inside the package."""
    packaged = Path(__file__).resolve().parent / "recipes"
    return RECIPES_DIR if RECIPES_DIR.is_dir() else packaged


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _debug_option():
    return typer.Option(False, "--debug", help="On an error, show the traceback instead of one message (for "
                                               "developers).")


@contextmanager
def _answered(debug: bool):
    """A mistake comes back as one message and its exit code (train/errors.py: 2 bad input, 3 would not
    fit, 1 failed), never a traceback; --debug re-raises instead, traceback and all."""
    try:
        yield
    except typer.Exit:
        raise
    except TrainingError as err:
        if debug:
            raise
        _fail(str(err), err.code)
    except ValueError as err:  # RecipeError, DataError, CheckpointError, ModelLoadError: a bad input
        if debug:
            raise
        _fail(str(err), 2)
    except OSError as err:  # the filesystem said no half-way (a disk that filled since the checks)
        if debug:
            raise
        _fail(f"{err} (--debug shows where)", 1)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"megatrain {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    pass


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, epilog=RECIPE_KEYS)
def train(ctx: typer.Context,
          recipe: Path = typer.Argument(..., help="Recipe YAML (see `megatrain recipes ls`)."),
          dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved recipe and the memory "
                                       "plan, allocate nothing, exit."),
          force: bool = typer.Option(False, "--force", help="Run even when the pre-flight memory check "
                                     "says it will not fit."),
          gpus: Optional[int] = typer.Option(None, "--gpus", help="Data-parallel ranks (one GPU each; CPU "
                                             "processes on gloo without CUDA); train.grad_accum must be a "
                                             "multiple. Under torchrun: its WORLD_SIZE."),
          debug: bool = _debug_option()) -> None:
    """Train with RECIPE, then key=value overrides, e.g. `train.lr=1e-5 engine.checkpoint_interval=2`.
    Exit codes: 0 done (a dry run: fits), 2 bad input, 3 will not fit (a dry run's verdict too)."""
    with _answered(debug):
        r = load_recipe(recipe, list(ctx.args))
        if gpus is not None or "WORLD_SIZE" in os.environ:
            from megatrain_cli.train.launch import train as train_dist

            raise typer.Exit(train_dist(r, gpus, dry_run=dry_run, force=force))
        from megatrain_cli.train import loop

        # run_training answers errors with a message and a code; _train (--debug) lets them out whole.
        code = (loop._train if debug else loop.run_training)(r, dry_run=dry_run, force=force)
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             options_metavar="[RECIPE] [KEY=VALUE ...] [OPTIONS]",
             epilog="The recipe sets the model, the step's shape and every engine setting, as for `train`; "
                    "the options describe the measurement. Old flags are now keys, e.g. --checkpoint-interval 2 "
                    "-> engine.checkpoint_interval=2, --no-memory-fallback -> engine.memory_fallback=false, "
                    "--max-gpu-mem 24GiB -> engine.max_gpu_mem=24GiB, --dashboard plain -> logging.dashboard=plain.\n\n"
                    + RECIPE_KEYS)
def bench(ctx: typer.Context,
          steps: int = typer.Option(3, help="Timed steps."),
          warmup: Optional[int] = typer.Option(None, help="Untimed steps before them (default 1; 0 on the "
                                               "long-context path, where a step takes minutes)."),
          baseline: Optional[str] = typer.Option(None, help="Also run the same model, batch and tokens under: "
                                                 "native (all on the GPU), deepspeed (ZeRO-3 Offload) or both."),
          layers: Optional[int] = typer.Option(None, help="Run N decoder layers instead of the preset's (same layer "
                                               "shape; the results say '7b[N of 28 layers]'). On the long-context "
                                               "path the whole model's step is extrapolated from the measured "
                                               "per-layer times and its memory plan is printed."),
          gpus: Optional[int] = typer.Option(None, "--gpus", help="Data-parallel ranks, one GPU each (CPU processes "
                                             "on gloo with engine.device=cpu); train.micro_batch_size and "
                                             "train.grad_accum are then per GPU. 1: the single-GPU engine through "
                                             "the same loop. Under torchrun: its WORLD_SIZE."),
          frame: Optional[Path] = typer.Option(None, help="Write the last step's dashboard frame (text) here."),
          probe_cache: Optional[Path] = typer.Option(None, help="Probe cache folder for the planner's prediction "
                                                     "(default ~/.cache/megatrain/probe; a new folder probes again)."),
          as_json: bool = typer.Option(False, "--json", help="Print results as JSON (stdout holds nothing else: "
                                       "no dashboard)."),
          output: Optional[Path] = typer.Option(None, help="Also write the JSON here."),
          model: Optional[str] = typer.Option(None, help="Shorthand for model.preset=MODEL (the recipe's model.path "
                                              "goes): tiny, 0.5b ... 72b, llama3-8b, gemma2-9b, gemma3-12b, phi4-14b, "
                                              "olmo2-7b, qwen3-30b-a3b, qwen3-235b-a22b, mixtral-8x7b, gpt-oss-20b, "
                                              "gpt-oss-120b (see model.preset)."),
          seq: Optional[str] = typer.Option(None, help="Shorthand for train.seq_len (512k = 524288)."),
          batch: Optional[int] = typer.Option(None, help="Shorthand for train.micro_batch_size."),
          grad_accum: Optional[int] = typer.Option(None, help="Shorthand for train.grad_accum."),
          device: Optional[str] = typer.Option(None, help="Shorthand for engine.device (cuda, cpu or auto)."),
          debug: bool = _debug_option()) -> None:
    """Time full training steps of RECIPE's model (default: recipes/bench.yaml, the 7B preset at 8 x 4096) on
    synthetic tokens, then key=value overrides as for `train`, e.g. `engine.checkpoint_interval=2`."""
    from megatrain_cli.bench.command import bench as run_bench_command
    from megatrain_cli.bench.settings import BenchRun

    with _answered(debug):
        code = run_bench_command(
            list(ctx.args), BenchRun(steps=steps, warmup=warmup, layers=layers, frame=str(frame) if frame else None,
                                     predict=True, probe_cache=str(probe_cache) if probe_cache else None),
            shorthand=dict(model=model, seq=seq, batch=batch, grad_accum=grad_accum, device=device),
            baseline=baseline, gpus=gpus, as_json=as_json, output=output)
    raise typer.Exit(code)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True}, epilog=RECIPE_KEYS)
def plan(ctx: typer.Context, recipe: Path = typer.Argument(..., help="Recipe YAML, then key=value overrides."),
         reprobe: bool = typer.Option(False, "--reprobe", help="Measure this machine again (else the cached probe)."),
         probe_cache: Optional[Path] = typer.Option(None, help="Probe cache folder (default ~/.cache/megatrain/probe)."),
         debug: bool = _debug_option()) -> None:
    """The fastest plan for RECIPE on this machine (checkpoint interval, kept blocks, resident layers) by a model
    over measured figures (docs/planner.md), and the runners-up. Exit codes: 0 a plan fits, 2 bad input, 3 none fits."""
    from megatrain_cli.plan_cmd import run_plan

    with _answered(debug):
        code = run_plan(load_recipe(recipe, list(ctx.args)), reprobe=reprobe, cache_dir=probe_cache)
    raise typer.Exit(code)


@app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
             options_metavar="[RECIPE] [KEY=VALUE ...] [OPTIONS]", epilog=EVAL_EPILOG)
def eval_cmd(ctx: typer.Context,
             model: str = typer.Option(..., "--model", help="HF model directory, a checkpoint's final/, or "
                                       "preset:NAME (random-init weights of a bench preset, e.g. preset:7b, to "
                                       "measure generation speed without a checkpoint: its answers are noise and "
                                       "every row runs to eval.max_new_tokens; prompts use the bundled tokenizer, "
                                       "the model keeps the preset's vocabulary (tiny: the tokenizer's), ids past "
                                       "the tokenizer decode to nothing)."),
             split: str = typer.Option("test", help="test (the seeded held-out split), train or all."),
             mode: str = typer.Option("auto", help="resident (whole model on the device), streamed (weights stay "
                                      "in host memory, every layer streams to the device each step: models larger "
                                      "than the GPU; decoding is bound by the host link) or auto (resident when "
                                      "it fits in free device memory; resident on CPU)."),
             output_dir: Optional[Path] = typer.Option(None, help="Where results.json and predictions.jsonl go "
                                                       "(default: MODEL/eval/; for preset:NAME, runs/eval/NAME/)."),
             debug: bool = _debug_option()) -> None:
    """Exact-match accuracy of greedy answers on math word problems (MetaMathQA / GSM8K style) of MODEL on
    RECIPE's data under its eval keys (no RECIPE: the schema's defaults, builtin:sample_math), then key=value
    overrides as for `train`, e.g. `eval.limit=8 engine.device=cpu`; generated tokens/s, mode and wall time
    in results.json, and the protocol the score depends on (prompt, few-shot, extraction, decoding). Exit
    codes: 2 bad input, 3 will not fit in host memory (the smallest of /proc's and the cgroups' limits)."""
    from megatrain_cli.eval.run import run_eval
    from megatrain_cli.eval.settings import default_output_dir, eval_recipe
    from megatrain_cli.eval.source import WouldNotFit
    from megatrain_cli.train.preflight import check_eval

    with _answered(debug):
        r = eval_recipe(ctx.args)
        out = output_dir or default_output_dir(model)
        check_eval(model, out)
        try:
            run_eval(r, model, split=split, mode=mode, output_dir=out)
        except WouldNotFit as err:
            _fail(str(err), 3)


@app.command()
def export(checkpoint: Path = typer.Argument(..., help="A step_N checkpoint directory (or a run's output_dir: "
                                             "its latest checkpoint)."),
           out: Path = typer.Argument(..., help="Output directory (Hugging Face format): new, empty, or a previous "
                                      "export (replaced only with --force)."),
           dtype: str = typer.Option("bf16", help="bf16 or fp32."),
           force: bool = typer.Option(False, "--force", help="Replace OUT when it holds a previous export."),
           debug: bool = _debug_option()) -> None:
    """Export a training checkpoint as a Hugging Face model directory."""
    import torch

    from megatrain_cli.checkpoint import export_checkpoint
    from megatrain_cli.train import stop
    from megatrain_cli.train.preflight import check_export

    with _answered(debug):
        if dtype not in ("bf16", "fp32"):
            _fail(f"--dtype: expected bf16 or fp32, got {dtype!r}")
        torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        check_export(checkpoint, out, torch_dtype, force=force)
        try:
            with stop.interruptible():
                path = export_checkpoint(checkpoint, out, dtype=torch_dtype)
        except (KeyboardInterrupt, stop.Interrupted) as err:
            signum = getattr(err, "signum", signal.SIGINT)
            _fail(f"export stopped by {signal.Signals(signum).name}: its partial files were removed, {out} is as it "
                  f"was; run it again to export", 128 + signum)
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
               dest: Path = typer.Argument(..., help="Where to write the copy (a file, or an existing folder)."),
               force: bool = typer.Option(False, "--force", help="Overwrite DEST when it exists.")) -> None:
    """Copy a shipped recipe to DEST for editing (an existing file is kept unless --force)."""
    src = _recipes_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if not src.is_file():
        known = ", ".join(p.stem for p in sorted(_recipes_dir().glob("*.yaml")))
        _fail(f"no shipped recipe named '{name}' (known: {known})")
    if dest.is_dir():
        dest = dest / src.name
    if not dest.parent.is_dir():
        _fail(f"DEST: the folder {dest.parent} does not exist; create it first (mkdir -p {dest.parent})")
    if dest.exists() and not force:
        _fail(f"DEST: {dest} exists (perhaps edited); --force overwrites it, or give another name")
    try:
        shutil.copyfile(src, dest)
    except OSError as err:
        _fail(f"DEST: cannot write {dest} ({err.strerror or err})")
    typer.echo(f"wrote {dest}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
