"""Where an EPS keeps its buffers: the storage half of the engine (l2l_hw/eps/engine.py).

The engine decides which buffers a tensor has (param, m, v, the working copy, spares, the
previous version) and what each holds; a storage decides only where they live and how
bytes get in and out. Three storages, any of them under the one engine:

    HostMemory     host tensors (here): the CPU and golden EPS in RAM
    RegionFiles    one region file per group under a state_dir, only the groups in flight
                   in memory (l2l_hw/eps/disk.py, docs/DISK.md)
    FpgaDram       buffers in the FPGA's DRAM behind a transport (l2l_hw/eps/fpga.py)

A kernel computes on what `hold()` gives for a buffer: a host tensor for `memory = "host"`
(HostMemory, RegionFiles: the host kernel and the golden rule run on either), a device
buffer for `memory = "fpga"` (the RTL kernel). The storage's hints (`expect`, `read_ahead`,
`update_queued`, `registered`) let a storage whose bytes live elsewhere (`waits_on_io`) move
them early; the engine gives them only to such a storage, and a hint never changes what a
read returns.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch

Buffer = Any  # a storage's buffer: a host tensor, a slice of a region file, a buffer in FPGA DRAM


@dataclass(frozen=True)
class Spec:
    """One buffer the engine asks for."""

    shape: torch.Size
    dtype: torch.dtype
    fetched: bool  # the working copy (or its spare or previous version): what fetch() reads
    pinned: bool  # it crosses to a CUDA device: page-locked wherever it is read into host memory


@dataclass(frozen=True)
class GroupLayout:
    """What a storage lays out for one EPS group: its tensors (what the group is, for a storage
    that records it) and every buffer the engine keeps of them, in order."""

    key: str
    shapes: dict[str, torch.Size]
    specs: list[Spec]


class Storage:
    """The storage protocol, with the hints' defaults (nothing to move early)."""

    memory = "host"  # what hold() gives a kernel: host tensors, or "fpga" device buffers
    # hold() and read() may wait on I/O: updates never run on the caller's thread, and the engine
    # gives the read-ahead hints
    waits_on_io = False

    def expect(self, groups: list[GroupLayout], rule: dict) -> None:
        """Every group about to be allocated, in order, and the rule the bytes follow (optimizer,
        state format, working dtype, double buffering): a storage that keeps state across runs
        checks the whole model against what it holds before it writes anything."""

    def allocate(self, group: GroupLayout, rule: dict) -> list[Buffer]:
        """The buffers of `group.specs`, in order (their bytes undefined until written)."""
        raise NotImplementedError

    def registered(self) -> None:
        """Every group is allocated (said at the first fetch or push)."""

    def scratch(self, shape: torch.Size, dtype: torch.dtype) -> Buffer:
        """A buffer outside any group, for a kernel's output that is thrown away."""
        raise NotImplementedError

    def free(self, buf: Buffer) -> None:
        """Give a buffer back (host memory: the garbage collector does)."""

    def write(self, buf: Buffer, values: torch.Tensor) -> None:
        raise NotImplementedError

    def read(self, buf: Buffer, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's values as a host tensor: the buffer itself where it is one (valid until
        the group's next update), else a copy."""
        raise NotImplementedError

    def hold(self, key: str, write_back: bool = False) -> ContextManager[Callable[[Buffer], Any] | None]:
        """Group `key` in reach for the block (a context manager): gives view(buffer), what a kernel
        reads and writes (the block may change every buffer of the group), or None where a kernel
        takes the buffers themselves. With `write_back` the group's update (queued by
        update_queued) ends with the block, and its bytes go back to where they live."""
        return _IN_REACH

    def read_ahead(self, key: str, buffers: list[Buffer]) -> None:
        """Group `key`'s `buffers` are used next but one: start bringing them into memory, never waiting."""

    def update_queued(self, key: str) -> None:
        """Group `key`'s update is queued: a read-ahead must not push it out of memory first."""

    def close(self) -> None:
        """Finish what is under way and release the storage's threads and files."""


_IN_REACH = contextlib.nullcontext()  # buffers a kernel takes as they are; no generator per update


class HostMemory(Storage):
    """Every buffer a host tensor; only the working copy pinned, and only for a CUDA relay."""

    def allocate(self, group, rule):
        return [torch.empty(s.shape, dtype=s.dtype, pin_memory=s.pinned) for s in group.specs]

    def scratch(self, shape, dtype):
        return torch.empty(shape, dtype=dtype)

    def write(self, buf, values):
        buf.copy_(values)

    def read(self, buf, shape, dtype):
        return buf
