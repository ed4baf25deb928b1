"""`megatrain bench train.method=grpo`: GRPO steps as training runs them, on synthetic prompts, two rows.

Each step: train.micro_batch_size x train.grad_accum / grpo.num_generations prompts of random tokens, each
train.seq_len - grpo.max_new_tokens long (so a row is train.seq_len tokens, the shape the plan was made for),
repeated grpo.num_generations times and decoded as one batch by the rollout path training uses
(train/rollout.sample over the engine's store, resident layers read in place, temperature / top-p sampling);
no end token stops a completion, so every one is grpo.max_new_tokens long (the generation's worst case).
Rewards are seeded random numbers (a reward's own cost is the user's), advantages and rows as training's,
then engine.step (the GRPO head, one backward, the optimizer).

    rollout     generation alone: generated tokens / its seconds; model TFLOPS its forward FLOPs (2 x matmul
                params per token, attention not counted)
    grpo train  the training step on the rollouts' rows: row tokens / its seconds
Both carry the step's split (generate / score / train seconds, per step) in `split`.
"""

from __future__ import annotations

import gc
import time

import torch

from megatrain_cli.bench.result import BenchResult
from megatrain_cli.machine import host_rss_bytes, peak_rss_bytes
from megatrain_cli.metrics.flops import streamed_step_flops


class _NoText:
    """The bench's rollouts are random ids of a random-init model: there is no text to decode."""

    @staticmethod
    def decode(ids, skip_special_tokens: bool = True) -> str:
        return ""


def run_grpo_bench(r, run, *, planned, log=print) -> list[BenchResult]:
    from megatrain_cli.bench.runner import DoesNotFit, build
    from megatrain_cli.methods import make_method

    if planned.problems:
        raise DoesNotFit("the bench would not fit:\n  " + "\n  ".join(planned.problems))
    if planned.long_context:
        raise DoesNotFit(f"train.method=grpo: the short-context (or memory-lean) path only; train.seq_len "
                         f"{r.train.seq_len} takes the long-context one")
    if r.train.seq_len <= r.grpo.max_new_tokens:
        raise DoesNotFit(f"train.seq_len {r.train.seq_len} leaves no room for a prompt before grpo.max_new_tokens="
                         f"{r.grpo.max_new_tokens}")
    built = build(planned, log=log, method=make_method("grpo", grpo=r.grpo))
    try:
        return measure(planned, built.store, built.engine, run, log=log)
    finally:
        built.engine.close()
        del built
        gc.collect()
        if planned.device.type == "cuda":
            torch.cuda.empty_cache()


def measure(planned, store, engine, run, *, log=print) -> list[BenchResult]:
    from megatrain_cli.eval.generate import Sampler
    from megatrain_cli.methods.grpo import group_advantages
    from megatrain_cli.train.rollout import rollout_rows, sample

    r, dev = planned.r, planned.device
    t, g = r.train, r.grpo
    rows = t.micro_batch_size * t.grad_accum
    prompts, prompt_len = rows // g.num_generations, t.seq_len - g.max_new_tokens
    vocab = planned.config.vocab_size
    sampler = Sampler(g.temperature, g.top_p, torch.Generator(device=dev).manual_seed(t.seed))
    warmup, steps = run.warmup_steps(False), run.steps
    times, generated, trained, widths = [], 0, 0, []

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    for s in range(warmup + steps):
        gen = torch.Generator().manual_seed(s)
        ids = torch.randint(1, vocab, (prompts, prompt_len), generator=gen).tolist()
        engine.synchronize(masters=False)  # as train/grpo.py: the resident state stays on the device
        rollouts = sample(store, dev, _NoText(), ids, g.num_generations, sampler, max_new_tokens=g.max_new_tokens,
                          eos_ids=[], pad_id=0, stop=[], engine=engine)
        t0 = time.perf_counter()
        rewards = torch.rand(prompts, g.num_generations, generator=gen, dtype=torch.float64)
        mbs = rollout_rows(rollouts, group_advantages(rewards), t.micro_batch_size, 0)
        scored = time.perf_counter() - t0
        t0 = time.perf_counter()
        res = engine.step(mbs, t.lr)
        sync()
        took = time.perf_counter() - t0
        log(f"[bench] grpo step {s}{' (warm-up)' if s < warmup else ''}: generate {rollouts.seconds:.2f} s "
            f"({rollouts.new_tokens} tokens, decoded {rollouts.decode_path}), score {scored:.3f} s, "
            f"train {took:.2f} s, grad norm {res.grad_norm:.3f}")
        if s >= warmup:
            times.append((rollouts.seconds, scored, took))
            generated += rollouts.new_tokens
            trained += sum(mb.input_ids.numel() for mb in mbs)
            widths += [mb.input_ids.shape[1] for mb in mbs]
    gen_s, score_s, train_s = (sum(x[i] for x in times) / steps for i in range(3))
    split = {"generate": round(gen_s, 3), "score": round(score_s, 4), "train": round(train_s, 3)}
    width = round(sum(widths) / len(widths))
    per_token, _ = streamed_step_flops(store, rows=1, seq=1, recomputed_layers=0)
    forward_per_token = per_token / 3  # 6 x params per trained token: the forward's 2 x params
    train_flops, executed = streamed_step_flops(store, rows=rows, seq=width, recomputed_layers=engine.recomputed_layers())
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0
    common = dict(model=planned.label, steps=steps, peak_device_bytes=peak, host_rss_bytes=host_rss_bytes(),
                  host_peak_rss_bytes=peak_rss_bytes(), bytes_per_param=store.host_bytes() / store.num_params(),
                  split=split)
    resident = (f"{engine.plan.resident_layers} of {store.adapter.num_layers} layers resident (read in place), "
                f"decoded {rollouts.decode_path}")
    step = gen_s + score_s + train_s
    note = (f"GRPO step {step:.2f} s = generate {gen_s:.2f} + score {score_s:.3f} + train {train_s:.2f}; {prompts} "
            f"prompts x {g.num_generations} completions of {g.max_new_tokens} new tokens after {prompt_len} prompt "
            f"tokens; {resident}; mean of {steps} step(s) after {warmup} warm-up")
    return [BenchResult(name="rollout", batch=prompts * g.num_generations, seq=g.max_new_tokens, step_time_s=gen_s,
                        tokens_per_s=generated / steps / gen_s,
                        model_tflops=forward_per_token * generated / steps / gen_s / 1e12,
                        executed_tflops=forward_per_token * generated / steps / gen_s / 1e12, notes=note, **common),
            BenchResult(name="grpo train", batch=rows, seq=width, step_time_s=train_s,
                        tokens_per_s=trained / steps / train_s, model_tflops=train_flops / train_s / 1e12,
                        executed_tflops=executed / train_s / 1e12, losses=[], notes=note, **common)]
