"""The planner's model: from the probe's figures (probe.py) and a candidate plan, a predicted step time.

A step is three phases run back to back, plus what nothing overlaps. Inside a phase the GPU, the PCIe
link and the host work at once (engine/transfer/cuda.py: three streams, a packer thread; optim/worker.py:
host AdamW in its own thread), so a phase lasts as long as its slowest resource:

    forward   each streamed layer: max(GPU forward, the packer's work on it, its H2D); a resident layer:
              its GPU forward. After a clipped step the packer applies the tile's deferred weights update
              as it streams it (update on read: 20 B/param of host traffic instead of the 6 of a cast):
              the host update must finish before the forward reads the tile.
    head      max(GPU head, the head tile's packer work, its H2D)
    backward  max(GPU recompute + backward (+ the resident layers' device AdamW), PCIe re-streams and
              gradient D2H (each way at the duplex rate), host: re-stream casts, gradient landing and the
              AdamW work of this phase: the deferred moments pass after a clipped step, the whole update
              of each tile as it lands when the step is not clipped (speculation))
    serial    the embedding's update before the next forward gathers its rows; without the optimizer
              thread (overlap_optimizer off, or on the CPU) every update, after the backward
    vision    a VLM's tower (its streamed layers' forward, recompute + backward, updates): vision_terms.py

GPU times come from the probe's timing of the engine's own ops (engine/layer_probe.py), per micro-batch times
micro-batches: a streamed layer's forward, a recorded forward (each recomputed layer's, and a kept block's
forward), each layer's backward, the head, and the step's fixed work (inputs, embedding backward; counted in
the backward). A timing without a head figure (older caches) takes the head from the layer's FLOP rate over
6 x vocab x hidden x tokens. PCIe: weights cross
at the compute dtype's width per parameter per transfer (schedule.transfers_per_layer: forward, recompute,
and again for a backward whose weights left the slots), gradients once. Host work is bytes per parameter
over the host bandwidth the AdamW pass reached in the probe (while the DMA engines were busy where they are
in the phase). docs/planner.md lists what the model leaves out.

Resident layers (engine.resident_layers, N; engine/resident.py): their master, moments, weights and gradient
live on the GPU and are updated there: no H2D, no D2H, no host work. They are the FIRST N layers
(`resident_ids`), as the engine keeps them.

`choose` enumerates candidates (checkpoint interval, kept blocks, resident layers) and asks the one planner
(step_plan.plan_step) whether each fits, on a copy of the recipe: the planner stays a black box.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megatrain_cli.engine.plan.lean_terms import checkpoint_bytes
from megatrain_cli.engine.plan.probe import LayerTiming, MachineFigures, coded_key, recipe_shape
from megatrain_cli.engine.plan.vision_terms import PerParam, TowerFigures, frozen_of, tower_phase
from megatrain_cli.engine.schedule import blocks, build_schedule, transfers_per_layer
from megatrain_cli.store.moments import moment_bytes_per_param
from megatrain_cli.store.tiles import HostStore

GiB = 2**30
# Host memory traffic per parameter of each host pass (optim/adamw_cpp.py, engine/transfer/cuda.py).
CAST_B = 6  # the packer's cast: read fp32, write bf16
EMIT_B = 20  # update on read: read p, m, v, g; write p and the bf16 weights
WEIGHTS_B = 18  # the worker's deferred weights pass (read p, m, v, g; write p)
MOMENTS_B = 18  # its moments pass (read m, v, g; write m, v)
UPDATE_B = 26  # the whole update in one pass
LAND_B = 4  # the gradient lander: read the pinned slab, write the tile's gradient (bf16)
RESIDENT_UPDATE_B = 36  # device traffic of their AdamW: p, m, v read + written, the gradient widened through fp32
# scratch (read 2, write 4, read 4), the bf16 weights written
HEADROOM = 0.88  # as memory.choose_keep_blocks: room for the allocator's fragmentation and workspaces (short path)


@dataclass(frozen=True)
class Candidate:
    checkpoint_interval: int
    keep_blocks: int = 0
    resident_layers: int = 0
    path: str = "short"  # 'short' or the lean plan's ('long-context', 'memory-lean'): interval 1, offloads
    offloaded_checkpoints: int = 0
    rebuilt_checkpoints: int = 0  # a lean plan's dropped checkpoints: one more no-grad layer forward each


@dataclass
class ModelFigures:
    num_layers: int
    layer_params: float  # mean over the layers
    head_params: int  # the head tile (final norm + LM head, or only the norm when tied)
    embed_params: int
    lm_head_params: int  # vocab x hidden: what the head multiplies by, tied or not
    hidden: int
    width: int  # bytes per weight of the compute dtype (what crosses PCIe)
    tower: TowerFigures | None = None  # a VLM's vision tower (vision_terms.py); None: a text model

    @classmethod
    def of(cls, adapter, dtype: torch.dtype, frozen: frozenset = frozenset()) -> "ModelFigures":
        store = HostStore(adapter, dtype, allocate=False)
        layers = sum(store.layouts[n].numel for n in store.layer_names)
        return cls(adapter.num_layers, layers / adapter.num_layers, store.layouts["head"].numel,
                   store.layouts["embed"].numel, adapter.vocab_size * adapter.hidden_size, adapter.hidden_size,
                   torch.finfo(dtype).bits // 8, TowerFigures.of(adapter, store.layouts, frozen))


@dataclass(frozen=True)
class StepShape:
    micro_batch_size: int
    seq_len: int
    grad_accum: int = 1
    layer_slots: int = 2
    clipped: bool = True  # predict a step after a clipped one (deferred updates); False: speculation hits
    update_on_read: bool = True
    overlap_optimizer: bool = True
    device: str = "cuda"
    moments: str = "fp32"  # train.optimizer_state: bf16 / int8 moments update in one pass, never split
    masters: str = "fp32"  # fp32, or bf16-nearest / bf16-stochastic (train.master_weights, train.master_rounding)
    disk: bool = False  # a disk tier (store.disk): one pass per tile too, after the verdict (its I/O: disk_tier.py)


def state_update_bytes(moments: str) -> float:
    """Host traffic per parameter of the one-pass update over bf16 / int8 moments (adamw_state.cpp): read p, m,
    v, g, write p, m, v (fp32 masters, bf16 gradients). Used where the probe has no rate of the pass itself
    (MachineFigures.state_at): bytes alone miss the coding's arithmetic."""
    return 4 + 2 + 4 + 2 * moment_bytes_per_param(moments)


@dataclass
class Prediction:
    candidate: Candidate
    total: float | None  # seconds per step; None when a part is unknown
    phases: dict = field(default_factory=dict)  # forward, head, backward, serial; a VLM's vision (its tower's)
    parts: dict = field(default_factory=dict)  # gpu, pcie, host: each resource's busy seconds
    unknown: list = field(default_factory=list)  # what the probe could not measure here
    device_bytes: int = 0
    fits: bool = True
    problems: list = field(default_factory=list)
    # packed rows (data.packing): how the probe's layer timing priced their attention: 'within documents' (timed
    # at the rows' docs_per_row), 'as one document per row' (no such timing cached, or the data not read yet)
    packed: str = ""

    @property
    def lower_bound(self) -> float:
        """The total over the known parts (the table's '>=' when some are unknown)."""
        return sum(v for v in self.phases.values() if v is not None)


def resident_ids(num_layers: int, resident: int) -> frozenset[int]:
    return frozenset(range(min(max(0, resident), num_layers)))


def predict(fig: MachineFigures, layer: LayerTiming | None, model: ModelFigures, shape: StepShape,
            cand: Candidate) -> Prediction:
    """The predicted step of `cand` (module doc). Unknown probe figures make the parts that need them None."""
    L, P, A, w = model.num_layers, model.layer_params, shape.grad_accum, model.width
    cuda = shape.device == "cuda"
    R = min(cand.resident_layers, L) if cuda else 0
    interval = 1 if cand.path != "short" else cand.checkpoint_interval
    bl = blocks(L, interval)
    kept = frozenset(range(len(bl) - cand.keep_blocks, len(bl))) if cand.path == "short" else frozenset()
    recomputed = sum(len(b) for i, b in enumerate(bl) if i not in kept)
    res = resident_ids(L, R)
    head = 0 if R else model.head_params  # the head's params on the host and the link (resident with the layers)
    counts = transfers_per_layer(build_schedule(L, interval, kept), shape.layer_slots)
    streamed = [i for i in range(L) if i not in res]
    S = len(streamed)
    fwd_transfers = S  # every streamed layer crosses once for the forward
    bwd_transfers = sum(counts.get(f"layers.{i}", 1) for i in streamed) - fwd_transfers
    unknown = [] if not cuda else fig.unknown()
    if layer is None:
        unknown.append("layer timing")

    # ---- GPU
    f = layer.forward_s * A if layer else None  # one layer, all micro-batches
    rec = layer.recorded * A if layer else None  # with autograd: a recompute, or a kept block's forward
    b = layer.backward_s * A if layer else None
    kept_layers = {i for k in kept for i in bl[k]}
    tokens = shape.micro_batch_size * shape.seq_len * A
    rate = None  # FLOP/s the probed layer reached (the head is matmul-bound as the layer is)
    if layer and layer.recorded + layer.backward_s > 0:
        rate = 6.0 * P * layer.tokens / (layer.recorded + layer.backward_s)
    elif fig.gemm_tflops and cuda:
        rate = fig.gemm_tflops * 1e12
    if layer is not None and layer.head_s is not None:
        gpu_head = layer.head_s * A
    else:
        gpu_head = 6.0 * model.lm_head_params * tokens / rate if rate else None
    gpu_resident = ((R * P + model.head_params) * RESIDENT_UPDATE_B / (fig.device_gbps * 1e9)
                    if R and fig.device_gbps else 0.0 if not R else None)
    gpu_bwd = None if f is None or b is None or gpu_resident is None else \
        recomputed * rec + cand.rebuilt_checkpoints * f + L * b + gpu_resident + layer.fixed_s * A

    def fwd(i: int) -> float:  # layer i's forward on the GPU
        return rec if i in kept_layers else f

    # ---- PCIe
    link = {k: getattr(fig, k) for k in ("h2d_gbps", "d2h_gbps", "duplex_gbps")}
    if cuda and all(link.values()):
        h2d_layer = P * w / (link["h2d_gbps"] * 1e9)
        ckpt = cand.offloaded_checkpoints * checkpoint_bytes(tokens, model.hidden, w)
        fwd_pcie = S * h2d_layer + ckpt / (link["d2h_gbps"] * 1e9)
        bwd_pcie = max(bwd_transfers * P * w + ckpt, S * P * w) / (link["duplex_gbps"] * 1e9)
        head_h2d = head * w / (link["h2d_gbps"] * 1e9)
    elif cuda:
        h2d_layer = fwd_pcie = bwd_pcie = head_h2d = None
    else:  # the CPU engine copies on the host: the casts below are its transfers
        h2d_layer, fwd_pcie, bwd_pcie, head_h2d = 0.0, 0.0, 0.0, 0.0

    # ---- host: the AdamW pass's bandwidth, lower the busier the DMA engines are in the phase (the probe's
    # figures alone and under both DMA directions, interpolated by the link's share of the phase)
    def busy(link_s, gpu_s) -> float:
        if not cuda:
            return 0.0
        if link_s is None or gpu_s is None:
            return 1.0  # unknown: the probe's contended figure
        return link_s / max(link_s, gpu_s, 1e-12)

    u_fwd = busy(h2d_layer, f)
    u_bwd = busy(bwd_pcie, gpu_bwd)
    alone = fig.host_gbps_at(0.0) * 1e9

    def host(params: float, nbytes: float, u: float) -> float:
        return params * nbytes / (fig.host_gbps_at(u) * 1e9)

    def coded_s(params: float, u: float) -> float:
        """The one-pass update (bf16 / int8 moments: at its own probed rate; fp32 moments under a disk tier, or a
        probe from before the rate was measured: by its bytes)."""
        rate = fig.state_at(coded_key(shape.moments, shape.masters), u) or fig.state_at(shape.moments, u)
        return params / rate if rate else host(params, state_update_bytes(shape.moments), u)

    def cast_s(u: float) -> float:  # one streamed layer's cast, slowed as the AdamW pass is
        return P / (fig.cast_elems_per_s * fig.host_gbps_at(u) * 1e9 / alone) if alone else 0.0

    worker = shape.overlap_optimizer and cuda
    # no speculation, no split passes: the forward waits for whole updates
    coded = shape.moments != "fp32" or shape.disk
    if worker and coded:
        prep = coded_s(P, u_fwd) + cast_s(u_fwd)
    elif worker and shape.clipped and shape.update_on_read:
        emit = fig.emit_at(u_fwd)
        prep = P / emit if emit else host(P, EMIT_B, u_fwd)
    elif worker and shape.clipped:
        prep = host(P, WEIGHTS_B, u_fwd) + cast_s(u_fwd)
    else:
        prep = cast_s(u_fwd)

    # ---- phases
    forward = head_phase = backward = None
    if f is not None and h2d_layer is not None:
        if cuda:
            forward = sum(max(fwd(i), prep, h2d_layer) for i in streamed) + sum(fwd(i) for i in res)
        else:  # the reference streamer casts synchronously, then the layer computes
            forward = sum(fwd(i) for i in range(L)) + L * prep
    head_prep = head * (prep / P)
    if gpu_head is not None and head_h2d is not None:
        head_phase = max(gpu_head, head_prep, head_h2d) if cuda else gpu_head + head_prep
    # per param of a landing gradient: the lander, and the AdamW work of this phase (moments, or a whole update)
    land_pp = host(1, LAND_B, u_bwd) + (host(1, MOMENTS_B if shape.clipped else UPDATE_B, u_bwd)
                                        if worker and not coded else 0.0)
    bwd_host = bwd_transfers * cast_s(u_bwd) + (S * P + head) * land_pp
    if worker and not coded and shape.clipped:  # the embedding's moments too
        bwd_host += host(model.embed_params, MOMENTS_B, u_bwd)
    if gpu_bwd is not None and bwd_pcie is not None:
        backward = max(gpu_bwd, bwd_pcie, bwd_host) if cuda else gpu_bwd + bwd_host
    # the embedding's update: its rows are gathered on the host before the next forward starts; without the
    # optimizer thread every update, after the backward, nothing to overlap it
    n_serial = model.embed_params + (0 if worker else S * P + head)
    serial = coded_s(n_serial, 0.0) if coded else \
        host(n_serial, WEIGHTS_B if worker and shape.clipped else UPDATE_B, 0.0)

    # ---- a VLM's tower (vision_terms.py): each tower parameter priced as a streamed decoder layer's above
    linked = cuda and all(link.values())
    pp = PerParam(*(b / (link[k] * 1e9) if linked else None for k, b in (
        ("h2d_gbps", w), ("duplex_gbps", w), ("h2d_gbps", 4 if shape.masters == "fp32" else 2))),
        prep / P, cast_s(u_fwd) / P, cast_s(u_bwd) / P + land_pp, serial / max(1, n_serial), worker)
    tower = tower_phase(model.tower, layer, A, pp, cuda=cuda)

    phases = {"forward": forward, "head": head_phase, "backward": backward, "serial": serial}
    if model.tower is not None:
        phases["vision"] = None if tower["forward"] is None else tower["forward"] + tower["backward"] + tower["serial"]
    gpu = None if f is None or gpu_head is None or gpu_bwd is None or tower["gpu"] is None else \
        sum(fwd(i) for i in range(L)) + gpu_head + gpu_bwd + tower["gpu"]
    pcie = None if fwd_pcie is None or tower["pcie"] is None else \
        fwd_pcie + bwd_pcie + (head_h2d or 0.0) + tower["pcie"]
    host_work = S * prep + head_prep + bwd_host + serial + tower["host"]
    total = None if any(v is None for v in phases.values()) else sum(phases.values())
    return Prediction(cand, total, phases, {"gpu": gpu, "pcie": pcie, "host": host_work}, unknown)


# ------------------------------------------------------------------ candidates, through the one planner
def _variant(r, **engine):
    return dataclasses.replace(r, engine=dataclasses.replace(r.engine, **engine))


def shape_of(r, device: torch.device, *, clipped: bool = True) -> StepShape:
    t, e = r.train, r.engine
    return StepShape(t.micro_batch_size, t.seq_len, t.grad_accum, e.layer_slots, clipped=clipped and
                     t.max_grad_norm is not None, update_on_read=e.update_on_read and e.defer_moments,
                     overlap_optimizer=e.overlap_optimizer, device=device.type, moments=t.optimizer_state,
                     masters="fp32" if t.master_weights == "fp32" else f"bf16-{t.master_rounding}")


def _planned(r, adapter, device, cand_engine: dict, budget):
    """(Candidate, device bytes, problems) of one recipe variant, from plan_step (the black box)."""
    from megatrain_cli.engine.plan.step_plan import plan_step

    variant = _variant(r, **cand_engine)
    try:
        plan = plan_step(variant, adapter, device)
    except ValueError as err:  # a recipe no plan serves (e.g. a sliding window shorter than a long row)
        return None, 0, [str(err)]
    dev = plan.device_bytes
    problems = list(plan.problems)
    # A lean plan keeps its own headroom (lean.py: 95% of what its resident layers leave, a 1 GiB reserve).
    if budget and plan.lean is None and dev > HEADROOM * budget and not problems:
        problems.append(f"device memory: about {dev / GiB:.1f} GiB of the {budget / GiB:.1f} GiB budget "
                        f"(over {HEADROOM:.0%}, the headroom the planner keeps for 'auto')")
    return candidate_of(plan, device), dev, problems


def predict_plan(r, adapter, device: torch.device, plan, fig: MachineFigures, layer: LayerTiming | None, *,
                 clipped: bool = True) -> Prediction:
    """The prediction for the plan `plan_step` made for `r` (what bench and train compare with the measured)."""
    model = ModelFigures.of(adapter, recipe_shape(r, device)["dtype"], frozen_of(r, adapter))
    shape = dataclasses.replace(shape_of(r, device, clipped=clipped), disk=plan.disk_state is not None)
    return predict(fig, layer, model, shape, candidate_of(plan, device))


def candidate_of(plan, device: torch.device) -> Candidate:
    """The candidate a StepPlan is (what `bench` predicts for the plan it runs)."""
    lean = plan.lean
    return Candidate(plan.checkpoint_interval, len(plan.keep_blocks), plan.resident_layers if device.type == "cuda"
                     else 0, "short" if lean is None else lean.label,
                     lean.offloaded_checkpoints if lean is not None else 0,
                     len(lean.dropped_checkpoints) if lean is not None else 0)


def resident_options(r, num_layers: int, device: torch.device) -> list[int]:
    """0, powers of two and all layers (CUDA; on the CPU 0 only: the device is the host)."""
    if device.type != "cuda":
        return [0]
    opts = {0, num_layers}
    k = 1
    while k < num_layers:
        opts.add(k)
        k *= 2
    return sorted(opts)


def interval_options(r, num_layers: int) -> list[int]:
    return sorted({c for c in (1, 2, 3, 4, 6, 8) if c <= num_layers} | {r.engine.checkpoint_interval})


def choose(r, adapter, device: torch.device, fig: MachineFigures, layer: LayerTiming | None, *,
           resident: list[int] | None = None, intervals: list[int] | None = None, clipped: bool = True
           ) -> list[Prediction]:
    """Every candidate's prediction, the feasible ones first, fastest first (ties: less device memory).
    Kept blocks grow until the planner says no (device memory only grows with them). The recipe as written
    (its own fallback and long-context choices included) is always among them."""
    from megatrain_cli.engine.plan.step_plan import device_budget

    model = ModelFigures.of(adapter, recipe_shape(r, device)["dtype"], frozen_of(r, adapter))
    shape = shape_of(r, device, clipped=clipped)
    budget = device_budget(r, device)
    resident = resident if resident is not None else resident_options(r, model.num_layers, device)
    seen: dict[Candidate, Prediction] = {}

    def add(engine: dict) -> bool:
        cand, dev, problems = _planned(r, adapter, device, engine, budget)
        if cand is None or cand in seen:
            return cand is not None and seen[cand].fits
        p = predict(fig, layer, model, shape, cand)
        p.device_bytes, p.problems, p.fits = dev, problems, not problems
        seen[cand] = p
        return p.fits

    add({})  # the recipe as written
    if device.type == "cuda":
        add({"resident_layers": "auto"})  # as many as fit, kept activations after them
    long = r.engine.long_context_min_seq is not None and r.train.seq_len >= r.engine.long_context_min_seq
    for R in resident:
        add({"resident_layers": R})  # the recipe's own interval, kept blocks, fallback and path
        if long:
            continue
        for C in intervals or interval_options(r, model.num_layers):
            for K in range(len(blocks(model.num_layers, C)) + 1):
                if not add({"resident_layers": R, "checkpoint_interval": C, "keep_activations": K,
                            "memory_fallback": False}):
                    break
    return sorted(seen.values(), key=lambda p: (not p.fits, p.total is None,
                                               p.total if p.total is not None else p.lower_bound, p.device_bytes))


def overrides(cand: Candidate, r) -> str:
    """The key=value overrides that select `cand` on `megatrain train`."""
    if cand.path != "short":
        keys = []
    else:
        keys = [f"engine.checkpoint_interval={cand.checkpoint_interval}", f"engine.keep_activations={cand.keep_blocks}"]
    keys.append(f"engine.resident_layers={cand.resident_layers}")
    return " ".join(keys) or "(the recipe as it is)"


def fmt_s(v: float | None) -> str:
    return "?" if v is None else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def interval_label(c: Candidate) -> str:
    return str(c.checkpoint_interval) if c.path == "short" else f"1 ({c.path})"
