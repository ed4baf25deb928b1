"""The dry-run table of issue #34: host bytes per parameter and host GiB, per model, at each optimizer-state
setting (train.master_weights x train.optimizer_state), from the planner's own figures (engine/plan/memory.py
make_plan: what `megatrain plan` and `train --dry-run` print), with the checkpoint size beside them.

Run:  python scripts/state_bytes_table.py > table.md     (CPU, seconds: shapes only, nothing allocated)

Figures: bf16 compute, micro-batch 4 x 4096 tokens, grad accumulation 1, 12 gradient slabs (the qwen*.yaml
recipes' engine settings). "tiles": the pageable host store; "all": tiles + pinned staging and gradient
slabs, the figure `--dry-run` prints as "host bytes per parameter, all state". Disk: no tier yet (#34 part 2).
"""

from __future__ import annotations

import torch

from megatrain_cli.checkpoint.layout import checkpoint_bytes
from megatrain_cli.engine.plan.memory import make_plan
from megatrain_cli.models.adapter import ModelAdapter
from megatrain_cli.presets import PRESETS
from megatrain_cli.store.tiles import MASTER_DTYPES, HostStore

MODELS = ["7b", "14b", "32b", "72b", "gpt-oss-120b", "qwen3-235b-a22b"]
SETTINGS = [("fp32", "fp32"), ("bf16", "fp32"), ("fp32", "bf16"), ("bf16", "bf16"), ("fp32", "int8"),
            ("bf16", "int8")]
GiB = 2**30


def row(name: str, master: str, moments: str) -> str:
    adapter = ModelAdapter(PRESETS[name].hf_config())
    plan = make_plan(adapter, torch.bfloat16, micro_batch_size=4, seq_len=4096, grad_accum=1, checkpoint_interval=4,
                     grad_slabs=12, master_dtype=MASTER_DTYPES[master], moments=moments, device_figures=False)
    n = plan.params
    everything = plan.host_total + plan.pinned_total
    disk = checkpoint_bytes(HostStore(adapter, torch.bfloat16, allocate=False, master_dtype=MASTER_DTYPES[master]))
    return (f"| {name} | {n / 1e9:.1f} B | {master} | {moments} | {plan.host_total / n:.2f} | {everything / n:.2f} | "
            f"{everything / GiB:,.0f} | {disk / GiB:,.0f} |")


def main() -> None:
    print("| model | params | master_weights | optimizer_state | host B/param (tiles) | host B/param (all) "
          "| host GiB (all) | checkpoint GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in MODELS:
        for master, moments in SETTINGS:
            print(row(name, master, moments))


if __name__ == "__main__":
    main()
