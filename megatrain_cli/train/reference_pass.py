"""The reference pass: every sequence of a preference data set scored by the model in the engine as it is
(the initial weights, before the first step), streamed forward-only (engine/validate.score_passes: the
preference head's own pass 1, so at step 0 the policy's sums equal these bit for bit), cached on disk.

Shapes: micro-batches of exactly train.micro_batch_size rows (the last one topped up with repeats of its
first row, whose scores are dropped), `group` of them per streamed pass as a step's forward holds: every
matrix multiply has a training step's shape, so no kernel choice that depends on the shape can make the
reference differ from the policy. With ranks, micro-batch i goes to rank i mod N (every rank runs as many
passes: the layers' all-gathers are collectives) and one all-reduce joins the scores.

The cache key (data/score_cache.py) names what decides the numbers and nothing else (not the method, not
beta): the data's fingerprint (tokens, labels, rows, roles), the tokenizer's (its chat template included),
the model files' SHA-256 (config.json and every *.safetensors; a preset: its name, seed and config), the
compute dtype, the kernels and the device type. A file's digest is remembered beside the cache by (path,
size, mtime), so a rerun or a resume does not read the weights again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import deque
from pathlib import Path

import torch

from megatrain_cli.data.score_cache import ScoreCache, cache_key, default_cache_dir
from megatrain_cli.data.token_cache import tokenizer_fingerprint
from megatrain_cli.methods import PreferenceMicroBatch, SequenceScores

HASH_MEMO = "file-hashes.json"


def score_data(engine, data, micro_batch_size: int, group: int, dist=None, progress=None,
               num_rows: int | None = None) -> SequenceScores:
    """Every sequence of `data` (PreferenceData), in its order (those of its first `num_rows` rows; the others
    0). progress(rows done, rows) after each pass."""
    from megatrain_cli.engine.validate import score_passes

    world, rank = (dist.world, dist.rank) if dist is not None else (1, 0)
    num_rows = data.num_rows if num_rows is None else min(num_rows, data.num_rows)
    n_mb = math.ceil(num_rows / micro_batch_size)
    per_rank = math.ceil(n_mb / world)
    logps = torch.zeros(data.num_sequences, dtype=torch.float64)
    tokens = torch.zeros(data.num_sequences, dtype=torch.int64)
    pending: deque = deque()  # (sequences, how many are real) of each micro-batch handed out, in order
    done = [0]

    def batches():
        for k in range(per_rank):
            i = k * world + rank
            rows = list(range(i * micro_batch_size, min((i + 1) * micro_batch_size, num_rows))) if i < n_mb \
                else [0]  # a rank with fewer micro-batches runs a dummy: the passes are collectives
            mb = data.micro_batch(rows)
            pending.append((mb.layout.sequences, len(mb.layout.sequences) if i < n_mb else 0, len(rows)))
            yield _topped_up(mb, micro_batch_size)

    def put(mb, scores: SequenceScores) -> None:
        sequences, real, rows = pending.popleft()
        logps[sequences[:real]] = scores.logps[:real].double().cpu()
        tokens[sequences[:real]] = scores.tokens[:real].cpu()
        done[0] += rows if real else 0

    def on_pass(mbs) -> None:
        if progress is not None:
            progress(min(num_rows, done[0] * world), num_rows)

    score_passes(engine, batches(), group, put, on_pass=on_pass)
    if dist is not None:  # each sequence was scored by one rank, zeros elsewhere
        joined = torch.stack([logps, tokens.double()]).to(dist.device)
        dist.all_reduce(joined)
        logps, tokens = joined[0].cpu(), joined[1].cpu().round().long()
    return SequenceScores(logps, tokens)


def _topped_up(mb: PreferenceMicroBatch, rows: int) -> PreferenceMicroBatch:
    """`mb` with repeats of its first row appended up to `rows` rows (their sequences come after its own)."""
    extra = rows - mb.input_ids.shape[0]
    if extra <= 0:
        return mb

    def top(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t[:1].expand(extra, -1)])

    return PreferenceMicroBatch(top(mb.input_ids), top(mb.labels), top(mb.position_ids), layout=mb.layout)


# ---------------------------------------------------------------- what the scores depend on
def reference_cache(r, data, tokenizer, config, engine) -> ScoreCache:
    """The cache entry of `data`'s reference scores (nothing is hashed when preference.reference_cache is off)."""
    setting = r.preference.reference_cache
    if setting == "off":
        return ScoreCache("off", "")
    folder = default_cache_dir() if setting == "auto" else Path(setting).expanduser()
    parts = [f"data:{data.fingerprint()}", f"tokenizer:{tokenizer_fingerprint(tokenizer)}:{r.data.template}",
             f"model:{model_fingerprint(r, config, folder)}", f"dtype:{r.model.dtype}",
             f"kernels:{engine.kernels}", f"device:{engine.device.type}"]
    return ScoreCache(setting, cache_key(*parts))


def model_fingerprint(r, config, memo_dir: Path) -> str:
    """A preset's name, seed and config; a model folder's config.json and weights, by content."""
    if r.model.path is None:
        return f"preset:{r.model.preset}:seed:{r.model.seed}:{config.to_json_string(use_diff=False)}"
    folder = Path(r.model.path)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    memo = _read_memo(memo_dir)
    h = hashlib.sha256()
    for f in files:
        h.update(f"{f.name}:{file_digest(f, memo)};".encode())
    _write_memo(memo_dir, memo)
    return h.hexdigest()


def file_digest(path: Path, memo: dict) -> str:
    """SHA-256 of a file's bytes, remembered in `memo` by (resolved path, size, mtime)."""
    st = path.stat()
    key = str(path.resolve())
    known = memo.get(key)
    if known and known[:2] == [st.st_size, st.st_mtime_ns]:
        return known[2]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    digest = h.hexdigest()
    memo[key] = [st.st_size, st.st_mtime_ns, digest]
    return digest


def _read_memo(folder: Path) -> dict:
    try:
        memo = json.loads((folder / HASH_MEMO).read_text())
        return memo if isinstance(memo, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_memo(folder: Path, memo: dict) -> None:
    tmp = folder / f".{HASH_MEMO}.{os.getpid()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(memo))
        os.replace(tmp, folder / HASH_MEMO)
    except OSError:  # a read-only cache folder: the next run hashes again
        tmp.unlink(missing_ok=True)
