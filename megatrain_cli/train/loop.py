"""The training loop, top to bottom: recipe -> plan -> model -> data -> engine -> metrics / checkpoints.

Exit codes (train/errors.py): 0 done or stopped by SIGTERM after a checkpoint, 1 training failed, 2 bad
input, 3 would not fit in memory, 75 preempted (SIGUSR1 or train.max_wall_time) after a checkpoint, 130
interrupted by Ctrl-C after a checkpoint. Stops: train/stop.py; resume: train/resume.py; the lock on
output_dir: train/lock.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from megatrain_cli.recipe import Recipe, render_yaml
from megatrain_cli.train.errors import TrainingError, out_of_memory_message, tier_failure
from megatrain_cli.train.predicted import against, data_images, describe, disk_lines, method_lines, prediction
from megatrain_cli.train.setup import DTYPES, build_engine, build_store, lean_allocator, resolve_device


def run_training(r: Recipe, *, dry_run: bool = False, force: bool = False, dist=None) -> int:
    """One run, or one rank's part of it (`dist`: a train.rank.RankSpec; train/launch.py starts the ranks).
    Errors come back as an exit code and a message on stderr, never a traceback."""
    try:
        return _train(r, dry_run=dry_run, force=force, dist=dist)
    except TrainingError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.code
    except torch.cuda.OutOfMemoryError as err:
        print(f"error: {out_of_memory_message(err)}", file=sys.stderr)
        return 1
    except ValueError as err:  # bad data, missing model path, unsupported architecture, bad checkpoint
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        if (tier := tier_failure(err)) is None:
            raise
        print(f"error: {tier}", file=sys.stderr)
        return 1


def _train(r: Recipe, *, dry_run: bool, force: bool, dist=None) -> int:
    from megatrain_cli.engine.plan.step_plan import plan_step
    from megatrain_cli.models.adapter import ModelAdapter
    from megatrain_cli.models.tokenizer import load_tokenizer
    from megatrain_cli.train import preflight

    # Every input first (model files, paths, data, eval settings): nothing is built or written before.
    preflight.check_inputs(r, dry_run=dry_run)
    tokenizer = load_tokenizer(r.model)
    config = preflight.read_model_config(r, tokenizer)
    # A dry run plans for the recipe's device even on a machine without it.
    device = torch.device("cuda") if r.engine.device == "cuda" and dry_run else resolve_device(r.engine.device)
    adapter = ModelAdapter(config)
    plan = plan_step(r, adapter, device, one_process=dist is None)
    # the step the planner predicts from this machine's cached probe (one process: ranks are not modelled)
    pred = prediction(r, adapter, device, plan, images=data_images(r, adapter) if dry_run else None) \
        if dist is None and not plan.problems else None  # the dry run reads a VLM's images as `plan` timed them
    preflight.check_tier_space(r, plan.memory.disk_total // (dist.world if dist is not None else 1))
    disk = preflight.run_disk_problem(r, config)
    if disk:
        plan.problems.append(disk)
    if dry_run:  # the verdict for this machine is the exit code: 0 fits, 3 will not fit
        print("# resolved recipe")
        print(render_yaml(r))
        print(plan.render())
        if dist is None and not plan.problems:
            print(describe(pred))
        for line in disk_lines(r, plan, pred):
            print(line)
        if r.train.method not in ("sft", "grpo"):
            print(method_lines(r, adapter, device, plan))
        if plan.problems:
            print("(`megatrain train --force` runs it anyway)")
        return 3 if plan.problems else 0
    pref = grpo = None
    if r.train.method == "grpo":  # the prompts read and the rewards imported before anything is written
        from megatrain_cli.train.grpo import prepare as prepare_grpo

        grpo = prepare_grpo(r, tokenizer, dist)
    elif r.train.method != "sft":  # the pairs read, checked and tokenised whole before anything is written
        from megatrain_cli.train.preference import prepare

        pref = prepare(r, tokenizer)
    if plan.problems and not force:
        raise TrainingError("the run would not fit:\n  " + "\n  ".join(plan.problems) +
                            "\n(--force runs it anyway)", 3)
    if dist is not None:
        from megatrain_cli.train.rank import start_rank

        dist = start_rank(dist, r, device, plan.lean)
    return _loop(r, device, tokenizer, config, plan, dist=dist, pred=pred, pref=pref, grpo=grpo)


def _loop(r: Recipe, device, tokenizer, config, plan, dist=None, pred=None, pref=None, grpo=None) -> int:
    """The run itself, with output_dir locked by its lead process (train/lock.py): a second writer is
    refused, a crashed one's lock taken over."""
    from megatrain_cli.train.lock import OutputLock
    from megatrain_cli.train.stop import StopWatch

    lead = dist is None or dist.rank == 0  # the one process that prints, logs, exports and holds the lock
    watch = StopWatch(r.train.max_wall_time)  # a bad value is refused here, before anything is written
    out = Path(r.output_dir)
    # The data and the checkpoint to resume, each refused when it cannot be right: before anything is written.
    data, held_out, total, candidates = _inputs(r, tokenizer, dist, lead, out, pref, grpo)
    # priced by its rows' documents, and a VLM's tower by its rows' images (data/image_rows.py)
    images = data.probe_images(r.train.micro_batch_size) if hasattr(data, "probe_images") else None
    if pred is not None and (r.data.packing or images) and pref is None and grpo is None:
        from megatrain_cli.engine.plan.probe import docs_per_row
        from megatrain_cli.models.adapter import ModelAdapter

        docs = docs_per_row(data.attention_pairs_per_row(), r.train.seq_len) if r.data.packing else None
        pred = prediction(r, ModelAdapter(config), device, plan, docs=docs, images=images)
    made = [d for d in (out, *out.parents) if not d.exists()]  # removed again if the run writes nothing
    out.mkdir(parents=True, exist_ok=True)
    lock, problem = OutputLock(out), None
    if lead:
        try:
            lock.acquire()
        except TrainingError as err:
            problem = str(err)
    if dist is not None:  # every rank stops when rank 0 cannot take the lock, none waits for it
        from megatrain_cli.train.rank import gather_problems

        problems = gather_problems(dist, problem)
        problem = problems[0].removeprefix("rank 0: ") if problems else None
    try:
        if problem:
            raise TrainingError(problem, 2)
        return _run(r, device, config, plan, dist, lead, out, watch, pred, tokenizer, data, held_out, total,
                    candidates, pref, grpo)
    finally:
        lock.release()
        for d in made:  # the folders this run made, when it wrote nothing in them (a refusal): gone again
            try:
                d.rmdir()
            except OSError:
                break


def _inputs(r: Recipe, tokenizer, dist, lead: bool, out: Path, pref=None, grpo=None):
    """(training rows, held-out rows or None, the run's last step, the checkpoints to resume from): read
    and checked before output_dir is touched. What the data leaves out (nothing to learn) is said here."""
    from megatrain_cli.train import resume

    t = r.train
    if pref is not None:  # a preference method's pairs, read and checked by train/preference.py
        data, held_out = pref.data, None
    elif grpo is not None:  # GRPO's rows are its rollouts, sampled step by step (train/grpo.py)
        data, held_out = grpo, None
    else:
        data, held_out = _supervised(r, tokenizer, dist, lead)
    total = t.steps if t.steps is not None else max(1, round(t.epochs * data.steps_per_epoch(t.micro_batch_size,
                                                                                              t.grad_accum)))
    total_text = f"train.steps={t.steps}" if t.steps is not None else f"train.epochs={t.epochs}"
    candidates = resume.choose(r.checkpoint.resume, out, total, total_text, lead, t.master_weights)
    return data, held_out, total, candidates


def _supervised(r: Recipe, tokenizer, dist, lead: bool):
    """(training rows, held-out rows or None) of a supervised run; what the data leaves out is said here."""
    from megatrain_cli.data import build_train_data, load_examples, split_examples
    from megatrain_cli.data.load import source_label
    from megatrain_cli.data.train_data import left_out_report
    from megatrain_cli.train.validation import HeldOut

    t = r.train
    examples = load_examples(r.data)
    train_ex, test_ex = split_examples(examples, r.data)
    if any(ex.images for ex in examples):  # a VLM's chats with images: through its processor
        from megatrain_cli.data.image_rows import build_image_data
        from megatrain_cli.models.processor import load_processor
        from megatrain_cli.train.preflight import check_images_fit_model

        check_images_fit_model(r, examples)  # the preflight saw only a sample when eval is off: all of it here
        processor = load_processor(r.model.tokenizer or r.model.path, r.model.trust_remote_code)
        data = build_image_data(train_ex, processor, r.data, t.seq_len, t.seed)
    else:
        data = build_train_data(train_ex, tokenizer, r.data, t.seq_len, t.seed)
    if lead and (data.left_out or data.truncated):
        what = [left_out_report(data.left_out, len(train_ex), source_label(r.data))] if data.left_out else []
        if data.truncated:
            what.append(f"{data.truncated} cut at train.seq_len={t.seq_len} (the end of their reply is lost)")
        print(f"data: {'; '.join(what)}", file=sys.stderr)
    return data, HeldOut.build(r, test_ex, tokenizer, dist)  # held out: None unless eval.every_n_steps is set


def _run(r: Recipe, device, config, plan, dist, lead: bool, out: Path, watch, pred, tokenizer, data, held_out,
         total: int, candidates, pref=None, grpo=None) -> int:
    from megatrain_cli.checkpoint import CheckpointWriteError, save_checkpoint
    from megatrain_cli.dashboard import Dashboard
    from megatrain_cli.metrics.flops import attention_pairs
    from megatrain_cli.metrics.step import step_metrics
    from megatrain_cli.optim.host_adamw import lr_at
    from megatrain_cli.recipe.load import to_dict
    from megatrain_cli.train import host_kernel, resume, stop
    from megatrain_cli.train.sinks import open_sinks
    from megatrain_cli.train.skips import SkipCount
    from megatrain_cli.train.validation import due

    t = r.train
    long_ctx = plan.lean
    if long_ctx is not None:
        lean_allocator(device)
    host_kernel.prepare(r.engine.host_adamw, log=(lambda line: print(line, file=sys.stderr)) if lead else
                        (lambda _line: None))
    store = build_store(r, config, dist, plan.disk_state)
    saved = tokenizer  # what checkpoints and the export write beside the weights: a VLM's processor files too
    if store.adapter.vision is not None:
        from megatrain_cli.models.processor import load_processor

        saved = load_processor(r.model.tokenizer or r.model.path, r.model.trust_remote_code)
    method = pref.method if pref is not None else grpo.method if grpo is not None else None
    engine = build_engine(r, store, plan, device, dist, method=method)
    if grpo is not None:  # the sampler, and the initial weights' copy for the KL term: before a resume loads
        grpo.bind(engine, store, device, tokenizer, lambda m: print(m, file=sys.stderr) if lead else None, plan)
    # Pin the offloaded checkpoints' host buffers now, not inside the first forward (0 on CPU).
    pinned = engine.reserve_checkpoint_buffers([(t.micro_batch_size, t.seq_len)] * t.grad_accum)
    if pref is not None:  # over the initial weights: before a resume loads a checkpoint
        from megatrain_cli.train.preference import score_reference

        with Dashboard(r.logging.dashboard if lead else "off", title=f"megatrain {r.output_dir}") as view:
            if dist is None:  # the predicted time of the pass (one process: ranks are not modelled)
                from megatrain_cli.models.adapter import ModelAdapter

                view.log(method_lines(r, ModelAdapter(config), device, plan, rows=data.num_rows))
            score_reference(pref, r, engine, tokenizer, config, dist, lambda m: _say(view, lead, m), view.progress)
    start, skips = 0, SkipCount(r, out)
    found = resume.load(store, candidates, auto=r.checkpoint.resume == "auto", dist=dist, lead=lead)
    if found is not None:
        ckpt, state = found
        start, skips.skipped = int(state["step"]), int(state.get("skipped_steps", 0))
        data.load_state_dict(state["data"])
        note = resume.rounding_note(state, t.master_weights, t.master_rounding)
        if lead:
            print(f"resumed from {ckpt} at step {start}" + (f"\n{note}" if note else ""), file=sys.stderr)

    def checkpoint(step: int) -> None:
        engine.synchronize()  # pending host updates land before the masters are read
        if dist is not None:
            from megatrain_cli.checkpoint import save_sharded_checkpoint as save
        else:
            save = save_checkpoint
        try:
            save(store, out, step, {"step": step, "skipped_steps": skips.skipped, "data": data.state_dict(),
                                    "master_rounding": t.master_rounding},
                 keep_last_n=r.checkpoint.keep_last_n, tokenizer=saved, source_dir=r.model.path)
        except CheckpointWriteError as err:  # disk full: nothing partial left, the previous one intact
            raise TrainingError(str(err), 1) from None

    code = 0
    logs = []
    try:
        # metrics.jsonl, TensorBoard, W&B, MLflow: each gets every logged step's record (train/sinks.py).
        logs = open_sinks(r.logging, out, start=start, config=to_dict(r)) if lead else []
        if lead:  # last of what may refuse the run (the resume read, the sinks): a refused run writes nothing
            (out / "recipe.yaml").write_text(render_yaml(r))
        with stop.watching(), Dashboard(r.logging.dashboard if lead else "off", total_steps=total,
                                        title=f"megatrain {r.output_dir}",
                                        val_every=held_out.every if held_out else
                                        r.eval.every_n_steps if pref is not None and pref.held_out else None,
                                        preference=pref is not None) as dash:
            dash.log(f"{store.num_params() / 1e6:.1f} M params on {device.type}, {total} steps, "
                     f"{data.num_rows} rows of {t.seq_len} tokens, host state "
                     f"{store.host_bytes() / 2**30:.2f} GiB" + (f", {store.disk_bytes() / 2**30:.2f} GiB in the disk tier "
                                                               f"(store.disk_state={plan.disk_state})"
                                                               if plan.disk_state else ""))
            if held_out is not None:
                dash.log(f"validation loss every {held_out.every} steps and after the last, on {held_out.rows} "
                         f"held-out rows of {t.seq_len} tokens")
            if pref is not None:
                dash.log(pref.describe(t.seq_len, r.data.packing))
            if grpo is not None:
                dash.log(grpo.describe())
                grpo.log = lambda m: _say(dash, lead, m)
            if dist is None:
                dash.log(describe(pred))
            if long_ctx is not None:
                dash.log(f"{long_ctx.label} path: {long_ctx.offloaded_checkpoints} of {long_ctx.num_checkpoints} "
                         f"checkpoints in host memory ({pinned / 2**30:.2f} GiB pinned), predicted device peak "
                         f"{long_ctx.predicted_peak / 2**30:.2f} GiB"
                         + (f"; {long_ctx.recompute_choice()}" if long_ctx.dropped_checkpoints else ""))
            t_run = time.perf_counter()
            for step in range(start, total):
                t0 = time.perf_counter()
                mbs = data.next_step(t.micro_batch_size, t.grad_accum)
                attended = attention_pairs(mbs)  # the global batch's documents: model TFLOPS count within them
                if dist is not None:  # every rank draws the global batch and keeps its share
                    from megatrain_cli.engine.dist import split_micro_batches

                    mbs = split_micro_batches(mbs, dist.rank, dist.world)
                if pref is not None:
                    pref.attach(mbs)  # each micro-batch's share of the reference's scores
                lr = lr_at(step, t, total)
                res = engine.step(mbs, lr)
                if grpo is not None:  # rollout figures and the step's split (generate / score / train)
                    res.metrics.update(grpo.step_metrics(res))
                skips.count(step, res.skipped, res.loss, res.grad_norm)  # a diverged run stops here (exit 1)
                validate = held_out is not None and held_out.due(step + 1, total) or \
                    pref is not None and pref.held_out is not None and due(r.eval.every_n_steps, step + 1, total)
                if (step + 1) % r.logging.every_n_steps == 0 or step + 1 == total or validate:
                    m = step_metrics(res, engine=engine, step=step, total=total, lr=lr, skipped=skips.skipped,
                                     step_time=time.perf_counter() - t0, seq_len=t.seq_len, attended=attended,
                                     eta=(time.perf_counter() - t_run) / (step + 1 - start) * (total - step - 1))
                    if validate and pref is not None:  # the first eval.val_batches micro-batches' pairs
                        from megatrain_cli.train.preference import evaluate

                        m.val_loss, m.val_preference = evaluate(pref, r, engine, dist,
                                                                r.eval.val_batches * t.micro_batch_size)
                    elif validate:  # after the step's figures: the pass neither counts in them nor changes them
                        m.val_loss = held_out.loss(engine)
                    dash.update(m)
                    for log in logs:
                        log.write(m)
                every = r.checkpoint.every_n_steps
                reason = watch.reason()
                if dist is not None:  # a signal or the clock of any rank stops them all after the same step
                    from megatrain_cli.train.rank import agree_on_stop

                    reason = agree_on_stop(dist, reason)
                if reason is not None or (every and (step + 1) % every == 0 and step + 1 < total):
                    checkpoint(step + 1)
                if reason is not None:
                    code = stop.exit_code(reason)
                    _say(dash, lead, f"stopped by {stop.describe(reason, t.max_wall_time)} after step {step + 1}: "
                                     f"checkpoint step_{step + 1} written, exit code {code}; resume with "
                                     "checkpoint.resume=auto")
                    return code
            engine.synchronize()
            line = against(pred, (time.perf_counter() - t_run) / max(1, total - start), total - start)
            if line:  # wall time per step, logging and checkpoints included: what the run cost
                dash.log(line)
            if start < total:  # the run's end is resumable too (every_n_steps or not): export and resume read it
                checkpoint(total)
            _export_final(r, store, out, dist, saved, dash, total)
            if pref is not None and r.eval.enabled:  # the held-out pairs, every one, with the final weights
                from megatrain_cli.train.preference import evaluate, metrics_line, write_results

                loss, metrics = evaluate(pref, r, engine, dist)
                where = write_results(out, r.train.method, loss, metrics, pref.held_out.num_units) if lead else ""
                dash.log(f"held-out {pref.held_out.num_units} {'pairs' if pref.method.paired else 'examples'} "
                         f"after step {total}: {metrics_line(loss, metrics)} ({where})")
    finally:
        engine.close()
        store.close()  # the disk tier's threads (store.disk); its files went when they were mapped
        if grpo is not None:
            grpo.close()
        for log in logs:
            log.close()
    if r.eval.enabled and r.checkpoint.export_final and lead and pref is None:
        from megatrain_cli.eval.run import run_eval

        # The engine's device buffers and the host store go first: eval's 'auto' mode measures free
        # device memory to choose resident or streamed generation, and loads final/ itself.
        del engine, store
        if device.type == "cuda":
            torch.cuda.empty_cache()

        run_eval(r, str(out / "final"), split="test", output_dir=out / "eval")  # as `megatrain eval` runs it
    return code


def _say(dash, lead: bool, message: str) -> None:
    """A line on the dashboard, or on stderr when it is off (a requeue script's log still gets it)."""
    if lead and dash.mode == "off":
        print(message, file=sys.stderr)
    dash.log(message)


def _export_final(r: Recipe, store, out: Path, dist, tokenizer, dash, total: int) -> None:
    """final/ in Hugging Face format (rank 0 writes it, gathered from every rank). A write that fails (a full
    disk) is exit 1, with the complete step_{total} checkpoint left for `megatrain export`."""
    if not r.checkpoint.export_final:
        return
    from megatrain_cli.checkpoint import export_hf, export_sharded

    try:
        if dist is not None:
            final = export_sharded(store, out / "final", dtype=DTYPES[r.model.dtype], tokenizer=tokenizer,
                                   source_dir=r.model.path)
        else:
            final = export_hf(store, out / "final", dtype=DTYPES[r.model.dtype], tokenizer=tokenizer,
                              source_dir=r.model.path)
    except OSError as err:
        raise TrainingError(f"writing {out / 'final'} failed: {err}. The checkpoint {out / f'step_{total}'} is "
                            f"complete: `megatrain export {out / f'step_{total}'} DIR` writes it later", 1) from None
    if final is not None:
        dash.log(f"wrote {final}")
