"""The backend registry: `make_eps(name, ...)` builds an EPS by name.

Backends register themselves with `@register_backend(name)` when their module is
imported (l2l_hw/eps/__init__.py imports them all). `shard_state=True` wraps the
backend in the ZeRO-style sharded EPS (l2l_hw/eps/sharded.py), by composition.
"""
from __future__ import annotations

import inspect
from typing import Callable

from l2l_hw.eps.base import EPS, LAYERWISE, OptimConfig
from l2l_hw.eps.sharded import ShardedEps

_BACKENDS: dict[str, Callable[..., EPS]] = {}
_DISK_TIERS: dict[str, Callable[..., EPS]] = {}  # backend name -> the class keeping its state under state_dir


def register_backend(name: str, state_dir: bool = False):
    """Class decorator: make a backend buildable by `make_eps(name)`; with `state_dir`, the
    class `make_eps(name, state_dir=PATH)` builds (its state in files: l2l_hw/eps/disk.py)."""
    def wrap(cls):
        (_DISK_TIERS if state_dir else _BACKENDS)[name] = cls
        cls.name = name
        return cls
    return wrap


def known_backends() -> list[str]:
    return sorted(_BACKENDS)


def make_eps(name: str, working_dtype: str = "fp32", shard_state: bool = False, process_group=None,
             **options) -> EPS:
    """Build an EPS by backend name; the other options are those of OptimConfig or the backend's
    (cpu and golden: `state="fp32" | "bf16" | "8bit"`, the format of m and v; cpu:
    `state_dir=PATH`, the state in files under PATH, only the groups in flight in memory,
    l2l_hw/eps/disk.py).

    shard_state=True (data parallel, torch.distributed initialized): this rank keeps 1/N of
    every tensor's master weights and state, ZeRO-style (l2l_hw/eps/sharded.py)."""
    if not isinstance(name, str) or name not in _BACKENDS:
        raise ValueError(f"unknown EPS backend {name!r}; known backends: {', '.join(known_backends())}")
    if not isinstance(shard_state, bool):
        raise ValueError(f"shard_state must be True or False, got {shard_state!r}")
    backend = _BACKENDS[name]
    backend_options = {k: options.pop(k) for k in list(options) if k not in OptimConfig.__dataclass_fields__}
    if backend_options.get("state_dir") is not None:
        if name not in _DISK_TIERS or shard_state:
            raise ValueError(f"state_dir keeps the state of the unsharded {' or '.join(sorted(_DISK_TIERS))} EPS on "
                             f"disk, not of the {'sharded ' if shard_state else ''}{name} EPS")
        backend = _DISK_TIERS[name]
    else:
        backend_options.pop("state_dir", None)
    if shard_state and options.get("optimizer") in LAYERWISE:
        raise ValueError(f"optimizer={options['optimizer']!r} needs each tensor's whole norms (its trust ratio); "
                         "shard_state=True keeps slices: use an unsharded EPS or adamw, adam or sgd")
    if shard_state and backend_options.get("state", "fp32") != "fp32":
        raise ValueError(f"shard_state=True keeps fp32 optimizer state only, not state={backend_options['state']!r} "
                         f"(its checkpoints gather fp32 tensors); use an unsharded EPS for bf16 or 8-bit state")
    accepted = inspect.signature(backend).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        unknown = sorted(set(backend_options) - set(accepted))
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(unknown)} for the {name} EPS; it takes the optimizer's "
                             f"({', '.join(OptimConfig.__dataclass_fields__)}) and its own "
                             f"({', '.join(p for p in accepted if p not in ('config', 'working_dtype'))})")
    eps = backend(OptimConfig(**options), working_dtype=working_dtype, **backend_options)
    return ShardedEps(eps, process_group) if shard_state else eps
