"""`train` with the disk tier (store.disk): a run killed by SIGKILL in the middle of a step resumes bit for bit
(its checkpoints equal an uninterrupted run's without the tier, file by file), resume works across tier
settings both ways, a killed run leaves nothing in store.disk, the bad folders are refused with one line and
exit 2, and the dry run prints the tier's bytes, the I/O a step needs and the folder's probe."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatrain_cli.recipe import load_recipe
from megatrain_cli.train.loop import run_training
from tests.helpers_bad_inputs import megatrain, refused
from tests.train.test_faults import assert_same_checkpoint, steps_logged

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "recipes" / "tiny.yaml"
FAST = ["train.seq_len=64", "train.micro_batch_size=2", "train.grad_accum=2", "train.schedule=constant",
        "train.warmup_steps=1", "logging.dashboard=off", "logging.every_n_steps=1", "checkpoint.export_final=false",
        "eval.enabled=false", "checkpoint.every_n_steps=1"]
STEPS = 6


def recipe(out: Path, *extra: str):
    return load_recipe(TINY, [*FAST, f"output_dir={out}", *extra])


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run in memory, a checkpoint after every step, all kept (constant lr: a longer run
    agrees with it on every step they share)."""
    out = tmp_path_factory.mktemp("straight")
    assert run_training(recipe(out, f"train.steps={STEPS}", f"checkpoint.keep_last_n={STEPS}")) == 0
    return out


def test_sigkill_mid_step_then_resume_is_bit_exact(straight, tmp_path):
    out, tier = tmp_path / "run", tmp_path / "nvme"
    tier.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "megatrain_cli", "train", str(TINY),
                             *FAST, f"output_dir={out}", "train.steps=1000", f"store.disk={tier}",
                             "store.disk_state=moments", "checkpoint.keep_last_n=3"],
                            cwd=ROOT, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while not (out / "step_2").is_dir():  # step 3 is under way once step_2 is published
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "no step_2 within 240 s"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert list(tier.iterdir()) == []  # the tier's files were unlinked when mapped: nothing is left
    done = max(int(p.name.split("_")[1]) for p in out.glob("step_*"))
    assert 2 <= done < STEPS
    assert_same_checkpoint(straight / f"step_{done}", out / f"step_{done}")
    # resumed with the masters on disk too: another tier setting, the same bytes
    assert run_training(recipe(out, f"train.steps={STEPS}", "checkpoint.resume=auto", f"store.disk={tier}",
                               "store.disk_state=moments+masters", f"checkpoint.keep_last_n={STEPS}")) == 0
    for n in range(done + 1, STEPS + 1):
        assert_same_checkpoint(straight / f"step_{n}", out / f"step_{n}")
    assert steps_logged(out)[-1] == STEPS


def test_resume_across_tier_settings(straight, tmp_path):
    """A checkpoint written in memory resumes with the tier, and one written with the tier resumes without."""
    tier = tmp_path / "nvme"
    tier.mkdir()
    first = tmp_path / "first"
    assert run_training(recipe(first, "train.steps=2", "checkpoint.keep_last_n=2", f"store.disk={tier}",
                               "store.disk_state=moments")) == 0
    assert_same_checkpoint(straight / "step_2", first / "step_2")
    assert run_training(recipe(first, "train.steps=4", "checkpoint.resume=auto", "checkpoint.keep_last_n=4")) == 0
    assert_same_checkpoint(straight / "step_4", first / "step_4")


def test_auto_puts_state_on_disk_only_when_the_host_is_short(tmp_path, monkeypatch):
    """store.disk_state auto (engine.memory_fallback on): nothing on disk while the host holds the tiles; with
    the host short of the moments, the moments go, and the path line says so; with memory_fallback off, none."""
    from megatrain_cli.engine.plan import memory
    from megatrain_cli.engine.plan.step_plan import plan_step
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.train.setup import model_config

    r = recipe(tmp_path, f"store.disk={tmp_path}", "train.steps=2")
    adapter = ModelAdapter(model_config(r, load_tokenizer(r.model)))
    import torch

    plan = plan_step(r, adapter, torch.device("cpu"))
    assert plan.disk_state is None and "nothing on disk (the host holds every tile)" in plan.path
    need = plan.memory.host_total + plan.memory.pinned_total
    moments = sum(v for k, v in plan.memory.host.items() if "Adam" in k)
    monkeypatch.setattr(memory, "available_host_bytes", lambda: int((need - moments / 2) / 0.95))
    plan = plan_step(r, adapter, torch.device("cpu"))
    assert plan.disk_state == "moments", plan.path
    assert "store.disk_state auto -> moments: the host cannot hold every tile" in plan.path
    assert plan.memory.disk_total >= moments and not any("Adam" in k for k in plan.memory.host)
    strict = recipe(tmp_path, f"store.disk={tmp_path}", "train.steps=2", "engine.memory_fallback=false")
    assert plan_step(strict, adapter, torch.device("cpu")).disk_state is None


def test_dry_run_prices_the_tier(tmp_path, capsys):
    tier = tmp_path / "nvme"
    tier.mkdir()
    assert run_training(recipe(tmp_path / "out", "train.steps=2", f"store.disk={tier}",
                               "store.disk_state=moments+masters", "train.optimizer_state=int8"), dry_run=True) == 0
    text = capsys.readouterr().out
    table = text.split("disk tier (store.disk: per-layer files")[1].split("device")[0]
    assert "fp32 master weights" in table and "int8 Adam exp_avg" in table and "int8 block exponents" in table
    assert f"disk tier: store.disk_state=moments+masters at {tier}:" in text
    assert "GiB/s read" in text and "GiB/s write (a quick probe): at least" in text
    assert list(tier.iterdir()) == []  # the probe's file is gone


@pytest.mark.parametrize("case", ["missing", "file", "full"])
def test_a_bad_folder_is_refused_with_one_line_and_exit_2(tmp_path, case, monkeypatch):
    folder = tmp_path / "nvme"
    if case == "file":
        folder.write_text("x")
    elif case == "full":
        folder.mkdir()
        from megatrain_cli.train import preflight

        monkeypatch.setattr(preflight, "free_bytes", lambda path: 1000 if Path(path) == folder else 2**40)
    out = refused(megatrain("train", TINY, "--dry-run", f"output_dir={tmp_path / 'out'}", f"store.disk={folder}",
                            "store.disk_state=moments"), 2, "store.disk:", str(folder))
    want = {"missing": "does not exist; create the folder on a local disk (an NVMe) or point store.disk at one",
            "file": "is a file, not a folder; point store.disk at a folder on a local disk",
            "full": "free; free space there, point store.disk at a larger disk"}[case]
    assert want in out and len([ln for ln in out.splitlines() if ln.startswith("error:")]) == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any folder")
def test_a_folder_without_write_permission_is_refused(tmp_path):
    folder = tmp_path / "nvme"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        refused(megatrain("train", TINY, "--dry-run", f"output_dir={tmp_path / 'out'}", f"store.disk={folder}"), 2,
                f"store.disk: cannot write in {folder}", "point store.disk at a folder this user can write in")
    finally:
        folder.chmod(0o755)


def test_plan_command_shows_the_tier(tmp_path):
    from megatrain_cli.engine.plan import probe as pb
    from tests.engine.test_plan_predict import SMALL

    pb.load_or_probe(cache_dir=tmp_path, machine_args=SMALL)
    tier = tmp_path / "nvme"
    tier.mkdir()
    result = megatrain("plan", TINY, "--probe-cache", tmp_path, "train.micro_batch_size=2", "train.seq_len=64",
                       f"store.disk={tier}", "store.disk_state=moments")
    out = result.output
    assert result.exit_code == 0, out
    assert "host state: " in out and "disk tier (store.disk_state=moments): " in out
    assert f"disk tier: store.disk_state=moments at {tier}:" in out and "(a quick probe): at least" in out
    assert "disk tier: the predicted" in out and "GiB/s of disk I/O" in out
    refused(megatrain("plan", TINY, "--probe-cache", tmp_path, f"store.disk={tmp_path / 'none'}"), 2,
            "store.disk:", "does not exist")


@pytest.mark.parametrize("name,host_gib,per_param,disk_gib", [("qwen14b", 120, 6.03, 0.0), ("qwen32b", 238, 6.00, 62)])
def test_the_big_recipes_fit_their_hosts(tmp_path, monkeypatch, capsys, name, host_gib, per_param, disk_gib):
    """recipes/qwen14b.yaml: the whole 14B on the 125 GiB H200 host (bf16 masters, int8 moments); qwen32b.yaml:
    256 GB of host and int8 moments in the disk tier. The dry run says so on a host of that size."""
    from megatrain_cli.train import preflight
    from tests.engine.test_rebuild import fake_host

    fake_host(monkeypatch, tmp_path, host_gib * 2**30)
    monkeypatch.setattr(preflight, "free_bytes", lambda path: 2**42)  # the checkpoints' and the tier's disks
    preset = {"qwen14b": "14b", "qwen32b": "32b"}[name]
    r = load_recipe(ROOT / "recipes" / f"{name}.yaml", ["model.path=null", f"model.preset={preset}",
                                                        f"output_dir={tmp_path / 'out'}", f"store.disk={tmp_path}"])
    assert run_training(r, dry_run=True) == 0
    text = capsys.readouterr().out
    tiles = text.split("host, pageable (the tiles)")[1].split("host, pinned")[0]
    assert next(ln for ln in tiles.splitlines() if "total" in ln).split()[3] == f"{per_param:.2f}"
    assert "verdict for this machine: fits" in text
    if disk_gib:
        table = text.split("disk tier (store.disk:")[1].split("device, peak")[0]
        total = float(next(ln for ln in table.splitlines() if "total" in ln).split()[1])
        assert total == pytest.approx(disk_gib, abs=1)


def test_a_store_that_cannot_be_built_leaves_no_tier_behind(tmp_path, monkeypatch):
    """The disk filling between the preflight and the store's files (posix_fallocate refused): exit 2 with the
    message, and neither the tier's folder in store.disk nor its reader and writer threads are left."""
    import threading

    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.store import disk
    from megatrain_cli.train.errors import TrainingError
    from megatrain_cli.train.setup import build_store, model_config

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    tier = tmp_path / "nvme"
    tier.mkdir()
    r = recipe(tmp_path / "out", f"store.disk={tier}", "store.disk_state=moments")
    config = model_config(r, load_tokenizer(r.model))
    before = set(threading.enumerate())
    monkeypatch.setattr(disk.os, "posix_fallocate", full)
    with pytest.raises(TrainingError, match=r"store\.disk: .* too little for the optimizer state") as err:
        build_store(r, config, None, "moments")
    assert err.value.code == 2
    assert list(tier.iterdir()) == []  # the tier's folder went with the failure
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("megatrain-tier")]


def test_an_io_error_of_the_tier_mid_run_ends_with_its_message(tmp_path, monkeypatch, capsys):
    """A write-behind failing on the tier's thread (EIO, a pulled disk): the run ends with exit 1 and one line
    naming the folder and what to do, not a traceback through the host AdamW worker; the tier's folder and
    threads are gone and the last checkpoint stays as it was published."""
    import threading

    from megatrain_cli.store import disk

    def failing(f):
        raise OSError(5, "Input/output error")

    tier = tmp_path / "nvme"
    tier.mkdir()
    out = tmp_path / "out"
    before = set(threading.enumerate())
    monkeypatch.setattr(disk.DiskTier, "_flush_and_drop", staticmethod(failing))
    code = run_training(recipe(out, "train.steps=3", f"store.disk={tier}", "store.disk_state=moments"))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1
    assert last == (f"error: store.disk: the disk tier's I/O in {tier} failed (OSError: [Errno 5] Input/output "
                    f"error); check that disk, then resume from the last checkpoint (the tier's files are scratch: "
                    f"checkpoints do not need them)")
    assert list(tier.iterdir()) == []
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("megatrain-tier")]
