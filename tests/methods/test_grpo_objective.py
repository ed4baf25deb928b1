"""GRPO's objective through the streamed engine equals a plain-PyTorch one written here, on the CPU in fp32.

For a FIXED set of sampled completions (prompts of different lengths, completions right-padded, two
micro-batches, so the step's token mean is not the mean of the micro-batches' means), the engine's loss and
every gradient (before the optimizer) equal an HF model's forward with the objective written out below from
the papers (DeepSeekMath eq. 3, DAPO's token-level mean, the k3 KL), within 1e-5: with the ratio at 1 (no
clipping), with old log-probs off the policy so that epsilon clips, and with the KL term on and off.
"""

from __future__ import annotations

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.methods import GRPO, RolloutMicroBatch
from megatrain_cli.methods.grpo import group_advantages
from megatrain_cli.models.loader import build_store
from megatrain_cli.recipe import TrainConfig
from tests.engines import make_engine
from tests.reference import reference_model, tiny_config

VOCAB, G = 97, 4
PROMPTS = [[5, 9, 12], [7, 3, 3, 8, 1]]  # two prompts, G completions each
REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.0, 1.0, 0.25]])
EPSILON = 0.2


def rollouts(old_noise: float, ref_noise: float, model) -> list[RolloutMicroBatch]:
    """G completions of each prompt (lengths 2..9, seeded), one prompt's group per micro-batch; old / ref
    log-probs: the model's own plus seeded noise (None when the noise is 0 for `old`)."""
    g = torch.Generator().manual_seed(7)
    adv = group_advantages(REWARDS).float()
    mbs = []
    for p, prompt in enumerate(PROMPTS):
        rows = [prompt + torch.randint(1, VOCAB, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g).tolist()
                for _ in range(G)]
        width = max(len(r) for r in rows)
        ids = torch.zeros(G, width, dtype=torch.int64)
        labels = torch.full((G, width), IGNORE_INDEX, dtype=torch.int64)
        advantages = torch.zeros(G, width)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row)
            labels[i, len(prompt):len(row)] = torch.tensor(row[len(prompt):])
            advantages[i, len(prompt):len(row)] = adv[p, i]
        own = plain_logps(model, ids, labels).detach()
        noise = lambda scale: torch.where(labels != IGNORE_INDEX, own + scale * torch.randn(own.shape, generator=g),
                                          torch.zeros(()))
        mbs.append(RolloutMicroBatch(ids, labels, advantages=advantages,
                                     old_logps=noise(old_noise) if old_noise else None,
                                     ref_logps=noise(ref_noise)))
    return mbs


def plain_logps(model, ids, labels) -> torch.Tensor:
    """[B, T] log-prob of each label under the HF model (aligned with labels, 0 where none)."""
    logits = model(input_ids=ids, use_cache=False).logits.float()
    lab = labels[:, 1:]
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, lab.clamp_min(0)[..., None])[..., 0]
    out = torch.zeros(labels.shape, dtype=lp.dtype)
    out[:, 1:] = torch.where(lab != IGNORE_INDEX, lp, torch.zeros(()))
    return out


def plain_objective(model, mbs, epsilon: float, beta: float):
    """The objective written out: per token -min(r A, clip(r, 1 - eps, 1 + eps) A) + beta k3-KL, summed over
    every completion token of the step and divided by their number; backward into the model."""
    total = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs)
    losses, clipped = [], []
    for mb in mbs:
        mask = mb.labels != IGNORE_INDEX
        logp = plain_logps(model, mb.input_ids, mb.labels)[mask].double()
        old = logp.detach() if mb.old_logps is None else mb.old_logps[mask].double()
        a = mb.advantages[mask].double()
        ratio = torch.exp(logp - old)
        per_token = -torch.min(ratio * a, torch.clamp(ratio, 1 - epsilon, 1 + epsilon) * a)
        if beta:
            ref = mb.ref_logps[mask].double()
            per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
        (per_token.sum() / total).backward()
        losses.append(float(per_token.detach().mean()))
        clipped.append(((ratio < 1 - epsilon) & (a < 0)) | ((ratio > 1 + epsilon) & (a > 0)))
    return losses, float(torch.cat(clipped).double().mean())


def grads_by_name(store) -> dict[str, torch.Tensor]:
    return {hf: store.tiles[t].grad[p.offset:p.offset + p.numel].view(p.shape) for hf, t, p in store.hf_items()}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("beta", [0.0, 0.1], ids=["no-kl", "kl"])
@pytest.mark.parametrize("old_noise", [0.0, 0.4], ids=["ratio-1", "clipping"])
def test_loss_and_every_gradient_equal_the_plain_objective(old_noise, beta, tied):
    config = tiny_config(vocab=VOCAB, layers=3, tied=tied)
    store = build_store(config, torch.float32, seed=3)
    model = reference_model(store, config)
    with torch.no_grad():
        mbs = rollouts(old_noise, 0.3, model)
    ref_losses, ref_clip = plain_objective(model, mbs, EPSILON, beta)

    engine = make_engine(store, TrainConfig(steps=1, grad_accum=2), device="cpu", checkpoint_interval=2,
                         loss_chunk_tokens=7, overlap_optimizer=False, method=GRPO(EPSILON, beta))
    res = engine.forward_backward(mbs)
    engine.close()

    total = sum(int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs)
    counts = [int((mb.labels != IGNORE_INDEX).sum()) for mb in mbs]
    assert counts[0] != counts[1], "micro-batches of unequal tokens: the step mean is not the mean of means"
    assert res.losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    assert res.loss == pytest.approx(sum(l * n for l, n in zip(ref_losses, counts)) / total, rel=1e-5, abs=1e-6)
    assert res.metrics["clip_ratio"] == pytest.approx(ref_clip, abs=1e-12)
    if old_noise:
        assert ref_clip > 0.1, "epsilon must clip some tokens in this case"
    else:
        assert ref_clip == 0.0
    assert ("kl" in res.metrics) == bool(beta)
    ours = grads_by_name(store)
    for name, p in model.named_parameters():
        if tied and name == "lm_head.weight":
            continue  # the embedding's gradient
        torch.testing.assert_close(ours[name], p.grad, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_group_advantages_are_group_relative():
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0]]))
    std = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased, as TRL
    assert adv[0].tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1 + [-0.5 / (std + 1e-4),
                                                                                             0.5 / (std + 1e-4)])
    assert adv[1].tolist() == [0.0] * 4  # all equal: nothing to learn from the group
    with pytest.raises(ValueError, match=r"generations >= 2"):
        group_advantages(torch.tensor([[1.0], [0.0]]))
