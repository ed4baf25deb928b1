"""Which metrics sinks a run writes to: the recipe's `logging` section -> open sinks (metrics/logs.py,
metrics/trackers.py). The lead process alone opens them; each gets every logged step's record."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from megatrain_cli.metrics import logs, trackers
from megatrain_cli.metrics.logs import MetricsSink


def open_sinks(logging_cfg, out: Path, *, start: int, config: dict | None = None) -> list[MetricsSink]:
    """The sinks `logging_cfg` asks for, writing under `out`. `start`: the step the run starts at
    (metrics.jsonl drops its records after it, so redone steps are logged once). `config`: the resolved
    recipe as a dict, the trackers' run parameters. A tracker that cannot start raises ValueError naming
    its key, after the sinks already open are closed."""
    name = logging_cfg.run_name or out.resolve().name
    sinks: list[MetricsSink] = []
    try:  # the trackers first: one that cannot start (a server, a login) refuses the run before a file is made
        if logging_cfg.mlflow:
            uri = logging_cfg.mlflow_tracking_uri or str(out.resolve() / "mlruns")
            sinks.append(trackers.MlflowLog(uri, experiment=logging_cfg.project, name=name, config=config))
        if logging_cfg.wandb != "off":
            sinks.append(trackers.WandbLog(out, mode=logging_cfg.wandb, project=logging_cfg.project, name=name,
                                           config=config))
        if logging_cfg.tensorboard:
            sinks.append(logs.TensorBoardLog(out / "tensorboard"))
        if logging_cfg.jsonl:
            logs.keep_steps_up_to(out / "metrics.jsonl", start)
            sinks.append(logs.JsonlLog(out / "metrics.jsonl"))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


def path_problems(logging_cfg, out: Path) -> list[str]:
    """One message per sink whose path under `out` is taken by the wrong kind of thing (a file where TensorBoard,
    W&B or MLflow make a folder, a folder where metrics.jsonl goes), naming the key: checked before anything is
    written, where the sink would fail with a raw [Errno 17] / [Errno 21]."""
    folders = []
    if logging_cfg.tensorboard:
        folders.append(("logging.tensorboard", out / "tensorboard", "logging.tensorboard=false"))
    if logging_cfg.wandb != "off":
        folders.append((f"logging.wandb={logging_cfg.wandb}", out / "wandb", "logging.wandb=off"))
    if logging_cfg.mlflow:
        uri = logging_cfg.mlflow_tracking_uri
        if uri is None:
            folders.append(("logging.mlflow", out / "mlruns", "logging.mlflow_tracking_uri"))
        elif urlparse(uri).scheme in ("", "file"):  # a folder store
            folders.append(("logging.mlflow_tracking_uri", Path(urlparse(uri).path if "://" in uri else uri),
                            "another logging.mlflow_tracking_uri"))
    problems = [f"{key}: {path} is a file, and it writes a folder there; move the file, or set {fix} or another "
                f"output_dir" for key, path, fix in folders if path.exists() and not path.is_dir()]
    if logging_cfg.jsonl and (out / "metrics.jsonl").is_dir():
        problems.append(f"logging.jsonl: {out / 'metrics.jsonl'} is a folder, and the metrics are a file there; move "
                        f"it, or set logging.jsonl=false or another output_dir")
    return problems


def missing_packages(logging_cfg) -> list[str]:
    """One message per tracker `logging_cfg` turns on whose package does not import here, naming the key,
    the pip command and how to turn it off (train/preflight.py refuses the run with them)."""
    problems = []
    if logging_cfg.tensorboard and not logs.tensorboard_available():
        problems.append(_missing("logging.tensorboard is on", "tensorboard", "logging.tensorboard=false"))
    if logging_cfg.wandb != "off" and not trackers.wandb_available():
        problems.append(_missing(f"logging.wandb is {logging_cfg.wandb}", "wandb", "logging.wandb=off"))
    if logging_cfg.mlflow and not trackers.mlflow_available():
        problems.append(_missing("logging.mlflow is on", "mlflow", "logging.mlflow=false"))
    return problems


def _missing(what: str, package: str, off: str) -> str:
    return (f"{what} but the {package} package is not installed: `pip install {package}` (or `pip install "
            f"'megatrain[{package}]'`), or {off}")
