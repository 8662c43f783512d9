"""The asynchronous update engine, written once for every EPS backend.

The engine owns each tensor's buffers, the update thread and the bookkeeping of what a
step wrote; a backend supplies only how a buffer is allocated, written and read, and
how one tensor is updated (`_run`: the host kernel, the RTL, or numpy).

Buffers of one tensor (`TensorBuffers`), in the backend's memory:
    current    param, m, v (the optimizer's slots) and, for a bf16/fp16 working copy,
               `working`: the committed state. Always there: 12 B/parameter with Adam,
               14 with a bf16 working copy. m and v are kept in the EPS's state format
               (`state=`, golden.STATE_FORMATS): fp32; bf16 (10 B/parameter with a bf16
               copy); or 8bit, codes plus `m_scale`/`v_scale` buffers of one fp32 scale per
               block (8.03 B/parameter). The master param is always fp32.
    spare      what updates write when they cannot run in place: with double buffering
               (a step discarded whole, fp16 overflow; PipeDream-2BW), and for backends
               whose update can fail halfway through a tensor (`in_place = False`: a bus
               error or a timeout on the FPGA). Slots the rule does not write have none.
    previous   double buffering only: the working copy one commit back (fetch(previous=True)).

An update first brings the whole group's gradients to the host, so everything that can
fail is done before any buffer is written; then it runs tensor by tensor, in place or
into the spare buffers. Without double buffering a group's spare buffers are swapped in
as soon as every tensor of the group was written, on the update thread, and `fetch`
waits for the group's pending update. With it, they are swapped in for every group at
commit_step (`_swap`), so `fetch` never waits and a step can be discarded whole.

Updates run on one worker thread in the order the relay pushes them, so the update of
layer i overlaps the backward of layer i-1 on the caller's thread; or inline, between
layers, where the layers and the update would compute on the same host cores (the relay on
the CPU; `configure(inline=...)`, l2l_hw/eps/worker.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from l2l_hw.eps import golden
from l2l_hw.eps.base import WORKING_DTYPES, LocalEps, OptimConfig, landed, release, updated_slots
from l2l_hw.eps.golden import step_scalars
from l2l_hw.eps.worker import UpdateWorker

Buffer = Any  # a backend's buffer: a host tensor, or a region of FPGA DRAM


@dataclass
class TensorBuffers:
    """One tensor's buffers, by slot (see the module docstring)."""

    current: dict[str, Buffer]
    spare: dict[str, Buffer] = field(default_factory=dict)
    previous: Buffer | None = None

    def flip(self) -> None:
        """The spare buffers (just written) become the current ones, and the other way round."""
        for slot in self.spare:
            self.current[slot], self.spare[slot] = self.spare[slot], self.current[slot]

    def all(self) -> list[Buffer]:
        return [*self.current.values(), *self.spare.values(), *([self.previous] if self.previous is not None else [])]


class AsyncEps(LocalEps):
    """An EPS whose updates run on the update thread over buffers the engine owns."""

    # False where an update can fail halfway through a tensor: updates then write spare buffers.
    in_place = True
    # True where an update is computation on the host's cores (not I/O, not another device's):
    # with the layers on the CPU too, it then runs inline (l2l_hw/eps/worker.py).
    computes_on_host = False

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 worker_name: str = "l2l-eps-update", state: str = "fp32"):
        if state not in golden.STATE_FORMATS:
            raise ValueError(f"unknown optimizer state format state={state!r}; choose one of "
                             f"{', '.join(golden.STATE_FORMATS)}")
        super().__init__(config, working_dtype, double_buffer)
        self.state_format = state
        self.buffers: dict[str, dict[str, TensorBuffers]] = {}
        self._worker = UpdateWorker(worker_name)
        self._written: dict[str, set[str]] = {}  # double buffering: tensors updated in the step, per group

    def configure(self, working_dtype=None, double_buffer=None, defer_updates=None, device=None, threads=None,
                  inline=None) -> None:
        super().configure(working_dtype, double_buffer, defer_updates, device, threads, inline)
        if inline is not None:
            self._worker.inline = inline and self.computes_on_host

    # -- what a backend provides ---------------------------------------------------
    def _allocate(self, shape: torch.Size, dtype: torch.dtype, fetched: bool) -> Buffer:
        """A buffer for `shape` x `dtype`; `fetched`: the working copy, which crosses to the device."""
        raise NotImplementedError

    def _write(self, buf: Buffer, values: torch.Tensor) -> None:
        raise NotImplementedError

    def _read(self, buf: Buffer, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's values as a host tensor (the buffer itself where it is host memory)."""
        raise NotImplementedError

    def _run(self, key: str, name: str, optimizer: str, s, grad: torch.Tensor,
             src: dict[str, Buffer], dst: dict[str, Buffer]) -> bool:
        """One tensor's update: read `src` (param, m, v), write `dst` (some of param, m, v,
        working; a destination may be its own source). Returns whether the gradient (times
        the inverse loss scale) held a non-finite value."""
        raise NotImplementedError

    def _free(self, buf: Buffer) -> None:
        """Give a buffer back (host memory: the garbage collector does)."""

    # -- layout ---------------------------------------------------------------------
    @property
    def working_slot(self) -> str:
        return "param" if self.working_dtype == "fp32" else "working"

    def _slots_written(self) -> tuple[str, ...]:
        """What an update writes: SGD and LARS without momentum leave m as it is."""
        state = updated_slots(self.config.optimizer, self.config.momentum)
        return ("param",) + state + (("working",) if self.working_dtype != "fp32" else ())

    @property
    def out_of_place(self) -> bool:
        return self.double_buffer or not self.in_place

    def _pieces(self, slot: str, shape: torch.Size) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """The buffers one slot is kept in: param fp32, the working copy in its dtype, m and v
        in the state format (8bit: codes shaped as the tensor, and a flat buffer of scales)."""
        if slot == "working":
            return {slot: (shape, WORKING_DTYPES[self.working_dtype])}
        if slot == "param":
            return {slot: (shape, torch.float32)}
        pieces = golden.stored_pieces(self.state_format, slot, shape.numel())
        return {piece: (shape if piece == slot else torch.Size([count]), dtype)
                for piece, (dtype, count) in pieces.items()}

    def stored_slots(self, shape):
        return {piece: layout for slot in self.slots() for piece, layout in self._pieces(slot, shape).items()}

    def buffer_layout(self, shape: torch.Size) -> list[tuple[str, str, torch.Size, torch.dtype, bool]]:
        """The buffers one tensor of `shape` takes, as (role, piece, shape, dtype, fetched): role
        "current", "spare" or "previous" (the module docstring); fetched: the working copy, which
        crosses to the device. What _new_tensor allocates, and what l2l_hw.estimate counts."""
        slots = self.slots() + (("working",) if self.working_dtype != "fp32" else ())
        layout = [("current", piece, s, dtype, slot == self.working_slot)
                  for slot in slots for piece, (s, dtype) in self._pieces(slot, shape).items()]
        if self.out_of_place:
            layout += [("spare", piece, s, dtype, slot == self.working_slot)
                       for slot in self._slots_written() for piece, (s, dtype) in self._pieces(slot, shape).items()]
        if self.double_buffer:
            layout.append(("previous", "previous", shape, WORKING_DTYPES[self.working_dtype], True))
        return layout

    def _new_tensor(self, shape: torch.Size) -> TensorBuffers:
        b = TensorBuffers({})
        for role, piece, s, dtype, fetched in self.buffer_layout(shape):
            buffer = self._allocate(s, dtype, fetched)
            if role == "previous":
                b.previous = buffer
            else:
                getattr(b, role)[piece] = buffer
        return b

    # -- registration and loading -----------------------------------------------------
    def _register(self, key, params):
        for name, p in params.items():
            self.load_tensor(key, name, {"param": p})

    def load_tensor(self, key, name, slots, previous=None):
        shape = self.shapes[key][name]
        group = self.buffers.setdefault(key, {})
        if name not in group:
            group[name] = self._new_tensor(shape)
        b = group[name]
        for slot in self.slots():
            for piece, values in self._stored_values(slot, slots, shape).items():
                self._write(b.current[piece], values)
        if self.working_dtype != "fp32":
            self._convert(key, name, b)
        if b.previous is not None:  # before the first commit the previous version is the loaded one
            if previous is None:
                previous = self._read(b.current[self.working_slot], shape, WORKING_DTYPES[self.working_dtype])
            self._write(b.previous, previous)

    def _stored_values(self, slot: str, given: dict[str, torch.Tensor], shape: torch.Size) -> dict[str, torch.Tensor]:
        """What to write into one slot's buffers: the stored pieces as given (a checkpoint of
        the same format: resumed bit for bit), else fp32 values (missing: zeros) encoded by
        the golden rule of the state format."""
        pieces = self._pieces(slot, shape)
        if all(p in given and given[p].dtype == dtype for p, (_, dtype) in pieces.items()):
            return {p: given[p] for p in pieces}
        values = given.get(slot)
        values = torch.zeros(shape) if values is None else values.float()
        if slot == "param" or self.state_format == "fp32":
            return {slot: values}
        stored = golden.state_tensors(golden.encode_state(values.numpy(), self.state_format, slot))
        return {p: t.reshape(pieces[p][0]) for p, t in stored.items()}

    def _convert(self, key: str, name: str, b: TensorBuffers) -> None:
        """The working copy of loaded weights by the backend's own rounding: a zero-step SGD
        run (p - 0 * 0 = p for finite p; NaN becomes the canonical NaN), its param output
        going to scratch so the master keeps every bit."""
        shape = self.shapes[key][name]
        scratch = b.spare.get("param")
        temporary = scratch is None
        if temporary:
            scratch = self._allocate(shape, torch.float32, False)
        try:
            zero = step_scalars(OptimConfig(optimizer="sgd", lr=0.0), 1)
            self._run(key, name, "sgd", zero, torch.zeros(shape), {"param": b.current["param"]},
                      {"param": scratch, "working": b.current["working"]})
        finally:
            if temporary:
                self._free(scratch)

    # -- the step ---------------------------------------------------------------------
    def _push(self, key, grads, inv_scale):
        s = step_scalars(self.config, self.step + 1, inv_scale)
        plain = golden.without_weight_decay(s)  # no_decay's tensors
        self._worker.submit(key, self._update, key, grads, {n: plain if n in self.no_decay[key] else s for n in grads})

    def _update(self, key: str, grads: dict[str, torch.Tensor], scalars: dict) -> bool:
        """Update thread: the group's gradients to the host first (all that can fail), then
        one run per tensor (with its step scalars), in place or into the spare buffers."""
        # fp32, bf16 or fp16 as they came (push_grads checked shapes and dtypes): the backend widens
        # them. The relay's gradients come as a Landing, on their way down from the device.
        try:
            host = {name: grad.detach().to("cpu").contiguous() for name, grad in landed(grads).items()}
            found = False
            for name, g in host.items():
                b = self.buffers[key][name]
                written = [piece for slot in self._slots_written() for piece in self._pieces(slot, g.shape)]
                dst = b.spare if self.out_of_place else {piece: b.current[piece] for piece in written}
                found |= self._run(key, name, self.config.optimizer, scalars[name], g, b.current, dst)
        finally:
            release(grads)
        if self.double_buffer:
            self._written.setdefault(key, set()).update(host)
        elif self.out_of_place:  # every tensor of the group succeeded: swap the group in
            for name in host:
                self.buffers[key][name].flip()
        return found

    def _swap(self):
        slot = self.working_slot
        for key, group in self.buffers.items():
            written = self._written.pop(key, set())
            for name, b in group.items():
                if name in written:
                    b.flip()  # spare now holds the version committed before: it becomes the previous one
                    b.spare[slot], b.previous = b.previous, b.spare[slot]
                else:  # unchanged in the step: its version one step back is the committed one
                    shape = self.shapes[key][name]
                    self._write(b.previous, self._read(b.current[slot], shape, WORKING_DTYPES[self.working_dtype]))

    def _discard(self):
        self._written.clear()  # the step's updates wrote only spare buffers

    def _wait(self):
        self.found_nonfinite |= self._worker.wait()

    # -- reading --------------------------------------------------------------------------
    def _fetch(self, key, previous=False):
        if not self.double_buffer:  # double buffered: updates write the spare, fetch need not wait
            self.found_nonfinite |= self._worker.result(key)
        dtype = WORKING_DTYPES[self.working_dtype]
        return {name: self._read(b.previous if previous else b.current[self.working_slot], self.shapes[key][name],
                                 dtype) for name, b in self.buffers[key].items()}

    def read_state(self, key, name):
        """fp32 param and optimizer slots (compressed state decoded by the golden rule)."""
        b, shape = self.buffers[key][name], self.shapes[key][name]
        out = {}
        for slot in self.slots():
            pieces = {p: self._read(b.current[p], s, dtype) for p, (s, dtype) in self._pieces(slot, shape).items()}
            if slot == "param" or self.state_format == "fp32":
                out[slot] = pieces[slot]
            else:
                decoded = golden.decode_state(golden.state_arrays(pieces), self.state_format, slot)
                out[slot] = torch.from_numpy(decoded.reshape(shape))
        return out

    def _reader(self, key, name, slot):
        """One stored piece as it is (compressed state too: a checkpoint keeps it unchanged)."""
        shape, dtype = self.stored_slots(self.shapes[key][name])[slot]
        return lambda: self._read(self.buffers[key][name].current[slot], shape, dtype)

    def close(self) -> None:
        """Wait for the update thread and give every buffer back."""
        if getattr(self, "_worker", None) is None:
            return
        self._worker.shutdown(wait=True)
        self._worker = None
        for group in self.buffers.values():
            for b in group.values():
                for buf in b.all():
                    self._free(buf)
        self.buffers.clear()

    def __del__(self):
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown(wait=False)
