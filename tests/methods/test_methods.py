"""The preference methods against their published formulas, written out here per pair in plain Python floats
(math, not torch), with their gradients with respect to each sequence's log-prob sum derived by hand; the
per-sequence bookkeeping (tokens -> sequences -> token weights) against plain loops and against autograd
through the log-softmax; the metrics' reduction over micro-batches and ranks."""

from __future__ import annotations

import math

import pytest
import torch

from megatrain_cli.batch import IGNORE_INDEX
from megatrain_cli.methods import (DPO, IPO, KTO, ORPO, SFT, MetricTotals, PreferenceLayout, SequenceScores, SimPO,
                                   make_method)
from megatrain_cli.methods.sequences import label_sequence_index, sequence_grads, sequence_sums, token_weights
from megatrain_cli.recipe.schema import PreferenceConfig

TOL = 1e-12


def sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def log_sig(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def pairs_case(p: int = 7, seed: int = 0, means=(-3.0, -0.05)):
    """Random scores of 2p sequences in a shuffled order, and which local sequence is each pair's chosen /
    rejected one. Sums are mean * tokens with means in `means` (ORPO needs them below 0)."""
    g = torch.Generator().manual_seed(seed)
    s = 2 * p
    tokens = torch.randint(1, 40, (s,), generator=g)
    lo, hi = means
    policy = (lo + (hi - lo) * torch.rand(s, generator=g, dtype=torch.float64)) * tokens
    reference = (lo + (hi - lo) * torch.rand(s, generator=g, dtype=torch.float64)) * tokens
    order = torch.randperm(s, generator=g)
    chosen, rejected = order[:p], order[p:]
    desirable = torch.zeros(s, dtype=torch.bool)
    desirable[chosen] = True
    layout = PreferenceLayout(torch.arange(100, 100 + s), desirable, chosen, rejected)
    return SequenceScores(policy, tokens), SequenceScores(reference, tokens), layout


def run(method, policy, reference, layout):
    losses, grad, metrics = sequence_grads(method, policy, reference, layout, scale=1.0)
    return losses.tolist(), grad.tolist(), metrics


def pair_values(policy, reference, layout, k):
    c, r = int(layout.chosen[k]), int(layout.rejected[k])
    pi, ref, n = policy.logps.tolist(), reference.logps.tolist(), policy.tokens.tolist()
    return c, r, pi, ref, n


def assert_close(got, want, tol=TOL):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= tol * max(1.0, abs(b)), (a, b)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_dpo_loss_and_gradient_are_the_formula(label_smoothing):
    beta = 0.3
    policy, reference, layout = pairs_case()
    losses, grad, metrics = run(DPO(beta, label_smoothing), policy, reference, layout)
    want_loss, want_grad = [], [0.0] * len(grad)
    for k in range(layout.chosen.numel()):
        c, r, pi, ref, _ = pair_values(policy, reference, layout, k)
        z = beta * ((pi[c] - pi[r]) - (ref[c] - ref[r]))
        want_loss.append(-(1 - label_smoothing) * log_sig(z) - label_smoothing * log_sig(-z))
        dz = -(1 - label_smoothing) * sig(-z) + label_smoothing * sig(z)
        want_grad[c], want_grad[r] = beta * dz, -beta * dz
    assert_close(losses, want_loss)
    assert_close(grad, want_grad)
    rc = [beta * (policy.logps[c] - reference.logps[c]).item() for c in layout.chosen.tolist()]
    rr = [beta * (policy.logps[r] - reference.logps[r]).item() for r in layout.rejected.tolist()]
    assert_close(metrics["rewards/chosen"].tolist(), rc)
    assert_close(metrics["rewards/rejected"].tolist(), rr)
    assert_close(metrics["rewards/margins"].tolist(), [a - b for a, b in zip(rc, rr)])
    assert metrics["rewards/accuracies"].tolist() == [float(a > b) for a, b in zip(rc, rr)]
    assert 0 < sum(metrics["rewards/accuracies"].tolist()) < len(rc)  # the case has both kinds
    assert metrics["logps/chosen"].tolist() == policy.logps[layout.chosen].tolist()
    assert metrics["logps/rejected"].tolist() == policy.logps[layout.rejected].tolist()


def test_dpo_is_ln2_when_the_policy_is_the_reference():
    policy, _, layout = pairs_case()
    losses, _ = DPO(0.1).loss(policy, policy, layout)
    assert losses.tolist() == [math.log(2)] * layout.chosen.numel()
    p32 = SequenceScores(policy.logps.float(), policy.tokens)
    losses32, metrics = DPO(0.1).loss(p32, p32, layout)
    assert (losses32 == torch.tensor(math.log(2), dtype=torch.float32)).all()
    assert (metrics["rewards/margins"] == 0).all() and (metrics["rewards/accuracies"] == 0).all()
    # cDPO at logits 0 is ln 2 too, and its gradient there is (1 - 2 eps) of DPO's.
    _, g_dpo, _ = sequence_grads(DPO(0.1), policy, policy, layout, 1.0)
    _, g_cdpo, _ = sequence_grads(DPO(0.1, 0.2), policy, policy, layout, 1.0)
    assert torch.allclose(g_cdpo, 0.6 * g_dpo, rtol=0, atol=1e-15)


def test_ipo_reads_per_token_means():
    beta = 0.2
    policy, reference, layout = pairs_case(seed=1)
    losses, grad, metrics = run(IPO(beta), policy, reference, layout)
    want_loss, want_grad = [], [0.0] * len(grad)
    for k in range(layout.chosen.numel()):
        c, r, pi, ref, n = pair_values(policy, reference, layout, k)
        h = (pi[c] / n[c] - pi[r] / n[r]) - (ref[c] / n[c] - ref[r] / n[r]) - 1 / (2 * beta)
        want_loss.append(h * h)
        want_grad[c], want_grad[r] = 2 * h / n[c], -2 * h / n[r]
    assert_close(losses, want_loss)
    assert_close(grad, want_grad)
    c = layout.chosen.tolist()
    assert_close(metrics["rewards/chosen"].tolist(),
                 [beta * (policy.logps[i] - reference.logps[i]).item() / policy.tokens[i].item() for i in c])
    assert_close(metrics["logps/chosen"].tolist(), [policy.logps[i].item() / policy.tokens[i].item() for i in c])
    same, _ = IPO(beta).loss(policy, policy, layout)
    assert_close(same.tolist(), [(1 / (2 * beta)) ** 2] * len(c))


@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
def test_simpo_is_reference_free_with_a_margin(label_smoothing):
    beta, gamma = 2.0, 1.2
    policy, _, layout = pairs_case(seed=2)
    losses, grad, metrics = run(SimPO(beta, gamma, label_smoothing), policy, None, layout)
    want_loss, want_grad = [], [0.0] * len(grad)
    for k in range(layout.chosen.numel()):
        c, r, pi, _, n = pair_values(policy, policy, layout, k)
        z = beta * (pi[c] / n[c] - pi[r] / n[r]) - gamma
        want_loss.append(-(1 - label_smoothing) * log_sig(z) - label_smoothing * log_sig(-z))
        dz = -(1 - label_smoothing) * sig(-z) + label_smoothing * sig(z)
        want_grad[c], want_grad[r] = beta * dz / n[c], -beta * dz / n[r]
    assert_close(losses, want_loss)
    assert_close(grad, want_grad)
    assert_close(metrics["rewards/chosen"].tolist(),
                 [beta * policy.logps[i].item() / policy.tokens[i].item() for i in layout.chosen.tolist()])


def test_orpo_is_the_nll_plus_the_odds_ratio_term():
    lam = 0.25
    policy, _, layout = pairs_case(seed=3, means=(-4.0, -0.01))  # both sides of log1mexp's switch at -ln 2
    means = (policy.logps / policy.tokens).tolist()
    assert min(means) < -math.log(2) < max(means)
    losses, grad, metrics = run(ORPO(lam), policy, None, layout)
    want_loss, want_grad, want_ratio = [], [0.0] * len(grad), []
    for k in range(layout.chosen.numel()):
        c, r, pi, _, n = pair_values(policy, policy, layout, k)
        mc, mr = pi[c] / n[c], pi[r] / n[r]
        log_odds = (mc - mr) - (math.log(1 - math.exp(mc)) - math.log(1 - math.exp(mr)))
        want_loss.append(-mc - lam * log_sig(log_odds))
        want_ratio.append(log_sig(log_odds))
        d_odds = -lam * sig(-log_odds)
        want_grad[c] = (-1 + d_odds / (1 - math.exp(mc))) / n[c]
        want_grad[r] = (-d_odds / (1 - math.exp(mr))) / n[r]
    assert_close(losses, want_loss)
    assert_close(grad, want_grad)
    assert_close(metrics["log_odds_ratio"].tolist(), want_ratio)
    assert_close(metrics["nll_loss"].tolist(), [-policy.logps[i].item() / policy.tokens[i].item()
                                                for i in layout.chosen.tolist()])
    assert_close(metrics["rewards/rejected"].tolist(),
                 [lam * policy.logps[i].item() / policy.tokens[i].item() for i in layout.rejected.tolist()])


@pytest.mark.parametrize("shift", [0.0, -3.0])  # the mean log-ratio above 0, and clamped at 0
def test_kto_weights_each_example_against_the_reference_point(shift):
    beta, wd, wu = 0.5, 1.3, 0.7
    policy, reference, layout = pairs_case(p=5, seed=4)
    policy = SequenceScores(reference.logps + torch.linspace(-1, 2, 10, dtype=torch.float64) + shift,
                            policy.tokens)
    desirable = layout.desirable.clone()
    desirable[:3] = ~desirable[:3]  # unpaired: not one good per bad
    layout = PreferenceLayout(layout.sequences, desirable, torch.empty(0, dtype=torch.int64),
                              torch.empty(0, dtype=torch.int64))
    losses, grad, metrics = run(KTO(beta, wd, wu), policy, reference, layout)
    r = (policy.logps - reference.logps).tolist()
    z0 = max(0.0, sum(r) / len(r))
    assert (z0 > 0) == (shift == 0.0)
    want_loss, want_grad = [], []
    for ri, good in zip(r, desirable.tolist()):
        x = beta * (ri - z0) if good else beta * (z0 - ri)
        want_loss.append((wd if good else wu) * (1 - sig(x)))
        sign = -1 if good else 1  # z0 carries no gradient
        want_grad.append(sign * (wd if good else wu) * beta * sig(x) * (1 - sig(x)))
    assert_close(losses, want_loss)
    assert_close(grad, want_grad)
    assert metrics["kl"].tolist() == pytest.approx([z0], abs=1e-15)
    assert_close(metrics["rewards/chosen"].tolist(), [beta * ri for ri, g in zip(r, desirable.tolist()) if g])
    assert_close(metrics["rewards/rejected"].tolist(), [beta * ri for ri, g in zip(r, desirable.tolist()) if not g])
    assert "rewards/accuracies" not in metrics and KTO(beta).units(layout) == 10
    same, _ = KTO(beta, wd, wu).loss(reference, reference, layout)
    assert same.tolist() == [(wd if g else wu) * 0.5 for g in desirable.tolist()]


def test_paired_methods_refuse_unpaired_examples():
    policy, reference, layout = pairs_case(p=2)
    unpaired = PreferenceLayout(layout.sequences, layout.desirable, layout.chosen[:1], layout.rejected[:1])
    with pytest.raises(ValueError, match="dpo needs pairs.*4 sequences, 1 pairs"):
        DPO().loss(policy, reference, unpaired)


def test_make_method_reads_the_recipe_with_trl_defaults():
    assert isinstance(make_method("sft"), SFT) and make_method("sft").token_mean
    dpo = make_method("dpo")
    assert (dpo.beta, dpo.label_smoothing, dpo.needs_reference) == (0.1, 0.0, True)
    simpo = make_method("simpo", PreferenceConfig(beta=2.0, simpo_gamma=1.0))
    assert (simpo.beta, simpo.simpo_gamma, simpo.needs_reference, simpo.length_normalised) == (2.0, 1.0, False, True)
    assert make_method("orpo", PreferenceConfig(orpo_lambda=0.5)).orpo_lambda == 0.5
    kto = make_method("kto", PreferenceConfig(desirable_weight=2.0))
    assert (kto.desirable_weight, kto.undesirable_weight, kto.paired) == (2.0, 1.0, False)
    assert make_method("ipo").needs_reference and not make_method("orpo").needs_reference
    with pytest.raises(ValueError, match="unknown method 'ppo'"):
        make_method("ppo")


# ---------------------------------------------------------------- sequences and token weights
def packed_batch(seed: int = 0):
    """Two rows: the first packs three sequences (and padding), the second one sequence; prompts unlabelled."""
    g = torch.Generator().manual_seed(seed)
    t = 16
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 7],
                        [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]])
    labels = torch.randint(0, 50, (2, t), generator=g)
    for row, prompt_ends in ((0, (0, 1, 5, 6, 8, 9)), (1, (0, 1, 2, 3, 14, 15))):
        labels[row, list(prompt_ends)] = IGNORE_INDEX  # prompt tokens; row 1's last two: padding
    labels[0, 13:] = IGNORE_INDEX  # row 0's padding
    return labels, pos


def plain_sequences(pos: torch.Tensor) -> list[list[int]]:
    """Each token's sequence, by walking the rows."""
    out, n = [], -1
    for row in pos.tolist():
        seqs = []
        for p in row:
            n += p == 0
            seqs.append(n)
        out.append(seqs)
    return out


def test_sequences_sums_and_counts_are_the_plain_loops():
    labels, pos = packed_batch()
    index, n = label_sequence_index(pos)
    plain = plain_sequences(pos)
    assert n == 4 and index.tolist() == [row[1:] for row in plain]
    logps = torch.randn(2, 15, dtype=torch.float64)
    scores = sequence_sums(logps, labels, pos)
    sums, counts = [0.0] * n, [0] * n
    for b in range(2):
        for t in range(15):
            if labels[b, t + 1] != IGNORE_INDEX:
                sums[plain[b][t + 1]] += logps[b, t].item()
                counts[plain[b][t + 1]] += 1
    assert_close(scores.logps.tolist(), sums)
    assert scores.tokens.tolist() == counts == [3, 1, 3, 10]
    with pytest.raises(ValueError, match="every row must start a sequence"):
        label_sequence_index(pos[:, 1:])


@pytest.mark.parametrize("method", [DPO(0.2, 0.1), IPO(0.3), SimPO(2.0, 0.5), ORPO(0.4), KTO(0.5, 1.2, 0.8)],
                         ids=lambda m: m.name)
def test_token_weighted_cross_entropy_gives_the_methods_gradient(method):
    """The backward the engine runs (cross-entropy per token, weighted by -dL/dS of its sequence) equals
    autograd of the method's loss through log-softmax and the per-sequence sums, on the logits."""
    labels, pos = packed_batch(1)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 16, 50, generator=g, dtype=torch.float64, requires_grad=True)
    ref_logits = torch.randn(2, 16, 50, generator=g, dtype=torch.float64)
    target = labels[:, 1:].clamp(min=0)

    def token_logps(lg):
        return torch.log_softmax(lg[:, :-1], -1).gather(-1, target[..., None])[..., 0]

    layout = PreferenceLayout(torch.arange(4), torch.tensor([True, False, False, True]), torch.tensor([0, 3]),
                              torch.tensor([2, 1]))
    reference = sequence_sums(token_logps(ref_logits), labels, pos)
    scale = 1 / 7  # the step's units, other micro-batches included
    losses, _ = method.loss(sequence_sums(token_logps(logits), labels, pos), reference, layout)
    (want,) = torch.autograd.grad(losses.sum() * scale, logits)
    with torch.no_grad():
        policy = sequence_sums(token_logps(logits), labels, pos)
    _, grad, _ = sequence_grads(method, policy, reference, layout, scale)
    weights = token_weights(grad, labels, pos)
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1),
                                           ignore_index=IGNORE_INDEX, reduction="none").reshape(2, 15)
    (got,) = torch.autograd.grad((ce * weights).sum(), logits)
    assert torch.allclose(got, want, rtol=0, atol=1e-14)
    assert (weights[labels[:, 1:] == IGNORE_INDEX] == 0).all()


def test_per_pair_normalisation_does_not_depend_on_the_split():
    """Scaled by 1 / (the step's pairs), each micro-batch's sequence gradients are those of the whole step."""
    policy, reference, layout = pairs_case(p=6, seed=5)
    _, whole, _ = sequence_grads(DPO(0.1), policy, reference, layout, 1 / 6)
    parts = torch.zeros_like(whole)
    for lo, hi in ((0, 2), (2, 6)):  # 2 pairs, then 4
        c, r = layout.chosen[lo:hi], layout.rejected[lo:hi]
        seqs = torch.cat([c, r])
        sub = PreferenceLayout(layout.sequences[seqs], layout.desirable[seqs], torch.arange(hi - lo),
                               torch.arange(hi - lo, 2 * (hi - lo)))
        _, g, _ = sequence_grads(DPO(0.1), SequenceScores(policy.logps[seqs], policy.tokens[seqs]),
                                 SequenceScores(reference.logps[seqs], reference.tokens[seqs]), sub, 1 / 6)
        parts[seqs] = g
    assert torch.allclose(parts, whole, rtol=0, atol=1e-15)


def test_metric_totals_over_micro_batches_and_ranks():
    policy, reference, layout = pairs_case(p=6, seed=6)
    _, whole = DPO(0.1).loss(policy, reference, layout)
    totals = [MetricTotals(), MetricTotals()]  # two ranks
    for rank, (lo, hi) in enumerate(((0, 1), (1, 6))):
        seqs = torch.cat([layout.chosen[lo:hi], layout.rejected[lo:hi]])
        sub = PreferenceLayout(seqs, layout.desirable[seqs], torch.arange(hi - lo),
                               torch.arange(hi - lo, 2 * (hi - lo)))
        _, metrics = DPO(0.1).loss(SequenceScores(policy.logps[seqs], policy.tokens[seqs]),
                                   SequenceScores(reference.logps[seqs], reference.tokens[seqs]), sub)
        totals[rank].add(metrics)
    reduced = MetricTotals.from_tensor(totals[0].as_tensor() + totals[1].as_tensor()).means()
    assert set(reduced) == set(whole)
    for name, values in whole.items():
        assert reduced[name] == pytest.approx(values.mean().item(), abs=1e-13)
    kto = MetricTotals()
    kto.add({"rewards/chosen": torch.tensor([1.0, 3.0]), "rewards/rejected": torch.tensor([-1.0]),
             "kl": torch.tensor([0.5])})
    kto.add({"rewards/chosen": torch.tensor([], dtype=torch.float64), "rewards/rejected": torch.tensor([-3.0]),
             "kl": torch.tensor([0.0])})
    assert kto.means() == {"rewards/chosen": 2.0, "rewards/rejected": -2.0, "kl": 0.25, "rewards/margins": 4.0}


# ---------------------------------------------------------------- the plain-PyTorch reference (preference_reference.py)
def test_the_reference_formulas_agree_with_the_methods():
    """Two independent writings of each formula (the parity tests' reference and megatrain_cli.methods)."""
    from tests.preference_reference import Hyper, unit_losses

    hp = Hyper(beta=0.3, label_smoothing=0.1, simpo_gamma=0.4, orpo_lambda=0.2, desirable_weight=1.3,
               undesirable_weight=0.6)
    policy, reference, layout = pairs_case(p=6, seed=7)
    c, r = layout.chosen.tolist(), layout.rejected.tolist()
    for name in ("dpo", "ipo", "simpo", "orpo"):
        values = lambda s: [[s.logps[i], s.logps[j]] for i, j in zip(c, r)]  # noqa: E731
        counts = [[int(policy.tokens[i]), int(policy.tokens[j])] for i, j in zip(c, r)]
        want = unit_losses(name, hp, values(policy), values(reference), counts, [[True, False]] * len(c))
        cfg = PreferenceConfig(**{k: v for k, v in vars(hp).items() if k in vars(make_method(name))})
        got, _ = make_method(name, cfg).loss(policy, reference, layout)
        assert_close(got.tolist(), [float(v) for v in want])
    order = layout.sequences.argsort().tolist()  # KTO: each sequence its own example
    want = unit_losses("kto", hp, [[policy.logps[i]] for i in order], [[reference.logps[i]] for i in order],
                       [[1]] * len(order), [[bool(layout.desirable[i])] for i in order])
    got, _ = make_method("kto", PreferenceConfig(beta=0.3, desirable_weight=1.3, undesirable_weight=0.6)).loss(
        policy, reference, layout)
    assert_close(got[order].tolist(), [float(v) for v in want])


@pytest.fixture(scope="module")
def tiny_pref():
    """The bundled tokenizer, preference micro-batches of the bundled set, and a tiny model of its vocabulary."""
    from transformers import AutoModelForCausalLM

    from megatrain_cli.data.preference import load_preference_examples
    from megatrain_cli.data.preference_rows import build_preference_data
    from megatrain_cli.models.tokenizer import load_bundled_tokenizer
    from megatrain_cli.recipe import DataConfig
    from tests.reference import tiny_config

    tok = load_bundled_tokenizer()
    data_cfg = DataConfig(source="builtin:sample_math_pref", max_samples=4, cache_dir="off")
    data = build_preference_data(load_preference_examples(data_cfg, "dpo"), tok, data_cfg, 256, seed=0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(vocab=len(tok), layers=2), dtype=torch.float32)
    return data, model


def test_the_reference_starts_at_ln2_learns_and_normalises_per_pair(tiny_pref):
    import copy

    from megatrain_cli.recipe import TrainConfig
    from tests.preference_reference import Hyper, reference_preference_train, units_of

    data, model = tiny_pref
    (mb,) = data.next_step(2, 1)
    units = units_of(mb, "dpo")
    assert len(units) == 4
    for unit, c, r in zip(units, mb.layout.chosen.tolist(), mb.layout.rejected.tolist()):
        for seq, s in zip(unit, (mb.layout.sequences[c], mb.layout.sequences[r])):
            lo, hi = int(data.offsets[s]), int(data.offsets[s + 1])
            assert seq.input_ids[:hi - lo].tolist() == data.tokens[lo:hi].tolist()
            assert (seq.labels[hi - lo:] == IGNORE_INDEX).all()  # the row's padding, after the last sequence
    cfg = TrainConfig(steps=3, lr=1e-2, weight_decay=0.1, max_grad_norm=1.0, warmup_steps=1)
    whole, split = copy.deepcopy(model), copy.deepcopy(model)
    history = reference_preference_train(whole, [[units]] * 3, "dpo", Hyper(beta=0.5), cfg, 3)
    ln2 = float(torch.tensor(math.log(2), dtype=torch.float32))
    assert history[0][0] == [ln2] * 4  # the policy is the reference: exactly ln 2 (in fp32)
    assert sum(history[2][0]) / 4 < math.log(2) - 0.01
    reference_preference_train(split, [[units[:1], units[1:]]] * 3, "dpo", Hyper(beta=0.5), cfg, 3)
    for a, b in zip(whole.parameters(), split.parameters()):  # per pair, whatever the micro-batches
        assert torch.allclose(a, b, rtol=0, atol=1e-5)  # fp32 sums in another order
    kto = reference_preference_train(copy.deepcopy(model), [[units_of(mb, "kto")]], "kto", Hyper(), cfg, 1)
    assert kto[0][0] == [0.5] * 8  # r = 0 and z0 = 0: each example's loss is 1 - sigmoid(0)
