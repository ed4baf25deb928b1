"""The disk tier (store.disk, store.disk_state): a tile's optimizer state (its Adam moments, and with
'moments+masters' its master weights too) lives in a file of its own on local disk, mapped into the tile, and
is brought into memory just before the host AdamW updates it and written back just after, on two threads of
its own, a few layers ahead of and behind the update (docs/precision.md, "The disk tier").

Why a mapping (MAP_SHARED of the tile's file) rather than buffers paged in and out: the tile's sections are
views into it, always valid, so everything that reads or writes the state (loading, checkpoints, the resident
layers, the update itself) works unchanged and is correct whatever the threads do: a page not read ahead is
read when touched (a stall, never a wrong value), and writing back (msync) and dropping (madvise DONTNEED of
the mapping, fadvise DONTNEED of the page cache, which skips dirty pages) never lose a write. So a run with
the tier is bit for bit the run without it, and its checkpoints are the same files. What the threads buy is
time: the reader faults a tile's pages in (MADV_POPULATE_WRITE: Linux 5.14+; else a pread of the file into
the page cache) before the update reaches it; the writer flushes the tile once it is updated and drops it,
so the tier's memory stays a few tiles (`in_flight` ahead, what is being written behind) whatever the model.

The files are made in store.disk without a name (O_TMPFILE), their space reserved (posix_fallocate: a full disk
is said up front, not as a SIGBUS mid-step), and mapped from the descriptor: a run that ends, crashes or is
killed at any point, setup included, leaves nothing behind, and there is no folder of ours to find and clean
(issue #34: a run killed during setup used to leave an empty `megatrain-tier-*` folder; a folder needs a name,
and a name outlives a SIGKILL). Where the file system lacks O_TMPFILE (it is Linux 3.11+, and ext4, xfs, btrfs,
tmpfs have it; some network file systems do not) the file is made with a name and unlinked in the next
syscall, before its space is reserved: a kill in that window leaves one empty `.megatrain-tier-*` file. They are
scratch: what lasts is the checkpoints.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import shutil
import tempfile
import threading
from pathlib import Path

import torch

DISK_STATES = ("moments", "moments+masters")
MOMENT_SECTIONS = ("exp_avg", "exp_avg_sq", "exp_avg_exp", "exp_avg_sq_exp")  # store/tiles.py's names


def disk_sections(state: str | None) -> tuple[str, ...]:
    """The tile sections store.disk_state puts on disk (None: none)."""
    if state is None:
        return ()
    if state not in DISK_STATES:
        raise ValueError(f"store.disk_state must be one of {DISK_STATES}, got {state!r}")
    return MOMENT_SECTIONS if state == "moments" else ("master", *MOMENT_SECTIONS)


_libc = ctypes.CDLL(None, use_errno=True)  # ctypes drops the GIL around the calls: the training thread runs on
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
MADV_DONTNEED, MADV_POPULATE_WRITE, MS_SYNC = 4, 23, 4
READ_CHUNK = 64 << 20  # bytes per pread where MADV_POPULATE_WRITE is missing


class TierError(RuntimeError):
    """The disk tier cannot be set up where store.disk points, or its I/O failed (the message names the folder
    and the fix)."""


class _File:
    def __init__(self, fd: int, view: torch.Tensor):
        self.fd, self.view = fd, view
        self.touched = False  # written since it was made (a fresh file reads as zeros)
        self.ready = threading.Event()  # paged in for the coming update
        self.written = threading.Event()  # no write-behind pending
        self.written.set()
        self.queued = False  # a read-ahead is queued or done for the coming update


class DiskTier:
    """Per-tile files under `path`; `in_flight`: tiles read ahead of the update (and so about the tiles the tier
    keeps in memory, with those being written behind)."""

    def __init__(self, path: str | Path, state: str, in_flight: int = 2):
        self.state, self.sections, self.in_flight = state, disk_sections(state), max(1, in_flight)
        self.folder = Path(path)  # store.disk itself: the files are made there, nameless
        if not self.folder.is_dir() or not os.access(self.folder, os.W_OK | os.X_OK):
            raise TierError(f"store.disk: cannot make a file in {path} (not a writable folder); point store.disk "
                            "at a writable local folder")
        self._tmpfile = hasattr(os, "O_TMPFILE")  # cleared on the first refusal: this file system lacks it
        self._files: dict[str, _File] = {}
        self._order: list[str] = []
        self._reads: list[str] = []
        self._writes: list[str] = []
        self._cv = threading.Condition()
        self._closed = False
        self._error: BaseException | None = None
        self._populate = True  # MADV_POPULATE_WRITE works here (cleared on the first EINVAL)
        self.read_bytes = self.written_bytes = 0
        self._threads = [threading.Thread(target=self._loop, args=(q, f), name=f"megatrain-tier-{n}", daemon=True)
                         for n, q, f in (("read", self._reads, self._read), ("write", self._writes, self._write))]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------ the files
    def map(self, name: str, nbytes: int) -> torch.Tensor:
        """A uint8 tensor of `nbytes` over tile `name`'s new file (zeros), its space reserved."""
        try:
            fd = self._open_nameless()
        except OSError as err:
            raise TierError(f"store.disk: cannot make a file in {self.folder} ({err.strerror or err}); point "
                            "store.disk at a writable local folder") from None
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
            # MAP_SHARED of the descriptor (no path to open): the tensor keeps the mapping alive (frombuffer holds
            # the mmap object), as torch.from_file's did; the descriptor stays open for pread and fadvise.
            mapping = mmap.mmap(fd, max(nbytes, 1), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
            view = torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes]
        except OSError as err:
            os.close(fd)
            free = shutil.disk_usage(self.folder).free
            raise TierError(f"store.disk: {self.folder} has {free / 2**30:.2f} GiB free, too little for the "
                            f"optimizer state store.disk_state={self.state} puts there ({err.strerror or err}); "
                            "free space there or point store.disk at a larger disk") from None
        self._files[name] = _File(fd, view)
        return view

    def _open_nameless(self) -> int:
        """A new file in store.disk that no name points to: O_TMPFILE, else a name unlinked at once."""
        if self._tmpfile:
            try:
                return os.open(self.folder, os.O_TMPFILE | os.O_RDWR, 0o600)
            except OSError as err:
                if err.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                self._tmpfile = False
        fd, name = tempfile.mkstemp(prefix=".megatrain-tier-", suffix=".state", dir=self.folder)
        os.unlink(name)  # the next syscall: the window in which a kill leaves a name is this one, the file empty
        return fd

    def bytes_on_disk(self) -> int:
        return sum(f.view.numel() for f in self._files.values())

    # ------------------------------------------------------------ in step with the updates
    def schedule(self, order: list[str]) -> None:
        """The order the host AdamW updates tiles each step (the engine's update order), read ahead cyclically."""
        with self._cv:
            self._order = [n for n in order if n in self._files]
            self._queue_after(None)

    def before(self, name: str) -> None:
        """`name` is about to be updated: wait for its read-ahead (reading it now if none was queued) and queue
        the next tiles'."""
        f = self._files.get(name)
        if f is None:
            return
        with self._cv:
            if not f.queued:
                self._queue(name)
            self._queue_after(name)
        self._wait(f.ready)

    def after(self, name: str) -> None:
        """`name` was updated: write it behind and drop it from memory."""
        f = self._files.get(name)
        if f is None:
            return
        with self._cv:
            f.touched, f.queued = True, False
            f.ready.clear()
            f.written.clear()
            self._writes.append(name)
            self._cv.notify_all()

    def settle(self, name: str) -> None:
        """Write tile `name` back and drop it now (after a checkpoint read or wrote it whole, the resident layers
        brought it home, a load filled it): the tier's memory stays bounded outside the updates too."""
        f = self._files.get(name)
        if f is not None:
            self._wait(f.written)
            f.touched = True
            self._flush_and_drop(f)

    def drain(self) -> None:
        """Every queued read-ahead and write-behind done."""
        for f in self._files.values():
            self._wait(f.written)
            if f.queued:
                self._wait(f.ready)

    def resident_bytes(self) -> int:
        """Bytes of the tier's files mapped in this process's memory now (mincore): what the tier holds."""
        page = os.sysconf("SC_PAGE_SIZE")
        total = 0
        for f in self._files.values():
            n = f.view.numel()
            pages = (n + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(f.view.data_ptr()), ctypes.c_size_t(n), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            total += sum(b & 1 for b in vec) * page
        return total

    def fresh(self, name: str) -> bool:
        """Tile `name`'s file was never written back (no update, no settle): its moments read as zeros still (a
        store's build writes only the masters), so zeroing them need page nothing in."""
        f = self._files.get(name)
        return f is not None and not f.touched

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        for t in self._threads:
            t.join()
        for f in self._files.values():
            os.close(f.fd)
        self._files.clear()

    # ------------------------------------------------------------ the threads
    def _queue(self, name: str) -> None:  # holds self._cv
        f = self._files[name]
        f.queued = True
        self._reads.append(name)
        self._cv.notify_all()

    def _queue_after(self, name: str | None) -> None:  # holds self._cv
        if not self._order:
            return
        at = self._order.index(name) + 1 if name in self._order else 0
        for k in range(self.in_flight):
            nxt = self._order[(at + k) % len(self._order)]
            if not self._files[nxt].queued and nxt != name:
                self._queue(nxt)

    def _wait(self, event: threading.Event) -> None:
        event.wait()
        if self._error is not None:  # a read or write-behind failed on the tier's threads (EIO, a pulled disk)
            e, where = self._error, self.folder  # the user's store.disk
            raise TierError(f"store.disk: the disk tier's I/O in {where} failed ({type(e).__name__}: {e}); "
                            f"check that disk, then resume from the last checkpoint (the tier's files are scratch: "
                            f"checkpoints do not need them)") from e

    def _loop(self, queue: list[str], work) -> None:
        while True:
            with self._cv:
                while not queue and not self._closed:
                    self._cv.wait()
                if not queue:
                    return
                name = queue.pop(0)
            f = self._files[name]
            try:
                work(f)
            except BaseException as err:  # surfaced by the next wait
                self._error = err
                f.ready.set()
                f.written.set()

    def _read(self, f: _File) -> None:
        f.written.wait()  # its previous write-behind first, or the drop would undo this read
        if f.touched:  # a fresh file is zeros: its pages are made where they are first written
            self._page_in(f)
            self.read_bytes += f.view.numel()
        f.ready.set()

    def _write(self, f: _File) -> None:
        self._flush_and_drop(f)
        self.written_bytes += f.view.numel()
        f.written.set()

    def _page_in(self, f: _File) -> None:
        addr, n = f.view.data_ptr(), f.view.numel()
        if self._populate and _libc.madvise(addr, n, MADV_POPULATE_WRITE) == 0:
            return
        self._populate = False  # an older kernel: read the file through the page cache instead
        for off in range(0, n, READ_CHUNK):
            os.pread(f.fd, min(READ_CHUNK, n - off), off)

    @staticmethod
    def _flush_and_drop(f: _File) -> None:
        addr, n = f.view.data_ptr(), f.view.numel()
        if _libc.msync(addr, n, MS_SYNC) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"msync of the disk tier: {os.strerror(err)}")
        _libc.madvise(addr, n, MADV_DONTNEED)  # unmapped here; the (clean) pages stay in the file
        os.posix_fadvise(f.fd, 0, n, os.POSIX_FADV_DONTNEED)


def measure(path: str | Path, nbytes: int = 128 << 20) -> tuple[float, float]:
    """(write, read) bytes/s of a quick probe of the folder `path`: `nbytes` written and fsynced, dropped from
    the page cache, read back; the file removed. What the planner sets the tier's traffic against."""
    import time

    block = os.urandom(1 << 20) * 8  # 8 MiB of incompressible bytes, written over and over
    fd, name = tempfile.mkstemp(prefix=".megatrain-disk-probe-", dir=path)
    os.unlink(name)  # now: a run killed mid-probe leaves no file (the open descriptor keeps its blocks until closed)
    nbytes = max(len(block), nbytes - nbytes % len(block))  # whole blocks: the write, the read and the rate agree
    try:
        t0 = time.perf_counter()
        for off in range(0, nbytes, len(block)):
            os.pwrite(fd, block, off)
        os.fsync(fd)
        write = nbytes / (time.perf_counter() - t0)
        os.posix_fadvise(fd, 0, nbytes, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, nbytes, READ_CHUNK):
            os.pread(fd, READ_CHUNK, off)
        read = nbytes / (time.perf_counter() - t0)
    finally:
        os.close(fd)
    return write, read
