"""FLOP counts of one training step: model FLOPs (what MFU divides) and executed FLOPs (recompute in).

A throughput figure says which FLOPs it counts: model FLOPs leave recompute out, executed FLOPs put it in.
Mixture-of-experts models are counted by their ACTIVE parameters: a routed expert's weights count
top_k / num_experts (what one token multiplies by), the router and any shared expert in full; the bytes
moved and the host optimizer's work are per TOTAL parameter, which is why an MoE step needs many more
tokens than a dense one of the same FLOPs to hide its transfers.
"""

from __future__ import annotations

from megatrain_cli.models.attention import document_bounds
from megatrain_cli.models.families import is_expert_param, moe_spec


def model_flops(num_matmul_params: int, tokens: int, batch: int, seq_len: int, hidden: int,
                num_layers: int, attended: float | None = None) -> float:
    """Model FLOPs of one training step (forward + backward), the numerator of MFU.

        6 * num_matmul_params * tokens  +  6 * attended * hidden * num_layers,
        attended = sum over the step's documents of doc_len**2  (= batch * seq_len**2, one document per row)

    - 6 = 2 (multiply-add) for the forward matmul + 4 for the backward (gradient of the input and
      of the weight), per parameter per token.
    - num_matmul_params: parameters that take part in a matmul -- every decoder-layer weight plus
      the LM head; for a mixture of experts the ACTIVE ones (routed experts x top_k / num_experts).
      The input embedding is a row lookup, not a matmul, so it is excluded (when the head is tied to
      the embedding, the shared matrix is counted once, as the head).
    - The attention term: QK^T and attention-times-V cost 2 * 2 * s^2 * h forward per sequence
      per layer, so 12 * b * s^2 * h * L forward+backward for full attention; causal attention
      needs only half of it: 6 * b * s^2 * h * L. Packed rows count each document's own causal triangle,
      6 * sum(doc_len^2) * h * L (`attended`, attention_pairs): a document attends only to itself, and the
      varlen kernel (models/attention.py) computes no more. One document per row: attended = b * s^2.
    - Recompute is NOT counted (see executed_flops): a smarter schedule must not look faster by
      doing more work. Norms, activations, softmax and the loss are left out (lower order).
    """
    attended = batch * seq_len ** 2 if attended is None else attended
    return 6.0 * num_matmul_params * tokens + 6.0 * attended * hidden * num_layers


def attention_pairs(micro_batches) -> float:
    """sum(doc_len^2) over every document of these micro-batches (model_flops' `attended`): documents as the
    attention sees them (models/attention.document_bounds); a row without position ids is one document."""
    total = 0.0
    for mb in micro_batches:
        b, t = mb.input_ids.shape
        docs = document_bounds(mb.position_ids) if mb.position_ids is not None else None
        if docs is None:
            total += float(b * t * t)
        else:
            lengths = (docs[0][1:] - docs[0][:-1]).double()
            total += float((lengths * lengths).sum())
    return total


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


def matmul_params(store) -> float:
    """Parameters one token's matmuls use: all but the embedding table (unless it is tied to the LM head),
    routed experts counted at top_k / num_experts (active parameters; = all of them for a dense model)."""
    spec = moe_spec(store.adapter.config)
    embed = store.layouts["embed"].numel
    total = sum(_active(s.name, s.shape, s.numel, spec) for layout in store.layouts.values() for s in layout.places)
    return total - (0 if store.adapter.tied else embed)


def hf_matmul_params(model) -> float:
    """matmul_params of a plain HF model (the native baseline's): active parameters, embedding excluded
    unless tied to the head (a tied parameter is listed once)."""
    spec = moe_spec(model.config)
    total = sum(_active(n, tuple(p.shape), p.numel(), spec) for n, p in model.named_parameters())
    emb = model.get_input_embeddings().weight.numel()
    return total - (0 if model.config.tie_word_embeddings else emb)


def _active(name: str, shape: tuple[int, ...], numel: int, spec) -> float:
    return numel * spec.top_k / spec.num_experts if is_expert_param(name, shape, spec) else float(numel)


def streamed_step_flops(store, *, rows: int, seq: int, recomputed_layers: int,
                        mlp_chunk_tokens: int | None = None, attended: float | None = None) -> tuple[float, float]:
    """(model FLOPs, executed FLOPs) of one step over `rows` sequences of `seq` tokens. Model FLOPs: 6 x
    matmul params x tokens + causal attention within documents (metrics.model_flops; `attended`: the
    step's attention_pairs, None for one document per row). Executed adds the forward of every recomputed
    layer (2 x its params x tokens + its attention) and, with a chunked MLP, the gate and up projections
    its backward runs again."""
    a = store.adapter
    cfg = a.config
    tokens = rows * seq
    attended = rows * seq * seq if attended is None else attended
    flops = model_flops(matmul_params(store), tokens, rows, seq, a.hidden_size, a.num_layers, attended)
    spec = moe_spec(cfg)
    layer_params = sum(_active(s.name, s.shape, s.numel, spec)
                       for n in store.layer_names for s in store.layouts[n].places) / a.num_layers
    extra = (2.0 * layer_params * tokens + 2.0 * attended * a.hidden_size) * recomputed_layers
    if mlp_chunk_tokens and tokens > mlp_chunk_tokens:  # only dense MLPs are chunked (routed experts run whole)
        dense = sum(not any(is_expert_param(s.name, s.shape, spec) for s in store.layouts[n].places)
                    for n in store.layer_names)
        extra += 4.0 * a.hidden_size * int(cfg.intermediate_size) * tokens * dense
    return flops, flops + extra
