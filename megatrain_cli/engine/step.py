"""One training step: forward / head / block recompute / backward / optimizer, driven by the schedule.

The math is the HF modules' (through templates); the order is schedule.py's; the bytes move through
transfers.py. This file only walks the schedule and keeps the per-micro-batch tensors in between.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import TYPE_CHECKING

import torch

from megatrain_cli.engine import kernel_patch
from megatrain_cli.batch import (  # noqa: F401 (MicroBatch, StepResult: re-exported for callers)
    IGNORE_INDEX, MAX_LONG_CONTEXT_MASK, MicroBatch, StepResult, block_causal_mask)
from megatrain_cli.engine.plan.lean import LongContextPlan
from megatrain_cli.engine.transfer.offload import CheckpointOffloader
from megatrain_cli.engine.schedule import Op, blocks, build_schedule, fetch_order
from megatrain_cli.engine.templates import TemplatePool, WeightRedirect, run_bound
from megatrain_cli.engine.tiling import SDPA_BACKENDS, sdpa_backend_context, slim_norms, tile_mlp
from megatrain_cli.engine.transfer import make_transfers
from megatrain_cli.optim.host_adamw import HostAdamW, clip_coefficient
from megatrain_cli.optim.worker import OptimizerWorker
from megatrain_cli.recipe import TrainConfig
from megatrain_cli.store.sharded import ShardedHostStore
from megatrain_cli.store.tiles import HostStore

if TYPE_CHECKING:  # torch.distributed is imported only by a distributed engine
    from megatrain_cli.engine.dist import DistContext


class Engine:
    """Drives plain HF layer modules over a host store, one streamed layer at a time.

    `long_context` (a LongContextPlan, issue #9) switches on the long-sequence path: every layer
    template runs its MLP tiled over plan.mlp_tile_tokens tokens, the RMSNorms keep 4 bytes per row when
    plan.lean_norms, the head's loss chunk is the plan's, and the activation checkpoints go through a
    CheckpointOffloader (plan.offload_keys live in host memory between forward and backward; each is
    brought back one block ahead of its recompute). `sdpa` restricts SDPA's backends on CUDA
    (tiling.sdpa_backend_context) for the op loop: 'auto' = cuDNN/flash/efficient, never MATH, and is
    applied only with a long-context plan; an explicit backend name applies either way. Without a plan
    and with sdpa='auto' the engine is exactly the short-context one.

    `kernels` (issue #8): 'triton' routes every layer template's and the final-norm template's RMSNorms,
    the SiLU MLPs' act(gate) * up and the attention's RoPE through megatrain_cli.kernels
    (kernel_patch.install_kernels, after the long-context pieces: a tiled MLP keeps its eager activation,
    a lean norm becomes the kernel's, which saves the same bytes), and the head uses the fused linear +
    cross-entropy. 'torch' is the plain HF/PyTorch path; 'auto' = 'triton' on CUDA, 'torch' elsewhere
    (kernel_patch.resolve). A kernel whose Triton path fails falls back to its PyTorch reference with
    one warning (the registry in megatrain_cli.kernels).

    `host_adamw` ('auto' | 'torch' | 'cpp') and `defer_moments` pick the host AdamW code and whether
    deferred (clipped-step) updates store their moments after the next forward (optim/host_adamw.py,
    optim/worker.py). `packer_threads` / `adamw_threads` cap the intra-op threads of the packer's casts and
    of host AdamW (None: torch's default, every core).

    `update_on_read` (one process, host casts, bf16 compute, the C++ kernel with deferred moments): a clipped
    step's weight updates are applied by the packer as the next forward streams each tile, the new weights
    cast into pinned staging from registers (optim/worker.py: update on read); off: the worker updates, the
    packer casts. Bit-identical either way.

    `dist` (a DistContext, issue #11) makes this engine one data-parallel rank: `store` is this rank's
    ShardedHostStore, `step` gets this rank's share of the step's micro-batches (split_micro_batches),
    layers are assembled on the device by all-gathers and gradients leave reduce-scattered, the loss is
    normalised by the global token count and the gradient norm is global (engine/distributed.py). On
    CUDA the transfers overlap compute as on one GPU (engine/dist_pipeline.py) unless dist.overlap is
    False; on the CPU they are synchronous. Without `dist`, nothing changes.
    """

    def __init__(self, store: HostStore, train: TrainConfig, *, device: torch.device,
                 checkpoint_interval: int = 1, loss_chunk_tokens: int = 4096,
                 keep_blocks: frozenset[int] = frozenset(), layer_slots: int = 2, grad_slabs: int = 12,
                 double_buffer: bool = True, overlap_optimizer: bool = False, speculate: bool = True,
                 long_context: LongContextPlan | None = None, sdpa: str = "auto", kernels: str = "torch",
                 host_adamw: str = "auto", defer_moments: bool = True, update_on_read: bool = True,
                 packer_threads: int | None = None, adamw_threads: int | None = None,
                 dist: DistContext | None = None):
        if long_context is not None and long_context.checkpoint_interval != checkpoint_interval:
            raise ValueError(f"the long-context plan is for checkpoint_interval {long_context.checkpoint_interval}, "
                             f"the engine was given {checkpoint_interval}: pass "
                             f"checkpoint_interval=plan.checkpoint_interval (its memory terms assume it)")
        if sdpa not in SDPA_BACKENDS:
            raise ValueError(f"unknown SDPA backend {sdpa!r}; one of {', '.join(SDPA_BACKENDS)}")
        if dist is not None and not isinstance(store, ShardedHostStore):
            raise ValueError("a distributed engine needs this rank's ShardedHostStore (store/sharded.py)")
        if dist is not None and (store.rank, store.world) != (dist.rank, dist.world):
            raise ValueError(f"the store holds shard {store.rank} of {store.world}, this is rank {dist.rank} "
                             f"of {dist.world}")
        self.dist = dist
        self.kernels = kernel_patch.resolve(kernels, device)  # 'torch' or 'triton'
        self.store, self.train_cfg, self.device = store, train, device
        self.adapter = store.adapter
        self.dtype = store.compute_dtype
        self.interval = checkpoint_interval
        self.chunk = loss_chunk_tokens
        self.templates = TemplatePool(self.adapter)
        self.norm_template = self.adapter.make_norm_template()
        self.rotary = self.adapter.make_rotary(device)
        self.optimizer = HostAdamW(train, kernel=host_adamw, defer_moments=defer_moments)
        self.worker = None
        self.update_on_read = False
        if overlap_optimizer:
            self.worker = OptimizerWorker(self.optimizer, store, forward_order=self.update_order(),
                                          max_grad_norm=train.max_grad_norm, speculate=speculate,
                                          threads=adamw_threads)
        before_read = self.worker.wait if self.worker else None
        self.streamer, self.sink = make_transfers(store, device, self.dtype, dist=dist, layer_slots=layer_slots,
                                                  double_buffer=double_buffer, grad_slabs=grad_slabs,
                                                  before_read=before_read, packer_threads=packer_threads)
        if self.worker is not None:
            self.sink.on_landed = self.worker.landed  # AdamW starts on a tile as soon as its gradient lands
            self.sink.before_write = self.worker.wait_state  # deferred moments read the old gradient
            # A clipped step's weights are updated by the packer as the next forward streams them (optim/
            # worker.py: update on read): the host-cast streamers of one process, bf16 compute, C++ kernel.
            self.update_on_read = (update_on_read and self.optimizer.defer_moments and self.dtype == torch.bfloat16
                                   and dist is None)
            if self.update_on_read:
                self.worker.update_on_read = frozenset([*store.layer_names, "head"])
                self.streamer.claim = self.worker.claim
        else:
            self.optimizer.defer_moments = False  # nothing would run the moments pass
        # Op | None -> None: None when a step's ops begin, then each op once its host work is issued (a
        # per-layer observer: bench_long's clock). Unset on the hot path: one attribute check per op.
        self.on_op = None
        self.redirect = WeightRedirect(self.streamer.resident)
        self.streamer.on_bind = self.redirect.bind
        self.ops = build_schedule(self.adapter.num_layers, checkpoint_interval, keep_blocks)
        self.keep_blocks = keep_blocks
        self.long_context, self.sdpa = long_context, sdpa
        self.offloader: CheckpointOffloader | None = None
        if long_context is not None:
            self._install_long_context(long_context)
        self._fused_ce = None
        if self.kernels == "triton":  # after the long-context pieces: see kernel_patch's precedence
            for template in (*self.templates.all(), self.norm_template):
                kernel_patch.install_kernels(template)
            self._fused_ce = kernel_patch.fused_cross_entropy()

    def _install_long_context(self, plan: LongContextPlan) -> None:
        if plan.mlp_tile_tokens:
            for template in self.templates.all():
                tile_mlp(template, plan.mlp_tile_tokens)
        if plan.lean_norms:
            for template in self.templates.all():
                slim_norms(template)
            slim_norms(self.norm_template)
        self.chunk = plan.loss_chunk_tokens  # the plan's head term assumes its chunk
        self.offloader = CheckpointOffloader(self.device, frozenset(plan.offload_keys))
        # The blocks in the order the backward recomputes them: each get() prefetches the next one.
        self._recompute_order = list(dict.fromkeys(op.block for op in self.ops if op.kind == "recompute"))
        self._first_recompute = self._recompute_order[0] if self._recompute_order else None
        self._next_recompute = dict(zip(self._recompute_order, self._recompute_order[1:]))

    def reserve_checkpoint_buffers(self, micro_batch_shapes: list[tuple[int, int]]) -> int:
        """Pin the offloaded checkpoints' host buffers before the first step (micro-batch [B, T] shapes of
        the steps to come); returns the bytes pinned. Without a long-context plan, or on CPU: 0."""
        if self.offloader is None:
            return 0
        like = [((b, t, self.adapter.hidden_size), self.dtype) for b, t in micro_batch_shapes]
        return sum(self.offloader.reserve(block, like) for block in self._recompute_order)

    def _check_mask_size(self, pos: torch.Tensor) -> None:
        b, t = pos.shape
        if b * t * t > MAX_LONG_CONTEXT_MASK and bool((pos[:, 1:] == 0).any()):
            raise ValueError(f"packed rows (positions restart inside a row) of {t} tokens need a [T, T] block-causal "
                             f"mask ({b * t * t / 2**30:.0f} GiB) and keep SDPA off flash/cuDNN: at long context "
                             f"train one document per row (data.packing=false)")

    def _sdpa_context(self):
        if self.device.type != "cuda" or (self.long_context is None and self.sdpa == "auto"):
            return contextlib.nullcontext()
        return sdpa_backend_context(self.sdpa, self.device)

    # ------------------------------------------------------------ helpers
    def _grad_zeros(self, tile: str) -> torch.Tensor:
        """A tile's fp32 gradient accumulator; on the distributed path padded to the store's shard multiple
        (the tail stays zero), so the sink reduce-scatters it as it is."""
        n = self.store.layouts[tile].numel if self.dist is None else self.store.padded_numel(tile)
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def _weights(self, tile: str, flat: torch.Tensor, grad: bool) -> dict[str, torch.Tensor]:
        views = self.store.layouts[tile].views(flat)
        if grad:
            views = {k: v.detach().requires_grad_() for k, v in views.items()}
        return views

    def _layer(self, i: int, weights, h, ctx):
        pos_emb, mask, pos = ctx
        return run_bound(self.templates.next_for(i), weights, h, attention_mask=mask, position_ids=pos,
                         position_embeddings=pos_emb)

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
        res.times["optimizer"] = time.perf_counter() - t0
        return res

    def recomputed_layers(self) -> int:
        """Layers whose forward runs twice per step (their block is recomputed for its backward)."""
        return sum(len(b) for i, b in enumerate(blocks(self.adapter.num_layers, self.interval))
                   if i not in self.keep_blocks)

    def mlp_tile_tokens(self) -> int | None:
        """Tokens per MLP tile when the long-context plan tiles the MLP (its backward redoes gate / up)."""
        return self.long_context.mlp_tile_tokens if self.long_context is not None else None

    def update_order(self) -> list[str]:
        """The order the next forward reads tiles: embedding rows, layers, head."""
        return ["embed", *self.store.layer_names, "head"]

    def synchronize(self) -> None:
        """Wait for every pending update (before reading masters: checkpoint, export, eval)."""
        if self.worker is not None:
            self.worker.drain()

    def close(self) -> None:
        self.synchronize()
        if self.offloader is not None:
            self.offloader.clear()
        for part in (self.worker, self.streamer, self.sink):
            if part is not None and hasattr(part, "close"):
                part.close()

    def forward_backward(self, mbs: list[MicroBatch]) -> StepResult:
        dev, H = self.device, self.adapter.hidden_size
        times: dict[str, float] = {}
        self.streamer.begin_step(fetch_order(self.ops))
        t_start = time.perf_counter()

        # Per micro-batch inputs. Embedding rows are gathered on the host (only the unique tokens of
        # the step cross PCIe, never the whole table); labels are shifted once here.
        waited_before = self.worker.waited_s if self.worker is not None else 0.0
        if self.worker is not None:
            self.streamer.idle_while(lambda: self.worker.wait("embed"))
        ids_all = torch.cat([mb.input_ids.reshape(-1) for mb in mbs])
        uniq, inverse = torch.unique(ids_all, return_inverse=True)
        if self.dist is None:
            rows = self.store.tiles["embed"].master.view(-1, H)[uniq].to(dev, self.dtype)
        else:
            self.sink.reset()
            rows = self.streamer.embed_rows(uniq)  # the rows live on their owner ranks
        inv_dev = inverse.to(dev)
        h, ctx, labels, offsets = [], [], [], []
        n_loss_tokens, start = 0, 0
        for mb in mbs:
            b, t = mb.input_ids.shape
            offsets.append((start, start + b * t))
            h.append(rows[inv_dev[start:start + b * t]].view(b, t, H))
            start += b * t
            pos = mb.position_ids if mb.position_ids is not None else torch.arange(t).expand(b, t)
            pos = pos.to(dev)
            if self.long_context is not None:
                self._check_mask_size(pos)
            ctx.append((self.rotary(h[-1], pos), block_causal_mask(pos), pos))
            shifted = torch.full_like(mb.labels, IGNORE_INDEX)
            shifted[:, :-1] = mb.labels[:, 1:]
            labels.append(shifted.to(dev))
            n_loss_tokens += int((shifted != IGNORE_INDEX).sum())
        if self.dist is not None:  # every rank scales by the global batch's loss tokens
            n_loss_tokens = int(self.dist.sum_scalars([n_loss_tokens])[0])
        norm_scale = 1.0 / max(1, n_loss_tokens)
        sq_norm = torch.zeros((), dtype=torch.float32, device=dev)

        checkpoints: dict[int, list[torch.Tensor]] = {}
        graphs: dict[int, tuple[list, list, dict]] = {}  # layer -> (inputs, outputs, leaves)
        grads_out: list[torch.Tensor] = []
        losses: list[float] = []

        off = self.offloader
        if off is not None:
            off.forget()  # anything a failed step left behind
        t0 = time.perf_counter()
        op = None
        if self.on_op is not None:
            self.on_op(None)  # the inputs are ready; the schedule's ops follow
        try:
            with self._sdpa_context():
                for op in self.ops:
                    if op.kind == "forward":
                        if op.checkpoint:
                            if off is None:
                                checkpoints[op.block] = list(h)
                            elif op.block not in self.keep_blocks:  # a kept block is never recomputed
                                off.put(op.block, list(h))
                        flat = self.streamer.acquire(op.tile)
                        if op.grad:
                            h = self._record_layer(op.layer, flat, h, ctx, graphs)
                        else:
                            with torch.no_grad():
                                w = self._weights(op.tile, flat, grad=False)
                                h = [self._layer(op.layer, w, x, c) for x, c in zip(h, ctx)]
                    elif op.kind == "head":
                        times["forward"] = time.perf_counter() - t0
                        t0 = time.perf_counter()
                        if self.worker is not None:  # the forward has every weight it needs: the last
                            self.worker.release_moments()  # step's deferred moments may use the host now
                        if off is not None and self._first_recompute is not None:
                            off.prefetch(self._first_recompute)  # comes back while the head computes
                        grads_out, losses, head_grad = self._head(h, labels, norm_scale, sq_norm)
                        h = []
                        times["head"] = time.perf_counter() - t0
                        t0 = time.perf_counter()
                    elif op.kind == "recompute":
                        if op.layer == blocks(self.adapter.num_layers, self.interval)[op.block].start:
                            if off is None:
                                h = checkpoints.pop(op.block)
                            else:
                                h = off.get(op.block)
                                if op.block in self._next_recompute:  # one block ahead, behind this one's compute
                                    off.prefetch(self._next_recompute[op.block])
                        flat = self.streamer.acquire(op.tile)
                        h = self._record_layer(op.layer, flat, h, ctx, graphs)
                    elif op.kind == "backward":
                        flat = self.streamer.acquire(op.tile)
                        grads_out = self._backward_layer(op.layer, grads_out, graphs, sq_norm)
                    elif op.kind == "embed_backward":
                        self._embed_backward(grads_out, uniq, inv_dev, offsets, head_grad, sq_norm)
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
        if self.dist is None:
            grad_norm = float(sq_norm.sqrt())
        else:  # sq_norm above is this rank's unreduced gradient: the sink has its share of the reduced one
            sq, loss_sum, total, n_tokens = self.dist.sum_scalars(
                [self.sink.take_sq_norm(), loss_sum, total, n_tokens])
            grad_norm, n_tokens = math.sqrt(sq) if sq >= 0 else float("nan"), int(n_tokens)
        finite = math.isfinite(grad_norm) and math.isfinite(loss_sum)
        times["total_fb"] = time.perf_counter() - t_start
        st = self.streamer.stats
        return StepResult([l for l, _ in losses], loss_sum / max(1, total), grad_norm,
                          n_tokens, n_loss_tokens, skipped=not finite, times=times,
                          h2d_bytes=st.h2d_bytes, d2h_bytes=st.d2h_bytes, h2d_count=dict(st.h2d_count))

    # ------------------------------------------------------------ phases
    def _record_layer(self, i: int, flat, h, ctx, graphs) -> list[torch.Tensor]:
        """Run layer i on every micro-batch with autograd; the graph refers to weights by tile."""
        tile = f"layers.{i}"
        w = self._weights(tile, flat, grad=True)
        xs = [x.detach().requires_grad_() for x in h]
        with torch.enable_grad(), self.redirect.hooks():
            ys = [self._layer(i, w, x, c) for x, c in zip(xs, ctx)]
        graphs[i] = (xs, ys, w)
        return [y.detach() for y in ys]

    def _backward_layer(self, i: int, grads_out, graphs, sq_norm) -> list[torch.Tensor]:
        xs, ys, w = graphs.pop(i)
        names = list(w)
        layout = self.store.layouts[f"layers.{i}"]
        acc = self._grad_zeros(f"layers.{i}")
        acc_views = layout.views(acc)
        grads_in = []
        for x, y, g in zip(xs, ys, grads_out):
            out = torch.autograd.grad(y, [x, *w.values()], g)
            grads_in.append(out[0])
            for name, gw in zip(names, out[1:]):
                acc_views[name].add_(gw)
        sq = torch.dot(acc, acc)  # no temporary the size of the layer, unlike acc.square().sum()
        sq_norm.add_(sq)
        self.sink.send(f"layers.{i}", acc, sq)
        return grads_in

    def _head(self, h, labels, norm_scale, sq_norm):
        """Final norm + LM head + cross-entropy, in token chunks so full logits never exist."""
        flat = self.streamer.acquire("head")
        w = self._weights("head", flat, grad=False)
        norm_w = {k[len("norm."):]: v.detach().requires_grad_() for k, v in w.items() if k.startswith("norm.")}
        if self.adapter.tied:
            lm_w = self.streamer.acquire("embed").view(self.adapter.vocab_size, -1)
        else:
            lm_w = w["lm_head.weight"]
        if self.adapter.tied:  # the embedding tile's gradient: padded on the distributed path
            tied_flat = self._grad_zeros("embed")
            lm_grad = tied_flat[:lm_w.numel()].view(lm_w.shape)
        else:
            lm_grad = torch.zeros(lm_w.shape, dtype=torch.float32, device=self.device)
        norm_grad = {k: torch.zeros(v.shape, dtype=torch.float32, device=self.device) for k, v in norm_w.items()}
        grads_out, losses = [], []
        for x, lab in zip(h, labels):
            x = x.detach().requires_grad_()
            with torch.enable_grad():
                normed = run_bound(self.norm_template, norm_w, x)
            flat_n = normed.detach().reshape(-1, normed.shape[-1])
            flat_l = lab.reshape(-1)
            if self._fused_ce is not None:
                d_normed, loss_sum = self._fused_loss(flat_n, flat_l, lm_w, lm_grad, norm_scale)
            else:
                d_normed, loss_sum = self._chunked_loss(flat_n, flat_l, lm_w, lm_grad, norm_scale)
            n_tok = int((flat_l != IGNORE_INDEX).sum())
            out = torch.autograd.grad(normed, [x, *norm_w.values()], d_normed.view_as(normed))
            grads_out.append(out[0])
            for name, g in zip(norm_w, out[1:]):
                norm_grad[name].add_(g)
            losses.append((loss_sum / max(1, n_tok), n_tok))
        head_layout = self.store.layouts["head"]
        head_acc = self._grad_zeros("head")
        views = head_layout.views(head_acc)
        for name, g in norm_grad.items():
            views["norm." + name].copy_(g)
        if not self.adapter.tied:
            views["lm_head.weight"].copy_(lm_grad)
        sq = torch.dot(head_acc, head_acc)
        sq_norm.add_(sq)
        self.sink.send("head", head_acc, sq)
        # Tied: the whole embedding tile's gradient, sent after the embedding rows are added; else sent now.
        return grads_out, losses, (tied_flat if self.adapter.tied else None)

    def _chunked_loss(self, flat_n, flat_l, lm_w, lm_grad, norm_scale) -> tuple[torch.Tensor, float]:
        """The PyTorch head loss: per token chunk a matmul, cross-entropy on fp32 logits and autograd;
        adds the LM-head gradient to lm_grad; returns (d loss*norm_scale / d flat_n, unscaled loss sum)."""
        d_normed = torch.zeros_like(flat_n)
        loss_sum = 0.0
        for lo in range(0, flat_n.shape[0], self.chunk):
            hi = min(lo + self.chunk, flat_n.shape[0])
            if not bool((flat_l[lo:hi] != IGNORE_INDEX).any()):
                continue
            n_c = flat_n[lo:hi].detach().requires_grad_()
            w_c = lm_w.detach().requires_grad_()
            with torch.enable_grad():
                logits = n_c @ w_c.t()
                l_sum = torch.nn.functional.cross_entropy(logits.float(), flat_l[lo:hi],
                                                          ignore_index=IGNORE_INDEX, reduction="sum")
            gn, gw = torch.autograd.grad(l_sum * norm_scale, [n_c, w_c])
            d_normed[lo:hi] = gn
            lm_grad.add_(gw)
            loss_sum += float(l_sum.detach())
        return d_normed, loss_sum

    def _fused_loss(self, flat_n, flat_l, lm_w, lm_grad, norm_scale) -> tuple[torch.Tensor, float]:
        """The same through kernels.fused_linear_cross_entropy: no autograd, one [chunk, V] logits buffer
        that becomes its own gradient, the LM-head gradient accumulated in lm_grad (fp32) in place."""
        loss, d_normed, _ = self._fused_ce(flat_n, lm_w, flat_l.to(torch.int64), ignore_index=IGNORE_INDEX,
                                           chunk_tokens=self.chunk, scale=norm_scale, grad_weight=lm_grad)
        return d_normed, float(loss) / norm_scale  # the kernel's loss is scaled; the engine reports sums

    def _embed_backward(self, grads_out, uniq, inv_dev, offsets, tied_flat, sq_norm) -> None:
        H = self.adapter.hidden_size
        rows = torch.zeros(uniq.numel(), H, dtype=torch.float32, device=self.device)
        for g, (lo, hi) in zip(grads_out, offsets):
            rows.index_add_(0, inv_dev[lo:hi], g.reshape(-1, H).float())
        if tied_flat is not None:
            tied_grad = tied_flat[:self.adapter.vocab_size * H].view(self.adapter.vocab_size, H)
            tied_grad.index_add_(0, uniq.to(self.device), rows)
            flat = tied_flat
            sq = torch.dot(flat, flat)
            sq_norm.add_(sq)
            self.sink.send("embed", flat, sq)
        else:
            sq = rows.square().sum()
            sq_norm.add_(sq)
            self.sink.send_rows("embed", rows, uniq, sq)
