"""Attention for packed rows: the one entry point every decoder layer's HF attention calls.

The adapter sets each layer template's config `_attn_implementation` to this entry (registered with
transformers' `AttentionInterface` under the name of the implementation HF chose, e.g.
`megatrain_packed_sdpa`), so HF's attention module calls it with its query, key and value as it would
call SDPA. Two kinds of rows arrive:

- Rows with one document each (unpacked rows, the bench's default rows): no document boundaries come with
  them, and the call goes on, untouched, to the implementation HF chose (its SDPA function, or the
  family's own eager code for Gemma 2's softcap and gpt-oss's sinks), with the mask HF built: exactly
  the path these rows took before this entry existed.
- Packed rows: models/layer_inputs.py runs HF's decoder code under this entry's name, so HF builds no
  mask at all, and hands the documents' boundaries as HF's padding-free keyword arguments
  (`cu_seq_lens_q/k`, `max_length_q/k`: cumulative document lengths over the flattened [B*T] tokens,
  as HF's DataCollatorWithFlattening passes them). On CUDA (fp16/bf16, no logit softcap, no sinks)
  they go to PyTorch's varlen flash kernel, `torch.nn.attention.varlen.varlen_attn`, with the window
  (W - 1, 0) on sliding-window layers: no [T, T] mask, and each document attends only to itself, so
  the kernel does within-document work only. Everywhere else (the CPU, fp32, Gemma 2's softcap,
  gpt-oss's sinks, an old torch) the exact reference runs: HF's own implementation over groups of whole
  documents of a row (up to GROUP_TOKENS together) under a block-diagonal causal (windowed) mask; on CUDA
  that fallback is named once (a RuntimeWarning). The reference costs a Python loop over the groups per
  layer, masks of at most GROUP_TOKENS^2 elements (a longer document: its own), and a host read of the boundaries.
"""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import warnings
from typing import Callable

import torch
from torch import nn

PREFIX = "megatrain_packed_"


# ---------------------------------------------------------------------------------------------- documents

def document_bounds(position_ids: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(cu_seqlens, longest) of rows whose positions restart inside a row, else None.

    `position_ids`: [B, T] text positions, or a VLM's multimodal positions in HF's layouts: [4, B, T] (HF's
    packed layout: the text positions first, then the three rotary axes; Qwen2-VL's text model reads the
    documents from the first alone) or [3, B, T] (the rotary axes alone: one document per row, as HF reads
    it). The rotary axes cannot say where a document starts: inside an image the temporal axis stays put and
    the height / width axes step back every grid row, so a rule over them would cut an image into
    'documents'; only the text axis is read.

    A document starts at each row's first token and wherever a position is not the one before plus 1
    (HF's rule: masking_utils.find_packed_sequence_indices), so a padding tail whose positions continue
    the last document belongs to it. cu_seqlens: int32 [N + 1], document starts in the flattened [B*T]
    tokens and B*T at the end; longest: the longest document's length. None when no row restarts: one
    document per row needs no boundaries (and takes the unpacked path). Runs where the positions are
    (the engine passes them on the host: no device sync)."""
    if position_ids.dim() == 3:
        if position_ids.shape[0] != 4:
            return None  # [3, B, T]: HF's unpacked multimodal layout, one document per row
        position_ids = position_ids[0]
    if position_ids.dim() > 3:
        raise ValueError(f"position ids of shape {tuple(position_ids.shape)}: expected [B, T], [3, B, T] or "
                         f"[4, B, T]")
    pos = position_ids.reshape(-1, position_ids.shape[-1])
    b, t = pos.shape
    starts = torch.ones(b, t, dtype=torch.bool, device=pos.device)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    at = starts.reshape(-1).nonzero().reshape(-1)
    cu = torch.cat([at, at.new_tensor([b * t])]).to(torch.int32)
    return cu, int((cu[1:] - cu[:-1]).max())


def document_kwargs(cu: torch.Tensor, longest: int) -> dict:
    """HF's padding-free attention arguments for self-attention over these documents."""
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


# ---------------------------------------------------------------------------------------------- installing

def entry_name(original: str) -> str:
    """The registered name of this entry in front of HF's `original` implementation (registered once)."""
    from transformers import AttentionInterface

    if original.startswith(PREFIX):
        return original
    name = PREFIX + original
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, functools.partial(packed_attention, original=original))
    return name


def use_entry(module: nn.Module) -> str:
    """Point every HF config inside `module` (a layer template) at this entry; returns its name."""
    name = None
    seen: set[int] = set()
    for m in module.modules():
        cfg = getattr(m, "config", None)
        if cfg is None or not hasattr(cfg, "_attn_implementation") or id(cfg) in seen:
            continue
        seen.add(id(cfg))
        name = entry_name(cfg._attn_implementation or "eager")
        cfg._attn_implementation = name
    if name is None:
        raise TypeError(f"{type(module).__name__} holds no Hugging Face config: its attention cannot be routed")
    return name


def config_with_entry(config):
    """A copy of `config` whose attention is this entry: HF's mask code then builds no mask (the entry is
    not one of its mask interfaces), which is what a decoder shell for packed rows needs."""
    packed = copy.deepcopy(config)
    packed._attn_implementation = entry_name(config._attn_implementation or "eager")
    return packed


def _plain(module: nn.Module, original: str) -> Callable:
    """HF's own implementation `original` for `module`: the registered function, or the family's eager code
    (what HF's attention modules fall back to when the name is 'eager')."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if original != "eager" and original in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[original]
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise TypeError(f"{type(module).__module__} has no eager_attention_forward for {type(module).__name__}")
    return fn


# ---------------------------------------------------------------------------------------------- the entry

def packed_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, *, original: str, cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None,
                     max_length_k=None, **kwargs):
    """HF's attention-interface signature: query [B, H, T, D], key / value [B, Hkv, T, D]; returns
    ([B, T, H, D], None). Without document boundaries: HF's `original` implementation, as it was."""
    plain = _plain(module, original)
    if cu_seq_lens_q is None:
        return plain(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None or (cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q):
        raise ValueError("packed rows: a mask or other key boundaries came with the document boundaries")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} attends both ways: packed rows need causal attention; "
                         f"use data.packing=false")
    window = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    reason = fast_kernel_blocker(query, kwargs)
    if reason is None:
        return _varlen(query, key, value, cu_seq_lens_q, int(max_length_q), kwargs.get("scaling"), window), None
    if query.is_cuda:
        _note_fallback(reason, original)
    return _reference(plain, module, query, key, value, cu_seq_lens_q, window, original, kwargs), None


@functools.lru_cache(maxsize=1)
def _varlen_api() -> tuple[Callable | None, bool]:
    """(varlen_attn, whether it takes enable_gqa), or (None, False) where it lacks scale / window_size
    (torch < 2.10) or is missing."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    params = inspect.signature(varlen_attn).parameters
    if "scale" not in params or "window_size" not in params:
        return None, False
    return varlen_attn, "enable_gqa" in params


def fast_kernel_blocker(query: torch.Tensor, kwargs: dict) -> str | None:
    """Why the varlen flash kernel cannot run this call (the reference runs instead), or None."""
    if not query.is_cuda:
        return "not on CUDA"
    if _varlen_api()[0] is None:
        return f"torch {torch.__version__} has no varlen_attn with scale and window_size (torch >= 2.10)"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"{query.dtype} (the flash kernel runs fp16 and bf16)"
    if kwargs.get("softcap") is not None:
        return "attention logit softcap (Gemma 2): the varlen kernel has none"
    if kwargs.get("s_aux") is not None:
        return "attention sinks (gpt-oss): the varlen kernel has none"
    if kwargs.get("dropout"):
        return "attention dropout: the varlen kernel has none"
    if query.shape[-1] > 256 or query.shape[-1] % 8:
        return f"head dim {query.shape[-1]} (flash: a multiple of 8, at most 256)"
    if torch.cuda.get_device_capability(query.device) < (8, 0):
        return "a GPU older than sm80 (flash attention needs Ampere or newer)"
    return None


_NOTED: set[str] = set()


def _note_fallback(reason: str, original: str) -> None:
    if reason not in _NOTED:
        _NOTED.add(reason)
        warnings.warn(f"packed rows: {reason}; attention runs over each group of whole documents through HF's "
                      f"{original} code (exact, slower than the varlen flash kernel)", RuntimeWarning, stacklevel=3)


def _varlen(query, key, value, cu: torch.Tensor, longest: int, scale: float | None, window: int | None):
    """The varlen flash kernel over the flattened rows. HF's window W lets a token see itself and the
    W - 1 before it: (W - 1, 0); (-1, 0) is plain causal. Costs the transposes to [B*T, heads, D]
    (HF's flash path makes the same copies)."""
    varlen_attn, takes_gqa = _varlen_api()
    b, h, t, d = query.shape
    hkv = key.shape[1]
    q = query.transpose(1, 2).reshape(b * t, h, d)
    k = key.transpose(1, 2).reshape(b * t, hkv, d)
    v = value.transpose(1, 2).reshape(b * t, hkv, d)
    # Grouped keys: torch >= 2.12 asks for enable_gqa; before it, the flash kernel takes fewer key heads as
    # they are (FlashAttention-2's own grouped-query support, forward and backward).
    gqa = {"enable_gqa": True} if hkv != h and takes_gqa else {}
    win = (-1, 0) if window is None or window >= longest else (int(window) - 1, 0)
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=win, **gqa)
    return out.view(b, t, h, d)


# The reference runs consecutive documents of a row together, up to this many tokens, under one block-diagonal
# causal mask (a document longer than this runs alone): fewer calls than one per document (a CPU SDPA call
# with its backward costs ~25 ms whatever its size on two busy cores; at 1024 tokens ~50 ms, at 4096 ~10x
# that: the masked-out blocks are computed too), masks of at most 1024^2 elements, exact all the same.
GROUP_TOKENS = 1024


def _reference(plain: Callable, module, query, key, value, cu: torch.Tensor, window: int | None, original: str,
               kwargs: dict) -> torch.Tensor:
    """The exact reference: HF's own implementation over each group of whole documents (GROUP_TOKENS), each
    document seeing only itself (documents never cross rows)."""
    b, h, t, d = query.shape
    bounds = cu.tolist()
    outs = []
    for group in _groups(bounds, t):
        row, lo = divmod(group[0], t)
        hi = lo + group[-1] - group[0]
        mask = _group_mask([e - s for s, e in zip(group[:-1], group[1:])], window, original, query)
        out, _ = plain(module, query[row:row + 1, :, lo:hi], key[row:row + 1, :, lo:hi],
                       value[row:row + 1, :, lo:hi], mask, **kwargs)
        outs.append(out[0])
    return torch.cat(outs).view(b, t, h, d)


def _groups(bounds: list[int], row_len: int) -> list[list[int]]:
    """Document boundaries cut into groups: consecutive documents of one row, GROUP_TOKENS at most together."""
    groups = [[bounds[0]]]
    for end in bounds[1:]:
        group = groups[-1]
        start = group[-1]
        if len(group) > 1 and (end - group[0] > GROUP_TOKENS or start % row_len == 0):
            groups.append([start])
        groups[-1].append(end)
    return groups


def _group_mask(lengths: list[int], window: int | None, original: str, like: torch.Tensor) -> torch.Tensor | None:
    """A group's mask, additive as HF's eager mask is (0 seen, dtype min hidden): each document causal (and
    windowed) over itself. None where SDPA's own causal flag says the same (one document, no window in it)."""
    n = sum(lengths)
    windowed = window is not None and window < max(lengths)
    if original == "sdpa" and len(lengths) == 1 and not windowed:
        return None
    doc = torch.repeat_interleave(torch.arange(len(lengths), device=like.device),
                                  torch.tensor(lengths, device=like.device))
    q = torch.arange(n, device=like.device)[:, None]
    k = torch.arange(n, device=like.device)[None, :]
    seen = (k <= q) & (doc[:, None] == doc[None, :])
    if windowed:
        seen = seen & (q - k < window)
    zero = torch.zeros((), dtype=like.dtype, device=like.device)
    return torch.where(seen, zero, torch.finfo(like.dtype).min)[None, None]
