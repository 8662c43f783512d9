"""The backend registry: `make_eps(name, ...)` composes an EPS from a kernel and a storage.

A backend registers a builder of its update kernel with `@register_backend(name)` when its
module is imported (l2l_hw/eps/__init__.py imports them all). make_eps puts the kernel
into the one engine (l2l_hw/eps/engine.py) on a storage: for a kernel that computes on
host memory (cpu, golden) host memory itself, or with `state_dir=PATH` region files under
PATH (l2l_hw/eps/disk.py), so every such backend has the disk tier; a kernel with memory of
its own (the RTL: FPGA DRAM) registers the storage that keeps it. `shard_state=True` wraps
the EPS in the ZeRO-style sharded EPS (l2l_hw/eps/sharded.py), by composition.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from l2l_hw.eps.base import EPS, WHOLE_TENSOR_RULES, OptimConfig
from l2l_hw.eps.disk import GROUPS_IN_FLIGHT, RegionFiles
from l2l_hw.eps.engine import Engine, Kernel, check_formats
from l2l_hw.eps.sharded import ShardedEps
from l2l_hw.eps.storage import HostMemory, Storage


@dataclass(frozen=True)
class Backend:
    kernel: Callable[..., Kernel]  # (config, state=..., **the backend's options) -> its kernel
    storage: Callable[[Kernel], Storage] | None  # the kernel's own memory; None: host memory (or a state_dir)


_BACKENDS: dict[str, Backend] = {}


def register_backend(name: str, storage: Callable[[Kernel], Storage] | None = None):
    """Decorator of a kernel builder: make the backend buildable by `make_eps(name)`. `storage`:
    for a kernel with memory of its own, the storage of a built kernel."""
    def wrap(build):
        _BACKENDS[name] = Backend(build, storage)
        return build
    return wrap


def known_backends() -> list[str]:
    return sorted(_BACKENDS)


def disk_tier_backends() -> list[str]:
    """The backends whose state may live in files under a state_dir: those computing on host memory."""
    return sorted(name for name, backend in _BACKENDS.items() if backend.storage is None)


def make_eps(name: str, working_dtype: str = "fp32", shard_state: bool = False, process_group=None,
             double_buffer: bool = False, state: str = "fp32", state_dir=None,
             groups_in_flight: int | None = None, delay_compensation: str = "none", **options) -> EPS:
    """Build an EPS by backend name; the other options are those of OptimConfig or the backend's.
    `state="fp32" | "bf16" | "8bit"`: the format of m and v. `state_dir=PATH` (cpu, golden): the
    state in files under PATH, only `groups_in_flight` groups of it in memory (default 4; docs/DISK.md).

    shard_state=True (data parallel, torch.distributed initialized): this rank keeps 1/N of
    every tensor's master weights and state, ZeRO-style (l2l_hw/eps/sharded.py)."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(f"unknown EPS backend {name!r}; known backends: {', '.join(known_backends())}")
    if not isinstance(shard_state, bool):
        raise ValueError(f"shard_state must be True or False, got {shard_state!r}")
    backend = _BACKENDS[name]
    backend_options = {k: options.pop(k) for k in list(options) if k not in OptimConfig.__dataclass_fields__}
    if state_dir is not None and (backend.storage is not None or shard_state):
        raise ValueError(f"state_dir keeps the state of the unsharded {' or '.join(disk_tier_backends())} EPS on "
                         f"disk, not of the {'sharded ' if shard_state else ''}{name} EPS"
                         + ("" if shard_state else " (its state is in its own memory)"))
    if delay_compensation != "none" and backend.storage is not None:  # before a transport is built
        raise ValueError(f"delay_compensation={delay_compensation!r} is computed on the host from the EPS's state; the "
                         f"{name} EPS keeps it in its own memory and its kernel does not predict: use the "
                         f"{' or '.join(disk_tier_backends())} EPS")
    if state_dir is None and groups_in_flight is not None:
        raise ValueError(f"groups_in_flight={groups_in_flight!r} bounds the groups of a state_dir in memory; give "
                         "state_dir too, or drop it")
    if shard_state and options.get("optimizer") in WHOLE_TENSOR_RULES:
        needs = "each matrix whole (its Newton-Schulz iterations)" if options["optimizer"] == "muon" else \
            "each tensor's whole norms (its trust ratio)"
        raise ValueError(f"optimizer={options['optimizer']!r} needs {needs}; shard_state=True keeps slices: use an "
                         "unsharded EPS or adamw, adam or sgd")
    if shard_state and state != "fp32":
        raise ValueError(f"shard_state=True keeps fp32 optimizer state only, not state={state!r} "
                         f"(its checkpoints gather fp32 tensors); use an unsharded EPS for bf16 or 8-bit state")
    accepted = inspect.signature(backend.kernel).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(backend_options) - set(accepted))
        if unknown:
            own = [p for p in accepted if p not in ("config", "state")]
            raise ValueError(f"unknown option(s) {', '.join(unknown)} for the {name} EPS; it takes the optimizer's "
                             f"({', '.join(OptimConfig.__dataclass_fields__)}), the engine's (working_dtype, "
                             f"double_buffer, state{', state_dir, groups_in_flight' if backend.storage is None else ''}"
                             f") and its own ({', '.join(own) or 'none'})")
    config = OptimConfig(**options)
    check_formats(state, working_dtype)  # before a state_dir is made
    kernel = backend.kernel(config, state=state, **backend_options)
    storage = None
    try:
        if backend.storage is not None:
            storage = backend.storage(kernel)
        else:
            storage = HostMemory() if state_dir is None else RegionFiles(state_dir, groups_in_flight or GROUPS_IN_FLIGHT)
        eps = Engine(config, kernel, storage, working_dtype=working_dtype, double_buffer=double_buffer, state=state,
                     name=name, delay_compensation=delay_compensation)
    except BaseException:
        if storage is not None:
            storage.close()
        kernel.close()
        raise
    return ShardedEps(eps, process_group) if shard_state else eps
