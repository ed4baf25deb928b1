"""The planner's probe: a few seconds that MEASURE this machine, cached per machine.

What predict.py needs and nothing else:

    link      pinned H2D and D2H bandwidth, and each way while both run at once (two streams)
    host      HostAdamW.update over one tile (the engine's kernel: C++ where it compiles), params/s, alone
              and while the DMA engines copy both ways (they share the host's memory bandwidth); the same
              for update on read (the C++ weights pass casting into pinned staging, what the packer runs
              after a clipped step); the packer's fp32 -> bf16 cast into pinned memory, elements/s
    device    bf16 GEMM TFLOP/s (an N x N x N matmul) and device memory bandwidth (a device-to-device
              copy: what an AdamW over resident layers is bound by)
    layer     the engine's own ops at the recipe's micro-batch x sequence (packed rows: docs_per_row equal
              documents), per micro-batch: a layer's forward (no autograd), recorded forward (a recompute or a
              kept block's), backward, the head, the fixed work, a VLM's tower layer (engine/vision_probe.py); by
              engine/layer_probe.py (passed in as `measure_layer`) over one layer of each structure, by count

On a machine without CUDA the link and device figures are None (unknown) and the layer is timed only when the
recipe computes on the CPU. The cache: one JSON file per machine (`cache_key`: host, GPU, torch) in the user's
cache directory, layer timings under their own key (`layer_key`); `load_or_probe(..., reprobe=True)` measures again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

# 2: engine-timed layers (recorded, head, fixed); 3: coded states' rates; 4: a VLM's tower layer (v3 priced it at 0)
CACHE_VERSION = 4
# Bytes of host memory traffic per parameter of the measured HostAdamW.update (optim/adamw_cpp.py: the C++
# pass reads p, m, v and a bf16 g and writes p, m, v; the torch path also widens g through fp32 scratch).
UPDATE_BYTES = {"cpp": 26.0, "torch": 34.0}
HOST_WARMUP = 5  # untimed passes before each host figure
CODED = ("bf16", "int8")  # train.optimizer_state values whose update pass is timed on its own


def coded_key(moments: str, masters: str = "fp32") -> str:
    """The name a coded pass's rate is kept under: its moments, and its masters where they are bf16 rounded
    stochastically (a hash per element more; 'int8+bf16-stochastic'); fp32 or nearest-rounded masters cost the
    pass nothing measurable beyond its bytes, so they share the moments' own rate."""
    return f"{moments}+{masters}" if masters == "bf16-stochastic" else moments


@dataclass
class LayerTiming:
    """Seconds per micro-batch as the engine runs them: per decoder layer (the mean over the model's layers),
    the head, and the step's fixed work."""

    forward_s: float  # the forward without autograd (a streamed step's forward)
    backward_s: float  # the backward op alone
    tokens: int  # micro_batch_size x seq_len
    device: str
    recorded_s: float | None = None  # the forward with autograd (a recompute, a kept block's forward); None: forward_s
    head_s: float | None = None  # final norm + chunked loss, forward and backward; None: from the layer's FLOP rate
    fixed_s: float = 0.0  # the step's inputs (embedding rows, masks) and the embedding's backward
    vision_forward_s: float = 0.0  # one tower layer over a micro-batch's images (vision_probe.py); 0: no images
    vision_backward_s: float = 0.0  # its recompute + backward, as vision_phase runs them

    @property
    def recorded(self) -> float:
        return self.forward_s if self.recorded_s is None else self.recorded_s


@dataclass
class MachineFigures:
    host: str
    gpu: str | None  # None: no CUDA here, every device figure unknown
    torch: str
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    duplex_gbps: float | None = None  # each way, H2D and D2H at once
    adamw_params_per_s: float = 0.0
    adamw_under_dma_params_per_s: float | None = None  # while both DMA directions run
    adamw_kernel: str = "torch"
    # update on read (HostAdamW.update_weights_span: the weights pass casting into pinned staging), the C++
    # kernel only: the packer's work on a tile after a clipped step; None where the kernel is torch's
    emit_params_per_s: float | None = None
    emit_under_dma_params_per_s: float | None = None
    # the one-pass update over bf16 / int8 moments (adamw_state.cpp), by train.optimizer_state: alone, under DMA
    state_params_per_s: dict = field(default_factory=dict)
    state_under_dma_params_per_s: dict = field(default_factory=dict)
    cast_elems_per_s: float = 0.0  # fp32 -> bf16 into pinned (pageable without CUDA)
    gemm_tflops: float | None = None
    device_gbps: float | None = None  # device memory: bytes read + written per second by a D2D copy
    measured_at: float = 0.0

    @property
    def host_gbps(self) -> float:
        """Host memory bandwidth as the AdamW pass sees it (its bytes x its params/s)."""
        return self.adamw_params_per_s * UPDATE_BYTES.get(self.adamw_kernel, 26.0) / 1e9

    def host_gbps_at(self, link_busy: float) -> float:
        """Host bandwidth with the DMA engines busy `link_busy` (0..1) of the time: between the probe's
        figure alone and its figure under both DMA directions, linearly."""
        return _between(self.adamw_params_per_s, self.adamw_under_dma_params_per_s, link_busy) * \
            UPDATE_BYTES.get(self.adamw_kernel, 26.0) / 1e9

    def emit_at(self, link_busy: float) -> float | None:
        """Params/s of update on read with the DMA engines busy `link_busy` of the time (None: not measured)."""
        return _between(self.emit_params_per_s, self.emit_under_dma_params_per_s, link_busy) \
            if self.emit_params_per_s else None

    def state_at(self, moments: str, link_busy: float) -> float | None:
        """Params/s of the one-pass update over `moments` (bf16 / int8) with the DMA engines busy `link_busy` of
        the time; None where not measured (then priced by its bytes)."""
        alone = self.state_params_per_s.get(moments)
        return _between(alone, self.state_under_dma_params_per_s.get(moments), link_busy) if alone else None

    def unknown(self) -> list[str]:
        return [k for k in ("h2d_gbps", "d2h_gbps", "duplex_gbps", "gemm_tflops", "device_gbps")
                if getattr(self, k) is None]


def _between(alone: float, under_dma: float | None, busy: float) -> float:
    if not under_dma:
        return alone
    busy = min(1.0, max(0.0, busy))
    return alone + (under_dma - alone) * busy


@dataclass
class Probe:
    machine: MachineFigures
    layer: LayerTiming | None = None  # None: not measured (a CUDA recipe planned on a machine without CUDA)
    path: Path | None = None
    measured: list = field(default_factory=list)  # what this call measured ('machine', 'layer'); [] = cached


def default_cache_dir() -> Path:
    """The user's cache directory (XDG convention, else ~/.cache), as the tokenisation cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatrain" / "probe"


def cache_key() -> str:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", f"{socket.gethostname()}-{gpu}-torch{torch.__version__}")


def layer_key(adapter, *, micro_batch_size: int, seq_len: int, dtype: torch.dtype, device: torch.device,
              kernels: str, loss_chunk_tokens: int = 4096, lean=None, docs_per_row: int | None = None,
              vision_images: tuple[int, int] | None = None) -> str:
    """The model's layer shapes (every distinct structure), its attention code, its head, the step's shape and
    how the engine runs it (kernels, loss chunk, a lean plan's MLP chunk and norms): a layer timing is reused
    only for the same work. Stable across processes (hashlib, not hash())."""
    cfg = adapter.config.get_text_config()
    shapes = sorted({json.dumps([(s.name, s.shape) for s in adapter.layer_specs(i)]) for i in range(adapter.num_layers)})
    what = json.dumps([adapter.model_type, getattr(cfg, "_attn_implementation", None), adapter.layer_types, shapes,
                       getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None),
                       adapter.vocab_size, adapter.tied])
    digest = hashlib.sha1(what.encode()).hexdigest()[:12]
    way = f"loss{loss_chunk_tokens}" if lean is None else \
        f"lean-loss{lean.loss_chunk_tokens}-mlp{lean.mlp_chunk_tokens or 0}{'-norms' if lean.lean_norms else ''}"
    docs = "" if docs_per_row is None else f"-{docs_per_row}docs"  # packed rows: attention within documents
    docs += "" if not vision_images else "-img{}x{}".format(*vision_images)  # images a micro-batch x grid side
    return (f"{adapter.model_type}-{digest}-{micro_batch_size}x{seq_len}{docs}-{str(dtype).removeprefix('torch.')}-"
            f"{device.type}-{kernels}-{way}")


def docs_per_row(pairs_per_row: float, seq_len: int) -> int:
    """Packed rows as the probe times them: the number of equal-length documents a row would hold for the same
    sum of squared document lengths (attention's cost in a packed row; data/train_data.attention_pairs_per_row),
    so rows of the same attention work share one timing."""
    return max(1, min(seq_len, round(seq_len * seq_len / max(1.0, pairs_per_row))))


# ------------------------------------------------------------------ timing helpers
def timed(fn: Callable[[], object], *, reps: int, warmup: int = 1, cuda: bool = False) -> float:
    """The median seconds of `fn` over `reps` runs after `warmup` (CUDA: synchronized around each)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _host_tile(params: int, moments: str = "fp32", master: torch.dtype = torch.float32):
    """One layer-like tile of `params` parameters (bf16 gradients), filled so AdamW does real math."""
    from megatrain_cli.store.tiles import ParamSpec, TileLayout, allocate_tile

    cols = 4096
    spec = ParamSpec("w", (max(1, params // cols), cols))
    tile = allocate_tile("layers.0", TileLayout.from_specs([spec]), torch.bfloat16, master, moments)
    tile.master.normal_(0, 0.02)
    for state in (tile.exp_avg, tile.exp_avg_sq, tile.exp_avg_exp, tile.exp_avg_sq_exp):
        state.zero_()  # coded moments: zero codes and exponents (a zero moment); fp32: zero, then v below
    if moments == "fp32":
        tile.exp_avg_sq.fill_(1e-6)
    tile.grad.normal_(0, 1e-3)
    return tile


class _Dma:
    """Both DMA directions busy in a side thread until stopped (copies release the GIL): what the host's
    memory looks like to AdamW while the engine streams."""

    def __init__(self, nbytes: int):
        self.host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self.dev_in = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.dev_out = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        self.streams = (torch.cuda.Stream(), torch.cuda.Stream())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def both_once(self) -> None:
        with torch.cuda.stream(self.streams[0]):
            self.dev_in.copy_(self.host_in, non_blocking=True)
        with torch.cuda.stream(self.streams[1]):
            self.host_out.copy_(self.dev_out, non_blocking=True)
        for s in self.streams:
            s.synchronize()

    def __enter__(self):
        def loop():
            while not self._stop.is_set():
                self.both_once()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


# ------------------------------------------------------------------ the machine
def measure_machine(*, tile_bytes: int = 256 << 20, link_bytes: int = 256 << 20, gemm_n: int = 8192,
                    reps: int = 3, log: Callable[[str], None] | None = None) -> MachineFigures:
    """Every machine figure (module doc). `tile_bytes`: the AdamW tile's host bytes (14 per parameter);
    `link_bytes`: each DMA copy; `gemm_n`: the matmul's size. Smaller values make a faster, rougher probe."""
    from megatrain_cli.machine import busy_note
    from megatrain_cli.optim.host_adamw import HostAdamW
    from megatrain_cli.recipe import TrainConfig

    cuda = torch.cuda.is_available()
    fig = MachineFigures(host=socket.gethostname(), gpu=torch.cuda.get_device_name(0) if cuda else None,
                         torch=torch.__version__, measured_at=time.time())
    say = log or (lambda _m: None)

    params = max(1 << 16, tile_bytes // 14)
    tile = _host_tile(params)
    opt = HostAdamW(TrainConfig(), kernel="auto")
    fig.adamw_kernel = opt.kernel
    if note := busy_note():  # other work on the host: its figures come out low, and are cached
        say(f"probe: {note}")
    say(f"probe: host AdamW ({opt.kernel}) over {tile.numel / 1e6:.0f} M params")
    # A process's first host passes run slower (its OpenMP team and pages still cold): the host figures are
    # timed after HOST_WARMUP passes, as a training run's steady state sees them.
    fig.adamw_params_per_s = tile.numel / timed(lambda: opt.update(tile, 1e-5), reps=reps, warmup=HOST_WARMUP)

    # The one-pass update over coded moments decodes, updates and codes again with stochastic rounding: arithmetic
    # more than bandwidth, so it is timed itself, not priced by its bytes at the fp32 pass's GB/s (a 7B step
    # with int8 moments was predicted 3.12 s and measured 7.06: docs/benchmarks.md, session 14).
    coded = {}
    for m in CODED:
        coded[coded_key(m)] = (_host_tile(params, m), HostAdamW(TrainConfig(optimizer_state=m), kernel="auto"))
        sr = TrainConfig(optimizer_state=m, master_weights="bf16", master_rounding="stochastic")
        coded[coded_key(m, "bf16-stochastic")] = (_host_tile(params, m, torch.bfloat16),
                                                  HostAdamW(sr, kernel="auto"))
    for m, (t, o) in coded.items():
        say(f"probe: host AdamW over {m} moments")
        fig.state_params_per_s[m] = t.numel / timed(lambda: o.update(t, 1e-5), reps=reps, warmup=HOST_WARMUP)

    src = tile.master
    dst = torch.empty(src.numel(), dtype=torch.bfloat16, pin_memory=cuda)
    emit = None
    if opt.defer_moments:  # the C++ kernel: update on read exists
        def _emit():
            opt.update_weights_span(tile, 1e-5, 0.5, 0, tile.numel, dst)
            opt.count_step(tile)
        emit = _emit
        fig.emit_params_per_s = tile.numel / timed(emit, reps=reps, warmup=HOST_WARMUP)
    say("probe: fp32 -> bf16 cast into pinned memory" if cuda else "probe: fp32 -> bf16 cast")
    fig.cast_elems_per_s = src.numel() / timed(lambda: dst.copy_(src), reps=reps, warmup=HOST_WARMUP)

    if cuda:
        say(f"probe: PCIe, {link_bytes >> 20} MiB copies")
        dma = _Dma(link_bytes)
        fig.h2d_gbps = link_bytes / timed(lambda: dma.dev_in.copy_(dma.host_in, non_blocking=True), reps=reps,
                                           cuda=True) / 1e9
        fig.d2h_gbps = link_bytes / timed(lambda: dma.host_out.copy_(dma.dev_out, non_blocking=True), reps=reps,
                                           cuda=True) / 1e9
        fig.duplex_gbps = link_bytes / timed(dma.both_once, reps=reps, cuda=True) / 1e9
        with dma:
            fig.adamw_under_dma_params_per_s = tile.numel / timed(lambda: opt.update(tile, 1e-5), reps=reps)
            if emit is not None:
                fig.emit_under_dma_params_per_s = tile.numel / timed(emit, reps=reps)
            for m, (t, o) in coded.items():
                fig.state_under_dma_params_per_s[m] = t.numel / timed(lambda: o.update(t, 1e-5), reps=reps)
        del dma
        say(f"probe: bf16 GEMM {gemm_n}^3, device memory")
        a = torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(gemm_n, gemm_n, device="cuda", dtype=torch.bfloat16)
        fig.gemm_tflops = 2.0 * gemm_n ** 3 / timed(lambda: a @ b, reps=reps, cuda=True) / 1e12
        del a, b
        x = torch.empty(link_bytes * 4, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        fig.device_gbps = 2 * x.numel() / timed(lambda: y.copy_(x), reps=reps, cuda=True) / 1e9
        del x, y
        torch.cuda.empty_cache()
    return fig


# ------------------------------------------------------------------ the cache
def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # missing, or damaged: measured again
    return data if isinstance(data, dict) and data.get("version") == CACHE_VERSION else None


def _write(path: Path, data: dict) -> None:
    """Atomically (a half-written cache read by a second process would only be measured again, but a
    rename costs nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)


def recipe_shape(r, device: torch.device, plan=None, docs: int | None = None, images=None) -> dict:
    """The layer-timing keys of recipe `r` on `device` (micro-batch, sequence, compute dtype, the kernels the
    engine will run, its loss chunk, and `plan`'s lean plan when it has one): what `plan`, `bench` and `train`
    pass to load_or_probe / read_cached. `docs`: packed rows' docs_per_row (None: one document per row, as a packed
    recipe before its data is read); `images`: a VLM's (images a micro-batch, patches a side), None: no tower."""
    from megatrain_cli.engine import kernel_patch
    from megatrain_cli.engine.plan.step_plan import DTYPES

    return dict(micro_batch_size=r.train.micro_batch_size, seq_len=r.train.seq_len, dtype=DTYPES[r.model.dtype],
                device=device, kernels=kernel_patch.resolve(r.engine.kernels, device),
                loss_chunk_tokens=r.engine.loss_chunk_tokens, lean=getattr(plan, "lean", None),
                docs_per_row=docs if r.data.packing else None, vision_images=images)


def read_cached(adapter, *, cache_dir: Path | str | None = None, **shape) -> Probe | None:
    """The cached figures of this machine and, when cached too, the layer's timing at `shape` (recipe_shape's
    keys); None when the machine was never probed. Measures nothing (what `train` and `--dry-run` read:
    `plan` and `bench` probe)."""
    path = Path(cache_dir or default_cache_dir()) / f"{cache_key()}.json"
    data = _read(path)
    if data is None:
        return None
    machine = MachineFigures(**{k: v for k, v in data["machine"].items() if k in MachineFigures.__dataclass_fields__})
    cached = data["layers"].get(layer_key(adapter, **shape))
    return Probe(machine, LayerTiming(**cached) if cached is not None else None, path)


def load_or_probe(adapter=None, *, measure_layer: Callable[..., LayerTiming] | None = None,
                  cache_dir: Path | str | None = None, reprobe: bool = False, log: Callable[[str], None] | None = None,
                  machine_args: dict | None = None, **shape) -> Probe:
    """The cached figures of this machine (measured first when missing, or with `reprobe`), and, given an
    adapter, its layer timing at `shape` (recipe_shape's keys): from the cache, else measured by
    `measure_layer(adapter, **shape)` (engine/layer_probe.measure_layer) when given and the device is here,
    else None. `machine_args`: measure_machine's sizes (tests make them small)."""
    path = Path(cache_dir or default_cache_dir()) / f"{cache_key()}.json"
    data = None if reprobe else _read(path)
    measured = []
    if data is None:
        data = {"version": CACHE_VERSION, "machine": asdict(measure_machine(log=log, **(machine_args or {}))),
                "layers": {}}
        measured.append("machine")
    machine = MachineFigures(**{k: v for k, v in data["machine"].items() if k in MachineFigures.__dataclass_fields__})
    layer = None
    if adapter is not None:
        shape = {"micro_batch_size": 1, "seq_len": 1, "dtype": torch.bfloat16, "kernels": "torch", **shape}
        shape["device"] = shape.get("device") or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        key = layer_key(adapter, **shape)
        cached = data["layers"].get(key)
        if cached is not None:
            layer = LayerTiming(**cached)
        elif measure_layer is not None and (shape["device"].type != "cuda" or torch.cuda.is_available()):
            if log:
                docs = shape.get("docs_per_row")
                log(f"probe: the engine's ops at {shape['micro_batch_size']} x {shape['seq_len']} tokens"
                    f"{'' if docs is None else f' ({docs} packed documents a row)'} on {shape['device'].type} "
                    f"(one layer of each structure)")
            layer = measure_layer(adapter, **shape)
            data["layers"][key] = asdict(layer)
            measured.append("layer")
    if measured:
        _write(path, data)
    return Probe(machine, layer, path, measured)
