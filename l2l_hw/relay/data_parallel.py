"""Data parallelism for the relay on torch.distributed (gloo on CPU, NCCL on CUDA).

Each rank runs the relay on its own shard of the minibatch. As soon as a layer's
backward ends, its gradients are averaged across ranks with one asynchronous
collective per EPS group, which runs while the next layer's backward computes; the
relay waits for it just before pushing that group to the EPS:

    replicated EPS   all_reduce of the group's gradients, flattened into one bucket;
                     every rank's EPS updates whole tensors
    sharded EPS      reduce_scatter of the same bucket laid out as [N, sum S]; each
                     rank pushes its slices (l2l_hw/eps/sharded.py)
    powersgd         (grad_compression) rank-R factors of each gradient matrix with error
                     feedback (l2l_hw/relay/powersgd.py): the exact bucket of vectors and
                     the factors P go out at once and overlap the next layer's backward;
                     the factors Q, computed from P, are all-reduced when the relay waits.
                     Every rank gets the whole approximation; a sharded EPS takes its slices

Averaging is exact for shards of different sizes: rank r's gradient (the mean over
its n_r samples) is weighted n_r / n before the sum. A collective that fails (a rank
died, or did not answer within the process group's timeout) raises DataParallelError
naming this rank and what it was waiting for. `wire` counts the bytes handed to the
step's gradient collectives, against what exact averaging would hand them.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist

from l2l_hw.distributed import comm_device, guarded
from l2l_hw.eps.base import StateEntry
from l2l_hw.eps.sharded import pack, rows, shard_sizes
from l2l_hw.options import check_options, option
from l2l_hw.relay.powersgd import PowerSGD, Round, WireBytes

COMPRESSIONS = ("none", "powersgd")


@dataclass(frozen=True)
class DataParallelOptions:
    """How data-parallel ranks average the gradients (under torchrun); RelayOptions has them."""

    grad_compression: str = option("none", "data parallel: the per-layer gradient all-reduce, exact (none) or "
                                   "PowerSGD's rank-R factors with error feedback (powersgd)", kind="choice",
                                   choices=COMPRESSIONS)
    powersgd_rank: int = option(4, "--grad-compression powersgd: the rank R of each gradient matrix's "
                                "approximation ((n + m) R values on the wire instead of n m)", kind="int", low=1,
                                flag="--rank", metavar="R")
    powersgd_start: int = option(0, "--grad-compression powersgd: steps averaged exactly before PowerSGD starts "
                                 "(torch's start_powerSGD_iter; with AdamW at rank 4 the reference GPT needed 80 "
                                 "of 200 steps to end within 0.05 nats of exact: docs/BENCHMARKS.md)",
                                 kind="int", low=0, metavar="STEPS")

    def __post_init__(self):
        check_options(self)


def check_compression(options: DataParallelOptions, precision: str, data_parallel: bool) -> None:
    """Gradient compression where it cannot run: one clear line."""
    if options.grad_compression == "none":
        return
    if not data_parallel:
        raise ValueError(f"grad_compression={options.grad_compression!r} compresses the gradient all-reduce of data "
                         "parallelism, and this relay runs alone: run it under torchrun with 2 or more processes "
                         "(torchrun --nproc-per-node N), or drop it")
    if precision == "fp16":
        raise ValueError(f"grad_compression={options.grad_compression!r} carries its error feedback from step to step, "
                         "which fp16's changing loss scale would mis-scale: use precision fp32 or bf16")


@dataclass
class Reduction:
    """One group's gradients on their way across the ranks."""

    key: str
    works: list  # the collectives under way
    grads: dict[str, torch.Tensor]  # the result, valid once `works` are done (exact)
    device: torch.device
    round: Round | None = None  # PowerSGD's: `grads` come from completing it


class GradReducer:
    """Averages the relay's per-group gradients across the ranks of `group`."""

    def __init__(self, group, eps, device: torch.device, overlap: bool = True,
                 options: DataParallelOptions | None = None):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sharded = eps.sharded
        self.eps = eps  # its `shapes` (group -> tensor -> whole shape) check a loaded PowerSGD state
        self.comm_device = comm_device(group, device)
        self.device = device
        self.overlap = overlap  # False: wait for each collective at once (the benchmark's baseline)
        self.weight = 1.0  # n_r / n of the step under way
        # Time the relay's thread blocked on collectives in the step under way. On NCCL a wait only
        # makes the compute stream wait, so this reads ~0 there: the exposed communication shows
        # as the compute stream's idle time instead (`l2l bench gpu`'s trace).
        self.wait_s = 0.0
        self.wire = WireBytes()  # of the step under way
        options = options or DataParallelOptions()
        self.powersgd = (PowerSGD(group, options.powersgd_rank, self.comm_device, self.guard)
                         if options.grad_compression == "powersgd" else None)
        self.powersgd_start = options.powersgd_start

    def guard(self, what: str, fn, /, *args, **kwargs):
        return guarded(self.group, what, fn, *args, **kwargs)

    def broadcast_(self, tensors, what: str) -> None:
        """Make every rank start from rank 0's values (initial weights, buffers)."""
        for t in tensors:
            buf = t.detach().to(self.comm_device)
            self.guard(what, dist.broadcast, buf, group_src=0, group=self.group)
            if buf is not t:
                t.detach().copy_(buf)

    def start_step(self, local_batch: int) -> None:
        """Agree on the minibatch size (this rank's gradient weight); also this step's check that
        every rank is alive."""
        n = torch.tensor([float(local_batch)], device=self.comm_device)
        self.guard("agreeing on the minibatch size at the start of a step", dist.all_reduce, n, group=self.group)
        self.weight = local_batch / n.item()
        self.wait_s = 0.0
        self.wire = WireBytes()

    def mean(self, local_mean: float, local_n: int, what: str) -> float:
        """The mean over all ranks' samples, from each rank's mean over its `local_n`."""
        buf = torch.tensor([local_mean * local_n, float(local_n)], dtype=torch.float64, device=self.comm_device)
        self.guard(what, dist.all_reduce, buf, group=self.group)
        return float(buf[0] / buf[1])

    def sum(self, value: torch.Tensor, what: str) -> torch.Tensor:
        """Sum a small tensor over the ranks (synchronous)."""
        buf = value.detach().to(self.comm_device, torch.float32).clone()
        self.guard(what, dist.all_reduce, buf, group=self.group)
        return buf.to(value.device)

    def launch(self, key: str, grads: dict[str, torch.Tensor]) -> Reduction:
        """Start averaging group `key`'s gradients; returns at once."""
        names = sorted(grads)  # the same order on every rank
        dtype = grads[names[0]].dtype
        if self.powersgd is not None and self.eps.step >= self.powersgd_start:
            round_ = self.powersgd.launch(key, grads, self.weight, self.wire)
            reduction = Reduction(key, round_.works, {}, self.device, round_)
        elif self.sharded:
            sizes = shard_sizes({n: grads[n].shape for n in names}, self.world)
            bucket = pack({n: grads[n].to(self.comm_device, dtype) * self.weight for n in names}, sizes, self.world)
            out = torch.empty(bucket.shape[1], dtype=dtype, device=self.comm_device)
            work = self.guard(f"reduce-scatter of {key}'s gradients", dist.reduce_scatter_single, out,
                               bucket.view(-1), group=self.group, async_op=True)
            result = dict(zip(names, torch.split(out, [sizes[n] for n in names])))
            reduction = Reduction(key, [work], result, self.device)
            self._count(bucket)
        else:
            bucket = torch.cat([grads[n].reshape(-1).to(self.comm_device, dtype) for n in names]).mul_(self.weight)
            work = self.guard(f"all-reduce of {key}'s gradients", dist.all_reduce, bucket,
                               group=self.group, async_op=True)
            result = dict(zip(names, (c.view(grads[n].shape) for n, c in
                                      zip(names, torch.split(bucket, [grads[n].numel() for n in names])))))
            reduction = Reduction(key, [work], result, self.device)
            self._count(bucket)
        if not self.overlap:
            self.finish(reduction)
        return reduction

    def _count(self, bucket: torch.Tensor) -> None:
        self.wire.sent += bucket.numel() * bucket.element_size()
        self.wire.exact += bucket.numel() * bucket.element_size()

    def _wait(self, work, what: str) -> None:
        t0 = time.perf_counter()
        self.guard(what, work.wait)
        self.wait_s += time.perf_counter() - t0

    def finish(self, reduction: Reduction) -> dict[str, torch.Tensor]:
        """Wait for a reduction; the averaged gradients (or this rank's slices of them)."""
        for work in reduction.works:
            self._wait(work, f"averaging {reduction.key}'s gradients across ranks")
        reduction.works = []
        if reduction.round is not None and not reduction.grads:
            reduction.grads = self.powersgd.complete(reduction.round, self._wait)
            if self.sharded:  # every rank has the whole approximation: the sharded EPS takes its slices
                sizes = shard_sizes({n: g.shape for n, g in reduction.grads.items()}, self.world)
                reduction.grads = {n: rows(g, sizes[n], self.world)[self.rank] for n, g in reduction.grads.items()}
        return {n: g.to(reduction.device) for n, g in reduction.grads.items()}

    # -- checkpoints (PowerSGD's state; exact averaging has none) --------------------
    def state_entries(self) -> dict[str, StateEntry]:
        """A collective: every rank calls it. PowerSGD's Q and every rank's error, on rank 0."""
        return self.powersgd.state_entries() if self.powersgd is not None else {}

    def load_state_dict(self, state: Mapping) -> None:
        """PowerSGD's state from state_entries() of a run on as many ranks (all of it checked first)."""
        if self.powersgd is None:
            if state:
                raise ValueError(f"the relay state holds PowerSGD state (dp/{next(iter(state))}, ...), and this "
                                 "relay averages gradients exactly; load it with grad_compression='powersgd'")
            return
        self.powersgd.load_state_dict(state, self.eps.shapes)
