"""Checkpoint write and resume time for a preset's host store (issue #6's H200 row).

    python scripts/time_checkpoint.py --model 7b --dir /tmp/ckpt --out $OUT/ckpt.json

Writes one full checkpoint (fp32 masters + both Adam moments, CRC'd, fsynced, atomically
published), then loads it back into a second store tile by tile and checks every byte. The 7B
checkpoint is ~85 GiB: the disk under --dir must hold it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import torch

from megatrain_cli.checkpoint import load_checkpoint, save_checkpoint
from megatrain_cli.machine import host_rss_bytes
from megatrain_cli.models.loader import build_store
from megatrain_cli.presets import PRESETS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="7b")
    ap.add_argument("--dir", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    p = PRESETS[args.model]
    config = p.hf_config(vocab_size=p.vocab_size or 1024)
    store = build_store(config, torch.bfloat16, seed=0)
    for tile in store.tiles.values():  # non-trivial moments, so the round trip checks real bytes
        tile.exp_avg.copy_(tile.master[: tile.numel]).mul_(1e-3)
        tile.exp_avg_sq.copy_(tile.master).square_()
        tile.step = 7
    shutil.rmtree(args.dir, ignore_errors=True)
    t0 = time.perf_counter()
    path = save_checkpoint(store, args.dir, 7, {"step": 7}, keep_last_n=1)
    write_s = time.perf_counter() - t0
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    print(f"write: {size / 2**30:.1f} GiB in {write_s:.1f} s = {size / write_s / 1e9:.2f} GB/s", flush=True)
    # A cold resume reads from disk, not from the page cache the write just filled: drop the
    # checkpoint's (clean, fsynced) pages first.
    for f in path.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    # Resume into the same store after scrambling it: the load must restore every byte.
    reference = {name: (t.master[:4096].clone(), t.exp_avg_sq[-4096:].clone()) for name, t in store.tiles.items()}
    for tile in store.tiles.values():
        tile.master.zero_()
        tile.exp_avg_sq.zero_()
        tile.step = 0
    t0 = time.perf_counter()
    state = load_checkpoint(store, path)
    load_s = time.perf_counter() - t0
    ok = all(torch.equal(t.master[:4096], reference[n][0]) and torch.equal(t.exp_avg_sq[-4096:], reference[n][1])
             and t.step == 7 for n, t in store.tiles.items())
    print(f"resume: {load_s:.1f} s = {size / load_s / 1e9:.2f} GB/s, state {state.get('step')}, bytes equal: {ok}",
          flush=True)
    result = {"model": args.model, "params": store.num_params(), "checkpoint_bytes": size, "write_s": write_s,
              "load_s": load_s, "write_gbps": size / write_s / 1e9, "load_gbps": size / load_s / 1e9,
              "round_trip_equal": ok, "host_rss_bytes": host_rss_bytes()}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
