"""Decoding with every decoder layer already on the device: each token step of the whole batch is one CUDA graph
replay (GRPO's rollouts when the trainer keeps all layers and the head resident).

Why: launched eagerly, a 7B token step at batch 64 issues ~30 kernels per layer from Python (HF's layer code and
functional_call's binding), ~1 ms of host time per layer for ~0.2 ms of GPU work: 27 ms a step, 2,359 generated
tokens/s (docs/benchmarks.md, session 13). A replay is one launch for the 28 layers, the final norm and the head.

What a graph needs, and what it costs:
  - fixed shapes and addresses: one KV cache of fixed capacity per layer (`StaticKV`), written at a column held
    in a device tensor; the step's inputs (embedded ids, positions, masks) copied into fixed buffers first;
  - attention reads the whole capacity every step (later columns are masked, and zeroed so a masked column
    adds exact zeros): up to ~2x an exact-length cache's attention reads, small beside the weights' at batch 64;
  - one capture per decode call (a warm-up step and the capture: ~2 eager steps), since batch and capacity
    change between calls.
Outside the graph, per step: the sampler (eager, so it draws what the eager path draws from the same logits), one
device -> host read of the new ids (the step's one sync), the stop rules on the host (HF's, on the host copy of
the sequences), and the next ids' embedding rows gathered from the host master and copied in.

The prefill (the prompts, many columns) runs eagerly through the same layers into the same caches. Token for
token this is StreamedModel.decode_batch's decoding (tests/eval/test_static_decode.py); on the CPU it runs the
same loop without a graph, which is how the CPU tests check it.
"""

from __future__ import annotations

import torch

from megatrain_cli.eval.decode_attention import use_decode_attention
from megatrain_cli.eval.generate import stopping_rules

# Config keys of a mixture-of-experts layer: HF routes tokens to experts with data-dependent shapes (nonzero,
# per-expert loops) that a graph cannot hold; such models decode eagerly.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


# A store whose capture failed once (keyed by id: one store per run) decodes eagerly for the rest of the run: a
# failed capture costs a step's time and may leave its memory pool behind, so it is not tried at every rollout.
_CAPTURE_FAILED: dict[int, str] = {}


def why_not_graph(model) -> str | None:
    """None when `model` (a StreamedModel) can decode through a CUDA graph, else the reason it cannot."""
    if model.device.type != "cuda":
        return "not on CUDA"
    all_in_place = getattr(model.feed, "all_in_place", None)
    if all_in_place is None or not all_in_place():
        return "some layers stream from host memory"
    text = model.adapter.text_config  # a VLM's decoder: its own config
    if any(getattr(text, k, None) for k in _EXPERT_KEYS):
        return "mixture-of-experts layers route with data-dependent shapes"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    kind = str(rope.get("rope_type", rope.get("type", ""))) if isinstance(rope, dict) else ""
    if "dynamic" in kind or kind == "longrope":
        return f"its {kind} RoPE picks its tables by the largest position, read on the host"
    if id(model.store) in _CAPTURE_FAILED:
        return f"the CUDA graph capture failed earlier in this run: {_CAPTURE_FAILED[id(model.store)]}"
    return None


class StaticKV:
    """One layer's keys and values at a fixed capacity, written at the columns `at` (a device tensor, so a
    graph replay writes where the step's inputs say). Returns the whole capacity: the mask hides the columns
    not written yet, which hold zeros (not garbage: a masked weight of 0 times a NaN would still be NaN)."""

    def __init__(self, capacity: int, at: list):
        self.capacity, self.at = capacity, at  # at[0]: the columns this forward writes
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def update(self, key: torch.Tensor, value: torch.Tensor, *_args, **_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            b, h, _, d = key.shape
            self.keys = key.new_zeros((b, h, self.capacity, d))
            self.values = value.new_zeros((b, h, self.capacity, value.shape[-1]))
        self.keys.index_copy_(2, self.at[0], key)
        self.values.index_copy_(2, self.at[0], value)
        return self.keys, self.values


class StaticDecoder:
    """StreamedModel.decode_batch's contract over fixed buffers, a step replayed as a CUDA graph (`graph`:
    False runs the same step eagerly: the CPU, and the tests)."""

    def __init__(self, model, graph: bool | None = None):
        self.m = model
        self.graph = model.device.type == "cuda" if graph is None else graph
        # Every layer's weights, read in place: the addresses a graph holds for the whole call.
        self.weights = [model.feed.get(i) for i in range(model.num_layers)]
        model.feed.release()
        # Templates of our own, whose one-token attention reads grouped key heads in place (decode_attention.py)
        self.templates = model.make_templates()
        for template in set(self.templates):
            use_decode_attention(template)

    def decode_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                     eos_ids: list[int], pad_id: int, stop_criteria: list, pick) -> tuple[torch.Tensor, torch.Tensor]:
        m, dev = self.m, self.m.device
        batch, width = input_ids.shape
        done_rule = stopping_rules(eos_ids, stop_criteria)
        capacity = width + max_new_tokens - 1  # the last new token is never fed back
        at = [torch.arange(width, device=dev)]
        caches = [StaticKV(capacity, at) for _ in range(m.num_layers)]
        key_mask = torch.ones((batch, capacity), dtype=torch.bool, device=dev)
        key_mask[:, :width] = attention_mask.to(dev, torch.bool)
        positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0).to(dev)
        sequences = input_ids.clone()  # the host copy the stop rules read
        unfinished = torch.ones(batch, dtype=torch.bool)
        lengths = torch.zeros(batch, dtype=torch.int64)
        pad = torch.full((batch,), pad_id, dtype=torch.int64)

        # The prefill, eagerly, over the whole capacity: its masks always built (the columns past the prompt are
        # not written yet; with no mask one-token prompts would attend to them).
        hidden = m._embed(input_ids)
        masks, rotary = m.masks(key_mask, 0, width, True), m.rotary_tables(hidden, positions)
        for i in range(m.num_layers):
            hidden = m.run_layer(i, self.weights[i], hidden, masks, positions, rotary, caches[i], self.templates)
        logits = m.head(hidden[:, -1:])[:, -1]
        m.steps += 1
        step_in = positions[:, -1:].clone()  # fixed buffers of the token steps: positions, the written column,
        at[0] = torch.zeros(1, dtype=torch.int64, device=dev)  # the embedded ids, the masks
        hidden_in = torch.empty((batch, 1, hidden.shape[-1]), dtype=hidden.dtype, device=dev)
        mask_in = m.masks(key_mask, width, 1, True)
        replay = None
        for step in range(max_new_tokens):
            ids = pick(logits).cpu()  # the one sync of a step: the graph's work is done when the ids are read
            ids = torch.where(unfinished, ids, pad)
            sequences = torch.cat([sequences, ids[:, None]], dim=1)
            lengths += unfinished  # a token picked while the row ran is the model's own
            unfinished &= ~done_rule(sequences, None).cpu()
            if not bool(unfinished.any()) or step + 1 == max_new_tokens:
                break
            column = width + step  # where this token's keys and values go
            hidden_in.copy_(m._embed(ids[:, None]))
            step_in.add_(1)
            at[0].fill_(column)
            for w, mask in m.masks(key_mask, column, 1, True).items():
                mask_in[w].copy_(mask)
            if replay is None:
                replay = self._capture(hidden_in, step_in, mask_in, caches)
            logits = replay()
            m.steps += 1
        return sequences[:, width:], lengths

    def _step(self, hidden, positions, masks, caches) -> torch.Tensor:
        m = self.m
        rotary = m.rotary_tables(hidden, positions)
        for i in range(m.num_layers):
            hidden = m.run_layer(i, self.weights[i], hidden, masks, positions, rotary, caches[i], self.templates)
        return m.head(hidden)[:, -1]

    def _capture(self, hidden, positions, masks, caches):
        """A callable running one token step over the fixed buffers -> the logits [B, V] (a fixed buffer too).
        The warm-up step writes the same cache column the first replay writes again: no state moves twice."""
        eager = lambda: self._step(hidden, positions, masks, caches)  # noqa: E731
        if not self.graph:
            return eager
        dev = self.m.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        graph, failure = torch.cuda.CUDAGraph(), None
        with torch.cuda.stream(side):
            self._step(hidden, positions, masks, caches)  # lazy inits (cuBLAS workspaces) outside the capture
            # Captured by hand, not under torch.cuda.graph: that context empties the allocator's caches on entry (the
            # trainer's cached blocks, at every rollout), and when the body raises its capture_end raises in turn
            # before the stream is switched back.
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                logits = self._step(hidden, positions, masks, caches)
            except RuntimeError as e:  # an op that syncs or sizes by data
                failure = e
            finally:
                try:
                    graph.capture_end()
                except RuntimeError as e:
                    failure = failure or e
        torch.cuda.current_stream(dev).wait_stream(side)
        if failure is not None:
            torch.cuda.synchronize(dev)
            reason = str(failure).splitlines()[0]
            _CAPTURE_FAILED[id(self.m.store)] = reason
            self.m.decode_path = f"eager (the CUDA graph capture failed: {reason}; not tried again this run)"
            return eager

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        return replay
