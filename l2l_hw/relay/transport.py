"""The transport: every movement of tensors between host memory and the device.

The relay moves four things: weights up (the EPS's working copy, and frozen parameters),
the minibatch up, stashed layer inputs down and back up (activations="host"), and each
group's gradients down to the EPS. All of it goes through one `Transport`:

    up(tensors)      host -> device on the up stream; `Transfer.wait()` makes the compute
                     stream wait for it and gives the device tensors
    down(tensors)    device -> host on the down stream, which first waits for the compute
                     stream (the tensors are written there); into pinned host memory, a
                     reused `StagingPool` buffer where one is given; `Transfer.landed()`
                     blocks the calling thread (the EPS worker) until the data is there

A source on the device is kept alive for its copy (`record_stream`); a device tensor a
transfer brought is recorded on the compute stream that uses it. Host sources of copies
up are pinned (the EPS pins the working copy; anything else is staged into pinned
memory first), so no copy blocks the host.

Three kinds, by the relay's device:
    cpu        the device is the host: up and down are no copies (down copies where the
               caller needs its own buffer: the activation stash)
    cuda       copy streams and events, as above
    cpu-async  the asynchronous twin of cuda, on the CPU, for tests: each stream is a
               thread that runs its copies in order and as late as it may (when waited
               for, or a while after they were issued). A
               destination reads as poison (NaN, or the integer type's minimum) until its
               transfer is waited for; a device source not kept alive for its copy is read
               as poison once its last user let it go; a staging buffer given back to its
               pool is poisoned at once. So a missing wait, event or keep-alive shows as
               NaN in the result, and the relay's equivalence tests run on it.

`blocking` counts the transfers that made the relay's thread wait for the device
(`Transfer.landed()` there, and the loss read back at the end of a step); a test holds it
constant per step, whatever the depth and the number of micro-batches.
"""
from __future__ import annotations

import atexit
import collections
import random
import threading
import time
import weakref
from typing import Callable, Sequence

import torch

KINDS = ("cpu", "cuda", "cpu-async")


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill `t` with what no computation produces by itself: NaN, or the integer minimum
    (an index out of every range)."""
    if t.is_floating_point() or t.is_complex():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(t.dtype).min)


class StagingPool:
    """Reused pinned host buffers for gradients on their way down, one per (shape, dtype)
    in use at a time: a buffer comes back when the EPS has updated from it. On the twin a
    buffer given back is poisoned at once, so giving it back early shows."""

    def __init__(self, pinned: bool, poison_returned: bool):
        self.pinned = pinned
        self.poison_returned = poison_returned
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self._lock = threading.Lock()

    def take(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        with self._lock:
            free = self._free.get((tuple(shape), dtype))
            if free:
                return free.pop()
        return torch.empty(shape, dtype=dtype, pin_memory=self.pinned)

    def give_back(self, buffers: Sequence[torch.Tensor]) -> None:
        for b in buffers:
            if self.poison_returned:
                poison(b)
            with self._lock:
                self._free.setdefault((tuple(b.shape), b.dtype), []).append(b)

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for free in self._free.values() for b in free)


class Transfer:
    """Tensors on their way; `wait()` on the compute stream, `landed()` on any thread."""

    def __init__(self, tensors: list[torch.Tensor], event, transport: "Transport"):
        self.tensors = tensors
        self.event = event  # None: the copies are done
        self.transport = transport

    def wait(self) -> list[torch.Tensor]:
        """The tensors, for use on the compute stream."""
        if self.event is not None:
            self.transport._compute_waits(self.event, self.tensors)
            self.event = None
        return self.tensors

    def landed(self) -> list[torch.Tensor]:
        """Block the calling thread until the tensors are there (host tensors, on the EPS's
        update thread: it waits for its group's gradients, the relay does not)."""
        if self.event is not None:
            if threading.current_thread() is self.transport.owner:
                self.transport.blocking += 1
            self.event.synchronize()
        return self.tensors


class _TwinEvent:
    def __init__(self, stream: "_TwinStream", index: int):
        self._stream, self._index = stream, index
        self._done = threading.Event()

    def synchronize(self) -> None:
        self._stream.demand(self._index)
        self._done.wait()

    def query(self) -> bool:
        return self._done.is_set()


_TWIN_STREAMS: "weakref.WeakSet[_TwinStream]" = weakref.WeakSet()


@atexit.register
def _drain_twin_streams() -> None:
    for stream in list(_TWIN_STREAMS):
        stream.close()
        stream.thread.join(timeout=10)


class _TwinStream:
    """A copy stream of the twin: one thread running its copies in order, each as late as it
    may: when it, or a later copy of the stream, is waited for, or else a while (`late_s`,
    jittered) after it was issued. Data that nothing waited for is poison for that long."""

    def __init__(self, name: str, rng: random.Random, late_s: float):
        self._ops: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._issued, self._demanded = 0, -1
        self._rng, self._late_s = rng, late_s
        self._closed = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        _TWIN_STREAMS.add(self)

    def close(self) -> None:
        """Run the copies issued at once, then let the thread end (the transport is gone, or
        the interpreter is exiting: no copy may run while it tears torch down)."""
        with self._cond:
            self._closed = True
            self._demanded = self._issued
            self._cond.notify()

    def submit(self, copies: list[tuple[torch.Tensor, Callable[[], torch.Tensor | None]]],
               after: list[_TwinEvent], keep: list[torch.Tensor]) -> _TwinEvent:
        with self._cond:
            done = _TwinEvent(self, self._issued)
            self._issued += 1
            due = time.monotonic() + self._rng.uniform(0.5, 1.0) * self._late_s
            self._ops.append((copies, after, done, keep, due))
            self._cond.notify()
        return done

    def demand(self, index: int) -> None:
        with self._cond:
            self._demanded = max(self._demanded, index)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ops and not self._closed:
                    self._cond.wait()
                if not self._ops:
                    return
                copies, after, done, keep, due = self._ops[0]
                while done._index > self._demanded and time.monotonic() < due:
                    self._cond.wait(timeout=due - time.monotonic())
                self._ops.popleft()
            for e in after:
                e.synchronize()
            for dst, source in copies:
                src = source()
                if src is None:  # the source was let go before its copy ran: its memory is reused
                    poison(dst)
                else:
                    dst.copy_(src)
            del keep
            done._done.set()


def torch_device(name: str | torch.device) -> torch.device:
    """The torch device a relay's `device` computes on: the CPU for cpu-async (the twin)."""
    return torch.device("cpu") if str(name) == "cpu-async" else torch.device(name)


class Transport:
    """Host <-> device movement for one relay (see the module docstring)."""

    def __init__(self, device: str | torch.device, seed: int = 0, late_s: float = 0.05):
        name = str(device)
        self.kind = "cpu-async" if name == "cpu-async" else torch.device(name).type
        if self.kind not in KINDS:
            raise ValueError(f"the relay runs on {', '.join(KINDS)} (or cuda:N), not {name!r}")
        self.device = torch_device(name)
        self.owner = threading.current_thread()  # the relay's thread: its waits are counted
        self.blocking = 0
        self.grad_pool = StagingPool(pinned=self.kind == "cuda", poison_returned=self.kind == "cpu-async")
        if self.kind == "cuda":
            self._up, self._down = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
        elif self.kind == "cpu-async":
            rng = random.Random(seed)
            self._up = _TwinStream("l2l-twin-up", rng, late_s)
            self._down = _TwinStream("l2l-twin-down", rng, late_s)
            weakref.finalize(self, _TwinStream.close, self._up)
            weakref.finalize(self, _TwinStream.close, self._down)

    @property
    def asynchronous(self) -> bool:
        return self.kind != "cpu"

    # -- the two directions ----------------------------------------------------------
    def up(self, tensors: Sequence[torch.Tensor], after: Transfer | None = None,
           dtype: torch.dtype | None = None) -> Transfer:
        """Copy host `tensors` to the device (floating-point ones as `dtype` where given),
        after the transfer `after` (the same tensors on their way down) has landed."""
        if not self.asynchronous:
            return Transfer([t.to(self.device, dtype=dtype if t.is_floating_point() else None)
                             for t in tensors], None, self)
        def destinations():
            return [torch.empty(t.shape, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype,
                                device=self.device) for t in tensors]

        if self.kind == "cuda":
            src = [t if t.is_pinned() else t.pin_memory() for t in tensors]
            # Allocated on the up stream, which writes them: memory the compute stream let go
            # may still be written by its queued kernels, and the up stream does not wait for them.
            with torch.cuda.stream(self._up):
                dst = destinations()
            return Transfer(dst, self._cuda_copy(self._up, dst, src, after, from_compute=False), self)
        dst = destinations()
        return Transfer(dst, self._twin_copy(self._up, dst, list(tensors), after), self)

    def down(self, tensors: Sequence[torch.Tensor], pool: StagingPool | None = None) -> Transfer:
        """Copy device `tensors` (written on the compute stream) to host memory: buffers of
        `pool`, else new pinned ones. On the CPU, with a pool, the tensors themselves."""
        if not self.asynchronous:
            return Transfer(list(tensors) if pool is not None else [t.clone() for t in tensors], None, self)
        dst = [pool.take(t.shape, t.dtype) if pool is not None else
               torch.empty(t.shape, dtype=t.dtype, pin_memory=self.kind == "cuda") for t in tensors]
        if self.kind == "cuda":
            return Transfer(dst, self._cuda_copy(self._down, dst, list(tensors), None, from_compute=True), self)
        return Transfer(dst, self._twin_copy(self._down, dst, list(tensors), None), self)

    def read(self, t: torch.Tensor) -> float:
        """A device scalar's value on the host: one blocking transfer (the step's loss)."""
        if self.asynchronous:
            self.blocking += 1
        return float(t)

    # -- the copy idiom, once per kind ---------------------------------------------------
    def _cuda_copy(self, stream, dst, src, after: Transfer | None, from_compute: bool):
        compute = torch.cuda.current_stream(self.device)
        if from_compute:  # the sources are written on the compute stream
            stream.wait_stream(compute)
        if after is not None and after.event is not None:
            stream.wait_event(after.event)
        with torch.cuda.stream(stream):
            for d, s in zip(dst, src):
                d.copy_(s, non_blocking=True)
                if s.is_cuda:
                    s.record_stream(stream)  # the allocator must not reuse it before the copy has read it
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _twin_copy(self, stream: _TwinStream, dst, src, after: Transfer | None):
        for d in dst:
            poison(d)
        waits = [after.event] if after is not None and after.event is not None else []
        # Each source is kept alive until its copy ran, as record_stream (device sources) and
        # the pinned host allocator (host sources) do on CUDA; only a weak reference otherwise.
        return stream.submit(list(zip(dst, [weakref.ref(s) for s in src])), waits, keep=list(src))

    def _compute_waits(self, event, tensors: list[torch.Tensor]) -> None:
        if self.kind == "cuda":
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(event)
            for t in tensors:  # allocated on a copy stream, used on the compute stream
                t.record_stream(compute)
        else:  # the twin's compute stream is the relay's thread itself
            event.synchronize()
