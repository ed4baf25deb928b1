"""The `megatrain train RECIPE --gpus 2` launcher and its ranks as one unit (issue #19), on the CPU (gloo).

Each fault hits a real launcher (a subprocess) once its first step is logged: a signal to the launcher
reaches both ranks, which checkpoint after the same step and exit with the signal's code; SIGKILL of the
launcher leaves orphans that checkpoint and exit by themselves; SIGKILL of a rank takes the other down
and the launcher names it. In every case no process of the run is left (found through /proc: the
launcher's children, recorded while they run), and the checkpoint left is byte-identical to the
uninterrupted run's of the same step; one resume is compared with it too. The learning rate is constant,
so a run of 1000 steps and the 20-step reference agree on every step they share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatrain_cli.recipe import load_recipe
from megatrain_cli.train import launch
from tests.train.test_faults import assert_same_checkpoint, steps_logged

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
FAST = ["train.seq_len=64", "train.micro_batch_size=2", "train.grad_accum=2", "train.schedule=constant",
        "train.warmup_steps=1", "logging.dashboard=off", "logging.every_n_steps=1", "checkpoint.export_final=false",
        "eval.enabled=false"]
REFERENCE_STEPS = 20


def overrides(out: Path, *extra: str) -> list[str]:
    return [*FAST, f"output_dir={out}", *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted 2-rank run: a checkpoint after every step, all kept."""
    out = tmp_path_factory.mktemp("reference")
    r = load_recipe(TINY, overrides(out, f"train.steps={REFERENCE_STEPS}", "checkpoint.every_n_steps=1",
                                    f"checkpoint.keep_last_n={REFERENCE_STEPS}"))
    assert launch.train(r, gpus=2) == 0
    return out


# ---------------------------------------------------------------- processes, through /proc
def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of a process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return int(fields[1]), fields[0], int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """Every live descendant of `root`: pid -> start time (so a reused pid is not mistaken for it)."""
    stats = {int(p.name): s for p in Path("/proc").iterdir() if p.name.isdigit() and (s := _stat(int(p.name)))}
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, _, start) in stats.items():
            if ppid == parent and pid not in found:
                found[pid] = start
                frontier.append(pid)
    return found


def running(pids: dict[int, int]) -> list[int]:
    return [pid for pid, start in pids.items() if (s := _stat(pid)) and s[2] == start and s[1] != "Z"]


def assert_all_gone(pids: dict[int, int], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = running(pids)
    for pid in left:  # never leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left running: {left}"


def a_step_logged(out: Path, launcher: int) -> bool:
    return (out / "metrics.jsonl").is_file() and bool((out / "metrics.jsonl").read_text().strip())


def ranks_started(out: Path, launcher: int) -> bool:
    """Both ranks exist (they are still importing: no step yet)."""
    ranks = 0
    for pid in descendants(launcher):
        try:
            ranks += b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone meanwhile
            pass
    return ranks == 2


def start(out: Path, *extra: str, ready=a_step_logged) -> tuple[subprocess.Popen, dict[int, int]]:
    """A 1000-step launcher on 2 ranks, returned once `ready(out, launcher pid)` holds, with its descendants
    (both ranks and multiprocessing's resource tracker)."""
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_cli", "train", str(TINY), "--gpus", "2",
                             *overrides(out, "train.steps=1000", *extra)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not ready(out, proc.pid):
        if proc.poll() is not None:
            raise AssertionError(f"launcher exited early ({proc.returncode}): {proc.communicate()[1]}")
        if time.monotonic() > deadline:
            pids = descendants(proc.pid)
            proc.kill()
            assert_all_gone(pids)
            raise AssertionError("no step within 120 s")
        time.sleep(0.05)
    pids = descendants(proc.pid)
    assert len(pids) >= 2, pids
    return proc, pids


def the_checkpoint(out: Path) -> int:
    ckpts = sorted(out.glob("step_*"))
    assert len(ckpts) == 1, ckpts
    n = int(ckpts[0].name.split("_")[1])
    assert 1 <= n <= REFERENCE_STEPS - 2, n
    return n


# ---------------------------------------------------------------- the faults
@pytest.mark.parametrize("sig,code,ready", [(signal.SIGTERM, 0, a_step_logged), (signal.SIGINT, 130, ranks_started)],
                         ids=["SIGTERM-mid-run", "SIGINT-while-the-ranks-start"])
def test_a_signal_to_the_launcher_stops_every_rank_after_one_checkpoint(reference, tmp_path, capsys, sig, code,
                                                                        ready):
    out = tmp_path / "run"
    proc, pids = start(out, ready=ready)
    if sig == signal.SIGTERM:  # meanwhile a second launcher is refused before it starts any rank
        holder = json.loads((out / ".megatrain.lock").read_text())["pid"]
        assert launch.train(load_recipe(TINY, overrides(out, "train.steps=1000")), gpus=2) == 2
        assert f"is in use by another megatrain run (pid {holder} on host" in capsys.readouterr().err
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert_all_gone(pids)
    n = the_checkpoint(out)
    if ready is ranks_started:  # the signal waited for the ranks' handlers: one step, then the stop
        assert n == 1
    assert f"stopped by {signal.Signals(sig).name}" in err and f"after step {n}: checkpoint step_{n} written" in err
    assert_same_checkpoint(reference / f"step_{n}", out / f"step_{n}")
    assert steps_logged(out) == list(range(1, n + 1))
    assert not (out / ".megatrain.lock").exists()


def test_sigkill_to_the_launcher_leaves_no_rank_running(reference, tmp_path):
    out = tmp_path / "run"
    proc, pids = start(out)
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert_all_gone(pids)  # the orphans checkpoint after the step in flight and exit
    n = the_checkpoint(out)
    assert_same_checkpoint(reference / f"step_{n}", out / f"step_{n}")
    assert not (out / ".megatrain.lock").exists()


def test_sigkill_to_a_rank_takes_the_other_down_and_resume_is_bit_exact(reference, tmp_path, capfd):
    out = tmp_path / "run"
    proc, pids = start(out, "checkpoint.every_n_steps=1", ready=lambda o, _: (o / "step_2").is_dir())
    rank0 = json.loads((out / ".megatrain.lock").read_text())["pid"]  # rank 0 holds the lock
    assert rank0 in pids
    os.kill(rank0, signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert "error: rank 0 was killed by SIGKILL; stopping rank 1" in err and "Traceback" not in err
    assert_all_gone(pids)
    done = max(int(p.name.split("_")[1]) for p in out.glob("step_*"))
    assert 2 <= done <= REFERENCE_STEPS - 2
    assert_same_checkpoint(reference / f"step_{done}", out / f"step_{done}")
    capfd.readouterr()
    # Resume (this process the launcher): the stale lock is taken over, the redone steps are logged once;
    # SIGUSR1 (Slurm's warning) once a step past the checkpoint is logged: exit 75, checkpoint bit-exact.
    finished = threading.Event()

    def preempt_after_a_step():  # the resumed run's first checkpoint: its ranks run, its launcher forwards
        while not (out / f"step_{done + 1}").is_dir():
            if finished.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGUSR1)

    watcher = threading.Thread(target=preempt_after_a_step, daemon=True)
    signal.signal(signal.SIGUSR1, lambda *a: None)  # a late SIGUSR1 must not end pytest
    watcher.start()
    r = load_recipe(TINY, overrides(out, "train.steps=1000", "checkpoint.resume=auto", "checkpoint.every_n_steps=1"))
    try:
        code = launch.train(r, gpus=2)
    finally:
        finished.set()
        watcher.join()
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert code == 75
    err = capfd.readouterr().err
    assert f"(pid {rank0} on host" in err and "taking it over" in err and f"at step {done}" in err
    assert "stopped by SIGUSR1 (preempted)" in err
    m = max(int(p.name.split("_")[1]) for p in out.glob("step_*"))
    assert done < m <= REFERENCE_STEPS, m
    assert_same_checkpoint(reference / f"step_{m}", out / f"step_{m}")
    assert steps_logged(out) == list(range(1, m + 1))



# ---------------------------------------------------------------- a full disk under two ranks
def _disk_full_rank(rank: int, world: int, init_file: str, out: str) -> None:
    """One rank: a sharded checkpoint at step 1; step 2 with rank 1's disk full mid-write; step 3 with too
    little space reported. Writes the errors this rank saw."""
    import errno
    import shutil

    import torch
    import torch.distributed as dist

    from megatrain_cli.checkpoint import CheckpointWriteError, layout, save_sharded_checkpoint
    from megatrain_cli.engine.dist import init_distributed, leave_process_group
    from megatrain_cli.models.loader import build_sharded_store
    from tests.reference import tiny_config

    init_distributed("cpu", init_method=f"file://{init_file}", rank=rank, world_size=world)
    store = build_sharded_store(tiny_config("Qwen2ForCausalLM", layers=2), torch.float32, rank, world, seed=3)
    save_sharded_checkpoint(store, out, 1, {"step": 1})
    real_write, real_usage, errors = layout.write_all, shutil.disk_usage, []

    def write_all(f, data, crc=0):
        if rank == 1 and ".step_2.tmp" in f.name:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(f, data, crc)

    layout.write_all = write_all
    try:
        save_sharded_checkpoint(store, out, 2, {"step": 2})
    except CheckpointWriteError as e:
        errors.append(str(e))
    layout.write_all = real_write
    shutil.disk_usage = lambda path: real_usage(path)._replace(free=1 << 20)
    try:
        save_sharded_checkpoint(store, out, 3, {"step": 3})
    except CheckpointWriteError as e:
        errors.append(str(e))
    shutil.disk_usage = real_usage
    dist.barrier()
    Path(out, f"errors{rank}.json").write_text(json.dumps(errors))
    leave_process_group()


def test_a_full_disk_on_one_rank_fails_every_rank_alike_and_leaves_nothing_partial(tmp_path):
    import torch.multiprocessing as mp

    from megatrain_cli.checkpoint import latest_checkpoint

    out = tmp_path / "run"
    mp.spawn(_disk_full_rank, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    errors = [json.loads((out / f"errors{r}.json").read_text()) for r in range(2)]
    assert errors[0] == errors[1] and len(errors[0]) == 2  # no rank hung, none went on alone
    assert errors[0][0].startswith("rank 1: writing step_2 in") and "(the disk is full)" in errors[0][0]
    assert errors[0][1].startswith("rank 0: not enough free space to write step_3")
    assert "1.0 MiB are free" in errors[0][1]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("errors")) == ["step_1"]
    assert latest_checkpoint(out) == out / "step_1"
