"""The EPS interface; the optimizer configuration (OptimConfig) is l2l_hw/eps/optimizer.py's.

An EPS holds fp32 master weights and optimizer state for named groups of tensors
(one group per relay layer, plus one per parameter shared by several layers).
The relay only ever talks to the interface `EPS` (abstract methods only):

    configure(...)             what the relay needs of it (working copy, double buffering, deferral)
    expect(groups)             every group about to be registered (a storage laying out files checks it whole)
    register(key, params)      take the fp32 master copy, allocate state
    expect_step(fetches, updates)  the order the step will use the groups in (a storage reads ahead along it)
    fetch(key) / fetch_async   host working copy the device computes with next
    push_grads(key, grads)     schedule the eager update of that group; returns at once
    commit_step()              the step is done: its updates finished, or (wait=False) finishing in the background
    discard_step() / wait() / master(key)
    state_dict() / load_state_dict() / state_entries()   (the last: streamed checkpoints)
    close()                    join its threads, release its files (also `with eps:`)
    sharded, process_group     what it is, so the relay never inspects its class

`LocalEps` implements it for whole tensors: the step semantics (deferred updates, commit
without waiting, discarding a step) written once; the update engine (l2l_hw/eps/engine.py)
owns the buffers and the update thread, and is composed of an update kernel (how one
tensor is updated) and a storage (where the buffers live). The sharded EPS
(l2l_hw/eps/sharded.py) implements the interface by wrapping a LocalEps that keeps this
rank's slices.
"""
from __future__ import annotations

import contextlib
import ctypes
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

# the optimizers and OptimConfig (eps/optimizer.py), under this module's names too, as callers import them
from l2l_hw.eps.optimizer import (LAYERWISE, MAX_NS_STEPS, MOMENTUM_OPTIMIZERS, MUON_ADJUST_LR, MUON_MATRIX_NDIM,
                                  MUON_MOMENTUM, OPTIMIZERS, RULE_SLOTS, SCHEDULES, STATE_SLOTS, WHOLE_TENSOR_RULES,
                                  OptimConfig, check_number, tensor_rule, updated_slots)

_LIBC = ctypes.CDLL(None)  # this process's symbols: its C library's among them


def release_freed_memory() -> None:
    """Give the pages of freed buffers back to the system (glibc's malloc_trim, every arena).
    glibc keeps freed blocks under its mmap threshold (up to 32 MiB) in its heaps, and the EPS's
    long-lived state sits among them: the encoding of 8-bit state at registration, the update's
    temporaries and the pushed gradients would otherwise stay resident, 4-40% over the state
    (issue 59; measured in tests/test_eps.py). Called once a step, as the step commits."""
    trim = getattr(_LIBC, "malloc_trim", None)  # glibc only (musl has none)
    if trim is not None:
        trim(0)


GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
WORKING_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StateEntry:
    """One tensor of the EPS state, read only when it is needed (streamed checkpoints)."""

    shape: torch.Size
    dtype: torch.dtype
    read: Callable[[], torch.Tensor]  # the values, valid until the next update; do not write


def tensor_of(x: torch.Tensor | StateEntry) -> torch.Tensor:
    """A tensor, reading a StateEntry (a state mapping may hold either)."""
    return x.read() if isinstance(x, StateEntry) else x


class PendingFetch:
    """A fetch under way: `wait()` gives the host tensors, `held()` what it holds meanwhile.
    A local EPS's fetch is ready at once, or once the group's update has landed; a sharded
    one's all-gather runs in the background."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    ready = True

    def held(self) -> list[torch.Tensor]:
        return []

    def wait(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def when_ready(self, landed: Callable[[dict[str, torch.Tensor]], None]) -> bool:
        """Whether `landed(tensors)` will be called, on another thread, as soon as the values are
        there (before `wait()`, which still collects the fetch and raises its error): the relay
        starts the copy up then. False: only `wait()` gives them."""
        return False


class Landing(dict):
    """A group's gradients on their way to host memory (the relay's transport: a copy from
    the device still running): name -> host tensor, whose values are there once `wait()`
    returned. `release()` gives the staging buffers back once the update has read them.
    Whoever reads the values calls `landed(grads)` first; a plain dict of host tensors has
    landed already."""

    def __init__(self, tensors: dict[str, torch.Tensor], wait: Callable[[], object],
                 release: Callable[[], None]):
        super().__init__(tensors)
        self._wait, self._release = wait, release

    def wait(self) -> "Landing":
        self._wait()
        return self

    def release(self) -> None:
        self._release()


def landed(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`grads` with their values there: a Landing waited for, anything else as it is."""
    return grads.wait() if isinstance(grads, Landing) else grads


def release(grads: dict[str, torch.Tensor]) -> None:
    """The update has read `grads`: a Landing's buffers go back to their pool."""
    if isinstance(grads, Landing):
        grads.release()


class EPS(ABC):
    """Eager Param Server: the interface the relay calls, nothing else. A local EPS
    (LocalEps, below) keeps whole tensors; the sharded EPS (l2l_hw/eps/sharded.py) wraps
    any EPS and keeps this rank's slices."""

    name = "abstract"
    sharded = False  # this rank keeps slices of every tensor (l2l_hw/eps/sharded.py)
    process_group = None  # the torch.distributed group of a sharded EPS
    config: OptimConfig
    step: int  # optimizer steps committed
    shapes: dict[str, dict[str, torch.Size]]  # group -> tensor name -> the whole tensor's shape
    working_dtype: str  # what fetch() gives: fp32, bf16 or fp16
    double_buffer: bool  # updates write spare buffers; a step can be discarded, the previous version read
    delay_compensation: str = "none"  # "predict": the working copy is the next step's predicted weights (golden.py)

    @abstractmethod
    def configure(self, working_dtype: str | None = None, double_buffer: bool | None = None,
                  defer_updates: bool | None = None, device: str | torch.device | None = None,
                  threads: int | None = None, inline: bool | None = None) -> None:
        """What the relay needs of the EPS, said once before the first register(). The relay's
        thread policy: `threads`, the host threads an update may compute with; `inline`, whether
        the layers compute on the caller's thread on the host's cores, so that an update computing
        there too runs between layers rather than beside them (l2l_hw/eps/worker.py)."""

    @abstractmethod
    def expect(self, groups: dict[str, dict[str, torch.Size]]) -> None:
        """The groups the relay is about to register, in order, with their tensors' shapes: said once,
        after configure() and before the first register(). A storage that lays out files for them
        (the disk tier's state_dir) checks the whole model against what it holds before it writes
        anything; the others need nothing of it."""

    @abstractmethod
    def register(self, key: str, params: dict[str, torch.Tensor], no_decay: frozenset[str] = frozenset()) -> None:
        """Take the fp32 master copy of a group's parameters and allocate its state; the tensors
        named in `no_decay` are updated without weight decay (biases and norms, as transformers'
        Trainer does)."""

    @abstractmethod
    def expect_step(self, fetches: list[str], updates: list[str]) -> None:
        """The order the step about to start uses the groups in, said at its start: `fetches`, the
        groups the forward sweep fetches, in order; `updates`, the groups whose gradients it
        pushes, in the order they come. A storage whose bytes live elsewhere (the state_dir)
        reads ahead along it; a step that says nothing gets no read-ahead. Only a hint: any
        fetch or push in any order stays correct."""

    @abstractmethod
    def fetch(self, key: str, previous: bool = False) -> dict[str, torch.Tensor]:
        """Host working copy of a group (working_dtype); `previous`: one commit back."""

    def fetch_async(self, key: str, previous: bool = False) -> PendingFetch:
        """fetch() that may still be under way when it returns (a sharded EPS's all-gather):
        the relay's weight prefetch starts it one layer ahead and waits when the layer runs."""
        return PendingFetch(self.fetch(key, previous=previous))

    @abstractmethod
    def push_grads(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float = 1.0) -> None:
        """Schedule the eager update of group `key` for the step under way; returns at once.
        `grads` may be a Landing (still on its way to host memory): the update waits for it."""

    @abstractmethod
    def commit_step(self, grad_scale: float = 1.0, skip_nonfinite: bool = False, wait: bool = True,
                    agree: Callable[[bool], bool] | None = None) -> bool:
        """Finish the step's updates and make them the committed state (LocalEps says how);
        whether a non-finite gradient was seen. `agree(found)`: the flag combined with the other
        ranks that hold the rest of the model (a pipeline's stages), so all skip the same steps."""

    @abstractmethod
    def discard_step(self) -> None:
        """Forget the step under way."""

    @abstractmethod
    def wait(self) -> None:
        """Block until every scheduled update has finished; raise an update's exception."""

    @abstractmethod
    def master(self, key: str) -> dict[str, torch.Tensor]:
        """fp32 master weights of a group (copies)."""

    def lr_at(self, step: int) -> float:
        return self.config.lr_at(step)

    def on_device(self, key: str) -> bool:
        """Whether group `key` lives on the relay's device (its fetch gives device tensors, its
        gradients stay there: l2l_hw/relay/device_share.py); a host EPS's never do."""
        return False

    @abstractmethod
    def state_entries(self) -> dict[str, StateEntry]:
        """Master weights and optimizer state as `{key}/{name}/{slot}` entries (plus `step`),
        read one at a time (streamed checkpoints)."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Master weights and optimizer state as `{key}/{name}/{slot}` tensors plus `step` (copies)."""
        return {name: e.read().to(e.dtype, copy=True) for name, e in self.state_entries().items()}

    @abstractmethod
    def load_state_dict(self, state: Mapping[str, torch.Tensor | StateEntry]) -> None:
        """Load what state_dict / state_entries gave (any EPS of the same model and rule)."""

    @abstractmethod
    def close(self) -> None:
        """Finish the updates under way, join the update thread and release what the EPS holds
        (files, device memory). Idempotent; the EPS is not used afterwards."""

    def __enter__(self) -> "EPS":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def new_group(shapes: dict[str, dict[str, torch.Size]], key: str, params: dict[str, torch.Tensor],
              no_decay: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """What any EPS registers, checked (a new key; floating-point tensors with values, not on the
    meta device; no_decay names some of them) and recorded in `shapes`; the tensors as fp32 on the host."""
    if key in shapes:
        raise ValueError(f"EPS group {key!r} is registered already")
    if not set(no_decay) <= set(params):
        raise ValueError(f"no_decay names tensors that group {key!r} does not hold: {sorted(set(no_decay) - set(params))}")
    for name, p in params.items():
        if not p.is_floating_point():
            raise TypeError(f"parameter {key}/{name} has dtype {p.dtype}; the EPS keeps floating-point parameters")
        if p.device.type == "meta":
            raise ValueError(f"parameter {key}/{name} is on the meta device: it has no values to register")
    shapes[key] = {name: p.shape for name, p in params.items()}
    return {n: p.detach().to("cpu", torch.float32) for n, p in params.items()}


def check_state_mapping(state) -> None:
    if not isinstance(state, Mapping):
        raise TypeError(f"EPS state must be a mapping of name -> tensor (a state_dict), got {type(state).__name__}")


class StepPushes:
    """The groups whose gradients were pushed in the step under way and, when updates wait for
    the commit (`defer`: global-norm clipping scales them all by one factor), their gradients,
    held on the host until then. Written once for the local and the sharded EPS."""

    def __init__(self):
        self.groups: set[str] = set()
        self.deferred: list[tuple[str, dict[str, torch.Tensor], float]] = []
        self.defer = False

    def add(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float, step: int,
            update: Callable[[str, dict[str, torch.Tensor], float], None]) -> None:
        """Group `key`'s gradients of step `step`: updated now by `update`, or deferred."""
        if key in self.groups:
            raise RuntimeError(f"gradients for EPS group {key!r} were pushed twice in step {step}")
        self.groups.add(key)
        if self.defer:  # a Landing is held as it is (its buffers come back after the update)
            held = grads if isinstance(grads, Landing) else {n: g.detach().to("cpu") for n, g in grads.items()}
            self.deferred.append((key, held, inv_scale))
        else:
            update(key, grads, inv_scale)

    def run_deferred(self, grad_scale: float, update: Callable[[str, dict[str, torch.Tensor], float], None]) -> None:
        for key, grads, inv_scale in self.deferred:
            update(key, grads, inv_scale * grad_scale)
        self.deferred.clear()

    def clear(self) -> None:
        """Forget the step: its groups and any gradients still deferred."""
        self.groups.clear()
        for _, grads, _ in self.deferred:
            release(landed(grads))
        self.deferred.clear()


class LocalEps(EPS):
    """An EPS of whole tensors: the step semantics (deferred updates, commit without waiting,
    discarding a step, double buffering), written once; l2l_hw/eps/engine.py adds the
    buffers and the update thread, composed of a kernel and a storage."""

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False):
        if working_dtype not in WORKING_DTYPES:
            raise ValueError(f"unknown working_dtype {working_dtype!r}; choose one of {', '.join(WORKING_DTYPES)}")
        self.config = config
        self.working_dtype = working_dtype
        self.step = 0  # optimizer steps committed
        self.shapes: dict[str, dict[str, torch.Size]] = {}
        self.pushes = StepPushes()  # what the step under way pushed (and deferred, with global clipping)
        self.no_decay: dict[str, frozenset[str]] = {}  # per group, the tensors updated without weight decay
        self.found_nonfinite = False  # a non-finite gradient was seen in the step under way
        # Deferred updates run at commit, all scaled by one factor (global-norm clipping):
        # the gradients wait in host memory and the updates no longer overlap the backward.
        # Double buffering: updates write a second copy of param and state; the step
        # commits by swapping, so a step can be discarded whole (overflow) and the
        # committed state is consistent at any time (checkpoints).
        self.double_buffer = bool(double_buffer)
        self._unsettled: set[str] | None = None  # groups of a double-buffered step committed with wait=False
        self.pin_fetched = False  # the working copy crosses to a CUDA device: pin it (nothing else)

    def configure(self, working_dtype: str | None = None, double_buffer: bool | None = None,
                  defer_updates: bool | None = None, device: str | torch.device | None = None,
                  threads: int | None = None, inline: bool | None = None) -> None:
        """What the relay needs of the EPS, said once at construction: the working copy's dtype
        (what the layers compute in), double buffering (a step can be discarded whole, or the
        previous version is read), whether updates wait for the end of the step, and the
        device the working copy goes to (pinned host memory only for CUDA)."""
        if device is not None:
            self.pin_fetched = torch.device(device).type == "cuda"
        if working_dtype is not None and working_dtype != self.working_dtype:
            if working_dtype not in WORKING_DTYPES:
                raise ValueError(f"unknown working_dtype {working_dtype!r}; choose one of {', '.join(WORKING_DTYPES)}")
            if self.shapes:
                raise ValueError(f"this EPS already holds groups with working_dtype={self.working_dtype!r}; "
                                 f"a relay computing in {working_dtype} needs a fresh one")
            self.working_dtype = working_dtype
        if double_buffer and not self.double_buffer:
            if self.shapes:
                raise ValueError("this EPS already holds groups without double buffering; build it with "
                                 "make_eps(..., double_buffer=True) for this relay")
            self.double_buffer = True
        if defer_updates is not None:
            self.pushes.defer = bool(defer_updates)

    # -- registration ---------------------------------------------------------
    def register(self, key: str, params: dict[str, torch.Tensor], no_decay: frozenset[str] = frozenset()) -> None:
        """Take the fp32 master copy of a group's parameters and allocate its state."""
        self._register(key, new_group(self.shapes, key, params, no_decay))
        self.no_decay[key] = frozenset(no_decay)

    # -- the step -------------------------------------------------------------
    def push_grads(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float = 1.0) -> None:
        """Schedule the eager update of group `key` for the step under way; returns at once.

        Tensors of the group missing from `grads` had no gradient and stay as they are."""
        self._settle()
        self._check_grads(key, grads)
        self.pushes.add(key, grads, inv_scale, self.step + 1, self._push)

    def commit_step(self, grad_scale: float = 1.0, skip_nonfinite: bool = False, wait: bool = True,
                    agree: Callable[[bool], bool] | None = None) -> bool:
        """Run deferred updates with their gradients times `grad_scale`, wait for every
        update of the step and make it the committed state; with `skip_nonfinite`, a
        step that saw a non-finite gradient is discarded whole instead (that needs double
        buffering: the updates of the step wrote spare buffers).

        wait=False: no barrier. The step counts as committed at once and its updates go on in
        the background, the backlog served in the order the next forward fetches the groups.
        In place (one buffer set), a group's next fetch (or read, or push) waits for its own
        update only; checkpoints, master() and wait() wait for all. Double buffered
        (PipeDream-2BW), they are swapped in when the next step first needs them (its first
        push, a fetch of the newest version, a checkpoint), and until then
        fetch(previous=True) gives the version they replace, so no layer waits. Nothing can
        be skipped then, and a non-finite flag is reported only for the updates that had
        finished (all of them where updates run inline).

        Returns whether a non-finite gradient was seen in the step."""
        self._settle()
        self.pushes.run_deferred(grad_scale, self._push)
        if not wait:
            release_freed_memory()  # what the steps before left (this step's updates go on)
            if skip_nonfinite:
                raise ValueError("commit_step(wait=False) cannot skip a non-finite step: deciding needs every "
                                 "update of the step finished (wait=True)")
            found = False
            if self.double_buffer:
                self._unsettled = set(self.pushes.groups)
            else:
                found = self._commit_in_background(self.pushes.groups)
            self.pushes.groups = set()
            self.found_nonfinite = False
            self.step += 1
            return found
        self._wait()
        release_freed_memory()
        found = self.found_nonfinite if agree is None else agree(self.found_nonfinite)
        if found and skip_nonfinite:
            self.discard_step()
            return True
        if self.double_buffer:
            self._swap()
        self.step += 1
        self.pushes.groups.clear()
        self.found_nonfinite = False
        return found

    def _settle(self) -> None:
        """Finish a commit made with wait=False: wait for its updates and swap them in. If one
        failed, that step is undone (its updates wrote only spare copies) and the error raised."""
        keys, self._unsettled = self._unsettled, None
        if keys is None:
            return
        try:
            self._wait()
        except BaseException:
            self.step -= 1
            self.pushes.groups |= keys
            self.discard_step()
            raise
        self._swap()
        self.found_nonfinite = False

    def wait(self) -> None:
        """Block until every scheduled update has finished (and a commit made without waiting
        is swapped in); raise an update's exception."""
        self._settle()
        self._wait()

    def discard_step(self) -> None:
        """Forget the step under way: deferred gradients are dropped and, with double
        buffering, every update written in the step. Without it, groups already updated
        in place cannot be restored, and this says so."""
        self._settle()
        self._wait()
        updated = set(self.pushes.groups) if not self.pushes.defer else set()
        self.pushes.clear()
        self.found_nonfinite = False
        self._discard()
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

    # -- fetching ---------------------------------------------------------------
    def fetch(self, key: str, previous: bool = False) -> dict[str, torch.Tensor]:
        """Host working copy of a group (working_dtype), valid until the group's next update.

        With double buffering, `previous` gives the version committed one step earlier
        (PipeDream-2BW computes on it while the newest one is being written)."""
        if self._unsettled is not None:
            if previous:  # the newest step is still being written: what it replaces is one step back
                return self._fetch(key, previous=False)
            self._settle()
        return self._fetch(key, previous and self.double_buffer)

    # -- checkpoints ----------------------------------------------------------
    def slots(self, shape: torch.Size | None = None) -> tuple[str, ...]:
        """The fp32 tensors a parameter of `shape` has in the state: param and its rule's slots
        (tensor_rule: a Muon EPS's matrices keep m alone); without a shape, every slot the
        optimizer's tensors may have."""
        rule = self.config.optimizer if shape is None else tensor_rule(self.config.optimizer, shape)
        return ("param",) + (STATE_SLOTS if shape is None else RULE_SLOTS)[rule]

    def stored_slots(self, shape: torch.Size) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """Shape and dtype of what one tensor keeps, as a checkpoint stores it: fp32 param and
        optimizer slots here; compressed optimizer state (engine.py) stores its own pieces."""
        return {slot: (shape, torch.float32) for slot in self.slots(shape)}

    def state_entries(self) -> dict[str, StateEntry]:
        """The state as `{key}/{name}/{slot}` entries read one at a time (plus `step`), so a
        checkpoint streams to its file without a second copy of the state in memory. With
        double buffering, `{key}/{name}/previous` is the version one commit back (fp32)."""
        self.wait()
        out = {"step": _ready(torch.tensor(self.step, dtype=torch.int64))}
        for key, names in self.shapes.items():
            for name, shape in names.items():
                for slot, (stored_shape, dtype) in self.stored_slots(shape).items():
                    out[f"{key}/{name}/{slot}"] = StateEntry(stored_shape, dtype, self._reader(key, name, slot))
                if self.double_buffer:  # PipeDream-2BW's next step computes on it; bf16/fp16 widen exactly
                    out[f"{key}/{name}/previous"] = StateEntry(
                        shape, torch.float32, lambda k=key, n=name: self.fetch(k, previous=True)[n].float())
        return out

    def _reader(self, key: str, name: str, slot: str) -> Callable[[], torch.Tensor]:
        return lambda: self.read_state(key, name)[slot]

    def load_state_dict(self, state: Mapping[str, torch.Tensor | StateEntry]) -> None:
        """Load a state_dict (or a streamed checkpoint's mapping, read one tensor at a time).
        Every entry's presence, dtype and shape is checked before anything is written."""
        self.wait()
        check_state_mapping(state)
        wanted = {f"{k}/{n}/{s}": layout for k, names in self.shapes.items() for n, shape in names.items()
                  for s, layout in self.stored_slots(shape).items()}
        wanted["step"] = (torch.Size([]), torch.int64)
        missing = sorted(set(wanted) - set(state))
        if missing:
            raise ValueError(f"EPS state is missing {len(missing)} entries, e.g. {missing[:3]}; was it saved with "
                             f"another model, optimizer ({self.config.optimizer}) or state format?")
        for name, (shape, dtype) in wanted.items():
            t = state[name]
            if t.shape != shape or t.dtype != dtype:
                raise ValueError(f"EPS state {name} is {t.dtype} {tuple(t.shape)}; expected {dtype} {tuple(shape)}")
        previous = {f"{k}/{n}/previous" for k, names in self.shapes.items() for n in names}
        extra = sorted(set(state) - set(wanted) - previous)
        if extra:
            raise ValueError(f"EPS state has {len(extra)} entries this EPS does not hold, e.g. {extra[:3]}; was it "
                             "saved with another model or state format?")
        step = int(tensor_of(state["step"]))
        if step < 0:
            raise ValueError(f"EPS state step is {step}; a step count is >= 0")
        for key, names in self.shapes.items():
            with self._holding(key):
                for name, shape in names.items():
                    previous = state.get(f"{key}/{name}/previous") if self.double_buffer else None
                    if previous is not None:
                        previous = tensor_of(previous).to(WORKING_DTYPES[self.working_dtype])
                    self.load_tensor(key, name, {s: tensor_of(state[f"{key}/{name}/{s}"])
                                                 for s in self.stored_slots(shape)}, previous)
        self.step = step

    def master(self, key: str) -> dict[str, torch.Tensor]:
        """fp32 master weights of a group (copies)."""
        self.wait()
        return {name: self.read_state(key, name)["param"].clone() for name in self.shapes[key]}

    # -- what the engine provides --------------------------------
    @abstractmethod
    def _register(self, key: str, params: dict[str, torch.Tensor]) -> None: ...

    @abstractmethod
    def _fetch(self, key: str, previous: bool = False) -> dict[str, torch.Tensor]: ...

    @abstractmethod
    def _push(self, key: str, grads: dict[str, torch.Tensor], inv_scale: float) -> None: ...

    @abstractmethod
    def _wait(self) -> None:
        """Block until every scheduled update has finished; raise an update's exception."""

    @abstractmethod
    def read_state(self, key: str, name: str) -> dict[str, torch.Tensor]:
        """fp32 `param` and state slots of one tensor (may share the EPS's memory: do not write)."""

    @abstractmethod
    def load_tensor(self, key: str, name: str, slots: dict[str, torch.Tensor],
                    previous: torch.Tensor | None = None) -> None:
        """Overwrite one tensor's param and state slots (a missing slot: zeros; fp32 values, or
        the stored pieces of `stored_slots`) and, with double buffering, its version one
        commit back (working dtype; None: the loaded param)."""

    @abstractmethod
    def _commit_in_background(self, groups: set[str]) -> bool:
        """commit_step(wait=False) in place: collect the updates of `groups` that have finished
        (raising their errors) and let the others finish in the background (or wait for all);
        whether a collected one saw a non-finite gradient."""

    def _discard(self) -> None:
        """Forget what the updates of the step wrote (double buffering: spare buffers)."""

    def _holding(self, key: str):
        """Group `key` kept in reach while its tensors are loaded one by one (a context manager)."""
        return contextlib.nullcontext()

    @abstractmethod
    def _swap(self) -> None:
        """Double buffering: the updates written in the step become the committed state, and
        every tensor's previous version what was committed before (for a tensor the step left
        alone, a skipped layer's, that is its committed version: it did not change)."""


def _ready(t: torch.Tensor) -> StateEntry:
    return StateEntry(t.shape, t.dtype, lambda: t)
