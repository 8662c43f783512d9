"""Data parallelism for the relay on torch.distributed (gloo on CPU, NCCL on CUDA).

Each rank runs the relay on its own shard of the minibatch. As soon as a layer's
backward ends, its gradients are averaged across ranks with one asynchronous
collective per EPS group, which runs while the next layer's backward computes; the
relay waits for it just before pushing that group to the EPS:

    replicated EPS   all_reduce of the group's gradients, flattened into one bucket;
                     every rank's EPS updates whole tensors
    sharded EPS      reduce_scatter of the same bucket laid out as [N, sum S]; each
                     rank pushes its slices (l2l_hw/eps/sharded.py)

Averaging is exact for shards of different sizes: rank r's gradient (the mean over
its n_r samples) is weighted n_r / n before the sum. A collective that fails (a rank
died, or did not answer within the process group's timeout) raises DataParallelError
naming this rank and what it was waiting for.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from l2l_hw.distributed import comm_device, guarded
from l2l_hw.eps.sharded import pack, shard_sizes


@dataclass
class Reduction:
    """One group's gradients on their way across the ranks."""

    key: str
    work: object
    grads: dict[str, torch.Tensor]  # the result, valid once `work` is done
    device: torch.device


class GradReducer:
    """Averages the relay's per-group gradients across the ranks of `group`."""

    def __init__(self, group, eps, device: torch.device, overlap: bool = True):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.sharded = eps.sharded
        self.comm_device = comm_device(group, device)
        self.device = device
        self.overlap = overlap  # False: wait for each collective at once (the benchmark's baseline)
        self.weight = 1.0  # n_r / n of the step under way
        # Time the relay's thread blocked on collectives in the step under way. On NCCL a wait only
        # makes the compute stream wait, so this reads ~0 there: the exposed communication shows
        # as the compute stream's idle time instead (`l2l bench gpu`'s trace).
        self.wait_s = 0.0

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
        if self.sharded:
            sizes = shard_sizes({n: grads[n].shape for n in names}, self.world)
            bucket = pack({n: grads[n].to(self.comm_device, dtype) * self.weight for n in names}, sizes, self.world)
            out = torch.empty(bucket.shape[1], dtype=dtype, device=self.comm_device)
            work = self.guard(f"reduce-scatter of {key}'s gradients", dist.reduce_scatter_single, out,
                               bucket.view(-1), group=self.group, async_op=True)
            result = dict(zip(names, torch.split(out, [sizes[n] for n in names])))
        else:
            bucket = torch.cat([grads[n].reshape(-1).to(self.comm_device, dtype) for n in names]).mul_(self.weight)
            work = self.guard(f"all-reduce of {key}'s gradients", dist.all_reduce, bucket,
                               group=self.group, async_op=True)
            result = dict(zip(names, (c.view(grads[n].shape) for n, c in
                                      zip(names, torch.split(bucket, [grads[n].numel() for n in names])))))
        reduction = Reduction(key, work, result, self.device)
        if not self.overlap:
            self.finish(reduction)
        return reduction

    def finish(self, reduction: Reduction) -> dict[str, torch.Tensor]:
        """Wait for a reduction; the averaged gradients (or this rank's slices of them)."""
        t0 = time.perf_counter()
        self.guard(f"averaging {reduction.key}'s gradients across ranks", reduction.work.wait)
        self.wait_s += time.perf_counter() - t0
        return {n: g.to(reduction.device) for n, g in reduction.grads.items()}
