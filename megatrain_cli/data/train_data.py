"""Training rows and the batch stream the trainer draws from.

Every example becomes ids and a loss mask (tokenize.py): tokens of a supervised reply, its end of turn
included, are labelled with their own ids (the engine shifts labels, as HF does), every other token
with -100 (no loss): the prompt, the turns around the replies. Rows are `seq_len` long: with packing,
several examples per row, `position_ids` restarting at 0 where each one starts (the engine turns the
resets into document boundaries for the attention, models/attention.py, so examples never see each
other); without it, one example per row. The tail of a row is padding: pad ids, label -100, positions
continuing the last example (so padding adds no reset, and a one-example row has one document).

Rows are fixed once built; each epoch visits them in an order drawn from a generator seeded by
(seed, epoch). `state_dict` is (epoch, cursor) plus a fingerprint of the data, which is all a
resumed run needs to produce exactly the batches the interrupted one would have.
"""

from __future__ import annotations

import hashlib
import itertools
import math

import numpy as np
import torch

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.example import Example
from megatrain_cli.data.load import source_label
from megatrain_cli.data.packing import pack_rows
from megatrain_cli.data.prompts import pad_id
from megatrain_cli.data.sources import RecordPlace
from megatrain_cli.data.token_cache import cached_tokenized
from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.recipe import DataConfig

STATE_VERSION = 1


class TrainData:
    """Fixed rows of tokenised examples, served as steps of micro-batches, epoch after epoch."""

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor, loss_mask: torch.Tensor,
                 rows: list[list[int]], *, seq_len: int, pad_token_id: int, seed: int, packing: bool,
                 truncated: int = 0, left_out: dict[str, list[int]] | None = None):
        self.tokens = tokens  # int32, every kept example's ids back to back
        self.offsets = offsets  # int64 [n + 1]: example i is tokens[offsets[i]:offsets[i + 1]]
        self.loss_mask = loss_mask  # bool, like tokens: True where the token is a label
        self.rows = rows  # example indices per row
        self.seq_len, self.pad_token_id, self.seed, self.packing = seq_len, pad_token_id, seed, packing
        self.truncated = truncated  # examples cut to seq_len (the end of their last reply is lost)
        self.left_out = left_out or {}  # why -> the records left out for it (nothing to learn in them)
        self.num_examples = len(offsets) - 1
        self.num_rows = len(rows)
        self.real_tokens = int(offsets[-1])  # non-pad tokens per epoch
        self.loss_tokens = int(loss_mask.sum())  # reply + end-of-turn tokens per epoch
        self.epoch = 0
        self.cursor = 0  # rows of this epoch already served
        self._order: tuple[int, torch.Tensor] | None = None
        self._fingerprint: str | None = None

    # ------------------------------------------------------------ sizes
    def steps_per_epoch(self, micro_batch_size: int, grad_accum: int) -> int:
        """Steps that cover every row once; the last one tops up from the next epoch's order."""
        return math.ceil(self.num_rows / (micro_batch_size * grad_accum))

    def stats(self) -> dict:
        return {"examples": self.num_examples, "rows": self.num_rows, "seq_len": self.seq_len,
                "packing": self.packing, "real_tokens": self.real_tokens, "loss_tokens": self.loss_tokens,
                "fill": self.real_tokens / (self.num_rows * self.seq_len), "truncated": self.truncated,
                "dropped": self.dropped}

    def attention_pairs_per_row(self) -> float:
        """The mean over rows of sum(document length^2) as the attention sees a row (build_row: the padding
        continues the last document): the attention work of a packed row, what the planner prices it by."""
        lengths = (self.offsets[1:] - self.offsets[:-1]).tolist()
        total = 0.0
        for row in self.rows:
            docs = [lengths[ex] for ex in row] or [0]
            docs[-1] += self.seq_len - sum(docs)
            total += sum(n * n for n in docs)
        return total / max(1, self.num_rows)

    @property
    def dropped(self) -> int:
        """Examples left out (nothing to learn in them)."""
        return sum(map(len, self.left_out.values()))

    # ------------------------------------------------------------ batches
    def next_step(self, micro_batch_size: int, grad_accum: int) -> list[MicroBatch]:
        """`grad_accum` micro-batches of [micro_batch_size, seq_len] int64 rows, continuing the stream."""
        if micro_batch_size < 1 or grad_accum < 1:
            raise ValueError(f"micro_batch_size and grad_accum must be >= 1, got {micro_batch_size}, {grad_accum}")
        row_ids = self._take(micro_batch_size * grad_accum)
        return [self.micro_batch(row_ids[lo:lo + micro_batch_size]) for lo in range(0, len(row_ids), micro_batch_size)]

    def micro_batch(self, rows: list[int]) -> MicroBatch:
        ids, labels, pos = zip(*(self.build_row(r) for r in rows))
        return MicroBatch(torch.stack(ids), torch.stack(labels), torch.stack(pos))

    def _take(self, count: int) -> list[int]:
        taken: list[int] = []
        while len(taken) < count:
            order = self._epoch_order(self.epoch)
            n = min(count - len(taken), self.num_rows - self.cursor)
            taken += order[self.cursor:self.cursor + n].tolist()
            self.cursor += n
            if self.cursor == self.num_rows:
                self.epoch, self.cursor = self.epoch + 1, 0
        return taken

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            self._order = (epoch, torch.randperm(self.num_rows, generator=g))
        return self._order[1]

    def build_row(self, row: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(input_ids, labels, position_ids) of one row, each [seq_len] int64."""
        t = self.seq_len
        ids = torch.full((t,), self.pad_token_id, dtype=torch.int64)
        labels = torch.full((t,), IGNORE_INDEX, dtype=torch.int64)
        pos = torch.empty(t, dtype=torch.int64)
        at, n = 0, 0
        for ex in self.rows[row]:
            lo, hi = int(self.offsets[ex]), int(self.offsets[ex + 1])
            n = hi - lo
            ids[at:at + n] = self.tokens[lo:hi]
            labels[at:at + n] = torch.where(self.loss_mask[lo:hi], self.tokens[lo:hi].long(), IGNORE_INDEX)
            pos[at:at + n] = torch.arange(n)
            at += n
        pos[at:] = torch.arange(n, n + t - at)
        return ids, labels, pos

    # ------------------------------------------------------------ resume
    def fingerprint(self) -> str:
        """A hash of the rows' contents: resuming onto different data would silently change batches.
        Where every example's labels are one run to its end (single-turn data), the mask is hashed as the
        length of the part before it, as it was before multi-turn masks: such runs still resume."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            h.update(f"{self.seq_len}:{self.packing}:{self.pad_token_id}:{self.num_rows}".encode())
            cs = torch.cat([torch.zeros(1, dtype=torch.int64), self.loss_mask.long().cumsum(0)])
            ends, starts = self.offsets[1:], self.offsets[:-1]
            counts = cs[ends] - cs[starts]  # labels per example
            before = ends - starts - counts  # what `prompt_lens` was, when the labels are one run to the end
            runs_to_end = bool((cs[ends] - cs[starts + before] == counts).all())
            for tensor in (self.tokens, self.offsets, before):
                h.update(tensor.contiguous().numpy().tobytes())
            if not runs_to_end:
                h.update(self.loss_mask.numpy().tobytes())
            for r in self.rows:
                h.update(",".join(map(str, r)).encode() + b";")
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "num_rows": self.num_rows, "fingerprint": self.fingerprint()}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data state has version {state.get('version')!r}, expected {STATE_VERSION}")
        if state["num_rows"] != self.num_rows or state["fingerprint"] != self.fingerprint():
            raise ValueError(f"the training data differs from the checkpoint's ({self.num_rows} rows, "
                             f"fingerprint {self.fingerprint()} now; {state['num_rows']} rows, fingerprint "
                             f"{state['fingerprint']} then): the data, tokenizer, seq_len or packing changed, "
                             f"so resuming would not continue the same batches")
        if not 0 <= state["cursor"] < self.num_rows:
            raise ValueError(f"data state cursor {state['cursor']} is outside 0..{self.num_rows - 1}")
        self.seed, self.epoch, self.cursor = int(state["seed"]), int(state["epoch"]), int(state["cursor"])
        self._order = None


def epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed from (seed, epoch) that does not collide for nearby pairs."""
    digest = hashlib.sha256(f"megatrain-data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def build_train_data(examples: list[Example], tokenizer, data_cfg: DataConfig, seq_len: int,
                     seed: int) -> TrainData:
    """Tokenise, truncate to seq_len, and lay out the rows (packed or one example each). Examples with nothing
    to learn are left out, each reason's record numbers kept (`TrainData.left_out`, `left_out_report`)."""
    label = source_label(data_cfg)
    if not examples:
        raise DataError(f"{label}: no training examples")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2, got {seq_len}")
    left_out: dict[str, list[int]] = {}  # why -> the records left out for it
    usable = []
    for ex in examples:
        why = ex.unusable or ("" if any(t["content"].strip() for t in ex.messages() if t["role"] == "assistant")
                              else EMPTY_REPLIES)
        if why:
            left_out.setdefault(why, []).append(ex.record)
        else:
            usable.append(ex)
    chunks: list[np.ndarray] = []  # int32 tokens, one array per tokenised batch
    mask_chunks: list[np.ndarray] = []  # their loss mask
    lengths: list[int] = []
    truncated = 0
    records = iter([ex.record for ex in usable])
    batches = cached_tokenized(usable, tokenizer, data_cfg.template, data_cfg.train_on, data_cfg.num_proc,
                               data_cfg.cache_dir) if usable else []
    for ids_batch, mask_batch in batches:
        kept_ids, kept_masks = [], []
        for ids, mask in zip(ids_batch, mask_batch):
            record = next(records)
            if not any(mask[:seq_len]):  # nothing to learn: no reply token, or none within seq_len
                why = NO_REPLY if not any(mask) else f"the prompt fills train.seq_len={seq_len}"
                left_out.setdefault(why, []).append(record)
                continue
            if len(ids) > seq_len:
                truncated += 1
                ids, mask = ids[:seq_len], mask[:seq_len]
            kept_ids.append(ids)
            kept_masks.append(mask)
            lengths.append(len(ids))
        n_tokens = sum(map(len, kept_ids))
        chunks.append(np.fromiter(itertools.chain.from_iterable(kept_ids), dtype=np.int32, count=n_tokens))
        mask_chunks.append(np.fromiter(itertools.chain.from_iterable(kept_masks), dtype=np.bool_, count=n_tokens))
    if not lengths:
        raise DataError(f"{label}: nothing left to train on: {left_out_report(left_out, len(examples), label)}")
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    tokens = torch.from_numpy(np.concatenate(chunks))
    loss_mask = torch.from_numpy(np.concatenate(mask_chunks))
    rows = pack_rows(lengths, seq_len) if data_cfg.packing else [[i] for i in range(len(lengths))]
    return TrainData(tokens, offsets, loss_mask, rows, seq_len=seq_len, pad_token_id=pad_id(tokenizer), seed=seed,
                     packing=data_cfg.packing, truncated=truncated, left_out=left_out)


EMPTY_REPLIES = "every assistant reply is empty"
NO_REPLY = "no reply token to learn (with data.train_on=last_assistant: the last reply is empty)"
FIXES = dict.fromkeys((EMPTY_REPLIES, NO_REPLY), "fill in the replies or remove those records")


def left_out_report(left_out: dict[str, list[int]], total: int, source: str = "", shown: int = 5) -> str:
    """'3 of 10 training examples left out: 2: the prompt fills train.seq_len=64 (lines 2, 6; raise
    train.seq_len); ...': each reason with its count, where its first `shown` examples are (lines of a .jsonl
    `source`, else record numbers from 0 in the source's order) and the fix."""
    place = RecordPlace(source)
    parts = []
    for why, records in sorted(left_out.items(), key=lambda kv: -len(kv[1])):
        ids = sorted(records)
        more = f", ... ({len(ids) - shown} more)" if len(ids) > shown else ""
        fix = FIXES.get(why, "raise train.seq_len" if why.startswith("the prompt fills") else "fix or remove them")
        where = [place.line(i) if place.file is not None and i >= 0 else i for i in ids[:shown]]
        kind = "line" if place.file is not None else "record"
        parts.append(f"{len(ids)}: {why} ({kind}{'s' if len(ids) > 1 else ''} "
                     f"{', '.join(map(str, where))}{more}; {fix})")
    n = sum(map(len, left_out.values()))
    return f"{n} of {total} training examples left out: " + "; ".join(parts)


def synthetic_lengths(tokens: int, mean: int, spread: float, longest: int, seed: int) -> list[int]:
    """Document lengths from a log-normal with mean `mean` tokens and sigma `spread` (0: every document `mean`
    long; about 1: the long tail of chat and instruction data), drawn until they sum to `tokens` or more; each
    in [1, longest]. The same arguments always draw the same lengths."""
    rng = np.random.default_rng(seed)
    mu = math.log(mean) - spread ** 2 / 2  # E[exp(N(mu, s))] = exp(mu + s^2 / 2) = mean
    out: list[int] = []
    total = 0
    while total < tokens:
        draw = np.clip(np.rint(rng.lognormal(mu, spread, size=1024)), 1, longest).astype(np.int64).tolist()
        for n in draw:
            out.append(n)
            total += n
            if total >= tokens:
                break
    return out


def synthetic_train_data(lengths: list[int], vocab: int, seq_len: int, seed: int) -> TrainData:
    """Packed rows of documents of these lengths (cut to seq_len, as build_train_data cuts them), packed as
    training packs them (pack_rows), of uniform random ids, every token a label: the bench's packed rows."""
    lengths = [min(n, seq_len) for n in lengths]
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    tokens = torch.randint(0, vocab, (total,), generator=g, dtype=torch.int64).to(torch.int32)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    return TrainData(tokens, offsets, torch.ones(total, dtype=torch.bool), pack_rows(lengths, seq_len),
                     seq_len=seq_len, pad_token_id=0, seed=seed, packing=True)
