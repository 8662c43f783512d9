"""ZeRO-style sharded EPS: each data-parallel rank keeps 1/N of every tensor.

`make_eps(name, shard_state=True)` wraps the backend `name` (cpu, golden, fpga-*): each
tensor of a group is flattened and padded to N * S elements, and rank r's backend holds
the slice [r*S, (r+1)*S) of its master weights and optimizer state. The update rules are
elementwise, so updating slices is the same arithmetic as updating whole tensors.

    push_grads   takes this rank's slices of the rank-averaged gradients (the relay
                 reduce-scatters them, l2l_hw/relay/data_parallel.py)
    fetch        all-gathers the working-copy slices into whole tensors
    commit_step  the ranks agree on whether any slice saw a non-finite gradient, so
                 they all commit or all discard
    state_dict   whole tensors gathered on rank 0 (other ranks get only the step): the
                 checkpoint is the same for any number of ranks, sharded or not
    load_state_dict  whole tensors in (from any number of ranks), this rank's slices kept

One collective per group and call: the slices of a group's tensors travel as one
[N, sum S] block (`pack` / `unpack`). fetch, master and state_dict are collectives:
every rank calls them in the same order (the relay does).
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.distributed as dist

from l2l_hw.distributed import comm_device, guarded
from l2l_hw.eps.base import (EPS, LocalEps, PendingFetch, StateEntry, StepPushes, check_state_mapping, new_group,
                             tensor_of)


def shard_sizes(shapes: dict[str, torch.Size], world: int) -> dict[str, int]:
    """Elements per rank of each tensor: ceil(numel / world)."""
    return {n: -(-math.prod(s) // world) for n, s in shapes.items()}


def rows(t: torch.Tensor, size: int, world: int) -> torch.Tensor:
    """`t` flattened, zero padded to world * size and viewed as [world, size]: row r is rank r's slice."""
    flat = t.reshape(-1)
    return torch.nn.functional.pad(flat, (0, world * size - flat.numel())).view(world, size)


def pack(tensors: dict[str, torch.Tensor], sizes: dict[str, int], world: int) -> torch.Tensor:
    """[world, sum S] block whose row r holds rank r's slice of every tensor."""
    return torch.cat([rows(tensors[n], size, world) for n, size in sizes.items()], dim=1)


def unpack(block: torch.Tensor, sizes: dict[str, int], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Inverse of pack: whole tensors from a [world, sum S] block."""
    out, col = {}, 0
    for name, size in sizes.items():
        numel = math.prod(shapes[name])
        out[name] = block[:, col:col + size].reshape(-1)[:numel].reshape(shapes[name])
        col += size
    return out


class ShardedEps(EPS):
    """This rank's slices of every tensor, kept by any EPS (`inner`), behind the EPS interface:
    registration, gradients and state go in as slices, fetches and state come out whole."""

    name = "sharded"
    sharded = True

    def __init__(self, inner: LocalEps, process_group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("shard_state=True needs torch.distributed initialized first "
                               "(torch.distributed.init_process_group, or run under torchrun)")
        self.inner = inner
        self.config = inner.config
        self.process_group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.comm_device = comm_device(process_group)
        self.shapes: dict[str, dict[str, torch.Size]] = {}  # whole shapes; the backend holds slices
        self.sizes: dict[str, dict[str, int]] = {}  # elements per rank of each tensor
        self.pushes = StepPushes()  # with global-norm clipping, the gradients wait here until commit

    # The backend keeps the per-step state and the buffers' format.
    step = property(lambda self: self.inner.step)
    working_dtype = property(lambda self: self.inner.working_dtype)
    double_buffer = property(lambda self: self.inner.double_buffer)
    delay_compensation = property(lambda self: self.inner.delay_compensation)

    def configure(self, working_dtype=None, double_buffer=None, defer_updates=None, device=None, threads=None,
                  inline=None) -> None:
        self.inner.configure(working_dtype=working_dtype, double_buffer=double_buffer, device=device, threads=threads,
                             inline=inline)
        if device is not None:  # NCCL's tensors on the relay's own GPU
            self.comm_device = comm_device(self.process_group, device)
        if defer_updates is not None:  # deferred here; the backend gets them at commit
            self.pushes.defer = bool(defer_updates)

    # -- registration and the step ---------------------------------------------
    def expect(self, groups: dict[str, dict[str, torch.Size]]) -> None:
        """The backend registers this rank's slices: it expects their shapes."""
        self.inner.expect({key: {n: torch.Size([size]) for n, size in shard_sizes(shapes, self.world).items()}
                           for key, shapes in groups.items()})

    def expect_step(self, fetches: list[str], updates: list[str]) -> None:
        """This rank's slices are used in the same order."""
        self.inner.expect_step(fetches, updates)

    def register(self, key: str, params: dict[str, torch.Tensor], no_decay: frozenset[str] = frozenset()) -> None:
        whole = new_group(self.shapes, key, params, no_decay)
        self.sizes[key] = sizes = shard_sizes(self.shapes[key], self.world)
        self.inner.register(key, {n: self._mine(whole[n], size) for n, size in sizes.items()}, no_decay)

    def _mine(self, t: torch.Tensor, size: int) -> torch.Tensor:
        return rows(t, size, self.world)[self.rank].clone()

    def push_grads(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float = 1.0) -> None:
        """This rank's slice of each of the group's rank-averaged gradients (the relay
        reduce-scatters them)."""
        if key not in self.shapes:
            raise KeyError(f"unknown EPS group {key!r}; registered groups: {', '.join(self.shapes) or 'none'}")
        for name, g in grads.items():
            want = self.sizes[key].get(name)
            if want is None or g.shape != (want,):
                raise ValueError(f"a sharded EPS takes this rank's slice of each gradient: {key}/{name} should be "
                                 f"a ({want},) tensor, got {tuple(g.shape)}; the Relay reduce-scatters them")
        self.pushes.add(key, grads, inv_scale, self.step + 1, self.inner.push_grads)

    def commit_step(self, grad_scale: float = 1.0, skip_nonfinite: bool = False, wait: bool = True,
                    agree=None) -> bool:
        """As the backend's, after every rank agrees whether any slice saw a non-finite gradient."""
        self.pushes.run_deferred(grad_scale, self.inner.push_grads)
        self.pushes.groups.clear()
        if not wait:  # no flag to agree on: nothing is skipped (LocalEps.commit_step)
            return self.inner.commit_step(wait=False)
        self.inner.wait()
        flag = torch.tensor([float(self.inner.found_nonfinite)], device=self.comm_device)
        guarded(self.process_group, "agreeing on non-finite gradients at commit", dist.all_reduce, flag,
                op=dist.ReduceOp.MAX, group=self.process_group)
        self.inner.found_nonfinite = bool(flag.item())
        return self.inner.commit_step(skip_nonfinite=skip_nonfinite, agree=agree)

    def discard_step(self) -> None:
        self.pushes.clear()
        self.inner.discard_step()

    def wait(self) -> None:
        self.inner.wait()

    def close(self) -> None:
        """The backend's threads and files (the process group is the caller's)."""
        self.inner.close()

    # -- whole tensors from slices ---------------------------------------------
    def _gather(self, key: str, slices: dict[str, torch.Tensor], root: int | None = None,
                async_op: bool = False):
        """Whole tensors from every rank's `slices` of group `key`: on every rank, or on `root`
        only (None elsewhere); with async_op, a PendingGather to wait on."""
        group = self.process_group
        sizes = {n: self.sizes[key][n] for n in slices}
        row = torch.cat([slices[n].reshape(-1) for n in sizes]).to(self.comm_device)
        flat = torch.empty(self.world * row.numel(), dtype=row.dtype, device=self.comm_device)
        if root is None:
            what = f"all-gather of {key}"
            work = guarded(group, what, dist.all_gather_single, flat, row, group=group, async_op=async_op)
        else:
            what = f"gather of {key} on rank {root}"
            work = guarded(group, what, dist.gather, row, list(flat.chunk(self.world)) if self.rank == root
                           else None, group_dst=root, group=group, async_op=async_op)
        pending = PendingGather(flat, work, lambda: unpack(flat.view(self.world, -1), sizes, self.shapes[key]),
                                group, what)
        if async_op:
            return pending
        return pending.wait() if root is None or self.rank == root else None

    def fetch(self, key: str, previous: bool = False) -> dict[str, torch.Tensor]:
        return self._gather(key, self.inner.fetch(key, previous=previous))

    def fetch_async(self, key: str, previous: bool = False) -> "PendingGather":
        """fetch() whose all-gather runs while the caller goes on (the relay's weight prefetch)."""
        return self._gather(key, self.inner.fetch(key, previous=previous), async_op=True)

    def read_state(self, key: str, name: str) -> dict[str, torch.Tensor]:
        return {s: self._gather(key, {name: t})[name] for s, t in self.inner.read_state(key, name).items()}

    def master(self, key: str) -> dict[str, torch.Tensor]:
        self.wait()
        return {n: t.clone() for n, t in self._gather(key, self.inner.master(key)).items()}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Whole tensors on rank 0, one group and slot at a time; other ranks get only `step`."""
        self.wait()
        out = {"step": torch.tensor(self.step, dtype=torch.int64)}
        for key, sizes in self.sizes.items():
            for slot in self.inner.slots():
                whole = self._gather(key, {n: self.inner.read_state(key, n)[slot] for n in sizes}, root=0)
                if whole is not None:
                    out.update({f"{key}/{n}/{slot}": t.to("cpu", copy=True) for n, t in whole.items()})
            if self.double_buffer:  # the version one commit back (PipeDream-2BW computes on it), as base does
                whole = self._gather(key, self.inner.fetch(key, previous=True), root=0)
                if whole is not None:
                    out.update({f"{key}/{n}/previous": t.to("cpu", torch.float32, copy=True) for n, t in whole.items()})
            if self.delay_compensation == "predict":  # the newest version's predicted working copy, as the engine's
                whole = self._gather(key, self.inner.fetch(key), root=0)
                if whole is not None:
                    out.update({f"{key}/{n}/predicted": t.to("cpu", torch.float32, copy=True) for n, t in whole.items()})
        return out

    def state_entries(self) -> dict[str, StateEntry]:
        """Gathered whole on rank 0 (a collective): a sharded checkpoint is not streamed."""
        return {name: StateEntry(t.shape, t.dtype, lambda t=t: t) for name, t in self.state_dict().items()}

    def load_state_dict(self, state: Mapping[str, torch.Tensor | StateEntry]) -> None:
        """Whole tensors in (from a checkpoint of any number of ranks, sharded or not); the backend
        loads this rank's slices, read one tensor at a time, after checking every entry."""
        check_state_mapping(state)
        sliced = {}
        for name, entry in state.items():
            key, _, rest = name.partition("/")
            tensor_name = rest.rpartition("/")[0]
            size = self.sizes.get(key, {}).get(tensor_name)
            if size is None:  # `step`, or a name the backend refuses as unknown
                sliced[name] = entry
                continue
            if entry.shape != self.shapes[key][tensor_name]:
                raise ValueError(f"EPS state {name} is {entry.dtype} {tuple(entry.shape)}; expected a whole "
                                 f"{tuple(self.shapes[key][tensor_name])} tensor")
            sliced[name] = StateEntry(torch.Size([size]), entry.dtype,
                                      lambda e=entry, size=size: self._mine(tensor_of(e), size))
        self.inner.load_state_dict(sliced)


class PendingGather(PendingFetch):
    """An all-gather under way: `held()` is the buffer it fills, `wait()` the whole tensors
    (the PendingFetch interface of l2l_hw/eps/base.py; nothing is handed on early)."""

    ready = False

    def __init__(self, flat: torch.Tensor, work, unpack_fn, group, what: str):
        self.flat, self._work, self._unpack, self._group, self._what = flat, work, unpack_fn, group, what

    def held(self) -> list[torch.Tensor]:
        return [self.flat]

    def wait(self) -> dict[str, torch.Tensor]:
        if self._work is not None:
            guarded(self._group, self._what, self._work.wait)
        return self._unpack()

