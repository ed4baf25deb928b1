"""The training loop, top to bottom: recipe -> model -> data -> engine -> metrics / checkpoints.

Exit codes: 0 done (or stopped by SIGTERM after a checkpoint), 1 training failed (NaN with
nan_policy=stop, CUDA out of memory), 2 bad input (recipe, paths, data), 3 would not fit in memory,
130 interrupted by Ctrl-C after a checkpoint.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import torch

from megatrain_cli.recipe import Recipe, parse_bytes, render_yaml

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


class TrainingError(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def out_of_memory_message(err: BaseException) -> str:
    """CUDA OOM: where it happened (the engine's note) and what to change for that phase."""
    phase = next((n.removeprefix("megatrain phase: ") for n in getattr(err, "__notes__", [])
                  if n.startswith("megatrain phase: ")), "unknown")
    if phase.startswith("head"):
        advice = "a smaller engine.loss_chunk_tokens (the LM head's logits are computed in chunks of that many tokens)"
    else:
        advice = ("a smaller train.micro_batch_size or train.seq_len, a smaller engine.checkpoint_interval, or "
                  "engine.keep_activations=0 (activations kept instead of recomputed)")
    return (f"CUDA out of memory during {phase} ({str(err).splitlines()[0]}). Use {advice}; "
            f"`megatrain train RECIPE --dry-run` shows the memory plan. The last checkpoint is intact.")


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("engine.device is 'cuda' but no CUDA device is available (use 'auto' or 'cpu')", 2)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def model_config(r: Recipe, tokenizer):
    from megatrain_cli.models.adapter import check_architecture
    from megatrain_cli.models.loader import load_hf_config
    from megatrain_cli.presets import PRESETS

    if r.model.path is not None:
        config = load_hf_config(r.model.path, r.model.trust_remote_code)
    else:
        p = PRESETS[r.model.preset]
        config = p.hf_config(vocab_size=p.vocab_size or len(tokenizer),
                             max_position_embeddings=max(p.max_position_embeddings, r.train.seq_len))
    check_architecture(config)
    if tokenizer is not None and len(tokenizer) > config.vocab_size:
        raise TrainingError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocabulary is "
                            f"{config.vocab_size}: they do not belong together", 2)
    return config


def device_budget(r: Recipe, device: torch.device) -> int | None:
    """The recipe's engine.max_gpu_mem, else what the CUDA device has; None when unknown (CPU)."""
    if r.engine.max_gpu_mem:
        return parse_bytes(r.engine.max_gpu_mem)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    return None


def build_plan(r: Recipe, config, device: torch.device, long_ctx=None):
    """The memory plan. With a long-context (or memory-lean) plan its host figures stand, its device figures
    are the short-context engine's (the long-context plan's replace them): interval and loss chunk are the
    long plan's, and no block keeps its activations."""
    from megatrain_cli.engine.plan.memory import make_plan, resolve_keep_blocks
    from megatrain_cli.models.adapter import ModelAdapter

    args = dict(adapter=ModelAdapter(config), compute_dtype=DTYPES[r.model.dtype],
                micro_batch_size=r.train.micro_batch_size, seq_len=r.train.seq_len, grad_accum=r.train.grad_accum,
                checkpoint_interval=r.engine.checkpoint_interval, grad_slabs=r.engine.grad_slabs,
                loss_chunk_tokens=r.engine.loss_chunk_tokens, device_type=device.type,
                device_cast=r.engine.device_cast)
    if long_ctx is not None:
        args.update(checkpoint_interval=long_ctx.checkpoint_interval, loss_chunk_tokens=long_ctx.loss_chunk_tokens)
        plan = make_plan(**args, keep_blocks=0)
        plan.notes.append(f"{long_ctx.label} path: the device figures above are the short-context engine's; the "
                          f"{long_ctx.label} plan replaces them")
        return plan
    keep = resolve_keep_blocks(r.engine.keep_activations, device_budget(r, device), **args)
    plan = make_plan(**args, keep_blocks=keep)
    if r.engine.keep_activations == "auto" and device_budget(r, device) is None and device.type == "cuda":
        plan.notes.append("keep_activations 'auto' is decided on the GPU from its memory (0 assumed here)")
    return plan


def check_packed_rows(r: Recipe) -> None:
    """Packed rows on the long-context path: the engine builds a [B, 1, T, T] block-causal mask for them
    and refuses one over MAX_LONG_CONTEXT_MASK elements (one 65536-token row) at the first step; refuse
    the recipe before anything is built instead (exit 2)."""
    from megatrain_cli.engine.step import MAX_LONG_CONTEXT_MASK

    b, t = r.train.micro_batch_size, r.train.seq_len
    if r.data.packing and b * t * t > MAX_LONG_CONTEXT_MASK:
        rows = f"{b} packed rows" if b > 1 else "a packed row"
        fix = "data.packing=false (one document per row)" + (", or a smaller train.micro_batch_size"
                                                             if t * t <= MAX_LONG_CONTEXT_MASK else "")
        raise TrainingError(f"data.packing with train.seq_len={t}: {rows} of {t} tokens need a block-causal mask of "
                            f"{b * t * t / 2**30:.0f} GiB and keep SDPA off flash/cuDNN; the long-context path "
                            f"takes at most {MAX_LONG_CONTEXT_MASK // 2**30} GiB "
                            f"({int(MAX_LONG_CONTEXT_MASK ** 0.5)} tokens in one row). Use {fix}", 2)


def long_context_plan(r: Recipe, config, device: torch.device, *, min_seq_len: int | None = None):
    """The long-context plan (engine/long_context.py) when train.seq_len >= `min_seq_len` (default
    LONG_CONTEXT_MIN_SEQ), else None: the short-context engine. Planned before the host store exists,
    so the host budget for offloaded checkpoints already leaves the store's bytes out."""
    from megatrain_cli.engine.plan.lean import LONG_CONTEXT_MIN_SEQ, plan_for_training
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.store.tiles import HostStore

    min_seq_len = LONG_CONTEXT_MIN_SEQ if min_seq_len is None else min_seq_len
    if r.train.seq_len < min_seq_len:
        return None
    check_packed_rows(r)
    adapter, dtype = ModelAdapter(config), DTYPES[r.model.dtype]
    return plan_for_training(adapter, seq_len=r.train.seq_len, micro_batch_size=r.train.micro_batch_size,
                             grad_accum=r.train.grad_accum, dtype=dtype, device_type=device.type,
                             device_budget=device_budget(r, device), grad_slabs=r.engine.grad_slabs,
                             loss_chunk_tokens=r.engine.loss_chunk_tokens,
                             store_bytes_to_come=HostStore(adapter, dtype, allocate=False).host_bytes(),
                             min_seq_len=min_seq_len)


def memory_lean_plan(r: Recipe, config, device: torch.device, short_plan):
    """The memory-lean plan (engine/long_context.plan_memory_lean) when the short-context plan does not fit
    the device budget (engine.max_gpu_mem, else the CUDA device's memory), else None. None too when the
    budget is unknown (CPU without engine.max_gpu_mem, a dry run for CUDA without it) and when packed rows
    would need a block-causal mask over the long-context path's limit (the short-context plan is refused
    with its numbers then). Check .fits: a plan that does not fit either is returned for its numbers."""
    from megatrain_cli.engine.plan.lean import plan_memory_lean
    from megatrain_cli.engine.plan.memory import device_problem
    from megatrain_cli.engine.step import MAX_LONG_CONTEXT_MASK
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.store.tiles import HostStore

    budget = device_budget(r, device)
    if budget is None or not device_problem(short_plan, device=device, device_budget=budget):
        return None
    b, t = r.train.micro_batch_size, r.train.seq_len
    if r.data.packing and b * t * t > MAX_LONG_CONTEXT_MASK:
        return None
    adapter, dtype = ModelAdapter(config), DTYPES[r.model.dtype]
    return plan_memory_lean(adapter, seq_len=t, micro_batch_size=b, grad_accum=r.train.grad_accum, dtype=dtype,
                            device_type=device.type, device_budget=budget, grad_slabs=r.engine.grad_slabs,
                            loss_chunk_tokens=r.engine.loss_chunk_tokens,
                            store_bytes_to_come=HostStore(adapter, dtype, allocate=False).host_bytes())


def path_line(r: Recipe, long_ctx, min_seq_len: int | None = None, short_plan=None) -> str:
    """Which engine path the run takes, in one line; `short_plan`: the short-context plan a memory-lean
    plan replaces (its device figure is quoted)."""
    from megatrain_cli.engine.plan.lean import LONG_CONTEXT_MIN_SEQ

    threshold = LONG_CONTEXT_MIN_SEQ if min_seq_len is None else min_seq_len
    if long_ctx is not None and long_ctx.label == "memory-lean":
        from megatrain_cli.engine.plan.lean import fmt_bytes

        need = f"needs about {fmt_bytes(short_plan.device_total)}" if short_plan is not None else "does not fit"
        return (f"path: memory-lean engine (the short-context plan {need} of the {fmt_bytes(long_ctx.budget)} "
                f"device budget): {long_ctx.summary()}, no kept activations")
    if long_ctx is None:
        return (f"path: short-context engine (train.seq_len {r.train.seq_len} < {threshold}; checkpoint interval "
                f"{r.engine.checkpoint_interval})")
    mlp = f"MLP tiled by {long_ctx.mlp_tile_tokens}" if long_ctx.mlp_tile_tokens else "MLP untiled"
    return (f"path: long-context engine (train.seq_len {r.train.seq_len} >= {threshold}): checkpoint interval "
            f"{long_ctx.checkpoint_interval}, {mlp}, {long_ctx.offloaded_checkpoints} of {long_ctx.num_checkpoints} "
            f"checkpoints offloaded to host memory, no kept activations")


def run_training(r: Recipe, *, dry_run: bool = False, force: bool = False,
                 long_context_min_seq: int | None = None, dist=None) -> int:
    """`long_context_min_seq`: train.seq_len from which the long-context path is taken (None:
    LONG_CONTEXT_MIN_SEQ, 32768); tests lower it to run that path at a length a CPU trains quickly.
    `dist`: this process is one data-parallel rank (a dist_train.RankSpec; dist_train.py launches them)."""
    try:
        return _train(r, dry_run=dry_run, force=force, long_context_min_seq=long_context_min_seq, dist=dist)
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except torch.cuda.OutOfMemoryError as err:
        print(f"error: {out_of_memory_message(err)}", file=sys.stderr)
        return 1
    except ValueError as err:  # bad data, missing model path, unsupported architecture, bad checkpoint
        print(f"error: {err}", file=sys.stderr)
        return 2


def _train(r: Recipe, *, dry_run: bool, force: bool, long_context_min_seq: int | None = None, dist=None) -> int:
    from megatrain_cli.models.tokenizer import load_tokenizer

    if r.model.path is not None and not Path(r.model.path).is_dir():
        raise TrainingError(f"model.path does not exist: {r.model.path}", 2)
    tokenizer = load_tokenizer(r.model)
    config = model_config(r, tokenizer)
    # A dry run plans for the recipe's device even on a machine without it.
    planned = torch.device("cuda") if r.engine.device == "cuda" and dry_run else resolve_device(r.engine.device)
    device = planned
    long_ctx = long_context_plan(r, config, device, min_seq_len=long_context_min_seq)
    plan = build_plan(r, config, planned, long_ctx)
    short_plan = None
    if long_ctx is None:
        # A step the short-context plan does not fit takes the memory-lean path (interval 1, checkpoints in
        # host memory as needed) instead of being refused.
        lean = memory_lean_plan(r, config, planned, plan)
        if lean is not None:
            short_plan, long_ctx = plan, lean
            plan = build_plan(r, config, planned, long_ctx)
    if dry_run:
        print("# resolved recipe")
        print(render_yaml(r))
        print(plan.render())
        print(path_line(r, long_ctx, long_context_min_seq, short_plan))
        if long_ctx is not None:
            print(long_ctx.render())
            if not long_ctx.fits:
                from megatrain_cli.engine.plan.lean import refusal

                print(f"would not fit: {refusal(long_ctx)} (--force runs it anyway)")
        return 0
    from megatrain_cli.engine.plan.memory import preflight

    if long_ctx is None:
        problems = preflight(plan, device=device, device_budget=device_budget(r, device))
    else:
        from megatrain_cli.engine.plan.lean import refusal

        # The host checks only: the long-context plan's device peak replaces the generic device estimate.
        problems = preflight(plan, device=torch.device("cpu"))
        if not long_ctx.fits and short_plan is not None:
            from megatrain_cli.engine.plan.lean import fmt_bytes

            problems.append(f"device memory: the short-context plan needs about {fmt_bytes(short_plan.device_total)} "
                            f"of the {fmt_bytes(long_ctx.budget)} budget, and the memory-lean plan does not "
                            f"fit either: {refusal(long_ctx)}. Use a smaller train.micro_batch_size, "
                            f"train.grad_accum or train.seq_len, or a larger engine.max_gpu_mem; "
                            f"`megatrain train RECIPE --dry-run` shows both plans.")
        elif not long_ctx.fits:
            problems.append(f"long context: {refusal(long_ctx)}. Use a shorter train.seq_len, a smaller "
                            f"train.micro_batch_size or train.grad_accum, or a larger engine.max_gpu_mem; "
                            f"`megatrain train RECIPE --dry-run` shows the plan.")
    if problems and not force:
        raise TrainingError("the run would not fit:\n  " + "\n  ".join(problems) +
                            "\n(--force runs it anyway)", 3)
    if dist is not None:
        from megatrain_cli.train.ranks import start_rank

        return _loop(r, device, tokenizer, config, plan, long_ctx, dist=start_rank(dist, r, device, long_ctx))
    return _loop(r, device, tokenizer, config, plan, long_ctx)


def _loop(r: Recipe, device, tokenizer, config, plan, long_ctx=None, dist=None) -> int:
    from megatrain_cli.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from megatrain_cli.dashboard import Dashboard
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.engine.plan.memory import kept_block_ids
    from megatrain_cli.engine.schedule import blocks
    from megatrain_cli.engine.step import Engine
    from megatrain_cli.metrics.logs import JsonlLog
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.optim.host_adamw import lr_at
    from megatrain_cli.metrics.step import step_metrics

    lead = dist is None or dist.rank == 0  # the one process that prints, logs and exports
    out = Path(r.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if lead:
        (out / "recipe.yaml").write_text(render_yaml(r))
    t, e = r.train, r.engine
    examples = load_examples(r.data)
    train_ex, _ = split_examples(examples, r.data)
    data = build_train_data(train_ex, tokenizer, r.data, t.seq_len, t.seed)
    total = t.steps if t.steps is not None else max(1, round(t.epochs * data.steps_per_epoch(t.micro_batch_size,
                                                                                              t.grad_accum)))
    if long_ctx is not None:
        from megatrain_cli.bench.long_context import _expandable_segments

        _expandable_segments(device)  # multi-GiB activations of varying size fragment the caching allocator
        interval, keep = long_ctx.checkpoint_interval, frozenset()
    else:
        interval = e.checkpoint_interval
        keep = kept_block_ids(len(blocks(config.num_hidden_layers, interval)), plan.keep_blocks)
    if dist is None:
        store = build_store(config, DTYPES[r.model.dtype], weights_path=r.model.path, seed=r.model.seed)
    else:
        from megatrain_cli.store.sharded import build_sharded_store

        store = build_sharded_store(config, DTYPES[r.model.dtype], dist.rank, dist.world,
                                    weights_path=r.model.path, seed=r.model.seed, cpu_group=dist.cpu_group)
    engine = Engine(store, t, device=device, checkpoint_interval=interval,
                    loss_chunk_tokens=long_ctx.loss_chunk_tokens if long_ctx else e.loss_chunk_tokens,
                    grad_slabs=e.grad_slabs, double_buffer=e.double_buffer,
                    overlap_optimizer=e.overlap_optimizer and device.type == "cuda",
                    speculate=e.speculate_optimizer, keep_blocks=keep, long_context=long_ctx,
                    kernels=e.kernels, host_adamw=e.host_adamw, defer_moments=e.defer_moments,
                    device_cast=e.device_cast and dist is None, update_on_read=e.update_on_read,
                    **({} if dist is None else {"dist": dist}))
    # Pin the offloaded checkpoints' host buffers now, not inside the first forward (0 on CPU).
    pinned = engine.reserve_checkpoint_buffers([(t.micro_batch_size, t.seq_len)] * t.grad_accum)
    start, skipped = 0, 0
    resume = r.checkpoint.resume
    ckpt = latest_checkpoint(out) if resume == "auto" else (Path(resume) if resume else None)
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise TrainingError(f"checkpoint.resume: no checkpoint at {resume}", 2)
    if ckpt is not None:
        state = load_checkpoint(store, ckpt)
        start, skipped = int(state["step"]), int(state.get("skipped_steps", 0))
        data.load_state_dict(state["data"])
        if lead:
            print(f"resumed from {ckpt} at step {start}", file=sys.stderr)

    stop = {"signal": None}

    def on_signal(signum, _frame):  # finish the step in flight, checkpoint, exit
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def checkpoint(step: int) -> None:
        engine.synchronize()  # pending host updates land before the masters are read
        if dist is not None:
            from megatrain_cli.checkpoint import save_sharded_checkpoint as save
        else:
            save = save_checkpoint
        save(store, out, step, {"step": step, "skipped_steps": skipped, "data": data.state_dict()},
             keep_last_n=r.checkpoint.keep_last_n, tokenizer=tokenizer)

    jsonl = JsonlLog(out / "metrics.jsonl") if r.logging.jsonl and lead else None
    code = 0
    try:
        with Dashboard(r.logging.dashboard if lead else "off", total_steps=total,
                       title=f"megatrain {r.output_dir}") as dash:
            dash.log(f"{store.num_params() / 1e6:.1f} M params on {device.type}, {total} steps, "
                     f"{data.num_rows} rows of {t.seq_len} tokens, host state "
                     f"{store.host_bytes() / 2**30:.2f} GiB")
            if long_ctx is not None:
                dash.log(f"{long_ctx.label} path: {long_ctx.offloaded_checkpoints} of {long_ctx.num_checkpoints} "
                         f"checkpoints in host memory ({pinned / 2**30:.2f} GiB pinned), predicted device peak "
                         f"{long_ctx.predicted_peak / 2**30:.2f} GiB")
            t_run = time.perf_counter()
            for step in range(start, total):
                t0 = time.perf_counter()
                mbs = data.next_step(t.micro_batch_size, t.grad_accum)
                if dist is not None:  # every rank draws the global batch and keeps its share
                    from megatrain_cli.engine.dist import split_micro_batches

                    mbs = split_micro_batches(mbs, dist.rank, dist.world)
                lr = lr_at(step, t, total)
                res = engine.step(mbs, lr)
                if res.skipped:
                    skipped += 1
                    if t.nan_policy == "stop":
                        raise TrainingError(f"step {step + 1}: loss {res.loss} / gradient norm {res.grad_norm} is "
                                            f"not finite (train.nan_policy=stop); the last checkpoint is intact", 1)
                if (step + 1) % r.logging.every_n_steps == 0 or step + 1 == total:
                    m = step_metrics(res, engine=engine, step=step, total=total, lr=lr, skipped=skipped,
                                     step_time=time.perf_counter() - t0, seq_len=t.seq_len,
                                     eta=(time.perf_counter() - t_run) / (step + 1 - start) * (total - step - 1))
                    dash.update(m)
                    if jsonl:
                        jsonl.write(m)
                every = r.checkpoint.every_n_steps
                if dist is not None:  # a signal seen by any rank stops them all after the same step
                    from megatrain_cli.train.ranks import agree_on_signal

                    stop["signal"] = agree_on_signal(dist, stop["signal"])
                if stop["signal"] is not None or (every and (step + 1) % every == 0 and step + 1 < total):
                    checkpoint(step + 1)
                if stop["signal"] is not None:
                    dash.log(f"stopped by signal {stop['signal']} after step {step + 1}; checkpoint written")
                    code = 130 if stop["signal"] == signal.SIGINT else 0
                    return code
            engine.synchronize()
            if r.checkpoint.every_n_steps:
                checkpoint(total)
            if r.checkpoint.export_final and dist is not None:
                from megatrain_cli.train.ranks import export_sharded

                final = export_sharded(store, out / "final", dtype=DTYPES[r.model.dtype], tokenizer=tokenizer)
                if final is not None:
                    dash.log(f"wrote {final}")
            elif r.checkpoint.export_final:
                from megatrain_cli.checkpoint import export_hf

                final = export_hf(store, out / "final", dtype=DTYPES[r.model.dtype], tokenizer=tokenizer)
                dash.log(f"wrote {final}")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        engine.close()
        if jsonl:
            jsonl.close()
    if r.eval.enabled and r.checkpoint.export_final and lead:
        from megatrain_cli.eval.run import run_eval

        # The engine's device buffers and the host store go first: eval's 'auto' mode measures free
        # device memory to choose resident or streamed generation, and loads final/ itself.
        del engine, store
        if device.type == "cuda":
            torch.cuda.empty_cache()

        run_eval(str(out / "final"), r.data.source, split="test", limit=r.eval.limit,
                 batch_size=r.eval.batch_size, max_new_tokens=r.eval.max_new_tokens, output_dir=str(out / "eval"),
                 device=device.type, data_cfg=r.data)
    return code
