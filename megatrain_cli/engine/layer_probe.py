"""The planner's layer timing, measured through the engine's own code (issue #22).

A decoder layer timed as a bare HF module runs faster than the engine runs it: the engine binds the
weights into a template, redirects saved tensors to its tiles, takes the gradients with autograd.grad and
sums them in an fp32 accumulator, and its head is the chunked (or fused Triton) cross-entropy, not a GEMM at
the layer's rate. So the probe builds the engine itself over a model cut to one layer of each structure
(sliding / full attention), every layer and the head resident on the GPU (no streaming: what is timed is
the GPU's work), and times each op of real steps with CUDA events recorded as the engine issues them.

Cost: a host store of the cut model (the embedding and the LM head at full size, 14 B/param), the device
memory of its resident state and one micro-batch's activations, and warm-up + `reps` forward/backward
passes; everything is freed before the caller builds its own store.
"""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import torch

from megatrain_cli.batch import MicroBatch
from megatrain_cli.engine.plan.lean import LeanPlan
from megatrain_cli.engine.plan.probe import LayerTiming
from megatrain_cli.engine.plan.step_plan import StepPlan
from megatrain_cli.engine.step import Engine
from megatrain_cli.engine.vision_probe import measure_tower
from megatrain_cli.recipe import EngineConfig, TrainConfig


def cut_config(adapter):
    """The model's config with one decoder layer of each distinct structure, in the order they first occur,
    and for each the number of the model's layers it stands for."""
    types = adapter.layer_types
    distinct = list(dict.fromkeys(types))
    whole = adapter.config.to_dict()
    # A vision-language model: its decoder's numbers are in text_config; its tower is cut to one layer (every
    # tower layer is one class and shape: engine/vision_probe.py times that one)
    data = whole["text_config"] if "vision_config" in whole else whole
    data["num_hidden_layers"] = len(distinct)
    if getattr(adapter.text_config, "layer_types", None) is not None:
        data["layer_types"] = distinct
    else:
        data.pop("layer_types", None)
    if "vision_config" in whole:
        vision = whole["vision_config"]
        vision["depth" if "depth" in vision else "num_hidden_layers"] = 1
    return type(adapter.config).from_dict(whole), [types.count(t) for t in distinct]


def host_bytes_to_measure(adapter, *, micro_batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
                          loss_chunk_tokens: int = 4096, **_shape) -> int:
    """The host memory measure_layer takes at this shape, by the planner's arithmetic (engine/plan/memory.py)
    over the cut model: its store (the embedding and the LM head at full size), pinned staging on CUDA, and on
    the CPU, where the 'device' is the host, the step's buffers and activations too. What `megatrain plan`
    and `bench` compare with the machine before probing (a 7B layer timed on the CPU needs tens of GiB)."""
    from megatrain_cli.engine.plan.memory import make_plan
    from megatrain_cli.models.adapter import ModelAdapter

    cuda = device.type == "cuda"
    cut, counts = cut_config(adapter)
    plan = make_plan(ModelAdapter(cut), dtype, micro_batch_size=micro_batch_size, seq_len=seq_len, grad_accum=1,
                     checkpoint_interval=1, grad_slabs=2, loss_chunk_tokens=loss_chunk_tokens,
                     device_type=device.type, resident_layers=len(counts) if cuda else 0)
    return plan.host_total + plan.pinned_total + (0 if cuda else plan.device_total)


MACHINE_PROBE_BYTES = 320 << 20  # measure_machine's host tile (256 MiB) and its bf16 cast target


def to_measure(adapter, *, cache_dir=None, reprobe: bool = False, **shape) -> tuple[bool, bool]:
    """(the machine, the layer): what load_or_probe would measure now, the rest being cached (and a layer on
    CUDA is timed only where there is a GPU). Both False: the probe writes nothing."""
    from megatrain_cli.engine.plan.probe import read_cached

    cached = None if reprobe else read_cached(adapter, cache_dir=cache_dir, **shape)
    here = shape["device"].type != "cuda" or torch.cuda.is_available()
    return cached is None, (cached is None or cached.layer is None) and here


def probe_memory_problem(adapter, *, cache_dir=None, reprobe: bool = False, **shape) -> str:
    """'' when what load_or_probe is about to measure (recipe_shape's keys in `shape`) fits the host memory
    free now, else the problem with both figures: checked before probing, since a probe past the limit is
    ended by the kernel's OOM killer with no word."""
    from megatrain_cli.machine import effective_host_limit

    machine, layer = to_measure(adapter, cache_dir=cache_dir, reprobe=reprobe, **shape)
    device = shape["device"]
    need = (MACHINE_PROBE_BYTES if machine else 0) + (host_bytes_to_measure(adapter, **shape) if layer else 0)
    limit = effective_host_limit()
    if not limit.available or need <= limit.available:  # 0 free: unknown (no Linux), not full
        return ""
    return (f"host memory: timing one layer of this model on {device.type} at {shape['micro_batch_size']} x "
            f"{shape['seq_len']} tokens needs about {need / 2**30:.1f} GiB (the embedding and the LM head at full "
            f"size, one layer, its optimizer state{', a step on the CPU' if device.type == 'cpu' else ''}), and "
            f"{limit.available / 2**30:.1f} GiB are free under {limit.source}")


class OpClock:
    """Seconds of each op of one step as the device runs it: a CUDA event after each op's launches (the
    engine's on_op hook), read after the step; the host runs ahead, so the gap between two events is the
    device's time for the op between them, launch stalls included. On the CPU ops are synchronous and the
    host clock is the device's."""

    def __init__(self, engine: Engine):
        self.cuda = engine.device.type == "cuda"
        self.marks: list[tuple[object, object]] = []
        engine.on_op = self._on_op

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.marks = [("start", self._now())]

    def _on_op(self, op) -> None:
        self.marks.append((op, self._now()))

    def durations(self) -> list[tuple[object, float]]:
        if self.cuda:
            torch.cuda.synchronize()
            gap = lambda a, b: a.elapsed_time(b) / 1e3  # noqa: E731
        else:
            gap = lambda a, b: b - a  # noqa: E731
        return [(op, gap(prev, now)) for (_, prev), (op, now) in zip(self.marks, self.marks[1:])]


def measure_layer(adapter, *, micro_batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
                  kernels: str = "torch", loss_chunk_tokens: int = 4096, lean: LeanPlan | None = None,
                  docs_per_row: int | None = None, vision_images: tuple[int, int] | None = None, reps: int = 3,
                  warmup: int = 1, seed: int = 0) -> LayerTiming:
    """The engine's per-layer, head and fixed times at micro_batch_size x seq_len (one micro-batch), the
    layers weighted by how many of the model's layers each stands for. `lean`: the recipe's lean plan
    (MLP chunk, lean norms, loss chunk), run here with no checkpoint offloaded or dropped. `docs_per_row`:
    packed rows of that many equal documents (position ids restarting at each), attention within each.
    `vision_images`: a VLM's (images a micro-batch, patches a side): one tower layer timed too (vision_probe.py)."""
    from megatrain_cli.models.loader import build_store

    config, counts = cut_config(adapter)
    cuda = device.type == "cuda"
    store = build_store(config, dtype, seed=seed)
    # The recipe's lean pieces, none of its checkpoint placement (the cut model has its own few checkpoints);
    # interval 1 and its loss chunk, as the lean plan has them. The memory figures are the planner's: none here.
    lean = dataclasses.replace(lean, offloaded_checkpoints=0, dropped_checkpoints=()) if lean is not None else None
    plan = StepPlan(memory=None, checkpoint_interval=1, lean=lean, resident_layers=len(counts) if cuda else 0,
                    loss_chunk_tokens=lean.loss_chunk_tokens if lean is not None else loss_chunk_tokens)
    # Only forward_backward runs: no optimizer thread; two slabs are enough for the few layers' gradients.
    settings = EngineConfig(kernels=kernels, overlap_optimizer=False, grad_slabs=2)
    engine = Engine(store, plan, settings, TrainConfig(), device=device)
    clock = OpClock(engine)
    vocab = engine.adapter.vocab_size
    samples: dict[str, list[float]] = {}
    tower = (0.0, 0.0)  # no images: the tower does no work
    pos = None if docs_per_row is None else \
        (torch.arange(seq_len) % -(-seq_len // docs_per_row)).expand(micro_batch_size, seq_len).contiguous()
    try:
        for s in range(warmup + reps):
            ids = torch.randint(0, vocab, (micro_batch_size, seq_len), generator=torch.Generator().manual_seed(s))
            clock.start()
            engine.forward_backward([MicroBatch(ids, ids.clone(), pos)])
            if s < warmup:
                continue
            per = {}
            for op, took in clock.durations():
                key = "fixed" if op is None or op.kind == "embed_backward" else \
                    "head" if op.kind == "head" else f"{op.kind}.{op.layer}"
                per[key] = per.get(key, 0.0) + took
            for key, took in per.items():
                samples.setdefault(key, []).append(took)
        if vision_images and vision_images[0] and engine.vision is not None:
            images, grid = vision_images
            tower = measure_tower(engine, images=images, grid=grid, reps=reps, warmup=warmup)
    finally:
        engine.close()
        del engine, store
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    med = {k: statistics.median(v) for k, v in samples.items()}
    n = sum(counts)

    def per_layer(kind: str) -> float:
        return sum(c * med.get(f"{kind}.{i}", 0.0) for i, c in enumerate(counts)) / n

    return LayerTiming(forward_s=per_layer("forward"), backward_s=per_layer("backward"),
                       tokens=micro_batch_size * seq_len, device=device.type, recorded_s=per_layer("recompute"),
                       head_s=med.get("head", 0.0), fixed_s=med.get("fixed", 0.0), vision_forward_s=tower[0],
                       vision_backward_s=tower[1])
