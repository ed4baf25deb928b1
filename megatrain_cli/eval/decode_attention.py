"""Attention of one new token per row over a fixed-capacity KV cache (eval/static_decode.py's token steps), each
key/value head read in place by its group of query heads.

Why: a fixed-capacity cache always needs a mask (its later columns are not written yet), and given a mask HF's SDPA
path repeats every key/value head for its query-head group before calling SDPA (PyTorch's fused kernels take
grouped heads only without a mask). At 7B, batch 64, a 511-column cache that is 2 x 234 MB written and read again
per layer per token step: a 7B token step measured 23.6 ms of GPU work for ~26 ms of wall (docs/benchmarks.md,
session 14). Here a group's query heads sit side by side against their shared key head ([B, Hkv, G, D] x
[B, Hkv, D, T]): the cache is read once and nothing is copied. The arithmetic is HF's eager attention's (scores in
the compute dtype, softmax in fp32, then back), not its SDPA's: the two agree to rounding, not bit for bit.

Anything else (the prompt's many queries, an additive mask, a softcap, sinks, dropout) goes on to the
packed-attention entry (models/attention.py) and from there to HF's own SDPA function, as in every other forward.
"""

from __future__ import annotations

import torch
from torch import nn

from megatrain_cli.models.attention import PREFIX, packed_attention

NAME = "megatrain_decode_sdpa"


def grouped_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                   scaling: float | None) -> torch.Tensor:
    """query [B, H, 1, D], key / value [B, Hkv, T, D] (query head j reads key head j // (H / Hkv), as HF's
    repeat_kv lays them out), mask [B, 1, 1, T] bool (True = attend) -> [B, 1, H, D]."""
    b, h, _, d = query.shape
    hkv, t = key.shape[1], key.shape[2]
    scale = d ** -0.5 if scaling is None else scaling
    q = query.reshape(b, hkv, h // hkv, d)
    scores = torch.matmul(q, key.transpose(-1, -2)) * scale  # [B, Hkv, G, T]
    scores = scores.masked_fill(~mask.reshape(b, 1, 1, t), torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, h, 1, d).transpose(1, 2).contiguous()


def decode_attention(module: nn.Module, query, key, value, attention_mask, **kwargs):
    """HF's attention-interface signature (as models/attention.packed_attention's)."""
    if (query.shape[2] == 1 and attention_mask is not None and attention_mask.dtype == torch.bool
            and not kwargs.get("dropout") and kwargs.get("softcap") is None and kwargs.get("s_aux") is None):
        return grouped_decode(query, key, value, attention_mask, kwargs.get("scaling")), None
    return packed_attention(module, query, key, value, attention_mask, original="sdpa", **kwargs)


def use_decode_attention(template: nn.Module) -> bool:
    """Point a layer template's attention at `decode_attention` where HF runs it through SDPA (behind the packed
    entry); a family on HF's eager code (Gemma 2's softcap, gpt-oss's sinks) keeps it. True if it did."""
    from transformers import AttentionInterface

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, decode_attention)
    changed = False
    for m in template.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "_attn_implementation", None) == PREFIX + "sdpa":
            cfg._attn_implementation = NAME
            changed = True
    return changed
