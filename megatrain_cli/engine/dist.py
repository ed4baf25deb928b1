"""Who this process is among N data-parallel ranks, and the collectives the engine issues.

`DistContext` carries the rank, the world size and the process groups: device collectives on the
default group (NCCL on CUDA, gloo on CPU), host tensors on a gloo group, and under NCCL a second
communicator for the weight all-gathers that the overlapped path's packer thread issues (one thread
per communicator: each sees the same ordered sequence on every rank). engine/transfer/sharded.py and
sharded_cuda.py move the bytes; this module only joins, leaves and reduces.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

def _all_gather_fn():  # newer torch renames it (the old name warns); torch 2.4 has only the old one
    return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _reduce_scatter_fn():
    return getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class DistContext:
    """Who this process is among the data-parallel ranks, and the groups its collectives use."""

    rank: int
    world: int
    device: torch.device
    group: object = None  # device-tensor collectives (NCCL on CUDA, gloo on CPU); None: the default group
    cpu_group: object = None  # host-tensor collectives (gloo); None: the default group
    # NCCL only: the weight all-gathers of the overlapped path (transfer/sharded_cuda.py), issued by its packer thread
    weight_group: object = None
    # Capability flags, found out on first use (see all_gather / reduce_scatter).
    _gather_tensor_ok: bool | None = field(default=None, repr=False)
    _scatter_tensor_ok: bool | None = field(default=None, repr=False)

    @classmethod
    def from_default_group(cls, device: torch.device) -> "DistContext":
        """After dist.init_process_group: under NCCL a gloo group is made for host tensors and a second
        NCCL group for the weight all-gathers (its communicator is created at its first collective).
        Every rank makes them in the same order, as new_group requires."""
        cpu_group = weight_group = None
        if dist.get_backend() != "gloo":
            cpu_group = dist.new_group(backend="gloo")
            weight_group = dist.new_group()
        return cls(dist.get_rank(), dist.get_world_size(), device, None, cpu_group, weight_group)

    # ------------------------------------------------------------ collectives
    def _backend(self) -> str:
        return dist.get_backend(self.group)

    def all_gather(self, full: torch.Tensor, mine: torch.Tensor) -> None:
        """full = concat over ranks of `mine` (full.numel() = world * mine.numel(); `mine` may be this
        rank's slice of `full`: in place, as NCCL supports)."""
        if self._backend() != "gloo":
            _all_gather_fn()(full, mine, group=self.group)
            return
        if self._gather_tensor_ok is not False:
            try:
                _all_gather_fn()(full, mine, group=self.group)
                self._gather_tensor_ok = True
                return
            except (RuntimeError, NotImplementedError):
                # An old gloo without all_gather_into_tensor: refused locally, before any traffic, on
                # every rank alike, so falling back here cannot desynchronise the ranks.
                if self._gather_tensor_ok:
                    raise
                self._gather_tensor_ok = False
        dist.all_gather(list(full.split(mine.numel())), mine.clone(), group=self.group)

    def reduce_scatter(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the sum over ranks of `grad` (grad.numel() divisible by world)."""
        n = grad.numel() // self.world
        if self._backend() != "gloo":
            out = torch.empty(n, dtype=grad.dtype, device=grad.device)
            _reduce_scatter_fn()(out, grad, group=self.group)
            return out
        if self._scatter_tensor_ok is not False:
            out = torch.empty(n, dtype=grad.dtype, device=grad.device)
            try:
                _reduce_scatter_fn()(out, grad, group=self.group)
                self._scatter_tensor_ok = True
                return out
            except (RuntimeError, NotImplementedError):
                # gloo has no reduce_scatter on CPU tensors in older torch versions: all-reduce the whole
                # gradient and keep this rank's slice (twice the traffic, same sums). As above, the refusal
                # is local and happens on every rank.
                if self._scatter_tensor_ok:
                    raise
                self._scatter_tensor_ok = False
        dist.all_reduce(grad, group=self.group)
        return grad[self.rank * n:(self.rank + 1) * n]

    def gather_weights(self, full: torch.Tensor, mine: torch.Tensor) -> None:
        """all_gather (in place) on `weight_group`: the overlapped path's packer thread, and no one else."""
        if self.weight_group is None:
            raise RuntimeError("no weight_group: the overlapped path needs NCCL (DistContext.from_default_group)")
        _all_gather_fn()(full, mine, group=self.weight_group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        dist.all_reduce(t, group=self.group)
        return t

    def sum_scalars(self, values) -> list[float]:
        """Sum each value over ranks (floats or 0-d tensors; one all-reduce, one host sync)."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64).to(self.device).reshape(()) for v in values])
        dist.all_reduce(t, group=self.group)
        return t.tolist()


def init_distributed(device_type: str = "cuda", *, init_method: str | None = None, rank: int | None = None,
                     world_size: int | None = None) -> DistContext:
    """The process group for one rank (torchrun's environment by default); NCCL on CUDA, else gloo.

    Under torchrun, LOCAL_RANK picks the GPU. NCCL's own settings (NVLS among them) are the user's: none set here."""
    if device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank if rank is not None else 0))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    kw = {} if init_method is None else {"init_method": init_method}
    if rank is not None:
        kw.update(rank=rank, world_size=world_size)
    dist.init_process_group(backend, **kw)
    return DistContext.from_default_group(device)


def leave_process_group() -> None:
    """destroy_process_group, then a moment for the backends' worker threads to drop the last collectives'
    tensors: that takes the GIL, and a thread that asks for it while the interpreter shuts down aborts the
    process ('terminate called without an active exception', seen with gloo in 2-rank CPU runs). Call it
    after every rank's last collective (a barrier), as a rank's last step."""
    dist.destroy_process_group()
    time.sleep(0.2)  # the GIL is free meanwhile


def split_micro_batches(micro_batches: list, rank: int, world: int) -> list:
    """This rank's share of the global batch: micro-batches rank, rank + N, ... (counts differ by at most
    one; the loss is normalised by the global token count, so any split gives the same gradient)."""
    if len(micro_batches) < world:
        raise ValueError(f"{len(micro_batches)} micro-batches per step cannot feed {world} ranks: raise "
                         f"train.grad_accum to at least {world}")
    return micro_batches[rank::world]
