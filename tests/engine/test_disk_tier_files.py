"""The disk tier's files leave nothing in store.disk whenever the process dies (issue #34): a process killed by
SIGKILL while its store is being built (some tiles mapped, the rest not) used to leave an empty
`megatrain-tier-*` folder; the files are now made without a name, so there is nothing to leave and nothing a
later run must clean. A second tier made in the same folder beside a live one never touches the live one's
bytes, and the fallback where O_TMPFILE is refused shows no name either."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatrain_cli.store import disk
from megatrain_cli.store.disk import DiskTier

ROOT = Path(__file__).resolve().parents[2]

# Maps two tiles' files, fills them, says so, and waits to be killed: a run in the middle of its setup.
CHILD = textwrap.dedent("""
    import sys, time
    from megatrain_cli.store.disk import DiskTier
    tier = DiskTier(sys.argv[1], "moments")
    for name in ("embed", "layers.0"):
        tier.map(name, 3 << 20).fill_(7)
    print("mapped", flush=True)
    time.sleep(600)
""")


def test_a_process_killed_while_mapping_its_tiles_leaves_nothing_in_the_folder(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout.readline() == "mapped\n", proc.stderr.read()
        assert list(tmp_path.iterdir()) == []  # alive, two tiles mapped: no folder, no file by name
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert list(tmp_path.iterdir()) == []


def test_a_second_tier_beside_a_live_one_leaves_the_live_ones_bytes_alone(tmp_path):
    live = DiskTier(tmp_path, "moments")
    view = live.map("layers.0", 1 << 20)
    view.fill_(5)
    live.settle("layers.0")  # written to its file and dropped from memory: the file holds the bytes now
    other = DiskTier(tmp_path, "moments")
    other.map("layers.0", 1 << 20).fill_(9)  # the same tile name: a file of its own, no name to collide
    other.close()
    assert list(tmp_path.iterdir()) == []
    assert torch.equal(view, torch.full_like(view, 5))  # read back from the live tier's file
    live.close()


def test_without_o_tmpfile_the_named_file_is_gone_before_its_space_is_reserved(tmp_path, monkeypatch):
    """A file system that refuses O_TMPFILE (EOPNOTSUPP): the file is named, unlinked at once, then reserved."""
    real_open, seen = os.open, []

    def no_tmpfile(path, flags, mode=0o777, **kw):
        if flags & getattr(os, "O_TMPFILE", 0) == getattr(os, "O_TMPFILE", -1):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_open(path, flags, mode, **kw)

    monkeypatch.setattr(disk.os, "open", no_tmpfile)
    fallocate = os.posix_fallocate
    monkeypatch.setattr(disk.os, "posix_fallocate",
                        lambda fd, off, n: seen.append(list(tmp_path.iterdir())) or fallocate(fd, off, n))
    tier = DiskTier(tmp_path, "moments")
    tier.map("embed", 4096).fill_(1)
    tier.map("head", 4096).fill_(2)
    assert seen == [[], []] and not tier._tmpfile  # noqa: SLF001 - the fallback was taken, and kept
    tier.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("case", ["missing", "file"])
def test_a_folder_that_is_not_one_is_refused_when_the_tier_is_made(tmp_path, case):
    path = tmp_path / "nvme"
    if case == "file":
        path.write_text("x")
    with pytest.raises(disk.TierError) as err:
        DiskTier(path, "moments")
    assert str(err.value) == (f"store.disk: cannot make a file in {path} (not a writable folder); point store.disk "
                              "at a writable local folder")
