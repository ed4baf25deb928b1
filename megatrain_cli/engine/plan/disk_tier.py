"""The disk tier in the plan (store.disk, store.disk_state; store/disk.py): which state goes to disk when
store.disk_state is 'auto', what a step reads and writes there, and the disk time against a quick probe of the
folder, which bounds the step from below (the tier's threads overlap it with the GPU; they cannot make it
shorter). docs/precision.md ("The disk tier") has the design and its costs.
"""

from __future__ import annotations

from megatrain_cli.engine.plan.memory import GiB, MemoryPlan, host_problems, make_plan

ORDER = (None, "moments", "moments+masters")  # 'auto' takes the first that fits the host


def choose_disk_state(r, plan_args: dict, check_host: bool) -> tuple[str | None, str]:
    """(what the disk tier holds, a note for the path line). 'auto' (engine.memory_fallback on, store.disk set,
    the host checked): nothing while the host holds every tile, else the least state on disk that fits it."""
    st = r.store
    if st.disk is None:
        return None, ""
    if st.disk_state != "auto":
        return st.disk_state, ""
    if not r.engine.memory_fallback or not check_host:
        why = "engine.memory_fallback is off" if check_host else "the host is not checked with the store built"
        return None, f"store.disk_state auto: nothing on disk ({why})"
    for state in ORDER:
        if not host_problems(make_plan(**plan_args, disk_state=state, device_figures=False)):
            if state is None:
                return None, "store.disk_state auto: nothing on disk (the host holds every tile)"
            return state, (f"store.disk_state auto -> {state}: the host cannot hold every tile, engine.memory_fallback "
                           f"puts the {state} in the disk tier at {st.disk}")
    return ORDER[-1], f"store.disk_state auto -> {ORDER[-1]}: the host is short even so"


def traffic(memory: MemoryPlan, state: str | None) -> tuple[int, int]:
    """(bytes read, bytes written) on the disk per step: every tile's state read ahead of its update and written
    behind it; with masters on disk, every layer transfer reads them again (through the page cache, which the
    write-behind emptied)."""
    if not state:
        return 0, 0
    total = memory.disk_total
    masters = sum(v for k, v in memory.disk.items() if "master" in k)
    return int(total + masters * memory.h2d_per_layer), total


def report(memory: MemoryPlan, state: str | None, folder: str | None, predicted_s: float | None,
           rates: tuple[float, float] | None = None) -> tuple[list[str], float | None]:
    """The lines `train --dry-run`, a run's start and `megatrain plan` print about the tier, and the step it
    allows: max(the predicted step, the disk's time), None without a predicted step. `rates`: (write, read)
    bytes/s measured (store/disk.measure of `folder` when None)."""
    if not state:
        return [], predicted_s
    from megatrain_cli.store.disk import measure

    read, write = traffic(memory, state)
    write_bps, read_bps = rates if rates is not None else measure(folder)
    disk_s = read / read_bps + write / write_bps  # one device, both directions: their times add up
    n = memory.params
    lines = [f"disk tier: store.disk_state={state} at {folder}: {memory.disk_total / GiB:.1f} GiB on disk "
             f"({memory.disk_total / n:.2f} bytes/param), host {(memory.host_total + memory.pinned_total) / n:.2f} "
             f"bytes/param",
             f"disk tier: per step {read / GiB:.1f} GiB read + {write / GiB:.1f} GiB written; this folder measured "
             f"{read_bps / GiB:.2f} GiB/s read, {write_bps / GiB:.2f} GiB/s write (a quick probe): at least "
             f"{disk_s:.2f} s/step of disk I/O"]
    if predicted_s is None:
        return lines, None
    step = max(predicted_s, disk_s)
    need = (read + write) / predicted_s
    verdict = ("the disk keeps up" if disk_s <= predicted_s else
               f"the disk is the bottleneck: about {step:.2f} s/step")
    lines.append(f"disk tier: the predicted {predicted_s:.3f} s/step needs {need / GiB:.2f} GiB/s of disk I/O; "
                 f"{verdict}")
    return lines, step
