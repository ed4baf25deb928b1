"""What `megatrain bench` runs: a recipe (default: recipes/bench.yaml, bench's own defaults) plus `train`'s
key=value overrides, read by the same load_recipe, and the few shorthands that stand for recipe keys.

Every engine setting is a recipe key; what is left to the command line describes the measurement
(BenchRun: timed steps, warm-up, --layers). The flags bench had before the recipe are answered with
the key that replaced them, so an old command line fails with its fix instead of a bare 'unknown option'.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megatrain_cli.recipe import Recipe, command_line


def default_recipe() -> Path:
    """recipes/bench.yaml: the repo's (editable install), else the copy inside the package."""
    repo = Path(__file__).resolve().parents[2] / "recipes" / "bench.yaml"
    return repo if repo.is_file() else Path(__file__).resolve().parents[1] / "recipes" / "bench.yaml"


@dataclass(frozen=True)
class BenchRun:
    """The measurement, as opposed to the training (the recipe): how many steps are timed after how
    many untimed ones, and whether the model runs with another layer count than its own."""

    steps: int = 3
    warmup: int | None = None  # None: 1 step, 0 on the long-context path (where one step takes minutes)
    layers: int | None = None  # the same layer shape, fewer (or more) of them; presets only
    optimizer: bool = True  # False: forward + backward alone (the reference for the optimizer's share)
    frame: str | None = None  # write the last step's dashboard frame (text) here
    predict: bool = False  # probe the machine and record the planner's prediction (bench/predicted.py)
    probe_cache: str | None = None  # the probe's cache folder; None: the user's cache dir

    def warmup_steps(self, long_context: bool) -> int:
        return (0 if long_context else 1) if self.warmup is None else self.warmup


def parse_tokens(text: str | int) -> int:
    """'512k' -> 524288, '4096' -> 4096."""
    s = str(text).strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if mult > 1 else s) * mult)
    except ValueError:
        raise ValueError(f"cannot read {text!r} as a token count (e.g. 4096, 32k, 512k)") from None


def shorthands(*, model: str | None = None, seq: str | int | None = None, batch: int | None = None,
               grad_accum: int | None = None, device: str | None = None) -> list[str]:
    """The overrides the shorthand options stand for. --model names a preset instead of the recipe's
    model (its model.path goes); --seq takes 512k."""
    out = []
    if model is not None:
        out += ["~model.path", f"model.preset={model}"]
    if seq is not None:
        out.append(f"train.seq_len={parse_tokens(seq)}")
    for key, value in (("train.micro_batch_size", batch), ("train.grad_accum", grad_accum), ("engine.device", device)):
        if value is not None:
            out.append(f"{key}={value}")
    return out


# bench's flags before the recipe: each is now a recipe key. (flag, takes a value, what to write instead)
MOVED_FLAGS: command_line.MovedFlags = {
    "--checkpoint-interval": (True, "engine.checkpoint_interval=N"),
    "--layer-slots": (True, "engine.layer_slots=N"),
    "--max-gpu-mem": (True, "engine.max_gpu_mem=24GiB"),
    "--keep-activations": (True, "engine.keep_activations=auto|N"),
    "--max-grad-norm": (True, "train.max_grad_norm=1.0 (null: no clipping)"),
    "--no-double-buffer": (False, "engine.double_buffer=false"),
    "--no-speculation": (False, "engine.speculate_optimizer=false"),
    "--no-overlap-optimizer": (False, "engine.overlap_optimizer=false"),
    "--long-context": (True, "engine.long_context_min_seq=N (the long-context path from train.seq_len N; "
                             "null: never)"),
    "--sdpa": (True, "engine.sdpa=auto|flash|cudnn|efficient|math"),
    "--kernels": (True, "engine.kernels=auto|torch|triton"),
    "--host-adamw": (True, "engine.host_adamw=auto|cpp|torch"),
    "--no-defer-moments": (False, "engine.defer_moments=false"),
    "--no-update-on-read": (False, "engine.update_on_read=false"),
    "--no-memory-fallback": (False, "engine.memory_fallback=false"),
    "--dist-sync": (False, "engine.overlap_ranks=false"),
    "--dashboard": (True, "logging.dashboard=auto|rich|plain|off"),
    "--device-cast": (False, None),
}
SETTINGS = "engine settings"  # what the recipe keys hold, in the answer to an unknown option


def split_args(args: list[str]) -> tuple[str | None, list[str], list[str]]:
    """The command line's words besides its options: (the recipe path or None, the overrides, problems);
    an old flag (MOVED_FLAGS) is answered with its key (recipe/command_line.py)."""
    return command_line.split_args(args, MOVED_FLAGS, "bench", SETTINGS)


def bench_recipe(args: list[str] = (), *, shorthand: list[str] = ()) -> Recipe:
    """The bench's recipe from the command line's words ([RECIPE] key=value ... ~key): RECIPE (default
    recipes/bench.yaml) with the `shorthand` overrides, then the words' (explicit keys win), validated
    by load_recipe. Raises RecipeError listing every problem, the old flags' included. data.packing says
    what the rows hold (loop.BenchRows): one synthetic document each (recipes/bench.yaml), or packed
    documents as the bench section describes them."""
    return command_line.command_recipe(args, MOVED_FLAGS, "bench", settings=SETTINGS, default=default_recipe(),
                                       shorthand=shorthand)


def bench_model_config(r: Recipe, layers: int | None = None):
    """The HF config the bench runs: train/setup.model_config (a preset without a tokenizer has a
    1024-token vocabulary when it names none, as tiny), with `layers` decoder layers instead of the
    model's: the same layer shape, fewer of them, times a long sequence's layers cheaply."""
    from megatrain_cli.models.adapter import check_architecture
    from megatrain_cli.train.setup import model_config

    if layers is not None and layers < 1:
        raise ValueError(f"layers must be >= 1, got {layers}")
    if layers is not None and r.model.path is not None:
        raise ValueError("--layers: presets only (model.preset); a model.path has its own layer count")
    config = model_config(r)
    if layers is None or layers == config.get_text_config().num_hidden_layers:
        return config
    if getattr(config, "vision_config", None) is not None:
        raise ValueError("--layers: not for a vision-language model (its tower and decoder run whole)")
    data = config.to_dict()
    data["num_hidden_layers"] = layers
    data.pop("layer_types", None)  # rebuilt for the new layer count
    config = type(config).from_dict(data)
    check_architecture(config)
    return config


def model_name(r: Recipe) -> str:
    """The preset, or the model directory's name."""
    return r.model.preset if r.model.preset is not None else Path(r.model.path).name


BASELINES = {None: [], "native": ["native"], "deepspeed": ["deepspeed"], "both": ["native", "deepspeed"],
             "native,deepspeed": ["native", "deepspeed"]}


def bench_problems(r: Recipe, run: BenchRun, *, baseline: str | None, gpus: int | None, output: str | None,
                   cuda: bool) -> list[str]:
    """Everything wrong with a bench's options and recipe that can be seen before planning: each problem
    names its option or key. Checked up front, so a bench never measures for minutes and then refuses
    (a baseline that cannot run on this device, an --output that cannot be written). `cuda`: whether
    this machine has a CUDA device."""
    from megatrain_cli.train.errors import TrainingError
    from megatrain_cli.train.model_files import check_model_dir
    from megatrain_cli.train.preflight import check_output_file

    problems = []
    baselines = BASELINES.get(baseline)
    if baselines is None:
        problems.append(f"--baseline: native, deepspeed or both, got {baseline!r}")
        baselines = []
    if run.steps < 1 or (run.warmup is not None and run.warmup < 0):
        problems.append(f"--steps must be >= 1 and --warmup >= 0, got {run.steps} and {run.warmup}")
    if run.layers is not None and run.layers < 1:
        problems.append(f"--layers: expected a number >= 1, got {run.layers}")
    if run.layers is not None and "deepspeed" in baselines:
        problems.append("--layers does not reach the DeepSpeed baseline (its child process builds the whole preset)")
    if "deepspeed" in baselines and r.model.preset is None:
        problems.append("--baseline deepspeed: presets only (model.preset; its child process builds the preset)")
    if r.engine.device == "cuda" and not cuda:
        problems.append("bench: engine.device is 'cuda' but there is no CUDA GPU (use --device cpu, i.e. "
                        "engine.device=cpu, for a functional run on a small preset)")
    elif baselines and (r.engine.device == "cpu" or not cuda):
        problems.append(f"--baseline {baseline}: the baselines run on a CUDA GPU, and this bench runs on the CPU "
                        f"(engine.device={r.engine.device}); drop --baseline, or bench on a CUDA machine")
    if baselines and r.data.packing:
        problems.append(f"--baseline {baseline}: the baselines time one document per row, and data.packing=true "
                        f"packs documents; drop --baseline, or set data.packing=false")
    if gpus is not None and gpus < 1:
        problems.append(f"--gpus must be >= 1, got {gpus}")
    if gpus is not None and (baselines or run.frame):
        refused = [f for f, on in (("--baseline", baselines), ("--frame", run.frame)) if on]
        problems.append(f"--gpus: not with {', '.join(refused)} (one engine per rank, measured alone)")
    if r.train.method != "sft" and (baselines or gpus is not None or run.layers is not None):
        refused = [f for f, on in (("--baseline", baselines), ("--gpus", gpus is not None),
                                   ("--layers", run.layers is not None)) if on]
        problems.append(f"train.method={r.train.method}: not with {', '.join(refused)} (a preference bench is one "
                        f"process over the whole model, and times the SFT step on the same tokens itself)")
    for option, path in (("--output", output), ("--frame", run.frame)):
        try:
            if path is not None:
                check_output_file(path, option)
        except TrainingError as err:
            problems.append(str(err))
    if r.model.path is not None:
        try:
            check_model_dir(r.model.path, "model.path", r.model.trust_remote_code)
        except TrainingError as err:
            problems.append(str(err))
    return problems
