"""A vision-language model's bench rows: synthetic chats with images, shaped as its processor makes them.

Each row holds `bench.images_per_row` images of `bench.image_size` pixels a side (rounded down to whole
merged patches: Qwen2-VL's 28), each written as <vision_start>, its feature tokens (patches / merge^2),
<vision_end>, with random text around them up to train.seq_len; loss on the text only. The pixel rows are
seeded random normals of the processor's shape ([patches, channels x temporal x patch^2]) with their
image_grid_thw, so the tower runs exactly the work real images of that size give it. Step s, micro-batch k
takes seed s * 97 + k, in ours and in the native baseline.

With data.packing, rows are packed as `train` packs image chats (data/image_rows.py): documents, each with
bench.images_per_row images after one text token and text after them (its length from the log-normal of
bench.doc_len_mean / bench.doc_len_spread, at least what its images need), packed best-fit (data/packing.py),
position_ids restarting at each document and a padding tail continuing the last; the engine gives each document
its own multimodal positions and attention. Images per step then vary with the rows: images/s counts them.
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.bench.loop import POOL_ROWS  # packed: documents for at least this many rows are drawn
from megatrain_cli.metrics.flops import attention_pairs


class VisionRows:
    def __init__(self, r, config, *, micro_batches: int, steps: int | None = None):
        vc = config.vision_config
        self.batch, self.seq, self.micro_batches = r.train.micro_batch_size, r.train.seq_len, micro_batches
        self.per_row = r.bench.images_per_row
        patch, merge = int(vc.patch_size), int(vc.spatial_merge_size)
        self.side = r.bench.image_size // (patch * merge) * (patch * merge)
        if self.side < patch * merge:
            raise ValueError(f"bench.image_size: {r.bench.image_size} px is below one merged patch "
                             f"({patch * merge} px); use bench.image_size >= {patch * merge}")
        self.grid = self.side // patch
        self.tokens = self.grid * self.grid // merge ** 2  # feature tokens per image
        self.pixel_dim = int(vc.in_channels) * int(vc.temporal_patch_size) * patch * patch
        self.ids = {k: int(getattr(config, f"{k}_token_id")) for k in ("image", "vision_start", "vision_end")}
        self.text_vocab = min(config.get_text_config().vocab_size, min(self.ids.values()))
        need = self.per_row * (self.tokens + 2) + 2
        if self.seq < need:
            raise ValueError(f"train.seq_len: {self.seq} tokens cannot hold {self.per_row} image(s) of "
                             f"{self.side} px ({self.tokens} tokens each) and text; use train.seq_len >= {need} "
                             f"or a smaller bench.image_size")
        self.attended: dict[int, float] = {}
        self.images: dict[int, int] = {}
        self.packed = None  # packed: (document lengths, rows of document indices in the order they are taken)
        if r.data.packing:
            if r.bench.doc_lengths != "synthetic":
                raise ValueError("bench.doc_lengths=data: a vision-language model's bench builds synthetic image "
                                 "chats, not data.source's; use bench.doc_lengths=synthetic (or `megatrain train` "
                                 "on the data)")
            self.packed = self._pack(r, need, rows=(steps or 1) * micro_batches * self.batch)

    def _pack(self, r, need: int, rows: int) -> tuple[list[int], list[list[int]]]:
        from megatrain_cli.data.packing import pack_rows
        from megatrain_cli.data.train_data import synthetic_lengths

        b = r.bench
        lengths = [max(n, need) for n in synthetic_lengths(max(rows, POOL_ROWS) * self.seq, b.doc_len_mean,
                                                           b.doc_len_spread, self.seq, seed=r.train.seed)]
        packed = pack_rows(lengths, self.seq)
        order = torch.randperm(len(packed), generator=torch.Generator().manual_seed(r.train.seed)).tolist()
        return lengths, [packed[i] for i in order]

    @property
    def probe_images(self) -> tuple[int, int] | None:
        """The planner probe's tower shape (engine/plan/probe.recipe_shape): (images a micro-batch, patches a
        side); packed, the rows' mean documents' images. None: no images in a row, no tower work."""
        docs = 1.0 if self.packed is None else sum(map(len, self.packed[1])) / len(self.packed[1])
        return (max(1, round(self.batch * docs * self.per_row)), self.grid) if self.per_row else None

    def images_in(self, steps) -> float:
        """Images a step, the mean over these steps (each row's documents' images when packed)."""
        return sum(self.images[s] for s in steps) / len(steps)

    def _document(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, labels) of one chat of n tokens: a text token, the images, text; loss on the text after them."""
        ids = torch.randint(0, self.text_vocab, (n,), generator=g)
        labels = ids.clone()
        image = [self.ids["vision_start"], *[self.ids["image"]] * self.tokens, self.ids["vision_end"]]
        for k in range(self.per_row):  # the images first, one after the other, after one text token each
            at = 1 + k * (len(image) + 1)
            ids[at:at + len(image)] = torch.tensor(image)
            labels[at - 1:at + len(image)] = IGNORE_INDEX  # the question, the image: no loss
        return ids, labels

    def micro_batch(self, seed: int, rows: list[list[int]] | None = None) -> MicroBatch:
        """One micro-batch: a document a row, or (packed) `rows`' documents back to back in each row."""
        g = torch.Generator().manual_seed(seed)
        if rows is None:
            ids, labels = map(torch.stack, zip(*(self._document(self.seq, g) for _ in range(self.batch))))
            pos, n = None, self.batch * self.per_row
        else:
            ids = torch.zeros(len(rows), self.seq, dtype=torch.int64)
            labels = torch.full((len(rows), self.seq), IGNORE_INDEX)
            pos = torch.zeros(len(rows), self.seq, dtype=torch.int64)
            lengths = self.packed[0]
            for i, docs in enumerate(rows):
                at = 0
                for d in docs:
                    ids[i, at:at + lengths[d]], labels[i, at:at + lengths[d]] = self._document(lengths[d], g)
                    pos[i, at:at + lengths[d]] = torch.arange(lengths[d])
                    at += lengths[d]
                pos[i, at:] = torch.arange(lengths[docs[-1]], lengths[docs[-1]] + self.seq - at)  # the tail
            n = sum(len(docs) for docs in rows) * self.per_row
        pixels = torch.randn(n * self.grid * self.grid, self.pixel_dim, generator=g)
        grid = torch.tensor([[1, self.grid, self.grid]] * n)
        return MicroBatch(ids, labels, pos, images={"pixel_values": pixels, "image_grid_thw": grid})

    def __call__(self, s: int) -> list[MicroBatch]:
        mbs = []
        for k in range(self.micro_batches):
            rows = None
            if self.packed is not None:
                lo = ((s * self.micro_batches + k) * self.batch) % len(self.packed[1])
                rows = [self.packed[1][(lo + i) % len(self.packed[1])] for i in range(self.batch)]
            mbs.append(self.micro_batch(s * 97 + k, rows))
        self.attended[s] = attention_pairs(mbs)
        self.images[s] = sum(int(mb.images["image_grid_thw"].shape[0]) for mb in mbs)
        return mbs

    def attended_per_step(self, steps) -> float | None:
        """The mean attention_pairs of these steps when packed; None: one document per row."""
        if self.packed is None:
            return None
        return sum(self.attended[s] for s in steps) / len(steps)

    def describe(self) -> str:
        what = (f"images: {self.per_row} per {'document' if self.packed else 'row'}, {self.side}x{self.side} px "
                f"({self.grid * self.grid} patches, {self.tokens} tokens each)")
        if self.packed is None:
            what += f", {self.micro_batches * self.batch * self.per_row} per step"
        else:
            lengths, rows = self.packed
            fill = sum(lengths[d] for row in rows for d in row) / (len(rows) * self.seq)
            what += (f"; packed rows: {sum(map(len, rows)) / len(rows):.1f} documents/row, fill {fill:.1%}; model "
                     f"and executed TFLOPS count attention within documents only")
        return what + "; TFLOPS count every parameter per text token (the tower's patches are not counted apart)"
