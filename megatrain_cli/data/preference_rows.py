"""Preference examples as training rows: each completion a sequence (the prompt through the tokenizer's chat
template or the plain one, then the completion, labelled with its end of turn as SFT labels a reply), a
pair's two sequences side by side in one row (chosen first), so a pair is never split across micro-batches.

A unit (a pair; a KTO example) is laid out whole: with `data.packing`, units are packed into rows of at most
`seq_len` tokens (packing.py, by the units' lengths); without, one unit per row. `position_ids` restart at 0
where each sequence starts, which is how the head tells sequences apart (methods/sequences.py). A unit
longer than `seq_len` is refused (naming it and its lengths), never truncated: a cut completion would be
scored as if it ended there.

`PreferenceData` is `TrainData` (train_data.py) over the sequences: the same seeded epoch order over rows,
`state_dict` and resume; its micro-batches carry their `PreferenceLayout` (methods/base.py): each sequence's
index in the data (the reference cache's key), whether it is desirable, and each pair's chosen and rejected.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Iterator

import numpy as np
import torch

from megatrain_cli.data.errors import DataError
from megatrain_cli.data.load import source_label
from megatrain_cli.data.packing import pack_rows
from megatrain_cli.data.preference import PreferenceExample
from megatrain_cli.data.prompts import pad_id
from megatrain_cli.data.token_cache import cached_tokenized
from megatrain_cli.data.train_data import TrainData
from megatrain_cli.methods.base import PreferenceLayout, PreferenceMicroBatch
from megatrain_cli.recipe import DataConfig

TRAIN_ON = "last_assistant"  # only the completion: earlier assistant turns of the prompt are context


class PreferenceData(TrainData):
    """Rows of whole units (pairs or KTO examples), served as steps of `PreferenceMicroBatch`es."""

    def __init__(self, tokens: torch.Tensor, offsets: torch.Tensor, loss_mask: torch.Tensor, rows: list[list[int]],
                 *, desirable: torch.Tensor, unit_of: torch.Tensor, **kwargs):
        super().__init__(tokens, offsets, loss_mask, rows, **kwargs)
        self.desirable = desirable  # bool [S]: chosen, or a KTO example labelled true
        self.unit_of = unit_of  # int64 [S]: the unit (pair or example) of each sequence
        self.num_units = int(unit_of.max()) + 1
        self.num_sequences = self.num_examples
        self._preference_fingerprint: str | None = None

    def stats(self) -> dict:
        return {**super().stats(), "examples": self.num_units, "sequences": self.num_sequences}

    def next_step(self, micro_batch_size: int, grad_accum: int) -> list[PreferenceMicroBatch]:
        if micro_batch_size < 1 or grad_accum < 1:
            raise ValueError(f"micro_batch_size and grad_accum must be >= 1, got {micro_batch_size}, {grad_accum}")
        row_ids = self._take(micro_batch_size * grad_accum)
        return [self.micro_batch(row_ids[lo:lo + micro_batch_size])
                for lo in range(0, len(row_ids), micro_batch_size)]

    def scoring_batches(self, micro_batch_size: int) -> Iterator[PreferenceMicroBatch]:
        """Every row once, in row order, leaving the training stream where it is: the reference pass."""
        for lo in range(0, self.num_rows, micro_batch_size):
            yield self.micro_batch(list(range(lo, min(lo + micro_batch_size, self.num_rows))))

    def micro_batch(self, row_ids: list[int]) -> PreferenceMicroBatch:
        ids, labels, pos = zip(*(self.build_row(r) for r in row_ids))
        sequences = [s for r in row_ids for s in self.rows[r]]
        return PreferenceMicroBatch(torch.stack(ids), torch.stack(labels), torch.stack(pos),
                                    layout=self.layout(sequences))

    def layout(self, sequences: list[int]) -> PreferenceLayout:
        """What the micro-batch's sequences (in row order) are. A pair's chosen sequence comes right before
        its rejected one (build_preference_data lays them out so)."""
        seq = torch.tensor(sequences, dtype=torch.int64)
        desirable = self.desirable[seq]
        unit = self.unit_of[seq]
        paired = torch.zeros(len(sequences), dtype=torch.bool)
        if len(sequences) > 1:
            paired[:-1] = unit[:-1] == unit[1:]  # a sequence followed by its unit's other one: a pair's chosen
        chosen = paired.nonzero().flatten()
        return PreferenceLayout(seq, desirable, chosen, chosen + 1)

    def fingerprint(self) -> str:
        """TrainData's (tokens, labels, rows) plus which sequence is which."""
        if self._preference_fingerprint is None:
            h = hashlib.sha256(f"preference:{super().fingerprint()}".encode())
            h.update(self.desirable.numpy().tobytes())
            h.update(self.unit_of.numpy().tobytes())
            self._preference_fingerprint = h.hexdigest()[:16]
        return self._preference_fingerprint


def build_preference_data(examples: list[PreferenceExample], tokenizer, data_cfg: DataConfig, seq_len: int,
                          seed: int) -> PreferenceData:
    """Tokenise every completion after its prompt, check each unit fits `seq_len`, lay out the rows."""
    label = source_label(data_cfg)
    if not examples:
        raise DataError(f"{label}: no training examples")
    sequences = [seq for ex in examples for seq in ex.sequences()]
    owner = [(ex, j) for ex in examples for j in range(len(ex.completions))]
    seq_lengths: list[int] = []
    chunks: list[np.ndarray] = []  # int32 tokens per tokenised batch: no Python int per token is kept
    mask_chunks: list[np.ndarray] = []
    for ids_batch, mask_batch in cached_tokenized(sequences, tokenizer, data_cfg.template, TRAIN_ON,
                                                  data_cfg.num_proc, data_cfg.cache_dir):
        for ids, mask in zip(ids_batch, mask_batch):
            _check_labels(*owner[len(seq_lengths)], mask)
            seq_lengths.append(len(ids))
        n = sum(map(len, ids_batch))
        chunks.append(np.fromiter(itertools.chain.from_iterable(ids_batch), dtype=np.int32, count=n))
        mask_chunks.append(np.fromiter(itertools.chain.from_iterable(mask_batch), dtype=np.bool_, count=n))
    first = np.cumsum([0] + [len(ex.completions) for ex in examples])  # each unit's first sequence
    unit_seq_lengths = [seq_lengths[first[u]:first[u + 1]] for u in range(len(examples))]
    too_long = [(u, n) for u, n in enumerate(unit_seq_lengths) if sum(n) > seq_len]
    if too_long:
        _refuse_long(examples, too_long, seq_len)
    offsets = torch.zeros(len(seq_lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(seq_lengths, dtype=torch.int64).cumsum(0)
    tokens = torch.from_numpy(np.concatenate(chunks))
    loss_mask = torch.from_numpy(np.concatenate(mask_chunks))
    unit_lengths = [sum(n) for n in unit_seq_lengths]
    units = pack_rows(unit_lengths, seq_len) if data_cfg.packing else [[u] for u in range(len(examples))]
    rows = [[s for u in row for s in range(first[u], first[u + 1])] for row in units]
    desirable = torch.tensor([d for ex in examples for d in ex.desirable], dtype=torch.bool)
    unit_of = torch.repeat_interleave(torch.arange(len(examples)),
                                      torch.tensor([len(ex.completions) for ex in examples]))
    return PreferenceData(tokens, offsets, loss_mask, rows, desirable=desirable, unit_of=unit_of, seq_len=seq_len,
                          pad_token_id=pad_id(tokenizer), seed=seed, packing=data_cfg.packing)


def _role(ex: PreferenceExample, j: int) -> str:
    if len(ex.completions) == 2:
        return ("chosen", "rejected")[j]
    return "completion"


def _check_labels(ex: PreferenceExample, j: int, mask: list[int]) -> None:
    """A completion must leave labels (the template may render an empty one as nothing), and the sequence
    must start with a prompt token: the head counts a label in the sequence of the token it predicts."""
    if not any(mask):
        raise DataError(f"{ex.where}: the {_role(ex, j)} completion has no token to score once the template renders "
                        f"it; fill it in or remove the record")
    if mask[0]:
        raise DataError(f"{ex.where}: the prompt renders to no token before the {_role(ex, j)} completion; give the "
                        f"record a prompt")


def _refuse_long(examples: list[PreferenceExample], too_long: list[tuple[int, list[int]]], seq_len: int) -> None:
    i, lengths = too_long[0]
    ex = examples[i]
    if len(lengths) == 2:
        what = (f"the pair is {sum(lengths)} tokens (chosen {lengths[0]}, rejected {lengths[1]}, each with its "
                f"prompt), more than train.seq_len={seq_len}: a pair is scored whole, in one row")
    else:
        what = f"the example is {lengths[0]} tokens with its prompt, more than train.seq_len={seq_len}"
    longest = max(sum(n) for _, n in too_long)
    others = f" ({len(too_long) - 1} more too long, the longest {longest} tokens)" if len(too_long) > 1 else ""
    raise DataError(f"{ex.where}: {what}{others}; raise train.seq_len to {longest}, or shorten or remove the "
                    f"record{'s' if len(too_long) > 1 else ''}")
