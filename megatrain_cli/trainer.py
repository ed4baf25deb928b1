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


def build_plan(r: Recipe, config, device: torch.device):
    from megatrain_cli.engine.plan import make_plan, resolve_keep_blocks
    from megatrain_cli.models.adapter import ModelAdapter

    args = dict(adapter=ModelAdapter(config), compute_dtype=DTYPES[r.model.dtype],
                micro_batch_size=r.train.micro_batch_size, seq_len=r.train.seq_len, grad_accum=r.train.grad_accum,
                checkpoint_interval=r.engine.checkpoint_interval, grad_slabs=r.engine.grad_slabs,
                loss_chunk_tokens=r.engine.loss_chunk_tokens, device_type=device.type)
    keep = resolve_keep_blocks(r.engine.keep_activations, device_budget(r, device), **args)
    plan = make_plan(**args, keep_blocks=keep)
    if r.engine.keep_activations == "auto" and device_budget(r, device) is None and device.type == "cuda":
        plan.notes.append("keep_activations 'auto' is decided on the GPU from its memory (0 assumed here)")
    return plan


def run_training(r: Recipe, *, dry_run: bool = False, force: bool = False) -> int:
    try:
        return _train(r, dry_run=dry_run, force=force)
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except torch.cuda.OutOfMemoryError as err:
        print(f"error: CUDA out of memory ({str(err).splitlines()[0]}). Use a smaller train.micro_batch_size or "
              f"train.seq_len, a smaller engine.checkpoint_interval, or engine.loss_chunk_tokens; "
              f"`megatrain train RECIPE --dry-run` shows the plan.", file=sys.stderr)
        return 1
    except ValueError as err:  # bad data, missing model path, unsupported architecture, bad checkpoint
        print(f"error: {err}", file=sys.stderr)
        return 2


def _train(r: Recipe, *, dry_run: bool, force: bool) -> int:
    from megatrain_cli.models.tokenizer import load_tokenizer

    if r.model.path is not None and not Path(r.model.path).is_dir():
        raise TrainingError(f"model.path does not exist: {r.model.path}", 2)
    tokenizer = load_tokenizer(r.model)
    config = model_config(r, tokenizer)
    # A dry run plans for the recipe's device even on a machine without it.
    planned = torch.device("cuda") if r.engine.device == "cuda" and dry_run else resolve_device(r.engine.device)
    plan = build_plan(r, config, planned)
    device = planned
    if dry_run:
        print("# resolved recipe")
        print(render_yaml(r))
        print(plan.render())
        return 0
    from megatrain_cli.engine.plan import preflight

    problems = preflight(plan, device=device, device_budget=device_budget(r, device))
    if problems and not force:
        raise TrainingError("the run would not fit:\n  " + "\n  ".join(problems) +
                            "\n(--force runs it anyway)", 3)
    return _loop(r, device, tokenizer, config, plan)


def _loop(r: Recipe, device, tokenizer, config, plan) -> int:
    from megatrain_cli.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from megatrain_cli.dashboard import Dashboard
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.engine.plan import kept_block_ids
    from megatrain_cli.engine.schedule import blocks
    from megatrain_cli.engine.step import Engine
    from megatrain_cli.metrics import JsonlLog
    from megatrain_cli.models.loader import build_store
    from megatrain_cli.optim.cpu_adamw import lr_at
    from megatrain_cli.step_metrics import step_metrics

    out = Path(r.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "recipe.yaml").write_text(render_yaml(r))
    t, e = r.train, r.engine
    examples = load_examples(r.data)
    train_ex, _ = split_examples(examples, r.data)
    data = build_train_data(train_ex, tokenizer, r.data, t.seq_len, t.seed)
    total = t.steps if t.steps is not None else max(1, round(t.epochs * data.steps_per_epoch(t.micro_batch_size,
                                                                                              t.grad_accum)))
    store = build_store(config, DTYPES[r.model.dtype], weights_path=r.model.path, seed=r.model.seed)
    engine = Engine(store, t, device=device, checkpoint_interval=e.checkpoint_interval,
                    loss_chunk_tokens=e.loss_chunk_tokens, grad_slabs=e.grad_slabs,
                    double_buffer=e.double_buffer, overlap_optimizer=e.overlap_optimizer and device.type == "cuda",
                    speculate=e.speculate_optimizer,
                    keep_blocks=kept_block_ids(len(blocks(config.num_hidden_layers, e.checkpoint_interval)),
                                               plan.keep_blocks))
    start, skipped = 0, 0
    resume = r.checkpoint.resume
    ckpt = latest_checkpoint(out) if resume == "auto" else (Path(resume) if resume else None)
    if resume not in (None, "auto") and not Path(resume).is_dir():
        raise TrainingError(f"checkpoint.resume: no checkpoint at {resume}", 2)
    if ckpt is not None:
        state = load_checkpoint(store, ckpt)
        start, skipped = int(state["step"]), int(state.get("skipped_steps", 0))
        data.load_state_dict(state["data"])
        print(f"resumed from {ckpt} at step {start}", file=sys.stderr)

    stop = {"signal": None}

    def on_signal(signum, _frame):  # finish the step in flight, checkpoint, exit
        stop["signal"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}

    def checkpoint(step: int) -> None:
        engine.synchronize()  # pending host updates land before the masters are read
        save_checkpoint(store, out, step, {"step": step, "skipped_steps": skipped, "data": data.state_dict()},
                        keep_last_n=r.checkpoint.keep_last_n, tokenizer=tokenizer)

    jsonl = JsonlLog(out / "metrics.jsonl") if r.logging.jsonl else None
    code = 0
    try:
        with Dashboard(r.logging.dashboard, total_steps=total, title=f"megatrain {r.output_dir}") as dash:
            dash.log(f"{store.num_params() / 1e6:.1f} M params on {device.type}, {total} steps, "
                     f"{data.num_rows} rows of {t.seq_len} tokens, host state "
                     f"{store.host_bytes() / 2**30:.2f} GiB")
            t_run = time.perf_counter()
            for step in range(start, total):
                t0 = time.perf_counter()
                mbs = data.next_step(t.micro_batch_size, t.grad_accum)
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
                if stop["signal"] is not None or (every and (step + 1) % every == 0 and step + 1 < total):
                    checkpoint(step + 1)
                if stop["signal"] is not None:
                    dash.log(f"stopped by signal {stop['signal']} after step {step + 1}; checkpoint written")
                    code = 130 if stop["signal"] == signal.SIGINT else 0
                    return code
            engine.synchronize()
            if r.checkpoint.every_n_steps:
                checkpoint(total)
            if r.checkpoint.export_final:
                from megatrain_cli.export import export_hf

                final = export_hf(store, out / "final", dtype=DTYPES[r.model.dtype], tokenizer=tokenizer)
                dash.log(f"wrote {final}")
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        engine.close()
        if jsonl:
            jsonl.close()
    if r.eval.enabled and r.checkpoint.export_final:
        from megatrain_cli.eval.run import run_eval

        run_eval(str(out / "final"), r.data.source, split="test", limit=r.eval.limit,
                 batch_size=r.eval.batch_size, max_new_tokens=r.eval.max_new_tokens, output_dir=str(out / "eval"),
                 device=device.type, data_cfg=r.data)
    return code
