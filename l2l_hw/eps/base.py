"""The EPS interface, the optimizer configuration and the backend registry.

An EPS holds fp32 master weights and optimizer state for named groups of tensors
(one group per relay layer, plus one per parameter shared by several layers).
The relay only ever talks to this interface:

    register(key, params)      take the fp32 master copy, allocate state
    fetch(key)                 host working copy the device computes with next
    push_grads(key, grads)     schedule the eager update of that group; returns at once
    commit_step()              wait for every update of the step; the step is done
    state_dict() / load_state_dict()
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from typing import Callable

import torch

OPTIMIZERS = ("adamw", "adam", "sgd")
SCHEDULES = ("constant", "cosine")
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WORKING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Optimizer state slots per optimizer: m is Adam's exp_avg or SGD's momentum buffer,
# v is Adam's exp_avg_sq.
STATE_SLOTS = {"adamw": ("m", "v"), "adam": ("m", "v"), "sgd": ("m",)}


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate schedule; names and defaults follow torch.optim."""

    optimizer: str = "adamw"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float | None = None  # None: torch's default (AdamW 1e-2, Adam/SGD 0)
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int | None = None
    min_lr: float = 0.0

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
        if self.weight_decay is None:
            object.__setattr__(self, "weight_decay", 1e-2 if self.optimizer == "adamw" else 0.0)
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        checks = [
            (self.lr >= 0, f"lr must be >= 0, got {self.lr}"),
            (self.eps >= 0, f"eps must be >= 0, got {self.eps}"),
            (len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
             f"betas must be two numbers in [0, 1), got {self.betas}"),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (self.momentum >= 0, f"momentum must be >= 0, got {self.momentum}"),
            (not self.nesterov or (self.momentum > 0 and self.dampening == 0),
             "nesterov needs momentum > 0 and dampening = 0 (as torch.optim.SGD)"),
            (self.schedule in SCHEDULES, f"unknown schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.schedule != "cosine" or (self.total_steps or 0) > self.warmup_steps,
             "the cosine schedule needs total_steps greater than warmup_steps"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (1-based): linear warm-up, then constant or cosine."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        return self.min_lr + (self.lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict:
        return asdict(self)


class EPS(ABC):
    """Eager Param Server. Subclasses store tensors and run the update rule of `golden.py`."""

    name = "abstract"

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False):
        if working_dtype not in WORKING_DTYPES:
            raise ValueError(f"unknown working_dtype {working_dtype!r}; choose one of {', '.join(WORKING_DTYPES)}")
        self.config = config
        self.working_dtype = working_dtype
        self.step = 0  # optimizer steps committed
        self.shapes: dict[str, dict[str, torch.Size]] = {}
        self._pushed: set[str] = set()  # groups updated in the step under way
        self.found_nonfinite = False  # a non-finite gradient was seen in the step under way
        # Deferred updates run at commit, all scaled by one factor (global-norm clipping):
        # the gradients wait in host memory and the updates no longer overlap the backward.
        self.defer_updates = False
        self._deferred: list[tuple[str, dict[str, torch.Tensor], float]] = []
        # Double buffering: updates write a second copy of param and state; the step
        # commits by swapping, so a step can be discarded whole (overflow) and the
        # committed state is consistent at any time (checkpoints).
        self.double_buffer = double_buffer
        self._unsettled: set[str] | None = None  # groups of a step committed with wait=False

    def enable_double_buffer(self) -> None:
        if self.shapes and not self.double_buffer:
            raise RuntimeError("enable double buffering before registering any group")
        self.double_buffer = True

    # -- registration ---------------------------------------------------------
    def register(self, key: str, params: dict[str, torch.Tensor]) -> None:
        """Take the fp32 master copy of a group's parameters and allocate its state."""
        if key in self.shapes:
            raise ValueError(f"EPS group {key!r} is registered already")
        for name, p in params.items():
            if not p.is_floating_point():
                raise TypeError(f"parameter {key}/{name} has dtype {p.dtype}; the EPS keeps floating-point parameters")
        self.shapes[key] = {name: p.shape for name, p in params.items()}
        self._register(key, {n: p.detach().to("cpu", torch.float32) for n, p in params.items()})

    def lr_at(self, step: int) -> float:
        return self.config.lr_at(step)

    # -- the step -------------------------------------------------------------
    def push_grads(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float = 1.0) -> None:
        """Schedule the eager update of group `key` for the step under way; returns at once.

        Tensors of the group missing from `grads` had no gradient and stay as they are."""
        self._settle()
        self._check_grads(key, grads)
        if key in self._pushed:
            raise RuntimeError(f"gradients for EPS group {key!r} were pushed twice in step {self.step + 1}")
        self._pushed.add(key)
        if self.defer_updates:
            self._deferred.append((key, {n: g.detach().to("cpu") for n, g in grads.items()}, inv_scale))
        else:
            self._push(key, grads, inv_scale)

    def commit_step(self, grad_scale: float = 1.0, skip_nonfinite: bool = False, wait: bool = True) -> bool:
        """Run deferred updates with their gradients times `grad_scale`, wait for every
        update of the step and make it the committed state; with `skip_nonfinite`, a
        step that saw a non-finite gradient is discarded whole instead.

        wait=False (double buffering; PipeDream-2BW): the step counts as committed at once
        and its updates go on in the background; they are swapped in when the next step
        first needs them (its first push, a fetch of the newest version, a checkpoint), and
        until then fetch(previous=True) gives the version they replace, so no layer waits.

        Returns whether a non-finite gradient was seen in the step (False with wait=False)."""
        self._settle()
        self._run_deferred(grad_scale)
        if not wait:
            if not self.double_buffer or skip_nonfinite:
                raise ValueError("commit_step(wait=False) needs double buffering and skip_nonfinite=False")
            self._unsettled, self._pushed = set(self._pushed), set()
            self.step += 1
            return False
        self.wait()
        found = self.found_nonfinite
        if found and skip_nonfinite:
            self.discard_step()
            return True
        if self.double_buffer:
            self._swap()
        self.step += 1
        self._pushed.clear()
        self.found_nonfinite = False
        return found

    def _run_deferred(self, grad_scale: float) -> None:
        for key, grads, inv_scale in self._deferred:
            self._push(key, grads, inv_scale * grad_scale)
        self._deferred.clear()

    def _settle(self) -> None:
        """Finish a commit made with wait=False: wait for its updates and swap them in. If one
        failed, that step is undone (its updates wrote only spare copies) and the error raised."""
        keys, self._unsettled = self._unsettled, None
        if keys is None:
            return
        try:
            self.wait()
        except BaseException:
            self.step -= 1
            self._pushed |= keys
            self.discard_step()
            raise
        self._swap()
        self.found_nonfinite = False

    def discard_step(self) -> None:
        """Forget the step under way: deferred gradients are dropped and, with double
        buffering, every update written in the step. Without it, groups already updated
        in place cannot be restored, and this says so."""
        self._settle()
        self.wait()
        updated = set(self._pushed) if not self.defer_updates else set()
        self._deferred.clear()
        self._pushed.clear()
        self.found_nonfinite = False
        if updated and not self.double_buffer:
            raise RuntimeError(f"the step was abandoned after {len(updated)} group(s) were updated in place; "
                               "enable double buffering (make_eps(..., double_buffer=True)) to discard steps")

    def _check_grads(self, key: str, grads: dict[str, torch.Tensor]) -> None:
        if key not in self.shapes:
            raise KeyError(f"unknown EPS group {key!r}; registered groups: {', '.join(self.shapes) or 'none'}")
        expected = self.shapes[key]
        unknown = sorted(set(grads) - set(expected))
        if unknown:  # a missing name is a parameter without gradient: left as is, as torch.optim does
            raise ValueError(f"gradients for EPS group {key!r} name unknown tensors {unknown}; "
                             f"the group holds {sorted(expected)}")
        for name, g in grads.items():
            if g.shape != expected[name]:
                raise ValueError(f"gradient {key}/{name} has shape {tuple(g.shape)}; expected {tuple(expected[name])}")
            if g.dtype not in GRAD_DTYPES:
                raise TypeError(f"gradient {key}/{name} has dtype {g.dtype}; the EPS takes float32, bfloat16 or float16")

    # -- checkpoints ----------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights and optimizer state as `{key}/{name}/{slot}` tensors plus `step`."""
        self._settle()
        self.wait()
        out = {"step": torch.tensor(self.step, dtype=torch.int64)}
        for key, names in self.shapes.items():
            for name in names:
                for slot, t in self._tensors(key, name).items():
                    out[f"{key}/{name}/{slot}"] = t.clone()
        if self.double_buffer:  # the version one commit back: PipeDream-2BW's next step computes on it
            for key in self.shapes:
                for name, t in self.fetch(key, previous=True).items():  # bf16/fp16 widen exactly
                    out[f"{key}/{name}/previous"] = t.to(torch.float32, copy=True)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._settle()
        self.wait()
        slots = self._slots()
        wanted = {f"{k}/{n}/{s}": shape for k, names in self.shapes.items() for n, shape in names.items() for s in slots}
        missing = sorted(set(wanted) - set(state))
        if missing:
            raise KeyError(f"EPS state is missing {len(missing)} entries, e.g. {missing[:3]}; "
                           f"was it saved with another model or optimizer ({self.config.optimizer})?")
        for name, shape in wanted.items():
            t = state[name]
            if t.shape != shape or t.dtype != torch.float32:
                raise ValueError(f"EPS state {name} is {t.dtype} {tuple(t.shape)}; expected float32 {tuple(shape)}")
        for key, names in self.shapes.items():
            for name in names:
                self._load(key, name, {s: state[f"{key}/{name}/{s}"] for s in slots})
                if self.double_buffer and f"{key}/{name}/previous" in state:
                    working = state[f"{key}/{name}/previous"].to(WORKING_DTYPES[self.working_dtype])
                    self._load_previous(key, name, working)
        self.step = int(state["step"])

    def _slots(self) -> tuple[str, ...]:
        return ("param",) + STATE_SLOTS[self.config.optimizer]

    def master(self, key: str) -> dict[str, torch.Tensor]:
        """fp32 master weights of a group (copies)."""
        self._settle()
        self.wait()
        return {name: self._tensors(key, name)["param"].clone() for name in self.shapes[key]}

    # -- what a backend provides ----------------------------------------------
    @abstractmethod
    def _register(self, key: str, params: dict[str, torch.Tensor]) -> None: ...

    def fetch(self, key: str, previous: bool = False) -> dict[str, torch.Tensor]:
        """Host working copy of a group (working_dtype), valid until the group's next update.

        With double buffering, `previous` gives the version committed one step earlier
        (PipeDream-2BW computes on it while the newest one is being written)."""
        if self._unsettled is not None:
            if previous:  # the newest step is still being written: what it replaces is one step back
                return self._fetch(key, previous=False)
            self._settle()
        return self._fetch(key, previous)

    @abstractmethod
    def _fetch(self, key: str, previous: bool = False) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def _push(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float) -> None: ...

    @abstractmethod
    def wait(self) -> None:
        """Block until every scheduled update has finished; raise an update's exception."""

    @abstractmethod
    def _tensors(self, key: str, name: str) -> dict[str, torch.Tensor]:
        """fp32 `param` and state slots of one tensor, as torch tensors (may share memory)."""

    @abstractmethod
    def _load(self, key: str, name: str, slots: dict[str, torch.Tensor]) -> None: ...

    def _load_previous(self, key: str, name: str, working: torch.Tensor) -> None:
        """Double buffering: restore the version one commit back (working dtype), as fetched."""
        raise NotImplementedError(f"the {self.name} EPS does not double-buffer")

    def _swap(self) -> None:
        """Double buffering: the updates written in the step become the committed state, and
        every tensor's previous version what was committed before (for a tensor the step left
        alone, a skipped layer's, that is its committed version: it did not change)."""
        raise NotImplementedError(f"the {self.name} EPS does not double-buffer")


_BACKENDS: dict[str, Callable[..., EPS]] = {}


def register_backend(name: str):
    """Class decorator: make a backend buildable by `make_eps(name)`."""
    def wrap(cls):
        _BACKENDS[name] = cls
        cls.name = name
        return cls
    return wrap


def known_backends() -> list[str]:
    return sorted(_BACKENDS)


def make_eps(name: str, working_dtype: str = "fp32", shard_state: bool = False, process_group=None,
             **options) -> EPS:
    """Build an EPS by backend name; the other options are those of OptimConfig or the backend's.

    shard_state=True (data parallel, torch.distributed initialized): this rank keeps 1/N of
    every tensor's master weights and state, ZeRO-style (l2l_hw/eps/sharded.py)."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown EPS backend {name!r}; known backends: {', '.join(known_backends())}")
    backend_options = {k: options.pop(k) for k in list(options) if k not in OptimConfig.__dataclass_fields__}
    eps = _BACKENDS[name](OptimConfig(**options), working_dtype=working_dtype, **backend_options)
    if shard_state:
        from l2l_hw.eps.sharded import ShardedEps

        eps = ShardedEps(eps, process_group)
    return eps
