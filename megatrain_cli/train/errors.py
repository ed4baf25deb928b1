"""How a run fails: TrainingError carries its exit code; a CUDA out-of-memory error becomes advice.

Exit codes: 0 done (or stopped by SIGTERM after a checkpoint), 1 training failed (NaN with
nan_policy=stop, CUDA out of memory), 2 bad input (recipe, paths, data), 3 would not fit in memory,
130 interrupted by Ctrl-C after a checkpoint.
"""

from __future__ import annotations


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
