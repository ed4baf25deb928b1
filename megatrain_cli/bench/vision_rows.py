"""A vision-language model's bench rows: synthetic chats with images, shaped as its processor makes them.

Each row holds `bench.images_per_row` images of `bench.image_size` pixels a side (rounded down to whole
merged patches: Qwen2-VL's 28), each written as <vision_start>, its feature tokens (patches / merge^2),
<vision_end>, with random text around them up to train.seq_len; loss on the text only. The pixel rows are
seeded random normals of the processor's shape ([patches, channels x temporal x patch^2]) with their
image_grid_thw, so the tower runs exactly the work real images of that size give it. Step s, micro-batch k
takes seed s * 97 + k, in ours and in the native baseline.
"""

from __future__ import annotations

import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch


class VisionRows:
    def __init__(self, r, config, *, micro_batches: int):
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

    @property
    def images_per_step(self) -> int:
        return self.micro_batches * self.batch * self.per_row

    def micro_batch(self, seed: int) -> MicroBatch:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.text_vocab, (self.batch, self.seq), generator=g)
        labels = ids.clone()
        image = [self.ids["vision_start"], *[self.ids["image"]] * self.tokens, self.ids["vision_end"]]
        for k in range(self.per_row):  # the images first, one after the other, after one text token each
            at = 1 + k * (len(image) + 1)
            ids[:, at:at + len(image)] = torch.tensor(image)
            labels[:, at - 1:at + len(image)] = IGNORE_INDEX  # the question, the image: no loss
        n = self.batch * self.per_row
        pixels = torch.randn(n * self.grid * self.grid, self.pixel_dim, generator=g)
        grid = torch.tensor([[1, self.grid, self.grid]] * n)
        return MicroBatch(ids, labels, images={"pixel_values": pixels, "image_grid_thw": grid})

    def __call__(self, s: int) -> list[MicroBatch]:
        return [self.micro_batch(s * 97 + k) for k in range(self.micro_batches)]

    def attended_per_step(self, steps) -> None:
        return None  # one document per row

    def describe(self) -> str:
        return (f"images: {self.per_row} per row, {self.side}x{self.side} px ({self.grid * self.grid} patches, "
                f"{self.tokens} tokens each), {self.images_per_step} per step; TFLOPS count every parameter per "
                f"text token (the tower's patches are not counted apart)")
