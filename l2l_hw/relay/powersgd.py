"""PowerSGD: low-rank compression of the data-parallel gradient all-reduce, with error feedback.

Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization" (NeurIPS 2019), Algorithm 1 (one power iteration, warm start)
with error feedback (Algorithm 2), per tensor of one EPS group. For each gradient matrix G
(n x m; a tensor of more dimensions as shape[0] x the rest) on rank r of N:

    M = N w_r G + e      w_r = n_r / n, the rank's share of the samples; e its error
    P = M Q              (n, R)   all-reduce (sum), P^ = orthogonalize(P)
    Q = M^T P^ / N       (m, R)   all-reduce (sum); kept for the next step (warm start)
    out = P^ Q^T         the rank-R approximation of the mean gradient sum_r w_r G_r
    e = M - out          what the compression left out, added to the next step's M

As torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook does it, but per tensor
rather than per DDP bucket (the relay reduces one layer's group at a time): vectors
(biases, norms) and matrices too small for R to pay (MIN_COMPRESSION_RATE, torch's
default) go exact, in one all-reduce of the group's bucket. The relay's first
`powersgd_start` steps are averaged exactly (torch's start_powerSGD_iter: the start of
training is the most sensitive to a biased gradient). The torch hook also
orthogonalizes Q before each step; the paper does not, and the result P^ P^T M is the same
up to rounding (measured: the 200-step validation loss of `l2l train` moved by 0.0003), so
this follows the paper. Everything is computed in fp32 and P and Q go
on the wire in fp32 whatever the gradients' dtype.

Q starts as a standard normal draw from a generator seeded by the tensor's name: the same
on every rank, and the global RNG (dropout's) is untouched. The state (every compressed
tensor's Q, the same on every rank, and each rank's own error: 4 B per compressed parameter)
lives on the communication device: host memory with gloo, the GPU with NCCL. A checkpoint
holds every rank's error, so it resumes on the same number of ranks only. A step whose P
or Q is not finite (an overflow, identical on every rank after the all-reduce) leaves the
state as it was, so a discarded step does not poison later ones.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.distributed as dist

from l2l_hw.eps.base import StateEntry, tensor_of

MIN_COMPRESSION_RATE = 2  # compress only where n m > 2 (n + m) R: torch's PowerSGDState default


def matrix_shape(shape: torch.Size, rank: int) -> tuple[int, int] | None:
    """(n, m) of a gradient that PowerSGD compresses at `rank`, or None: it goes exact."""
    if len(shape) < 2:
        return None
    n, m = shape[0], math.prod(shape[1:])
    return (n, m) if (n + m) * min(n, m, rank) * MIN_COMPRESSION_RATE < n * m else None


def initial_q(name: str, m: int, rank: int) -> torch.Tensor:
    """The first Q of tensor `name` ("group/tensor"): (m, rank) standard normal, the same on every rank."""
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(m, rank, generator=generator)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning those of p (n, R), R <= n: reduced QR (finite for a zero p)."""
    return torch.linalg.qr(p).Q


@dataclass
class Factors:
    """One compressed tensor's state between steps."""

    q: torch.Tensor  # (m, R) fp32, the same on every rank
    error: torch.Tensor  # (n, m) fp32, this rank's


@dataclass
class Round:
    """One group's compression between launch and complete."""

    key: str
    shapes: dict[str, torch.Size]  # every gradient's shape, in the group's (sorted) order
    dtype: torch.dtype  # the gradients'
    exact: list[str]  # names sent whole, in the bucket
    bucket: torch.Tensor | None  # their weighted sum, once the all-reduce is done
    m: dict[str, torch.Tensor] = field(default_factory=dict)  # compressed names -> M (n, m)
    p: torch.Tensor | None = None  # every M's P, flat, summed over ranks once the all-reduce is done
    works: list = field(default_factory=list)  # the all-reduces of the bucket and of P


@dataclass
class WireBytes:
    """Bytes this rank hands to the gradient collectives in a step: `sent`, against `exact`, what the
    uncompressed reduction would hand them; `matrix_*` the same for the compressed matrices alone.
    (A ring all-reduce sends about 2 (N-1)/N times these bytes per rank, a reduce-scatter (N-1)/N.)"""

    sent: int = 0
    exact: int = 0
    matrix_sent: int = 0
    matrix_exact: int = 0


class PowerSGD:
    """Rank-`rank` PowerSGD over process group `group`; tensors on `device` (the collectives')."""

    def __init__(self, group, rank: int, device: torch.device, guard: Callable):
        self.group, self.rank, self.device, self.guard = group, rank, device, guard
        self.world = dist.get_world_size(group)
        self.me = dist.get_rank(group)
        self.factors: dict[str, Factors] = {}  # "group/tensor" -> its state

    def _factors(self, name: str, n: int, m: int) -> Factors:
        if name not in self.factors:
            self.factors[name] = Factors(initial_q(name, m, min(n, m, self.rank)).to(self.device),
                                         torch.zeros(n, m, device=self.device))
        return self.factors[name]

    def launch(self, key: str, grads: dict[str, torch.Tensor], weight: float, wire: WireBytes) -> Round:
        """Start the all-reduces of the group's exact bucket and of its P's; returns at once."""
        names = sorted(grads)
        dtype = grads[names[0]].dtype
        matrices = {n: matrix_shape(grads[n].shape, self.rank) for n in names}
        exact = [n for n in names if matrices[n] is None]
        round_ = Round(key, {n: grads[n].shape for n in names}, dtype, exact, None)
        if exact:
            round_.bucket = torch.cat([grads[n].reshape(-1).to(self.device, dtype) for n in exact]).mul_(weight)
            round_.works.append(self.guard(f"all-reduce of {key}'s uncompressed gradients", dist.all_reduce,
                                           round_.bucket, group=self.group, async_op=True))
        ps = []
        for name in names:
            if matrices[name] is None:
                continue
            factors = self._factors(f"{key}/{name}", *matrices[name])
            m = grads[name].to(self.device, torch.float32).reshape(matrices[name]) * (weight * self.world)
            round_.m[name] = m.add_(factors.error)  # (n, m)
            ps.append(m @ factors.q)  # (n, R)
        if ps:
            round_.p = torch.cat([p.reshape(-1) for p in ps])
            round_.works.append(self.guard(f"all-reduce of {key}'s PowerSGD factors P", dist.all_reduce,
                                           round_.p, group=self.group, async_op=True))
        dense = {n: grads[n].numel() * grads[n].element_size() for n in names}
        q_numel = sum(self.factors[f"{key}/{n}"].q.numel() for n in round_.m)
        factor_bytes = 4 * ((round_.p.numel() if ps else 0) + q_numel)  # fp32 P (n, R) and Q (m, R)
        wire.sent += factor_bytes + sum(dense[n] for n in exact)
        wire.exact += sum(dense.values())
        wire.matrix_sent += factor_bytes
        wire.matrix_exact += sum(dense[n] for n in round_.m)
        return round_

    def complete(self, round_: Round, wait: Callable) -> dict[str, torch.Tensor]:
        """After launch's all-reduces (`wait(work, what)` waits for one): Q's all-reduce, then the
        group's averaged gradients, each in the gradients' dtype and shape."""
        key = round_.key
        p_hat, qs, offset = {}, [], 0
        for name, m in round_.m.items():
            q_old = self.factors[f"{key}/{name}"].q
            p = round_.p[offset:offset + m.shape[0] * q_old.shape[1]].view(m.shape[0], q_old.shape[1])
            offset += p.numel()
            p_hat[name] = orthogonalize(p)  # (n, R)
            qs.append(m.T @ p_hat[name])  # (m, R)
        out = {}
        if qs:
            q_flat = torch.cat([q.reshape(-1) for q in qs])
            wait(self.guard(f"all-reduce of {key}'s PowerSGD factors Q", dist.all_reduce, q_flat,
                            group=self.group, async_op=True), f"all-reduce of {key}'s PowerSGD factors Q")
            q_flat.div_(self.world)
            finite = torch.isfinite(round_.p).all() & torch.isfinite(q_flat).all()  # the same on every rank
            offset = 0
            for name, m in round_.m.items():
                factors = self.factors[f"{key}/{name}"]
                q = q_flat[offset:offset + factors.q.numel()].view_as(factors.q)
                offset += q.numel()
                out[name] = p_hat[name] @ q.T  # (n, m)
                factors.error = torch.where(finite, m - out[name], factors.error)
                factors.q = torch.where(finite, q, factors.q)
        if round_.exact:
            out.update(zip(round_.exact, torch.split(round_.bucket, [round_.shapes[n].numel() for n in round_.exact])))
        return {n: out[n].reshape(shape).to(round_.dtype) for n, shape in round_.shapes.items()}

    # -- checkpoints ---------------------------------------------------------------
    def state_entries(self) -> dict[str, StateEntry]:
        """A collective: on rank 0 every tensor's `q` and every rank's `error` ([N, n, m], gathered
        one tensor at a time); nothing on the other ranks."""
        out = {}
        for name, factors in sorted(self.factors.items()):
            errors = [torch.empty_like(factors.error) for _ in range(self.world)] if self.me == 0 else None
            self.guard(f"gather of {name}'s PowerSGD error on rank 0", dist.gather, factors.error, errors,
                       group_dst=0, group=self.group)
            if self.me == 0:
                q = factors.q.to("cpu", copy=True)
                out[f"{name}/q"] = StateEntry(q.shape, torch.float32, lambda t=q: t)
                stacked = torch.stack(errors).cpu()
                out[f"{name}/error"] = StateEntry(stacked.shape, torch.float32, lambda t=stacked: t)
        return out

    def load_state_dict(self, state: Mapping, shapes: Mapping[str, Mapping[str, torch.Size]]) -> None:
        """The state from state_entries() (of a run on as many ranks), checked against the EPS's
        `shapes` (group -> tensor -> whole shape) before anything is replaced; this rank keeps its error."""
        names = {entry.rpartition("/")[0] for entry in state}
        loaded = {}
        for name in sorted(names):
            key, _, tensor = name.partition("/")
            matrix = matrix_shape(shapes[key][tensor], self.rank) if tensor in shapes.get(key, {}) else None
            if matrix is None:
                raise ValueError(f"the relay state's PowerSGD entry {name} names no matrix this relay compresses "
                                 f"at PowerSGD rank {self.rank}; was it saved from another model or rank?")
            n, m = matrix
            want = {"q": (m, min(n, m, self.rank)), "error": (self.world, n, m)}
            for part, shape in want.items():
                entry = state.get(f"{name}/{part}")
                if entry is None or tuple(entry.shape) != shape or entry.dtype != torch.float32:
                    got = "none" if entry is None else f"{entry.dtype} {tuple(entry.shape)}"
                    why = (f"; PowerSGD's error feedback is per rank, so resume on {entry.shape[0]} rank(s)"
                           if part == "error" and entry is not None and len(entry.shape) == 3
                           and tuple(entry.shape[1:]) == (n, m) else "")
                    raise ValueError(f"the relay state's PowerSGD entry {name}/{part} is {got}; this run of "
                                     f"{self.world} rank(s) with PowerSGD rank {self.rank} needs float32 {shape}{why}")
            loaded[name] = (state[f"{name}/q"], state[f"{name}/error"])
        self.factors = {name: Factors(tensor_of(q).to(self.device, copy=True),
                                      tensor_of(error)[self.me].to(self.device, copy=True))
                        for name, (q, error) in loaded.items()}
