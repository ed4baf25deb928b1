"""How a run fails: TrainingError carries its exit code; a CUDA out-of-memory error becomes advice.

Exit codes (README's "Exit codes"; a requeue script tests them):

    0    done, or stopped by SIGTERM after a checkpoint
    1    training failed: NaN with nan_policy=stop, a diverged run (train/skips.py), CUDA out of memory, a
         checkpoint that could not be written (disk full: the previous checkpoint is intact), a rank that failed
    2    bad input: recipe, paths, data, a checkpoint that does not fit; output_dir in use by another run
    3    would not fit in memory
    75   preempted, resumable: SIGUSR1 or train.max_wall_time, after a checkpoint (EX_TEMPFAIL)
    130  interrupted by Ctrl-C (SIGINT) after a checkpoint
    128+S  `--gpus` launcher: a rank was killed by signal S (137: SIGKILL, e.g. the kernel's OOM killer)
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
EXIT_PREEMPTED = 75  # sysexits.h EX_TEMPFAIL: "try again later"; resume with checkpoint.resume=auto


class TrainingError(RuntimeError):
    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def tier_failure(err: BaseException) -> str | None:
    """The disk tier's own message where its I/O failure is what ended the step (it reaches the training thread
    wrapped by the host AdamW worker), else None."""
    from megatrain_cli.store.disk import TierError

    while err is not None:
        if isinstance(err, TierError):
            return str(err)
        err = err.__cause__
    return None


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
