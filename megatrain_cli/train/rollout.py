"""GRPO's rollouts: G completions of each prompt sampled from the weights the trainer holds, and the rows they
train as.

Generation is the eval's streamed generator (eval/streamed.StreamedModel) over the trainer's own host store:
the layers the engine keeps resident on the device are read there in place (`TrainerLayerFeed`), the others
through the eval's layer feed from their masters (on the CPU in place; on CUDA cast through pinned staging each
step, never pinned up front, since the weights change every step); the final norm and LM head are copied to
the device once per call, or read in place too when the head is resident. So a rollout always sees the weights
of the step before it and nothing is reloaded between generating and training. The caller lands pending host
updates first (`engine.synchronize(masters=False)`): the resident state stays on the device, not copied home.
Every prompt is repeated G times and all of them decode as one left-padded batch, one
KV cache preallocated for the longest row; the next token is drawn by a generate.Sampler (temperature, top-p,
a seeded generator whose state the checkpoint keeps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.eval.generate import Sampler, StopOnStrings, _finish, left_pad
from megatrain_cli.eval.layer_feed import layer_feed
from megatrain_cli.eval.streamed import StreamedModel
from megatrain_cli.methods.grpo import RolloutMicroBatch


@dataclass
class Rollouts:
    prompt_ids: list[list[int]]  # [P * G], each prompt repeated G times (prompt-major)
    completion_ids: list[list[int]]  # [P * G] the sampled tokens, up to and including the one that ended it
    texts: list[str]  # [P * G] the completions as text (cut at eos / a stop string), what the rewards read
    seconds: float  # generation's wall time
    decode_path: str = ""  # StreamedModel.decode_path: "graph", or "eager (why not)"

    @property
    def new_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


class TrainerLayerFeed:
    """The eval's layer-feed protocol (eval/layer_feed.py) over the trainer's engine: a layer the engine keeps
    resident (engine.resident_layers, once loaded) is read in place from its device weights, nothing moves;
    every other layer comes through the eval's feed from its host master (cast in pinned staging on CUDA)."""

    def __init__(self, engine, device: torch.device):
        self.resident = engine.resident
        if not self.resident.loaded:  # a run's (or a resume's) first rollout, before any step loaded them: else
            self.resident.load()  # every layer streams from its master at every token (7B: 156 s, not 7)
        self._inner, self.device, self.dtype = None, device, engine.dtype
        self.store = engine.store
        self.layouts = [engine.store.layouts[n] for n in engine.store.layer_names]
        self._streamed = False  # whether the layer in use came through the inner feed

    @property
    def inner(self):
        """The feed of the streamed layers, made at the first one: on CUDA its two pinned staging buffers of a
        layer each (7B: 2 x 466 MB of cudaHostAlloc, ~0.2 s) are not paid when every layer is resident."""
        if self._inner is None:
            self._inner = layer_feed(self.store, self.device, self.dtype, pin_all=False)
        return self._inner

    @property
    def bytes_sent(self) -> int:
        return 0 if self._inner is None else self._inner.bytes_sent

    def all_in_place(self) -> bool:
        """Every decoder layer is read in place on the device (a decode step can be one CUDA graph)."""
        return all(self._in_place(i) for i in range(len(self.layouts)))

    def _in_place(self, layer: int) -> bool:
        return self.resident.loaded and f"layers.{layer}" in self.resident

    def get(self, layer: int) -> dict[str, torch.Tensor]:
        self._streamed = not self._in_place(layer)
        if self._streamed:
            return self.inner.get(layer)
        return self.layouts[layer].views(self.resident.weights(f"layers.{layer}"))

    def prefetch(self, layer: int) -> None:
        if not self._in_place(layer):
            self.inner.prefetch(layer)

    def release(self) -> None:
        if self._streamed:
            self.inner.release()

    def head(self) -> dict[str, torch.Tensor] | None:
        """The head tile's device weights (final norm, untied LM head) when the engine keeps it resident (with
        any resident layer), else None: the host master is then current."""
        if not (self.resident.loaded and "head" in self.resident):
            return None
        return self.store.layouts["head"].views(self.resident.weights("head"))


def sample(store, device: torch.device, tokenizer, prompt_ids: list[list[int]], group: int, sampler: Sampler, *,
           max_new_tokens: int, eos_ids: list[int], pad_id: int, stop: list[str], engine=None) -> Rollouts:
    """`group` completions of every prompt, from the masters in `store` now (`engine`: the trainer's, whose
    resident layers are then read in place on the device)."""
    t0 = time.perf_counter()
    feed = TrainerLayerFeed(engine, device) if engine is not None else None
    # the resident head's weights, current on the device (its host master is not), else the master's copy
    model = StreamedModel(store, device, pin_all=False, feed=feed, head=feed.head() if feed is not None else None)
    repeated = [ids for ids in prompt_ids for _ in range(group)]
    input_ids, mask = left_pad(repeated, pad_id)
    criteria = [StopOnStrings(tokenizer, stop, input_ids.shape[1])] if stop else []
    with torch.inference_mode():
        new, lengths = model.decode_batch(input_ids, mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                          pad_id=pad_id, stop_criteria=criteria, pick=sampler)
    completions, texts = [], []
    for row, length in zip(new.tolist(), lengths.tolist()):
        generation = _finish(tokenizer, row, eos_ids, pad_id, stop, length)
        completions.append(row[:generation.new_tokens])
        texts.append(generation.text)
    return Rollouts(repeated, completions, texts, time.perf_counter() - t0, model.decode_path)


def rollout_rows(rollouts: Rollouts, advantages: torch.Tensor, micro_batch_size: int,
                 pad_id: int) -> list[RolloutMicroBatch]:
    """Each completion as one row (prompt + completion, right-padded to its micro-batch's longest; labels on the
    completion's tokens only, each with its completion's advantage), `micro_batch_size` rows per micro-batch."""
    rows = list(zip(rollouts.prompt_ids, rollouts.completion_ids, advantages.reshape(-1).tolist()))
    out = []
    for lo in range(0, len(rows), micro_batch_size):
        chunk = rows[lo:lo + micro_batch_size]
        width = max(len(p) + max(1, len(c)) for p, c, _ in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.int64)
        labels = torch.full((len(chunk), width), IGNORE_INDEX, dtype=torch.int64)
        adv = torch.zeros(len(chunk), width, dtype=torch.float32)
        for i, (p, c, a) in enumerate(chunk):
            ids[i, :len(p) + len(c)] = torch.tensor(p + c, dtype=torch.int64)
            labels[i, len(p):len(p) + len(c)] = torch.tensor(c, dtype=torch.int64)
            adv[i, len(p):len(p) + len(c)] = a
        out.append(RolloutMicroBatch(ids, labels, advantages=adv))
    return out
