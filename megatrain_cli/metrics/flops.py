"""FLOP counts of one training step: model FLOPs (what MFU divides) and executed FLOPs (recompute in).

A throughput figure says which FLOPs it counts: model FLOPs leave recompute out, executed FLOPs put it in.
"""

from __future__ import annotations

def model_flops(num_matmul_params: int, tokens: int, batch: int, seq_len: int, hidden: int,
                num_layers: int) -> float:
    """Model FLOPs of one training step (forward + backward), the numerator of MFU.

        6 * num_matmul_params * tokens  +  6 * batch * seq_len**2 * hidden * num_layers

    - 6 = 2 (multiply-add) for the forward matmul + 4 for the backward (gradient of the input and
      of the weight), per parameter per token.
    - num_matmul_params: parameters that take part in a matmul -- every decoder-layer weight plus
      the LM head. The input embedding is a row lookup, not a matmul, so it is excluded (when the
      head is tied to the embedding, the shared matrix is counted once, as the head).
    - The attention term: QK^T and attention-times-V cost 2 * 2 * s^2 * h forward per sequence
      per layer, so 12 * b * s^2 * h * L forward+backward for full attention; causal attention
      needs only half of it: 6 * b * s^2 * h * L. Packed rows are counted as one causal sequence of
      seq_len (the kernel computes the whole causal triangle; the block mask only hides entries).
    - Recompute is NOT counted (see executed_flops): a smarter schedule must not look faster by
      doing more work. Norms, activations, softmax and the loss are left out (lower order).
    """
    return 6.0 * num_matmul_params * tokens + 6.0 * batch * seq_len ** 2 * hidden * num_layers


def executed_flops(model_flops_value: float, recompute_fraction: float, *, head_flops: float = 0.0) -> float:
    """FLOPs the device actually executed: model FLOPs plus the recomputed forward passes.

    A forward pass is 2 of the 6 FLOPs per parameter per token (and the same third of the
    attention term), so recomputing a layer adds 2/6 = 1/3 of that layer's model FLOPs:

        executed = model + (model - head_flops) * recompute_fraction / 3

    recompute_fraction: the fraction of decoder layers whose forward runs twice (1.0 for block
    recompute of every block; less when some blocks keep their activations; 0 without recompute).
    head_flops: the LM head's share of model_flops_value, which is never recomputed; the default 0
    treats the whole value as layer FLOPs, overstating executed FLOPs by head_share / 3 at most.
    """
    if not 0.0 <= recompute_fraction <= 1.0:
        raise ValueError(f"recompute_fraction must be in [0, 1], got {recompute_fraction}")
    return model_flops_value + (model_flops_value - head_flops) * recompute_fraction / 3.0


def matmul_params(store) -> int:
    """Parameters that take part in matmuls: all but the embedding table, unless it is tied to the LM head."""
    embed = store.layouts["embed"].numel
    return store.num_params() - (0 if store.adapter.tied else embed)


def streamed_step_flops(store, *, rows: int, seq: int, recomputed_layers: int,
                        mlp_chunk_tokens: int | None = None) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of one step over `rows` sequences of `seq` tokens. Model FLOPs: 6 x
    matmul params x tokens + causal attention (metrics.model_flops). Executed adds the forward of every
    recomputed layer (2 x its params x tokens + its attention) and, with a chunked MLP, the gate and up
    projections its backward runs again."""
    a = store.adapter
    cfg = a.config
    tokens = rows * seq
    flops = model_flops(matmul_params(store), tokens, rows, seq, a.hidden_size, a.num_layers)
    layer_params = sum(store.layouts[n].numel for n in store.layer_names) / a.num_layers
    extra = (2.0 * layer_params * tokens + 2.0 * rows * seq * seq * a.hidden_size) * recomputed_layers
    if mlp_chunk_tokens and tokens > mlp_chunk_tokens:
        extra += 4.0 * a.hidden_size * int(cfg.intermediate_size) * tokens * a.num_layers
    return flops, flops + extra
