"""GRPO's rollouts: G completions of each prompt sampled from the weights the trainer holds, and the rows they
train as.

Generation is the eval's streamed generator (eval/streamed.StreamedModel) over the trainer's own host store:
its layer feed reads each layer's master where it lies (on the CPU in place; on CUDA cast through pinned
staging each step, never pinned up front, since the weights change every step), the final norm and LM head are
copied to the device once per call, so a rollout always sees the weights of the step before it and nothing is
reloaded between generating and training. The caller brings pending host updates home first
(`engine.synchronize()`). Every prompt is repeated G times and all of them decode as one left-padded batch, one
KV cache preallocated for the longest row; the next token is drawn by a generate.Sampler (temperature, top-p,
a seeded generator whose state the checkpoint keeps).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.eval.generate import Sampler, StopOnStrings, _finish, left_pad
from megatrain_cli.eval.streamed import StreamedModel
from megatrain_cli.methods.grpo import RolloutMicroBatch


@dataclass
class Rollouts:
    prompt_ids: list[list[int]]  # [P * G], each prompt repeated G times (prompt-major)
    completion_ids: list[list[int]]  # [P * G] the sampled tokens, up to and including the one that ended it
    texts: list[str]  # [P * G] the completions as text (cut at eos / a stop string), what the rewards read
    seconds: float  # generation's wall time

    @property
    def new_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


def sample(store, device: torch.device, tokenizer, prompt_ids: list[list[int]], group: int, sampler: Sampler, *,
           max_new_tokens: int, eos_ids: list[int], pad_id: int, stop: list[str]) -> Rollouts:
    """`group` completions of every prompt, from the masters in `store` now."""
    t0 = time.perf_counter()
    model = StreamedModel(store, device, pin_all=False)
    repeated = [ids for ids in prompt_ids for _ in range(group)]
    input_ids, mask = left_pad(repeated, pad_id)
    criteria = [StopOnStrings(tokenizer, stop, input_ids.shape[1])] if stop else []
    with torch.inference_mode():
        new = model.decode_batch(input_ids, mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                                 stop_criteria=criteria, pick=sampler)
    completions, texts = [], []
    for row in new.tolist():
        generation = _finish(tokenizer, row, eos_ids, pad_id, stop)
        completions.append(row[:generation.new_tokens])
        texts.append(generation.text)
    return Rollouts(repeated, completions, texts, time.perf_counter() - t0)


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
