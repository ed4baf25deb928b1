"""Bytes on disk, below every checkpoint and export: safetensors headers, chunked writes and reads that
go straight between tensor memory and a file while computing CRC-32, and files and directories made
durable (fsync) and published atomically (rename).

Nothing here knows what a checkpoint holds (layout.py does); export.py writes its shards with the same
pieces, so a Hugging Face export and a checkpoint tile are written by one safetensors writer.

A write that cannot finish (a full disk, an I/O error, an exception, Ctrl-C) leaves nothing behind: its
free space is checked first (check_free_space) and its temp dir removed on any failure
(removed_on_failure), so a full disk never keeps a partial folder that holds the space.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

CHUNK_BYTES = 64 << 20  # I/O and CRC granularity; also keeps every write() below Linux's 2 GiB cap


class CheckpointError(ValueError):
    pass


class CheckpointSettingError(CheckpointError):
    """A sound checkpoint this run must not resume: it was written with another train.master_weights. Not a
    damaged one: `checkpoint.resume: auto` refuses it instead of passing over it."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint (or export) could not be written: not enough space, or an OS error while writing. Its
    temp dir is gone and the earlier checkpoints are intact; the trainer exits 1 with this message."""


# ---------------------------------------------------------------- raw safetensors
def safetensors_header(entries: list[tuple[str, str, tuple[int, ...], int, int]],
                       metadata: dict[str, str]) -> bytes:
    """The 8-byte length + JSON header of a safetensors file, padded with spaces to 8 bytes as the
    reference writer does. entries: (name, dtype code, shape, begin, end) with data offsets."""
    header: dict[str, Any] = {"__metadata__": metadata}
    for name, code, shape, begin, end in entries:
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def read_safetensors_header(f, name: str) -> tuple[dict[str, Any], bytes]:
    """(parsed header, its raw bytes including the length prefix); f is positioned at the data. A
    length over 100 MiB is refused as corruption before anything that large is read."""
    prefix = f.read(8)
    if len(prefix) != 8:
        raise CheckpointError(f"{name}: truncated (no safetensors header)")
    (length,) = struct.unpack("<Q", prefix)
    if length > 100 << 20:
        raise CheckpointError(f"{name}: corrupted safetensors header (claims {length} bytes)")
    raw = f.read(length)
    try:
        return json.loads(raw), prefix + raw
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}: corrupted safetensors header ({e})") from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor, without a copy (little-endian, as safetensors wants)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


# ---------------------------------------------------------------- chunked I/O with CRC-32
def write_all(f, data: memoryview | bytes, crc: int = 0) -> int:
    """Write everything (in chunks: one write() moves at most ~2 GiB on Linux); returns the CRC. The
    bytes go from `data` to the file with no copy of their own; the CRC is one more pass over them."""
    data = memoryview(data)
    for start in range(0, len(data), CHUNK_BYTES):
        chunk = data[start:start + CHUNK_BYTES]
        crc = zlib.crc32(chunk, crc)
        while len(chunk):
            chunk = chunk[f.write(chunk):]
    return crc


def read_into(f, target: memoryview, name: str, crc: int = 0) -> int:
    """Fill `target` from f (straight into its memory: no temporary buffer); returns the CRC. A file
    that ends early raises CheckpointError, leaving `target` partly overwritten."""
    for start in range(0, len(target), CHUNK_BYTES):
        chunk = target[start:start + CHUNK_BYTES]
        got = 0
        while got < len(chunk):
            n = f.readinto(chunk[got:])
            if not n:
                raise CheckpointError(f"{name}: truncated (ended early)")
            got += n
        crc = zlib.crc32(chunk, crc)
    return crc


# ---------------------------------------------------------------- durable files, atomic publication
def fsync_dir(path: Path) -> None:
    """Make the directory's entries (created, renamed files) durable: without it a crash may lose a
    rename that already returned."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> dict[str, int]:
    """Write and fsync a whole file (a disk flush); its manifest entry {bytes, crc32}."""
    with open(path, "wb", buffering=0) as f:
        crc = write_all(f, data)
        os.fsync(f.fileno())
    return {"bytes": len(data), "crc32": crc}


def seal_file(path: Path, base: Path) -> dict[str, dict[str, int]]:
    """Fsync and checksum a small file written by other code (config/tokenizer save_pretrained):
    reading it back costs nothing worth mentioning."""
    with open(path, "rb") as f:
        data = f.read()
        os.fsync(f.fileno())
    return {path.relative_to(base).as_posix(): {"bytes": len(data), "crc32": zlib.crc32(data)}}


def seal_tree(root: Path, base: Path) -> dict[str, dict[str, int]]:
    """seal_file for every file under root, then fsync root and its subdirectories."""
    entries: dict[str, dict[str, int]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        entries.update(seal_file(path, base))
    for d in sorted({p for p in root.rglob("*") if p.is_dir()} | {root}):
        fsync_dir(d)
    return entries


def publish_dir(tmp: Path, final: Path) -> None:
    """Atomically rename a finished temp dir into place. rename() cannot replace a non-empty dir, so
    an existing `final` is moved aside first and deleted after (only a same-name re-save pays this)."""
    old = final.with_name(f".{final.name}.old")
    if old.exists():
        shutil.rmtree(old)
    if final.exists():
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if old.exists():
        shutil.rmtree(old)


# ---------------------------------------------------------------- free space, failed writes
def human_bytes(n: float) -> str:
    units = ("bytes", "KiB", "MiB", "GiB", "TiB")
    k = 0
    while abs(n) >= 1024 and k < len(units) - 1:
        n, k = n / 1024, k + 1
    return f"{n:.0f} bytes" if k == 0 else f"{n:.1f} {units[k]}"


def free_inodes(directory: Path) -> int | None:
    """Files that can still be made on `directory`'s file system; None where it keeps no count (btrfs, some
    network file systems report 0 inodes in all)."""
    st = os.statvfs(directory)
    return st.f_favail if st.f_files else None


def check_free_space(directory: Path, need: int, what: str, files: int = 0) -> None:
    """Refuse before the first byte is written when `directory`'s file system has less than `need` free (the
    new checkpoint is complete before rotation deletes an old one, so it needs its whole size), or fewer free
    inodes than the `files` it makes (a disk of many small files runs out of those first)."""
    free = shutil.disk_usage(directory).free
    if free < need:
        raise CheckpointWriteError(f"not enough free space to write {what} in {directory}: it needs "
                                   f"{human_bytes(need)}, {human_bytes(free)} are free. Nothing was written and "
                                   "the earlier checkpoints are intact; free some space (or move output_dir to a "
                                   "larger disk) and resume with checkpoint.resume=auto")
    inodes = free_inodes(directory) if files else None
    if inodes is not None and inodes < files:
        raise CheckpointWriteError(f"no free inodes to write {what} in {directory}: it makes about {files} files and "
                                   f"the file system has room for {inodes} more (its inode table is full, though "
                                   f"{human_bytes(free)} are free). Nothing was written and the earlier checkpoints "
                                   "are intact; delete files there (many small ones free the most inodes) or move "
                                   "output_dir to another file system, and resume with checkpoint.resume=auto")


@contextmanager
def removed_on_failure(tmp: Path, what: str, need: int | None = None, where: Path | None = None):
    """Remove the temp dir `tmp` when the block fails in any way (an exception, KeyboardInterrupt, SystemExit),
    then re-raise; an OSError (ENOSPC mid-write, EIO, ...) becomes CheckpointWriteError saying so (`where`:
    the directory the message names, tmp's parent by default)."""
    where = tmp.parent if where is None else where
    try:
        yield
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError):
            free = shutil.disk_usage(where).free
            full = ""
            if err.errno == errno.ENOSPC:
                full = (f" (the file system has no free inodes left, though {human_bytes(free)} are free)"
                        if free_inodes(where) == 0 else " (the disk is full)")
            elif err.errno == errno.EDQUOT:
                full = " (your disk quota is used up)"
            needs = f"; it needs {human_bytes(need)}" if need is not None else ""
            raise CheckpointWriteError(f"writing {what} in {where} failed{full}: {err.strerror or err} "
                                       f"({human_bytes(free)} free{needs}). Its partial files were removed and "
                                       "the earlier checkpoints are intact") from err
        raise


def remove_interrupted(output_dir: Path) -> None:
    """Temp dirs (.step_*.tmp) left by writes that were killed: never complete, only holding space. Only
    output_dir's one writer (train/lock.py) calls this, so no write in progress is among them."""
    for stale in output_dir.glob(".step_*.tmp"):
        if stale.is_dir():
            shutil.rmtree(stale)
