"""Device bytes of GRPO's rollouts, for the memory plan (memory.py).

A GRPO step first decodes every completion it trains on at once (train.micro_batch_size x train.grad_accum rows:
eval/static_decode.py) with the weights the trainer holds: resident layers read in place, streamed ones through
the layer slots the step uses too. What the rollouts add on the device is theirs alone:
  - the KV caches: per layer, keys and values of [rows, kv heads, capacity, head dim] in the compute dtype, the
    capacity a prompt plus grpo.max_new_tokens (at most train.seq_len, which is what is counted);
  - the prefill's transients: one layer at a time over rows x prompt tokens (the prompt at most train.seq_len -
    grpo.max_new_tokens): its MLP's gate, up and their product, and the attention's inputs and outputs;
  - the last position's logits and the sampler's fp32 copy of them.
They live before the step's forward and are freed when it starts, so the step's activations and loss chunk
never sit beside them: the short-context plan carries only what the rollouts need beyond those (memory.py), and
every plan keeps room for them beside its resident layers, the layer slots and the head (rollout_problem). At
the 7B preset (64 rows of 512) that is nothing: 1.9 GB of caches against ~30 GB of activations; at 14B, 64 rows
of 4K tokens need 52 GB of caches, and a plan that ignored them filled the device with resident layers.
"""

from __future__ import annotations

from megatrain_cli.engine.plan.lean_terms import ModelShape

GiB = 2**30
HEADROOM = 0.88  # of the device budget, as memory.py's choices keep
# The short-context plan's device terms alive while rollouts run (memory.py's names): the layer slots the streamed
# layers decode through, the head, the gradient buffers the engine holds for the step; not its activations.
BESIDE = ("layer weight slots", "head weights", "tied embedding table", "layer gradient", "LM head gradient")


def rollout_device_bytes(adapter, width: int, *, rows: int, seq_len: int, max_new_tokens: int) -> int:
    """The rollouts' own device bytes (module doc) for `rows` completions in a capacity of `seq_len` tokens."""
    shape = ModelShape.of(adapter)
    caches = shape.layers * 2 * shape.kv_heads * shape.head_dim * rows * seq_len * width
    prompt = max(1, seq_len - max_new_tokens)
    prefill = rows * prompt * (3 * shape.intermediate + 2 * shape.hidden + shape.q_dim + 2 * shape.kv_heads
                               * shape.head_dim) * width
    logits = rows * shape.vocab * (width + 4)
    return caches + prefill + logits


def recipe_rollout_bytes(r, adapter, width: int) -> int:
    """rollout_device_bytes of recipe `r` (0 unless train.method is grpo)."""
    if r.train.method != "grpo":
        return 0
    t = r.train
    return rollout_device_bytes(adapter, width, rows=t.micro_batch_size * t.grad_accum, seq_len=t.seq_len,
                                max_new_tokens=r.grpo.max_new_tokens)


def rollout_problem(device: dict, resident_bytes: int, rollout_bytes: int, budget: int, *, rows: int, seq_len: int,
                    resident: int) -> str:
    """'' when the rollouts fit `HEADROOM` of `budget` beside the resident layers and the `BESIDE` terms of a
    short-context plan's `device` lines, else the problem with its fixes."""
    beside = sum(v for k, v in device.items() if k.startswith(BESIDE))
    if resident_bytes + beside + rollout_bytes <= HEADROOM * budget:
        return ""
    return (f"device memory: GRPO's rollouts ({rows} completions in {seq_len}-token KV caches, with the prefill: about "
            f"{rollout_bytes / GiB:.2f} GiB) do not fit beside {resident} resident layers ({resident_bytes / GiB:.2f} "
            f"GiB) and the layer slots and head ({beside / GiB:.2f} GiB) in {HEADROOM:.0%} of the "
            f"{budget / GiB:.2f} GiB device budget. Use fewer engine.resident_layers (or 'auto'), a shorter "
            f"train.seq_len / grpo.max_new_tokens, or fewer completions a step (train.micro_batch_size x "
            f"train.grad_accum)")
