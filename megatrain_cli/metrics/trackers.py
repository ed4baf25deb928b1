"""The experiment trackers as metrics sinks: Weights & Biases and MLflow (optional extras).

Each writes the same scalars as TensorBoard (`logs.tracker_scalars` of the step's record) at the step's
number, and the resolved recipe as the run's config (W&B) or parameters (MLflow). Neither package is a
dependency: `pip install 'megatrain[wandb]'` / `'megatrain[mlflow]'`; a run that asks for a tracker whose
package is missing is refused before anything is built (train/preflight.py). Costs: W&B runs its own
service process (offline: it writes run files under output_dir/wandb/); MLflow writes each logged step
to its store (a folder, a database or a server) from the training thread, one call per step.

A resumed run is a new tracker run (W&B's and MLflow's step axes only grow); its first steps are the
ones after the checkpoint it resumed from.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from urllib.parse import urlparse

from megatrain_cli.metrics.logs import MetricsSink, tracker_scalars
from megatrain_cli.metrics.record import StepMetrics

MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit on parameters per log_batch
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on a parameter value's length


def wandb_available() -> bool:
    """Whether the wandb package imports here."""
    try:
        import wandb  # noqa: F401
    except Exception:  # ImportError, or a broken install
        return False
    return True


def mlflow_available() -> bool:
    """Whether the mlflow package (mlflow or mlflow-skinny) imports here."""
    try:
        from mlflow.tracking import MlflowClient  # noqa: F401
    except Exception:
        return False
    return True


class WandbLog(MetricsSink):
    """A W&B run in `mode` 'offline' (run files under out/wandb/, `wandb sync` uploads them) or 'online'.
    W&B's console capture is off: the dashboard's live frames would fill its log."""

    def __init__(self, out: Path, *, mode: str, project: str, name: str, config: dict | None = None):
        if mode not in ("offline", "online"):
            raise ValueError(f"logging.wandb: expected off, offline or online, got {mode!r}")
        import wandb

        try:
            self._run = wandb.init(mode=mode, dir=str(out), project=project, name=name, config=config or {},
                                   settings=wandb.Settings(console="off"))
        except Exception as err:  # not logged in, no network for 'online', a bad project name
            raise ValueError(f"logging.wandb={mode}: W&B did not start a run: {err}") from err
        self.dir = Path(self._run.dir).parent  # out/wandb/<offline-run-...>: the run's own folder

    def write(self, m: StepMetrics) -> None:
        if self._run is None:
            raise ValueError("W&B run already finished")
        self._run.log(tracker_scalars(m.to_json()), step=m.step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None


def server_problem(uri: str, timeout: float = 5.0) -> str:
    """'' when an http(s) tracking URI's host takes a TCP connection within `timeout` seconds (a folder or a
    database URI: ''), else why not. Asked before the run writes anything: MLflow's client retries an
    unreachable server with its own backoff for minutes before it gives up."""
    parsed = urlparse(uri)
    if parsed.scheme not in ("http", "https"):
        return ""
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return ""
    except (OSError, ValueError) as err:  # refused, timed out, no such host; a bad port number
        if isinstance(err, TimeoutError):
            return f"the server does not answer (no connection within {timeout:g} s)"
        return f"the server does not answer ({getattr(err, 'strerror', None) or err})"


@contextlib.contextmanager
def _folder_store_allowed(uri: str):
    """MLflow 3 keeps its folder ("file") store behind its own opt-in, MLFLOW_ALLOW_FILE_STORE, read when the
    store is built. A recipe that names a folder (or leaves the default, output_dir/mlruns) has opted in:
    the opt-in is set while the client builds its store, then put back as it was."""
    if urlparse(uri).scheme not in ("", "file"):
        yield
        return
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
        else:
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested recipe dict as MLflow parameters: dotted keys, values as text cut to MLflow's limit."""
    out: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = str(value)[:MLFLOW_PARAM_CHARS]
    return out


class MlflowLog(MetricsSink):
    """An MLflow run in experiment `experiment` at `tracking_uri`: a folder (a file store), sqlite:///FILE
    or a server. The recipe goes in as parameters; each step's scalars in one log_batch call."""

    def __init__(self, tracking_uri: str, *, experiment: str, name: str, config: dict | None = None):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.tracking_uri = tracking_uri
        try:
            with _folder_store_allowed(tracking_uri):
                self._client = MlflowClient(tracking_uri=tracking_uri)
            found = self._client.get_experiment_by_name(experiment)
            exp_id = found.experiment_id if found is not None else self._client.create_experiment(experiment)
            self.run_id: str | None = self._client.create_run(exp_id, run_name=name).info.run_id
            params = [Param(k, v) for k, v in flat_params(config or {}).items()]
            for lo in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
                self._client.log_batch(self.run_id, params=params[lo:lo + MLFLOW_PARAMS_PER_CALL])
        except Exception as err:  # an unreachable server, a store of another MLflow version
            raise ValueError(f"logging.mlflow: MLflow at {tracking_uri} did not start a run: {err}") from err

    def write(self, m: StepMetrics) -> None:
        from mlflow.entities import Metric

        if self.run_id is None:
            raise ValueError("MLflow run already ended")
        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, m.step) for k, v in tracker_scalars(m.to_json()).items()]
        self._client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        if self.run_id is not None:
            self._client.set_terminated(self.run_id)
            self.run_id = None
