"""One training step: forward / head / block recompute / backward / optimizer, driven by the schedule.

The math is the HF modules' (through templates); the order is schedule.py's; the bytes move through
transfer/. This file only walks the schedule and keeps the per-micro-batch tensors in between.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import torch

from megatrain_cli.batch import MicroBatch, StepResult
from megatrain_cli.engine import kernel_patch
from megatrain_cli.engine.inputs import embed_output_grads, step_inputs
from megatrain_cli.engine.deepstack import Deepstack
from megatrain_cli.engine.embed_backward import embed_backward
from megatrain_cli.engine.grad_norm import squared_norm
from megatrain_cli.engine.head import run_head
from megatrain_cli.engine.policy_head import run_policy_head
from megatrain_cli.engine.preference_head import run_preference_head
from megatrain_cli.engine.plan.lean import LeanPlan
from megatrain_cli.engine.rebuild import StepCheckpoints
from megatrain_cli.engine.resident import ResidentLayers
from megatrain_cli.engine.router_loss import moe_setup, routers
from megatrain_cli.engine.schedule import Op, blocks, build_schedule, fetch_order
from megatrain_cli.engine.templates import TemplatePool, WeightRedirect, run_bound
from megatrain_cli.engine.lean_layers import SDPA_BACKENDS, sdpa_backend_context, slim_norms, chunk_mlp
from megatrain_cli.engine.transfer import make_transfers
from megatrain_cli.engine.transfer.updates import NO_UPDATES
from megatrain_cli.engine.transfer.offload import CheckpointOffloader
from megatrain_cli.engine.vision_phase import VisionPhase
from megatrain_cli.methods import GRPO, SFT, MetricTotals, PreferenceMethod
from megatrain_cli.optim.host_adamw import HostAdamW, clip_coefficient
from megatrain_cli.optim.worker import OptimizerWorker
from megatrain_cli.store.sharded import ShardedHostStore
from megatrain_cli.store.tiles import HostStore

if TYPE_CHECKING:  # annotations only: torch.distributed is imported only by a distributed engine
    from megatrain_cli.engine.dist import DistContext
    from megatrain_cli.engine.plan.step_plan import StepPlan
    from megatrain_cli.recipe import EngineConfig, TrainConfig


class Engine:
    """Drives plain HF layer modules over a host store, one streamed layer at a time, as docs/architecture.md
    ("The step") says. `plan` (interval, kept blocks, loss chunk, lean plan, resident layers) and `settings`
    are taken as given (train/setup.py's build_engine chooses them); `dist`: one data-parallel rank over its
    ShardedHostStore; `method`: the loss (methods/, SFT's token mean unless handed one); `frozen`: tiles that
    never train. Options change how, never what: every combination computes the same step."""

    def __init__(self, store: HostStore, plan: StepPlan, settings: EngineConfig, train: TrainConfig, *,
                 device: torch.device, dist: DistContext | None = None, method: SFT | PreferenceMethod | GRPO | None = None,
                 frozen: frozenset[str] = frozenset()):
        if settings.sdpa not in SDPA_BACKENDS:
            raise ValueError(f"unknown SDPA backend {settings.sdpa!r}; one of {', '.join(SDPA_BACKENDS)}")
        if dist is not None and not isinstance(store, ShardedHostStore):
            raise ValueError("a distributed engine needs this rank's ShardedHostStore (store/sharded.py)")
        if dist is not None and (store.rank, store.world) != (dist.rank, dist.world):
            raise ValueError(f"the store holds shard {store.rank} of {store.world}, this is rank {dist.rank} "
                             f"of {dist.world}")
        if plan.resident_layers and dist is not None:
            raise ValueError("resident_layers needs one process: a data-parallel rank holds a shard of each layer")
        if store.adapter.vision is not None and dist is not None:
            raise ValueError("a vision-language model trains in one process here (no data parallel yet)")
        self.plan, self.settings, self.dist = plan, settings, dist
        self.frozen = frozen  # a VLM's model.freeze_vision / freeze_projector
        self.method = method if method is not None else SFT()
        self.kernels = kernel_patch.resolve(settings.kernels, device)  # 'torch' or 'triton'
        self.store, self.train_cfg, self.device = store, train, device
        self.adapter = store.adapter
        self.dtype = store.compute_dtype
        self.interval, self.chunk, self.keep_blocks = plan.checkpoint_interval, plan.loss_chunk_tokens, plan.keep_blocks
        self.templates = TemplatePool(self.adapter)
        self.moe, self.router = moe_setup(self.adapter.config, self.templates, device)  # None, None if dense
        self.norm_template = self.adapter.make_norm_template()
        self.vision = VisionPhase(self, frozen) if self.adapter.vision is not None else None  # a VLM's tower
        self.deepstack = self.vision.deepstack if self.vision is not None else Deepstack(-1, 0)  # none: a no-op
        self.layer_inputs = self.adapter.make_layer_inputs(device)  # HF's decoder code: masks, rotary tables
        # With a disk tier (store.disk) each tile's state is touched once a step, by one update pass, in the
        # order the tier reads ahead: no speculation (corrections), no deferred moments (a second pass).
        tier = store.tier
        self.optimizer = HostAdamW(train, kernel=settings.host_adamw, defer_moments=settings.defer_moments, tier=tier)
        names = store.layer_names[:max(0, plan.resident_layers)]  # none: an empty set, every tile streamed
        self.resident = ResidentLayers(store, [*names, "head"] if names else [], device, self.dtype, train)
        self.worker = None
        self.update_on_read = False
        if settings.overlap_optimizer:
            # A clipped step's weights are updated by the packer as the next forward streams them (optim/
            # worker.py: update on read): the host-cast streamers of one process, bf16 compute, C++ kernel.
            self.update_on_read = (settings.update_on_read and self.optimizer.defer_moments
                                   and self.dtype == torch.bfloat16 and dist is None)
            held = frozenset([*store.layer_names, "head"]) if self.update_on_read else frozenset()
            self.worker = OptimizerWorker(self.optimizer, store, forward_order=self.update_order(),
                                          max_grad_norm=train.max_grad_norm,
                                          speculate=settings.speculate_optimizer and tier is None,
                                          threads=settings.adamw_threads, update_on_read=held)
        else:
            self.optimizer.defer_moments = False  # nothing would run the moments pass
        # Op | None -> None: None when a step's ops begin, then each op once its host work is issued (a
        # per-layer observer: the long-context bench's LayerClock). Unset on the hot path: one attribute check per op.
        self.on_op = None
        # The backward's saved tensors name a streamed weight by its tile; the streamer says where it is now.
        self.redirect = WeightRedirect(lambda tile: self.streamer.resident(tile))
        if tier is not None:
            tier.schedule(self.update_order())
        updates = self.worker if self.worker is not None else NO_UPDATES
        self.streamer, self.sink = make_transfers(store, device, self.dtype, settings, updates, self.redirect.bind,
                                                  dist=dist)
        lean = plan.lean
        dropped = frozenset(lean.dropped_checkpoints) if lean is not None else frozenset()
        self.ops = build_schedule(self.adapter.num_layers, self.interval, self.keep_blocks, dropped)
        self.offloader: CheckpointOffloader | None = None
        if lean is not None:
            self._install_lean(lean)
        self.checkpoints = StepCheckpoints(self.ops, self.adapter.num_layers, self.interval, self.keep_blocks,
                                           self.offloader)
        self.fused_ce = None  # the fused linear + cross-entropy kernel the head runs, or None on the PyTorch path
        if self.kernels == "triton":  # after the lean plan's pieces: see kernel_patch's precedence
            for template in (*self.templates.all(), self.norm_template):
                kernel_patch.install_kernels(template)
            if self.adapter.logit_softcap is None:  # the fused kernel has no softcap: Gemma's head runs chunked
                self.fused_ce = kernel_patch.fused_cross_entropy()

    def _install_lean(self, lean: LeanPlan) -> None:
        if lean.mlp_chunk_tokens:
            for template in self.templates.all():
                if self.moe is None or not routers(template, self.moe):  # routed experts run whole
                    chunk_mlp(template, lean.mlp_chunk_tokens)
        if lean.lean_norms:
            for template in self.templates.all():
                slim_norms(template)
            slim_norms(self.norm_template)
        self.offloader = CheckpointOffloader(self.device, frozenset(lean.offload_keys))

    def reserve_checkpoint_buffers(self, micro_batch_shapes: list[tuple[int, int]]) -> int:
        """Pin the offloaded checkpoints' host buffers before the first step (micro-batch [B, T] shapes of
        the steps to come); returns the bytes pinned. Without a lean plan, or on CPU: 0."""
        like = [((b, t, self.adapter.hidden_size), self.dtype) for b, t in micro_batch_shapes]
        return self.checkpoints.reserve(like)

    def _sdpa_context(self):
        sdpa = self.settings.sdpa
        if self.device.type != "cuda" or (self.plan.lean is None and sdpa == "auto"):
            return contextlib.nullcontext()
        return sdpa_backend_context(sdpa, self.device)

    # ------------------------------------------------------------ helpers
    def grad_zeros(self, tile: str) -> torch.Tensor:
        """A tile's fp32 gradient accumulator; on the distributed path padded to the store's shard multiple
        (the tail stays zero), so the sink reduce-scatters it as it is."""
        n = self.store.layouts[tile].numel if self.dist is None else self.store.padded_numel(tile)
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def weight_views(self, tile: str, flat: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
        views = self.store.layouts[tile].views(flat)
        if grad:
            views = {k: v.detach().requires_grad_() for k, v in views.items()}
        return views

    def _layer(self, i: int, weights, h, call, mb: int = 0, count: bool = False, keep: bool = False):
        """Layer i on micro-batch `mb`, with the arguments HF's decoder loop gives it (models/layer_inputs.py);
        `count` / `keep`: what the router loss takes from its routers (engine/router_loss.py)."""
        if self.router is not None:
            self.router.at(i, mb, count=count, keep=keep)
        return self.deepstack.add(i, mb, run_bound(self.templates.next_for(i), weights, h, **call.kwargs[i]))

    # ------------------------------------------------------------ the step
    def step(self, micro_batches: list[MicroBatch], lr: float) -> StepResult:
        """Forward, backward and (unless the gradient is not finite) the optimizer for one step.

        With the worker, updates start during the backward (speculatively, see optim/worker.py) and
        the rest run on while the next step's forward streams; `resolve` only hands over the verdict.
        """
        if self.worker is not None:
            self.worker.begin_step(lr)
        try:
            res = self.forward_backward(micro_batches)
        except BaseException:
            if self.worker is not None:  # undo this step's speculative updates: nothing half-applied
                self.worker.resolve(1.0, finite=False)
                self.worker.drain()
            raise
        t0 = time.perf_counter()
        coef = clip_coefficient(res.grad_norm, self.train_cfg.max_grad_norm) if not res.skipped else 1.0
        self.streamer.invalidate()
        if self.worker is not None:
            res.speculation = self.worker.resolve(coef, finite=not res.skipped)
        elif not res.skipped:
            for name in self.update_order():
                self.optimizer.update(self.store.tiles[name], lr, coef)
        if not res.skipped:
            self.resident.update(lr, coef)
        res.times["optimizer"] = time.perf_counter() - t0
        return res

    def recomputed_layers(self) -> int:
        """Layer forwards run again per step: the recomputed blocks' layers, and the layers rebuilding a
        dropped checkpoint (engine/rebuild.py)."""
        return sum(len(b) for i, b in enumerate(blocks(self.adapter.num_layers, self.interval))
                   if i not in self.keep_blocks) + sum(op.kind == "rebuild" for op in self.ops)

    def mlp_chunk_tokens(self) -> int | None:
        """Tokens per MLP chunk when the lean plan chunks the MLP (its backward redoes gate / up)."""
        return self.plan.lean.mlp_chunk_tokens if self.plan.lean is not None else None

    def update_order(self) -> list[str]:
        """The order the next forward reads the host-updated tiles: a VLM's image side, embedding rows,
        layers, head; frozen tiles never update."""
        image_side = self.vision.trainable if self.vision is not None else []
        return [t for t in (*image_side, "embed", *self.store.layer_names, "head") if t not in self.resident]

    def acquire(self, tile: str) -> torch.Tensor:
        """A tile's weights on the device: a resident tile's own buffer, else the streamer's slot."""
        return self.resident.weights(tile) if tile in self.resident else self.streamer.acquire(tile)

    def send_grad(self, tile: str, grad: torch.Tensor, sq: torch.Tensor) -> None:
        """A tile's finished fp32 gradient: kept on the device for a resident tile, else to the host."""
        if tile in self.resident:
            self.resident.set_grad(tile, grad)
        else:
            self.sink.send(tile, grad, sq)

    def synchronize(self, masters: bool = True) -> None:
        """Wait for every pending host update; `masters`: also bring the resident layers' state home, so
        the host tiles are current (checkpoint, export, eval). A bench's timing wants the wait alone."""
        if self.worker is not None:
            self.worker.drain()
        if masters:
            self.resident.store_home()

    def close(self) -> None:
        self.synchronize()
        self.checkpoints.forget()
        if self.offloader is not None:
            self.offloader.clear()
        for part in (self.worker, self.streamer, self.sink):
            if part is not None and hasattr(part, "close"):
                part.close()

    def forward_backward(self, mbs: list[MicroBatch]) -> StepResult:
        dev, H = self.device, self.adapter.hidden_size
        times: dict[str, float] = {}
        if not self.resident.loaded:
            self.resident.load()  # here, not at construction: a resume fills the host tiles in between
        image_in, image_back = self.vision.fetch_order() if self.vision is not None else ([], [])  # a VLM's tower
        self.streamer.begin_step([*image_in, *[t for t in fetch_order(self.ops) if t not in self.resident], *image_back])
        if self.dist is None:  # ranks start their all-gathers in step with each other, at the first acquire
            self.streamer.prefetch_first()
        t_start = time.perf_counter()

        # Per micro-batch inputs. Embedding rows are gathered on the host (only the unique tokens of
        # the step cross PCIe, never the whole table); labels are shifted once here.
        waited_before = self.worker.waited_s if self.worker is not None else 0.0
        if self.worker is not None:
            self.streamer.idle_while(lambda: self.worker.wait("embed"))
        if self.dist is not None:
            self.sink.reset()
        sq_norm = torch.zeros((), dtype=torch.float64, device=dev)  # engine/grad_norm.py says why fp64
        feats = self.vision.forward(mbs, sq_norm) if self.vision is not None else None  # the tower streams
        x = step_inputs(mbs, self.store, self.streamer, self.layer_inputs, dev, self.dtype, self.dist,
                        check_mask=self.plan.lean is not None, features=feats)
        ids_all, uniq, inv_dev, h, ctx, labels, offsets = x.ids, x.uniq, x.inverse, x.h, x.calls, x.labels, x.offsets
        n_loss_tokens = x.loss_tokens
        if self.router is not None:
            self.router.begin(len(mbs))
        norm_scale = 1.0 / max(1, n_loss_tokens)

        graphs: dict[int, tuple[list, list, dict]] = {}  # layer -> (inputs, outputs, leaves)
        pref = None  # a preference step's head: its metrics and units
        grads_out: list[torch.Tensor] = []
        losses: list[float] = []

        ckpt = self.checkpoints
        ckpt.forget()  # anything a failed step left behind
        t0 = time.perf_counter()
        op = None
        if self.on_op is not None:
            self.on_op(None)  # the inputs are ready; the schedule's ops follow
        try:
            with self._sdpa_context():
                for op in self.ops:
                    if op.kind == "forward":
                        if op.checkpoint:
                            ckpt.save(op.block, h)
                        flat = self.acquire(op.tile)
                        if op.grad:
                            h = self._record_layer(op.layer, flat, h, ctx, graphs, count=True)
                        else:
                            h = self.forward_layer(op.layer, flat, h, ctx, count=True)
                    elif op.kind == "head":
                        times["forward"] = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        if self.worker is not None:  # the forward has every weight it needs: the last
                            self.worker.release_moments()  # step's deferred moments may use the host now
                        ckpt.prefetch_first()  # comes back while the head computes
                        if isinstance(self.method, (PreferenceMethod, GRPO)):
                            pref = run_preference_head(self, h, labels, mbs, sq_norm) if isinstance(
                                self.method, PreferenceMethod) else run_policy_head(self, h, labels, mbs, sq_norm,
                                                                                    n_loss_tokens)
                            grads_out, losses, head_grad, units = pref.grads_out, pref.losses, pref.tied_grad, pref.units
                        else:
                            grads_out, losses, head_grad = run_head(self, h, labels, norm_scale, sq_norm)
                            units = n_loss_tokens
                        if self.router is not None:  # each micro-batch's loss as HF's: + coef * router aux loss
                            losses = self.router.add_to(losses, units)  # weighted by its share of tokens / units
                        h = []
                        times["head"] = time.perf_counter() - t0
                        t0 = time.perf_counter()
                    elif op.kind == "rebuild":  # a dropped checkpoint, from the one before (engine/rebuild.py)
                        h = ckpt.rebuild(self, op, h, ctx)
                    elif op.kind == "recompute":
                        if op.layer == ckpt.blocks[op.block].start:
                            h = ckpt.load(op.block)
                        flat = self.acquire(op.tile)
                        h = self._record_layer(op.layer, flat, h, ctx, graphs)
                    elif op.kind == "backward":
                        h = []  # the block's output: its graph holds it until this backward; nothing reads it later
                        self.acquire(op.tile)
                        grads_out = self._backward_layer(op.layer, grads_out, graphs, sq_norm)
                    elif op.kind == "embed_backward":
                        outs = [embed_output_grads(tr, g) for tr, g in zip(x.transforms, grads_out)]
                        embed_backward(self, [o[0] for o in outs], uniq, inv_dev, offsets, head_grad, sq_norm)
                        if self.vision is not None:  # the image side's backward: the tower streams again
                            self.vision.backward([o[1] for o in outs])
                    if self.on_op is not None:
                        self.on_op(op)  # its host work is issued
        except torch.cuda.OutOfMemoryError as err:
            # Say where: the trainer's message turns the phase into what to change.
            where = f"layer {op.layer}" if op is not None and op.layer >= 0 else "head / embedding"
            err.add_note(f"megatrain phase: {op.kind if op else 'inputs'} ({where})")
            raise
        self.sink.finish()
        times["backward"] = time.perf_counter() - t0
        if self.worker is not None:  # packer and training thread, blocked until host AdamW had a tile done
            times["wait_optimizer"] = self.worker.waited_s - waited_before

        # The one host sync of the step: the global gradient norm.
        loss_sum = sum(l * n for l, n in losses)
        total = sum(n for _, n in losses)
        n_tokens = int(ids_all.numel())
        # A preference method's metrics: sums and counts, reduced with the loss (methods/metrics.py)
        totals = pref.totals.as_tensor() if pref is not None else None
        if self.dist is None:
            grad_norm = float(sq_norm.sqrt())
        else:  # sq_norm above is this rank's unreduced gradient: the sink has its share of the reduced one
            extra = totals.flatten().tolist() if totals is not None else []
            sq, loss_sum, total, n_tokens, *extra = self.dist.sum_scalars(
                [self.sink.take_sq_norm(), loss_sum, total, n_tokens, *extra])
            grad_norm, n_tokens = math.sqrt(sq) if sq >= 0 else float("nan"), int(n_tokens)
            if totals is not None:
                totals = torch.tensor(extra, dtype=torch.float64).view_as(totals)
        metrics = MetricTotals.from_tensor(totals).means() if totals is not None else {}
        finite = math.isfinite(grad_norm) and math.isfinite(loss_sum)
        times["total_fb"] = time.perf_counter() - t_start
        st = self.streamer.stats
        return StepResult([l for l, _ in losses], loss_sum / max(1, total), grad_norm,
                          n_tokens, n_loss_tokens, skipped=not finite, times=times,
                          h2d_bytes=st.h2d_bytes, d2h_bytes=st.d2h_bytes, h2d_count=dict(st.h2d_count),
                          metrics=metrics)

    # ------------------------------------------------------------ phases
    def forward_layer(self, i: int, flat, h, ctx, count: bool = False) -> list[torch.Tensor]:
        """Layer i on every micro-batch without autograd (the forward, a checkpoint's rebuild)."""
        with torch.no_grad():
            w = self.weight_views(f"layers.{i}", flat, grad=False)
            return [self._layer(i, w, x, c, m, count=count) for m, (x, c) in enumerate(zip(h, ctx))]

    def _record_layer(self, i: int, flat, h, ctx, graphs, count: bool = False) -> list[torch.Tensor]:
        """Run layer i on every micro-batch with autograd; the graph refers to weights by tile."""
        tile = f"layers.{i}"
        w = self.weight_views(tile, flat, grad=True)
        xs = [x.detach().requires_grad_() for x in h]
        with torch.enable_grad(), self.redirect.hooks():
            ys = [self._layer(i, w, x, c, m, count=count, keep=True) for m, (x, c) in enumerate(zip(xs, ctx))]
        graphs[i] = (xs, ys, w)
        return [y.detach() for y in ys]

    def _backward_layer(self, i: int, grads_out, graphs, sq_norm) -> list[torch.Tensor]:
        xs, ys, w = graphs.pop(i)
        names = list(w)
        layout = self.store.layouts[f"layers.{i}"]
        acc = self.grad_zeros(f"layers.{i}")
        acc_views = layout.views(acc)
        grads_in = []
        for m, (x, y, g) in enumerate(zip(xs, ys, grads_out)):
            aux = self.router.terms(i, m) if self.router is not None else []  # the router aux loss's share
            self.deepstack.take_grad(i, m, g)  # Qwen3-VL: d loss / d its deepstack features (engine/deepstack.py)
            out = torch.autograd.grad([y, *aux], [x, *w.values()], [g, *[None] * len(aux)])
            grads_in.append(out[0])
            for name, gw in zip(names, out[1:]):
                acc_views[name].add_(gw)
        sq = squared_norm(acc)
        sq_norm.add_(sq)
        self.send_grad(f"layers.{i}", acc, sq)
        return grads_in
