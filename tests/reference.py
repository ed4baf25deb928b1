"""The reference every parity test compares against: a plain HF model trained with torch AdamW."""

from __future__ import annotations

import contextlib
import inspect

import torch

from megatrain_cli.batch import IGNORE_INDEX, MicroBatch
from megatrain_cli.optim.host_adamw import lr_at
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.tiles import HostStore


ARCH_TYPES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
              "Qwen3ForCausalLM": "qwen3"}

# Per family, what a tiny config needs besides the common shape to exercise what makes the family itself.
FAMILY_EXTRAS = {
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64}},
    "qwen2": {},
    "qwen3": {"head_dim": 8},
    "mistral": {"head_dim": 8, "sliding_window": 6},  # a window shorter than the test rows
    "gemma2": {"head_dim": 8, "sliding_window": 6, "query_pre_attn_scalar": 8, "final_logit_softcapping": 3.0,
               "attn_logit_softcapping": 5.0, "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"head_dim": 8, "sliding_window": 6, "query_pre_attn_scalar": 8, "final_logit_softcapping": 3.0,
                    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"],
                    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "phi3": {"pad_token_id": 5, "bos_token_id": 1, "eos_token_id": 2},
    "olmo2": {"pad_token_id": 5, "bos_token_id": 1, "eos_token_id": 2},
    # Mixture of experts: more experts than top-k, an aux coefficient large enough that a wrong router
    # gradient shows at 1e-5 (the published 0.001 would hide it).
    "qwen3_moe": {"head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "norm_topk_prob": True, "router_aux_loss_coef": 0.5},
    "qwen2_moe": {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 24, "mlp_only_layers": [1], "router_aux_loss_coef": 0.5},
    "mixtral": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None,
                "router_aux_loss_coef": 0.5},
    "gpt_oss": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 6,
                "router_aux_loss_coef": 0.5,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64,
                                    "rope_theta": 150000.0}},
}


def tiny_config(arch: str = "Qwen2ForCausalLM", *, layers: int = 3, tied: bool = False, vocab: int = 97,
                hidden: int = 32, heads: int = 4, kv_heads: int = 2, inter: int = 48, **extra):
    """A tiny config of `arch`: an architecture class name (the config's defaults, as test_parity.py has
    always used them) or a model_type (with FAMILY_EXTRAS: the family's own features switched on)."""
    from transformers import AutoConfig

    model_type = ARCH_TYPES.get(arch, arch)
    kwargs = {"head_dim": hidden // heads} if model_type in ("qwen3", "mistral") else {}
    if arch not in ARCH_TYPES:
        kwargs = dict(FAMILY_EXTRAS.get(model_type, {}))
    if "layer_types" in kwargs:
        kwargs["layer_types"] = (kwargs["layer_types"] * layers)[:layers]
    kwargs.update(extra)
    if arch in ARCH_TYPES:
        kwargs.setdefault("architectures", [arch])
    return AutoConfig.for_model(model_type, hidden_size=hidden, num_hidden_layers=layers,
                                num_attention_heads=heads, num_key_value_heads=kv_heads,
                                intermediate_size=inter, vocab_size=vocab, tie_word_embeddings=tied,
                                max_position_embeddings=256, **kwargs)


def reference_model(store: HostStore, config, dtype=torch.float32, device="cpu"):
    """An HF model holding exactly the store's current master weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # HF's own attention choice
    missing, unexpected = model.load_state_dict(store.hf_state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing  # tied head comes from the embedding
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(device=device, dtype=dtype)


def saved_bytes(run, exclude) -> int:
    """Bytes of the storages autograd saves while `run()` computes, each storage once, not counting the
    tensors in `exclude` (inputs and weights that the caller, not autograd, keeps)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude}
    kept = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(kept.values())


def param_groups(model, weight_decay: float):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def reference_train(model, steps: list[list[MicroBatch]], cfg: TrainConfig, total_steps: int,
                    router_aux: bool = False):
    """Plain training: per-micro-batch losses, global token-mean gradient, clip, AdamW.

    `router_aux`: an MoE model's forward runs with output_router_logits (as HF's training turns it on) and
    each micro-batch's loss is HF's, cross-entropy mean + router_aux_loss_coef * aux_loss (HF's own aux),
    weighted like its cross-entropy by its share of the step's loss tokens (engine/router_loss.py)."""
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                            eps=cfg.eps, foreach=False)
    dev = next(model.parameters()).device
    all_losses = []
    for s, mbs in enumerate(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg, total_steps)
        n_tok = sum(int((mb.labels[:, 1:] != IGNORE_INDEX).sum()) for mb in mbs)
        losses = []
        for mb in mbs:
            kw = {}
            if mb.position_ids is not None:  # packed rows: HF detects the documents from the positions
                kw = {"position_ids": mb.position_ids.to(dev)}  # (only without a KV cache: use_cache=False)
            if router_aux:
                kw["output_router_logits"] = True
            if mb.images is not None:  # a VLM's rows: the processor's tensors, and which tokens are image ones
                kw.update({k: v.to(dev) for k, v in mb.images.items()})
                for key in ("mm_token_type_ids", "token_type_ids"):  # Qwen2-VL's mrope, Gemma 3's image masks
                    if key in inspect.signature(model.forward).parameters:
                        kw[key] = (mb.input_ids == model.config.image_token_id).long().to(dev)
            with packed_masks(model, kw.get("position_ids")):
                out = model(input_ids=mb.input_ids.to(dev), use_cache=False, **kw)
            logits = out.logits.float()
            lab = mb.labels[:, 1:].to(dev)
            loss_sum = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                         lab.reshape(-1), ignore_index=IGNORE_INDEX,
                                                         reduction="sum")
            n_mb = int((lab != IGNORE_INDEX).sum())
            aux = model.router_aux_loss_coef * out.aux_loss if router_aux else 0.0
            (loss_sum / n_tok + aux * (n_mb / n_tok)).backward()
            losses.append(float(loss_sum.detach()) / max(1, n_mb) + float(aux.detach() if router_aux else aux))
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        all_losses.append(losses)
    return all_losses


@contextlib.contextmanager
def packed_masks(model, position_ids: torch.Tensor | None):
    """HF's own masks for packed rows, handed to a decoder whose forward does not give its position ids to
    its mask code: gpt-oss in transformers 5.25 (its packed rows would attend across documents). The
    causal LM's own arguments stay as they were (its router loss reads `attention_mask` as a padding mask).
    Every other family's forward detects the documents itself: nothing is done."""
    if position_ids is None or model.config.model_type != "gpt_oss":
        yield
        return
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    b, t = position_ids.shape
    like = torch.empty(b, t, 1, dtype=next(model.parameters()).dtype, device=position_ids.device)
    args = dict(config=model.config, inputs_embeds=like, attention_mask=None, cache=None, position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**args), "sliding_attention": create_sliding_window_causal_mask(**args)}

    def hand_masks(module, args, kwargs):
        return args, {**kwargs, "attention_mask": masks}

    hook = model.get_decoder().register_forward_pre_hook(hand_masks, with_kwargs=True)
    try:
        yield
    finally:
        hook.remove()


def random_batches(vocab: int, steps: int, accum: int, batch: int, seq: int, seed: int = 0,
                   prompt_len: int = 5):
    """Token batches whose first `prompt_len` tokens carry no loss (as a prompt would)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        mbs = []
        for _ in range(accum):
            ids = torch.randint(0, vocab, (batch, seq), generator=g)
            labels = ids.clone()
            labels[:, :prompt_len] = IGNORE_INDEX
            mbs.append(MicroBatch(ids, labels))
        out.append(mbs)
    return out
