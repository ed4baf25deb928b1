"""Plain-PyTorch references for bf16 training: our precision recipe written out with a plain HF model,
and the usual alternative (fp32 weights under bf16 autocast), to tell the engine's rounding from the
recipe's.

Our recipe (docs/precision.md): fp32 master weights and Adam moments on the host; every layer computes
with bf16 copies of its weights on bf16 activations (HF's modules as they are: RMSNorm and softmax
upcast inside); per micro-batch bf16 parameter gradients, summed in fp32; the global norm and clipping
from the fp32 sums; the gradient handed to AdamW rounded to bf16 (the host store keeps bf16 gradients);
logits in bf16, the final-logit softcap (Gemma) and cross-entropy in fp32.
"""

from __future__ import annotations

import copy

import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.optim.host_adamw import clip_coefficient, lr_at
from tests.reference import param_groups


def _loss_sum(model, mb, dev, softcap=None):
    logits = model(input_ids=mb.input_ids.to(dev), use_cache=False).logits.float()
    if softcap:  # on the fp32 logits, as the engine's head does (HF's bf16 model would cap in bf16)
        logits = torch.tanh(logits / softcap) * softcap
    lab = mb.labels[:, 1:].to(dev)
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), lab.reshape(-1),
                                             ignore_index=IGNORE_INDEX, reduction="sum"), int((lab != IGNORE_INDEX).sum())


def recipe_reference(masters: dict, config, steps, cfg, device) -> tuple[list[list[float]], dict]:
    """Our bf16 recipe with a plain HF model: returns (per-micro-batch losses per step, fp32 masters)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    softcap = getattr(config, "final_logit_softcapping", None)
    config = copy.deepcopy(config)
    config.final_logit_softcapping = None  # applied in fp32 by _loss_sum
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(dev)
    if config.tie_word_embeddings:
        masters = {k: v for k, v in masters.items() if k != "lm_head.weight"}
    master = {k: v.detach().clone().to(dev).requires_grad_() for k, v in masters.items()}
    params = dict(model.named_parameters())
    names = list(master)
    groups = [{"params": [master[n] for n in names if master[n].ndim >= 2], "weight_decay": cfg.weight_decay},
              {"params": [master[n] for n in names if master[n].ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, foreach=False)
    out = []
    for s, mbs in enumerate(steps):
        with torch.no_grad():
            for n in names:
                params[n].copy_(master[n])  # the bf16 compute copy
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg, len(steps))
        n_tok = sum(int((mb.labels[:, 1:] != IGNORE_INDEX).sum()) for mb in mbs)
        acc = {n: torch.zeros_like(master[n]) for n in names}
        losses = []
        for mb in mbs:
            loss_sum, k = _loss_sum(model, mb, dev, softcap)
            (loss_sum / n_tok).backward()
            for n in names:
                acc[n] += params[n].grad.float()
                params[n].grad = None
            losses.append(float(loss_sum.detach()) / max(1, k))
        norm = torch.sqrt(sum(a.double().square().sum() for a in acc.values())).item()
        coef = clip_coefficient(norm, cfg.max_grad_norm)
        for n in names:
            master[n].grad = acc[n].to(torch.bfloat16).float() * coef
        opt.step()
        out.append(losses)
    return out, {k: v.detach().cpu() for k, v in master.items()}


def autocast_reference(masters: dict, config, steps, cfg, device) -> list[list[float]]:
    """fp32 weights, bf16 autocast forward, fp32 gradients, torch AdamW: per-micro-batch losses."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(masters, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.to(dev)
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    out = []
    for s, mbs in enumerate(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(s, cfg, len(steps))
        n_tok = sum(int((mb.labels[:, 1:] != IGNORE_INDEX).sum()) for mb in mbs)
        losses = []
        for mb in mbs:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss_sum, k = _loss_sum(model, mb, dev)
            (loss_sum / n_tok).backward()
            losses.append(float(loss_sum.detach()) / max(1, k))
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(losses)
    return out
