"""Where a run starts (checkpoint.resume), said out loud and refused when it cannot be right.

    checkpoint.resume    candidates                                  a damaged one
    null                 none: step 0                                -
    a path               that checkpoint                             refused (exit 2)
    auto                 output_dir's step_* dirs, newest first      passed over, and stderr says which,
                                                                     why, and which one the run resumes from;
                                                                     none usable: refused (exit 2)

Decided before anything is built or written (choose: manifests and file sizes, stats only): a checkpoint
past the run's last step is refused, since resuming it would label later weights with an earlier step and
rotate the later checkpoint away. A checkpoint whose data turns out corrupted when read (load) is passed
over by auto too; ranks read different files, so they decide together (train/rank.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from megatrain_cli.checkpoint import (CheckpointError, CheckpointSettingError, checkpoint_step,
                                     checkpoints_newest_first, load_checkpoint)
from megatrain_cli.checkpoint.layout import sound_one_before
from megatrain_cli.train.errors import EXIT_BAD_INPUT, TrainingError


def choose(resume: str | None, out: Path, total: int, total_text: str, lead: bool,
           master_weights: str | None = None) -> list[Path]:
    """The checkpoints to try, in order (empty: start at step 0). `master_weights`: the run's
    train.master_weights; a first candidate written with the other one is refused here, before the store is
    built (load refuses it too)."""
    if resume is None:
        return []
    if resume != "auto":
        if not Path(resume).is_dir():
            raise TrainingError(f"checkpoint.resume: no checkpoint at {resume}", EXIT_BAD_INPUT)
        candidates = [Path(resume)]
        step = checkpoint_step(resume)  # an incomplete one: CheckpointError, exit 2
    else:
        found = checkpoints_newest_first(out)
        candidates = [p for p, problem in found if problem is None]
        for path, problem in found:
            if problem is None:
                break
            if lead:
                print(f"checkpoint.resume=auto: {path.name} is damaged ({problem}); passing over it",
                      file=sys.stderr)
        if not candidates:
            if found:
                raise TrainingError(_none_usable(out, [(p.name, why) for p, why in found]), EXIT_BAD_INPUT)
            return []
        step = checkpoint_step(candidates[0])
    if step > total:
        raise TrainingError(f"{candidates[0]} is at step {step}, past the run's last step {total} ({total_text}): "
                            f"resuming would label later weights as step {total} and rotate {candidates[0].name} "
                            f"away. Set train.steps to more than {step} to train on, or start over in another "
                            "output_dir. Nothing was written", EXIT_BAD_INPUT)
    if master_weights is not None:
        from megatrain_cli.checkpoint.layout import read_manifest

        written = read_manifest(candidates[0]).get("master_weights", "fp32")
        if written != master_weights:
            raise TrainingError(f"{candidates[0]} was written with train.master_weights={written}, this run has "
                                f"train.master_weights={master_weights}: resume with train.master_weights={written}, "
                                "or export it and start a new run from the export. Nothing was written",
                                EXIT_BAD_INPUT)
    return candidates


def load(store, candidates: list[Path], *, auto: bool, dist, lead: bool) -> tuple[Path, dict] | None:
    """Read the first candidate every rank can read into `store`; its (path, trainer state), or None when there
    are no candidates. A candidate that fails passes to the next under auto (the next load overwrites every
    section the failed one touched); otherwise the error stands."""
    tried = []
    for path in candidates:
        try:
            state, problem = load_checkpoint(store, path), None
        except CheckpointSettingError as e:  # sound, but not for this run's settings: refused, never passed over
            raise TrainingError(str(e), EXIT_BAD_INPUT) from None
        except CheckpointError as e:
            state, problem = None, str(e)
        problems = [problem] if problem else []
        if dist is not None:
            from megatrain_cli.train.rank import gather_problems

            problems = gather_problems(dist, problem)
        if not problems:
            return path, state
        if not auto:
            before = sound_one_before(path)
            raise TrainingError(f"checkpoint.resume: {path} is damaged ({'; '.join(problems)})"
                                f"{f'; {before} is the newest sound one before it' if before else ''}. Nothing was "
                                "written", EXIT_BAD_INPUT)
        tried.append((path.name, "; ".join(problems)))
        if lead:
            print(f"checkpoint.resume=auto: {path.name} is damaged ({tried[-1][1]}); passing over it",
                  file=sys.stderr)
    if tried:
        raise TrainingError(_none_usable(candidates[0].parent, tried), EXIT_BAD_INPUT)
    return None


def _none_usable(out: Path, damaged: list[tuple[str, str]]) -> str:
    listing = "; ".join(f"{name}: {why}" for name, why in damaged)
    return (f"checkpoint.resume=auto: no usable checkpoint in {out} ({listing}). Move them away to start over, "
            "or set checkpoint.resume=null")


def rounding_note(state: dict, master_weights: str, master_rounding: str) -> str | None:
    """What a resume says when its bf16 masters are now rounded otherwise than when the checkpoint was written
    (train.master_rounding; a trainer state that names none was written before stochastic became the default,
    under round to nearest). The resume works either way (the rounding's bits are a stateless hash); the run
    only continues differently from the one that wrote the checkpoint. None: nothing to say."""
    if master_weights != "bf16":
        return None
    written = state.get("master_rounding", "nearest")
    if written == master_rounding:
        return None
    return (f"note: the checkpoint's bf16 masters were rounded with train.master_rounding={written}, this run "
            f"rounds them {master_rounding}; set train.master_rounding={written} to continue as that run would")
