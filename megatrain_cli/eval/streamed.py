"""Greedy generation with the weights left in host memory, for models larger than the GPU.

Every forward step (the prefill, then one token for the whole batch per step) streams every decoder
layer to the device: for layer i, `layer_feed` brings its weights in the compute dtype (on CUDA from
pinned memory on a copy stream, into one of two device buffers, so layer i+1's copy overlaps layer
i's compute), the HF decoder-layer template runs on them through `run_bound`, and the layer's keys and
values go into its device KV cache. The final norm and LM head stay on the device for the whole call
(every step needs them); embedding rows are gathered on the host, since a step needs only the batch's
few rows of it.

What it costs: decoding is bound by the host->device link, not by compute. Each step re-sends all
layers, so steps/s ~= link GB/s / layer bytes and tokens/s ~= batch x that. A 7B model in bf16 streams
~13 GB of decoder layers a step (its ~2 GB of embedding and head are not streamed); at ~50 GB/s that
is ~4 steps/s: ~120 tokens/s at batch 32, twice that at 64. Large batches are what make it worthwhile,
and the KV cache (device memory, batch x length) is what bounds them. Resident generation, when the
model fits, reads the weights from device memory instead, at ~100x the link's bandwidth.

Token for token the same as HF `generate` with greedy decoding: the same left padding, position ids
(cumsum of the attention mask - 1, then +1 a step), causal + padding mask (and sliding window where a
layer has one), argmax over the last position's logits, and rows that have ended are fed pad tokens
until the batch ends; the stopping rules are `generate.stopping_rules`, i.e. HF's.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from megatrain_cli.engine.templates import run_bound
from megatrain_cli.eval.generate import greedy, stopping_rules
from megatrain_cli.eval.layer_feed import layer_feed
from megatrain_cli.eval.static_decode import StaticDecoder, why_not_graph
from megatrain_cli.store.tiles import HostStore


class LayerKV:
    """One layer's keys and values for the whole batch, preallocated for the longest sequence of a call.

    HF attention calls `cache.update(key, value, layer_idx, ...)` and attends over what it returns.
    This provides just that method (transformers 5.17 and 5.24 pass different extra arguments; none is
    needed here), so no HF Cache class, whose API moves between versions, is involved; and appending
    a token writes in place instead of concatenating the whole history as DynamicCache does.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.length = 0

    def update(self, key: torch.Tensor, value: torch.Tensor, *_args, **_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:  # (batch, kv_heads, seq, head_dim): sized from the first keys seen
            b, h, _, d = key.shape
            self.keys = key.new_empty((b, h, self.capacity, d))
            self.values = value.new_empty((b, h, self.capacity, value.shape[-1]))
        end = self.length + key.shape[2]
        self.keys[:, :, self.length:end] = key
        self.values[:, :, self.length:end] = value
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def attention_mask(key_mask: torch.Tensor, q_start: int, q_len: int, window: int | None,
                   padded: bool) -> torch.Tensor | None:
    """Boolean (batch, 1, q_len, kv_len) mask, True = attend, for the queries at columns q_start.. ;
    None where HF passes none (no padding, no window in reach, and the causal pattern is SDPA's own):
    the same SDPA kernel then runs in both paths, so bf16 rounding agrees too.

    A query sees the non-pad keys at its column or before (within `window` columns, if given). It also
    always sees itself: that changes nothing for real tokens, and spares a left-pad query a row with
    no key at all, whose softmax would be NaN and then leak through pad keys into later layers.
    """
    kv_len = key_mask.shape[1]
    if not padded and (window is None or kv_len < window) and (q_len == 1 or q_len == kv_len):
        return None
    q = torch.arange(q_start, q_start + q_len, device=key_mask.device)[:, None]
    k = torch.arange(kv_len, device=key_mask.device)[None, :]
    visible = k <= q
    if window is not None:
        visible = visible & (q - k < window)
    return (key_mask[:, None, None, :] & visible) | (k == q)


def sliding_window(adapter, layer: int) -> int | None:
    """The attention window of a layer, as HF masks it: layers typed 'sliding_attention', and every
    layer of a config without layer types that sets `sliding_window` (Mistral)."""
    if adapter.sliding_window is None:
        return None
    if getattr(adapter.config, "layer_types", None) and "sliding" not in adapter.layer_types[layer]:
        return None
    return adapter.sliding_window


class StreamedModel:
    """A HostStore's model, run for greedy generation with one decoder layer on the device at a time."""

    def __init__(self, store: HostStore, device: torch.device, pin_all: bool | None = None, feed=None,
                 head: dict[str, torch.Tensor] | None = None):
        """`feed`: where the layers' weights come from (layer_feed.py's protocol); None: the store's masters
        through `layer_feed` (GRPO's rollouts hand in one that reads the trainer's resident layers in place).
        `head`: the head tile's weights already on the device (a trainer's resident head, current where its host
        master is not); None: copied from the host master (7B: ~1 GB in the compute dtype, ~0.3 s)."""
        self.store, self.adapter, self.device = store, store.adapter, device
        self.dtype = store.compute_dtype
        self.num_layers = self.adapter.num_layers
        self.feed = feed if feed is not None else layer_feed(store, device, self.dtype, pin_all)
        self.templates = self.make_templates()
        self.windows = [sliding_window(self.adapter, i) for i in range(self.num_layers)]
        # HF's eager attention (Gemma 2's softcapped one) adds its mask to the scores and applies none when given
        # none: it takes an additive mask, always built (SDPA takes the boolean one, or none where causal)
        self.additive_mask = getattr(self.adapter.config, "_attn_implementation", None) == "eager"
        # transformers 5.24 names the layer's cache argument `cache`, 5.17 `past_key_values`.
        params = inspect.signature(type(self.templates[0]).forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.rotary = self.adapter.make_rotary(device)
        # Gemma 3's one rotary module holds a table per layer type (two RoPE bases): asked per type.
        self.rotary_per_type = "layer_type" in inspect.signature(type(self.rotary).forward).parameters
        self.norm_template = self.adapter.make_norm_template().eval()
        self.embedding = store.tiles["embed"].master.view(self.adapter.vocab_size, self.adapter.hidden_size)
        if head is None:
            head = store.layouts["head"].views(store.tiles["head"].master)
        self.norm_weights = {k.removeprefix("norm."): v.to(device, self.dtype)
                             for k, v in head.items() if k.startswith("norm.")}
        self.lm_weight = (self.embedding if self.adapter.tied else head["lm_head.weight"]).to(device, self.dtype)
        self.steps = 0  # forward steps run (each streamed every layer once)
        self.decode_path = ""  # how the last decode_batch ran: "graph", or "eager (why not a graph)"

    def make_templates(self) -> list[torch.nn.Module]:
        """One template per layer structure: layers run one after another, each bound to its own weights."""
        by_structure: dict[str, torch.nn.Module] = {}
        for i in range(self.num_layers):
            by_structure.setdefault(self.adapter.layer_structure(i), self.adapter.make_layer_template(i).eval())
        return [by_structure[self.adapter.layer_structure(i)] for i in range(self.num_layers)]

    @property
    def bytes_sent(self) -> int:
        """Bytes copied host -> device so far (0 on CPU, where nothing moves)."""
        return self.feed.bytes_sent

    def greedy_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                     eos_ids: list[int], pad_id: int, stop_criteria: list) -> torch.Tensor:
        """New ids for one left-padded batch (on the host), rows that ended early filled with pad ids:
        the same contract, and the same ids, as `generate.hf_greedy_batch`."""
        return self.decode_batch(input_ids, attention_mask, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                                 pad_id=pad_id, stop_criteria=stop_criteria, pick=greedy)[0]

    def decode_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                     eos_ids: list[int], pad_id: int, stop_criteria: list, pick) -> tuple[torch.Tensor, torch.Tensor]:
        """greedy_batch's decoding with the next ids chosen by `pick` ([B, V] logits -> [B] ids: `greedy`, or a
        generate.Sampler for GRPO's rollouts): (the new ids, each row's own count of them), on the host. The
        count, not the ids, says where a row ended: a row stopped by a stop string is filled with pad ids, which
        are the eos id where a tokenizer has no pad token of its own."""
        why_not = why_not_graph(self)
        self.decode_path = "graph" if why_not is None else f"eager ({why_not})"
        if why_not is None:
            return StaticDecoder(self).decode_batch(input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                                    eos_ids=eos_ids, pad_id=pad_id, stop_criteria=stop_criteria,
                                                    pick=pick)
        batch, width = input_ids.shape
        done_rule = stopping_rules(eos_ids, stop_criteria)
        # The last new token is never fed back, so the cache needs width + max_new_tokens - 1 columns.
        capacity = width + max_new_tokens - 1
        caches = [LayerKV(capacity) for _ in range(self.num_layers)]
        key_mask = torch.ones((batch, capacity), dtype=torch.bool, device=self.device)
        key_mask[:, :width] = attention_mask.to(self.device, torch.bool)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0).to(self.device)
        sequences = input_ids.to(self.device)
        unfinished = torch.ones(batch, dtype=torch.bool, device=self.device)
        lengths = torch.zeros(batch, dtype=torch.int64, device=self.device)
        padded = not bool(attention_mask.all())  # new columns are never padding
        step_ids, q_start = input_ids, 0
        for step in range(max_new_tokens):
            q_len = step_ids.shape[1]
            hidden = self._embed(step_ids)
            hidden = self._layers(hidden, positions, key_mask[:, :q_start + q_len], q_start, padded, caches,
                                  prefetch_next_step=step + 1 < max_new_tokens)
            next_ids = pick(self.head(hidden[:, -1:])[:, -1])
            next_ids = torch.where(unfinished, next_ids, torch.full_like(next_ids, pad_id))
            sequences = torch.cat([sequences, next_ids[:, None]], dim=1)
            lengths += unfinished  # a token picked while the row ran is the model's own
            unfinished &= ~done_rule(sequences, None)
            if not bool(unfinished.any()):
                break
            step_ids = next_ids[:, None].cpu()
            positions = positions[:, -1:] + 1
            q_start += q_len
        return sequences[:, width:].cpu(), lengths.cpu()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        # Gathering fp32 rows and then casting gives the values an embedding held in the compute dtype would;
        # a scaled embedding (Gemma) multiplies by its scale in that dtype, as HF's module does.
        rows = self.embedding[ids.cpu()].to(self.dtype).to(self.device)
        if self.adapter.input_scale is not None:
            rows = rows * torch.tensor(self.adapter.input_scale, dtype=self.dtype)
        return rows

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head over `hidden` [B, q, H] -> logits [B, q, V]."""
        logits = F.linear(run_bound(self.norm_template, self.norm_weights, hidden), self.lm_weight)
        if self.adapter.logit_softcap is not None:  # Gemma 2/3: what training's head computes (engine/loss.py)
            cap = self.adapter.logit_softcap
            logits = torch.tanh(logits.float() / cap) * cap
        return logits

    def masks(self, key_mask, q_start: int, q_len: int, padded: bool) -> dict:
        """Each attention window's mask for the queries at columns q_start.. (`attention_mask`), additive where
        the family's eager attention adds it to the scores."""
        full = padded or self.additive_mask
        masks = {w: attention_mask(key_mask, q_start, q_len, w, full) for w in set(self.windows)}
        if self.additive_mask:
            masks = {w: torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill_(
                ~m, torch.finfo(self.dtype).min) for w, m in masks.items()}
        return masks

    def rotary_tables(self, hidden, positions) -> dict:
        """Each layer type's rotary (cos, sin) for `positions`."""
        if self.rotary_per_type:
            return {t: self.rotary(hidden, positions, t) for t in set(self.adapter.layer_types)}
        return dict.fromkeys(set(self.adapter.layer_types), self.rotary(hidden, positions))

    def run_layer(self, i: int, weights, hidden, masks, positions, rotary, cache, templates=None):
        """Layer i on `weights` (through `templates`, default this model's)."""
        return run_bound((templates or self.templates)[i], weights, hidden, attention_mask=masks[self.windows[i]],
                         position_ids=positions, position_embeddings=rotary[self.adapter.layer_types[i]],
                         **{self.cache_arg: cache})

    def _layers(self, hidden, positions, key_mask, q_start, padded, caches, *, prefetch_next_step: bool):
        masks = self.masks(key_mask, q_start, hidden.shape[1], padded)
        rotary = self.rotary_tables(hidden, positions)
        last = self.num_layers - 1
        for i in range(self.num_layers):
            weights = self.feed.get(i)
            if i < last:
                self.feed.prefetch(i + 1)
            elif prefetch_next_step:
                self.feed.prefetch(0)  # the next step's first layer streams during the head and the stop check
            hidden = self.run_layer(i, weights, hidden, masks, positions, rotary, caches[i])
            self.feed.release()
        self.steps += 1
        return hidden
