"""The dry-run table of issue #34: host bytes per parameter and host GiB, per model, at each optimizer-state
setting (train.master_weights x train.optimizer_state) and with the disk tier (store.disk_state), from the
planner's own figures (engine/plan/memory.py make_plan: what `megatrain plan` and `train --dry-run` print),
with the tier's disk bytes and the checkpoint size beside them.

Run:  python scripts/state_bytes_table.py > table.md     (CPU, seconds: shapes only, nothing allocated)

Figures: bf16 compute, micro-batch 4 x 4096 tokens, grad accumulation 1, 12 gradient slabs (the qwen*.yaml
recipes' engine settings). "tiles": the pageable host store; "all": tiles + pinned staging and gradient
slabs, the figure `--dry-run` prints as "host bytes per parameter, all state". "disk": the tier's files under
store.disk (scratch, beside the checkpoints).
"""

from __future__ import annotations

import torch

from megatrain_cli.checkpoint.layout import checkpoint_bytes
from megatrain_cli.engine.plan.memory import make_plan
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.presets import PRESETS
from megatrain_cli.store.tiles import MASTER_DTYPES, HostStore

MODELS = ["7b", "14b", "32b", "72b", "gpt-oss-120b", "qwen3-235b-a22b"]
SETTINGS = [("fp32", "fp32", None), ("bf16", "fp32", None), ("fp32", "bf16", None), ("bf16", "bf16", None),
            ("fp32", "int8", None), ("bf16", "int8", None), ("fp32", "fp32", "moments"), ("bf16", "int8", "moments"),
            ("fp32", "fp32", "moments+masters"), ("bf16", "int8", "moments+masters")]
GiB = 2**30


def row(name: str, master: str, moments: str, disk_state: str | None) -> str:
    adapter = ModelAdapter(PRESETS[name].hf_config())
    plan = make_plan(adapter, torch.bfloat16, micro_batch_size=4, seq_len=4096, grad_accum=1, checkpoint_interval=4,
                     grad_slabs=12, master_dtype=MASTER_DTYPES[master], moments=moments, device_figures=False,
                     disk_state=disk_state)
    n = plan.params
    everything = plan.host_total + plan.pinned_total
    ckpt = checkpoint_bytes(HostStore(adapter, torch.bfloat16, allocate=False, master_dtype=MASTER_DTYPES[master]))
    return (f"| {name} | {n / 1e9:.1f} B | {master} | {moments} | {disk_state or '-'} | {plan.host_total / n:.2f} | "
            f"{everything / n:.2f} | {everything / GiB:,.0f} | {plan.disk_total / n:.2f} | {plan.disk_total / GiB:,.0f} "
            f"| {ckpt / GiB:,.0f} |")


def main() -> None:
    print("| model | params | master_weights | optimizer_state | store.disk_state | host B/param (tiles) "
          "| host B/param (all) | host GiB (all) | disk B/param | disk GiB | checkpoint GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in MODELS:
        for master, moments, disk_state in SETTINGS:
            print(row(name, master, moments, disk_state))


if __name__ == "__main__":
    main()
