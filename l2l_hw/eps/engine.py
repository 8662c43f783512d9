"""The asynchronous update engine, written once: an update kernel on a storage, composed.

    Engine(config, kernel, storage)     (make_eps composes it: l2l_hw/eps/registry.py)

The engine owns each tensor's buffers, the update thread, the bookkeeping of what a step
wrote, push / wait / commit / discard and the buffer flips; the kernel computes one
tensor's update (l2l_hw/eps/kernel.py), the storage keeps the buffers
(l2l_hw/eps/storage.py). Neither inherits the engine or knows the other, so any kernel runs
on any storage of its memory:

    kernels    HostKernel (the fused C kernel, l2l_hw/eps/cpu.py), GoldenKernel (numpy,
               l2l_hw/eps/golden_eps.py), RtlKernel (l2l_optim through its driver, fpga.py)
    storages   HostMemory (RAM), RegionFiles (a state_dir, l2l_hw/eps/disk.py), FpgaDram

Buffers of one tensor (`TensorBuffers`), in the storage:
    current    param, m, v (the optimizer's slots) and, for a bf16/fp16 working copy,
               `working`: the committed state. Always there: 12 B/parameter with Adam,
               14 with a bf16 working copy. m and v are kept in the EPS's state format
               (`state=`, golden.STATE_FORMATS): fp32; bf16 (10 B/parameter with a bf16
               copy); or 8bit, codes plus `m_scale`/`v_scale` buffers of one fp32 scale per
               block (8.03 B/parameter). The master param is always fp32.
    spare      what updates write when they cannot run in place: with double buffering
               (a step discarded whole, fp16 overflow; PipeDream-2BW), and for kernels
               whose run can fail halfway through a tensor (`in_place = False`: a bus
               error or a timeout on the FPGA). Slots the rule does not write have none.
    previous   double buffering only: the working copy one commit back (fetch(previous=True)).

Delay compensation "predict" (PipeDream-2BW; golden.predict_rule): the kernel writes param and
the state, then its `predict` writes the working copy (a buffer of its own, fp32 too: +8 B/parameter
with an fp32 copy, in current and spare) at the weights the next step is predicted to reach. Checkpoints keep the
newest version's predicted copy (`{key}/{name}/predicted`): it is not a function of the state.

An update first brings the whole group's gradients to the host, so everything that can
fail is done before any buffer is written; then it runs tensor by tensor, in place or
into the spare buffers. Without double buffering a group's spare buffers are swapped in
as soon as every tensor of the group was written, on the update thread, and `fetch`
waits for the group's pending update. With it, they are swapped in for every group at
commit_step (`_swap`), so `fetch` never waits and a step can be discarded whole.

Updates run on one worker thread (l2l_hw/eps/worker.py), so the update of layer i overlaps
the backward of layer i-1 on the caller's thread and the step's last updates overlap the next
step's forward (a commit need not wait: each group's next fetch waits for its own update);
the backlog is served in the order the next forward fetches the groups, UPDATE_CHUNK elements
at a time, so a group needed sooner overtakes one under way (docs/ARCHITECTURE.md, "The
update's life"). Or inline, between layers, where the layers and the update would compute on
the same host cores (the relay on the CPU with a kernel computing on the host and a storage
that never waits on I/O; `configure(inline=...)`).

Read-ahead follows the relay's order, told, not guessed: at the start of a step the relay
says which groups it fetches in the forward sweep and in which order their gradients come
(`expect_step`); each fetch and each update then asks the storage to read ahead the uses
that follow (`StepOrder`). Only a storage that waits on I/O is given the hints.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

import torch

from l2l_hw.eps import golden
from l2l_hw.eps.base import (WHOLE_TENSOR_RULES, WORKING_DTYPES, LocalEps, OptimConfig, PendingFetch, StateEntry,
                             check_state_mapping, landed, release, tensor_of, tensor_rule, updated_slots)
from l2l_hw.eps.golden import step_scalars
from l2l_hw.eps.kernel import CANONICAL_NAN, Kernel, UpdateRule
from l2l_hw.eps.storage import Buffer, GroupLayout, Spec, Storage
from l2l_hw.eps.worker import Update, UpdateWorker

# fp32 m and v encoded this many elements at a time (whole blocks: the same codes as at once); the
# golden encoder's temporaries take ~70 B per element, 9 GB for a 131 M-element embedding at once
ENCODE_CHUNK = golden.QUANT_BLOCK << 14
# An update runs this many elements of a tensor at a time (whole 8-bit blocks), so that a group the
# device needs sooner overtakes it within a few milliseconds: ~28 MB of fp32 AdamW traffic, ~2.5 ms
# at the host kernel's one-thread rate here (16 x 1.5 M elements in 18.5 ms); each chunk costs
# ~0.05 ms more (2^19: 20.0 ms for the same, 1.08x).
UPDATE_CHUNK = 1 << 20
assert UPDATE_CHUNK % golden.QUANT_BLOCK == 0


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


class StepOrder:
    """The order the relay said the step under way uses the groups in (EPS.expect_step): the
    forward's fetches, then the updates in the order the gradients come. Each use reached
    names the uses to read ahead: after a forward fetch the next two (working copies, or the
    first regions of the backward), after an update the next one, and so after the backward's
    fetch of a group (recomputed layers), whose update comes next. One region ahead in the
    backward, not two: two evicted groups about to be used (docs/DISK.md). A step that told
    nothing reads nothing ahead."""

    AHEAD = {"fetch": 2, "update": 1}

    def __init__(self):
        self.uses: list[tuple[str, str]] = []  # (group, "fetch" | "update")
        self.reached: list[bool] = []
        self.waiting: dict[tuple[str, str], collections.deque] = {}  # use -> its places not reached yet
        self._lock = threading.Lock()  # fetches reach uses on the caller's thread, updates on the update thread

    def expect(self, fetches: list[str], updates: list[str]) -> None:
        with self._lock:
            self.uses = [(key, "fetch") for key in fetches] + [(key, "update") for key in updates]
            self.reached = [False] * len(self.uses)
            self.waiting = {}
            for i, use in enumerate(self.uses):
                self.waiting.setdefault(use, collections.deque()).append(i)

    def reach(self, key: str, kind: str) -> list[tuple[str, str]]:
        """Group `key` is used for `kind` now: the uses to read ahead."""
        with self._lock:
            places, ahead = self.waiting.get((key, kind)), self.AHEAD[kind]
            if places:
                i = places.popleft()
                self.reached[i] = True
            elif kind == "fetch" and self.waiting.get((key, "update")):  # fetched again in the backward:
                i, ahead = self.waiting[key, "update"][0], self.AHEAD["update"]  # the use of its update comes next
            else:
                return []
            after = []
            for j in range(i + 1, len(self.uses)):
                if not self.reached[j]:
                    after.append(self.uses[j])
                    if len(after) == ahead:
                        break
            return after


class Engine(LocalEps):
    """An EPS whose updates run on the update thread: `kernel` on buffers kept by `storage`."""

    def __init__(self, config: OptimConfig, kernel: Kernel, storage: Storage, working_dtype: str = "fp32",
                 double_buffer: bool = False, state: str = "fp32", name: str | None = None,
                 delay_compensation: str = "none"):
        check_formats(state, working_dtype)
        check_delay_compensation(delay_compensation, config, name or kernel.name, kernel.memory)
        self.delay_compensation = delay_compensation
        if kernel.memory != storage.memory:
            raise ValueError(f"the {kernel.name} kernel computes on {kernel.memory} memory; a {type(storage).__name__} "
                             f"storage keeps {storage.memory} memory")
        super().__init__(config, working_dtype, double_buffer)
        self.name = name or kernel.name
        self.kernel, self.storage = kernel, storage
        self.state_format = state
        self.buffers: dict[str, dict[str, TensorBuffers]] = {}
        self.order = StepOrder()
        self._worker: UpdateWorker | None = UpdateWorker("l2l-eps-update")
        self._written: dict[str, set[str]] = {}  # double buffering: tensors updated in the step, per group
        self._in_use = False  # a fetch or a push happened: registration is over
        self._background: set[str] = set()  # groups whose update of a step committed without waiting runs on

    def configure(self, working_dtype=None, double_buffer=None, defer_updates=None, device=None, threads=None,
                  inline=None) -> None:
        super().configure(working_dtype, double_buffer, defer_updates, device, threads, inline)
        if threads is not None:
            self.kernel.configure(threads)
        if inline is not None:  # an update that may wait on I/O runs beside the layers, never between them
            self._open().inline = inline and self.kernel.computes_on_host and not self.storage.waits_on_io

    def _open(self) -> UpdateWorker:
        if self._worker is None:
            raise RuntimeError(f"the {self.name} EPS is closed")
        return self._worker

    # -- layout ---------------------------------------------------------------------
    @property
    def working_slot(self) -> str:
        """The buffer the device reads: param itself for an fp32 copy, unless it is predicted."""
        return "param" if self.working_dtype == "fp32" and not self.predicts else "working"

    @property
    def predicts(self) -> bool:
        """Delay compensation "predict": every update writes the working copy at the weights the
        next step is predicted to reach (golden.predict_rule), not the rounding of param."""
        return self.delay_compensation == "predict"

    def _slots_written(self, shape: torch.Size) -> tuple[str, ...]:
        """What an update of a tensor of `shape` writes: SGD and LARS without momentum leave m as it is."""
        state = updated_slots(self.config.optimizer, self.config.momentum, shape)
        return ("param",) + state + (("working",) if self.working_slot == "working" else ())

    @property
    def out_of_place(self) -> bool:
        return self.double_buffer or not self.kernel.in_place

    def _rule(self, optimizer: str | None = None, shape: torch.Size | None = None) -> UpdateRule:
        """The rule a kernel run applies: `optimizer`, else that of a tensor of `shape` (base.tensor_rule:
        a Muon EPS runs Muon on its matrices, AdamW on the rest)."""
        rule = optimizer or (self.config.optimizer if shape is None else tensor_rule(self.config.optimizer, shape))
        return UpdateRule(rule, self.state_format, self.working_dtype, self.config.nesterov)

    def _stored_rule(self) -> dict:
        """What the bytes of a group depend on besides the model (a storage that keeps them checks it)."""
        rule = {"optimizer": self.config.optimizer, "state": self.state_format, "working_dtype": self.working_dtype,
                "double_buffer": self.double_buffer}
        return rule | ({"delay_compensation": self.delay_compensation} if self.predicts else {})

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
        return {piece: layout for slot in self.slots(shape) for piece, layout in self._pieces(slot, shape).items()}

    def buffer_layout(self, shape: torch.Size) -> list[tuple[str, str | None, Spec]]:
        """(role, piece, spec) of every buffer one tensor of `shape` takes: role "current", "spare"
        or "previous" (the module docstring); spec.fetched: the working copy, which crosses to the
        device. What a storage allocates, and what l2l_hw.estimate counts."""
        def spec(s, dtype, slot):
            fetched = slot == self.working_slot
            return Spec(torch.Size(s), dtype, fetched, fetched and self.pin_fetched)

        slots = self.slots(shape) + (("working",) if self.working_slot == "working" else ())
        out = [("current", piece, spec(s, dtype, slot))
               for slot in slots for piece, (s, dtype) in self._pieces(slot, shape).items()]
        if self.out_of_place:
            out += [("spare", piece, spec(s, dtype, slot))
                    for slot in self._slots_written(shape) for piece, (s, dtype) in self._pieces(slot, shape).items()]
        if self.double_buffer:
            out.append(("previous", None, spec(shape, WORKING_DTYPES[self.working_dtype], self.working_slot)))
        return out

    def _layout(self, key: str, shapes: dict[str, torch.Size]) -> tuple[GroupLayout, list]:
        roles = [(name, role, piece, spec) for name, shape in shapes.items()
                 for role, piece, spec in self.buffer_layout(torch.Size(shape))]
        return GroupLayout(key, {n: torch.Size(s) for n, s in shapes.items()}, [r[3] for r in roles]), roles

    # -- registration and loading -----------------------------------------------------
    def expect(self, groups):
        """The whole model's groups, for a storage that checks them against what it holds."""
        self.storage.expect([self._layout(key, shapes)[0] for key, shapes in groups.items()], self._stored_rule())

    def _register(self, key, params):
        self._open()
        shapes = {name: p.shape for name, p in params.items()}
        layout, roles = self._layout(key, shapes)
        group = {name: TensorBuffers({}) for name in shapes}
        for (name, role, piece, _), buf in zip(roles, self.storage.allocate(layout, self._stored_rule())):
            b = group[name]
            if role == "previous":
                b.previous = buf
            else:
                getattr(b, role)[piece] = buf
        self.buffers[key] = group
        self.kernel.prepare(shapes)
        with self.storage.hold(key, write_back=True):
            for name, p in params.items():
                self.load_tensor(key, name, {"param": p})

    def _holding(self, key):
        return self.storage.hold(key)

    def load_tensor(self, key, name, slots, previous=None):
        shape = self.shapes[key][name]
        b = self.buffers[key][name]
        for slot in self.slots(shape):
            for piece, values in self._stored_values(slot, slots, shape).items():
                self.storage.write(b.current[piece], values)
        if self.working_slot == "working":
            self._convert(key, name, b)
        if b.previous is not None:  # before the first commit the previous version is the loaded one
            if previous is None:
                previous = self.storage.read(b.current["param" if self.working_dtype == "fp32" else "working"],
                                             shape, WORKING_DTYPES[self.working_dtype])
            self.storage.write(b.previous, previous)

    def state_entries(self):
        """LocalEps's, and under "predict" the working copy of the newest version, `{key}/{name}/predicted`
        (fp32): the step after the next computes on it, and it is not a function of the state alone."""
        out = super().state_entries()
        if self.predicts:
            for key, names in self.shapes.items():
                for name, shape in names.items():
                    out[f"{key}/{name}/predicted"] = StateEntry(
                        shape, torch.float32, lambda k=key, n=name: self._working(k, False)[n].float())
        return out

    def load_state_dict(self, state):
        """LocalEps's, and under "predict" the checkpoint's predicted working copies (without them the
        working copy is param's rounding, as for a fresh run), each checked before anything is written."""
        check_state_mapping(state)
        predicted = {name: entry for name, entry in state.items() if name.endswith("/predicted")} \
            if self.predicts else {}
        for name, entry in predicted.items():
            key, _, rest = name.partition("/")
            shape = self.shapes.get(key, {}).get(rest.rpartition("/")[0])
            if shape is None or entry.shape != shape or entry.dtype != torch.float32:
                raise ValueError(f"EPS state {name} is {entry.dtype} {tuple(entry.shape)}; expected float32 "
                                 f"{tuple(shape) if shape is not None else 'of a tensor this EPS holds'}")
        super().load_state_dict({k: v for k, v in state.items() if k not in predicted} if predicted else state)
        for key, names in self.shapes.items():
            with self._holding(key):
                for name in names:
                    entry = predicted.get(f"{key}/{name}/predicted")
                    if entry is not None:
                        self.storage.write(self.buffers[key][name].current["working"],
                                           tensor_of(entry).to(WORKING_DTYPES[self.working_dtype]))

    def _stored_values(self, slot: str, given: dict[str, torch.Tensor], shape: torch.Size) -> dict[str, torch.Tensor]:
        """What to write into one slot's buffers: the stored pieces as given (a checkpoint of
        the same format: resumed bit for bit), else fp32 values (missing: zeros) encoded by
        the golden rule of the state format, ENCODE_CHUNK elements at a time (whole blocks),
        and zeros encoded once (every all-zero block encodes alike)."""
        pieces = self._pieces(slot, shape)
        if all(p in given and given[p].dtype == dtype for p, (_, dtype) in pieces.items()):
            return {p: given[p] for p in pieces}
        values = given.get(slot)
        if slot == "param" or self.state_format == "fp32":
            return {slot: torch.zeros(shape) if values is None else values.float()}
        if values is None and shape.numel() >= golden.QUANT_BLOCK:
            block = _encoded(torch.zeros(golden.QUANT_BLOCK), self.state_format, slot)
            return {p: torch.full(s, block[p].reshape(-1)[0].item(), dtype=dtype) for p, (s, dtype) in pieces.items()}
        values = torch.zeros(shape) if values is None else values
        parts = [_encoded(chunk, self.state_format, slot) for chunk in values.float().reshape(-1).split(ENCODE_CHUNK)]
        return {p: torch.cat([part[p].reshape(-1) for part in parts]).reshape(s) for p, (s, _) in pieces.items()}

    def _convert(self, key: str, name: str, b: TensorBuffers) -> None:
        """The working copy of loaded weights by the kernel's own rounding: a zero-step SGD
        run (p - 0 * 0 = p for finite p; NaN becomes the canonical NaN), its param output
        going to scratch so the master keeps every bit. An fp32 copy (predict's) is param's bits."""
        shape = self.shapes[key][name]
        if self.working_dtype == "fp32":
            p = self.storage.read(b.current["param"], shape, torch.float32)
            self.storage.write(b.current["working"], torch.where(torch.isnan(p), CANONICAL_NAN, p))
            return
        zero = step_scalars(OptimConfig(optimizer="sgd", lr=0.0), 1)
        if self.kernel.slices:  # a chunk at a time: no scratch or zero gradient of the tensor's size beside it
            with self.storage.hold(key) as view:
                held = _viewed({"param": b.current["param"], "working": b.current["working"]}, view)
                param, working = held["param"].reshape(-1), held["working"].reshape(-1)
                size = min(shape.numel(), UPDATE_CHUNK)
                scratch, grad = torch.empty(size), torch.zeros(size)
                for start in range(0, shape.numel(), UPDATE_CHUNK):
                    end = min(shape.numel(), start + UPDATE_CHUNK)
                    self.kernel.run(_what(key, name), self._rule("sgd"), zero, grad[:end - start],
                                    {"param": param[start:end]},
                                    {"param": scratch[:end - start], "working": working[start:end]})
            return
        scratch = b.spare.get("param")
        temporary = scratch is None
        if temporary:
            scratch = self.storage.scratch(shape, torch.float32)
        try:
            with self.storage.hold(key) as view:
                self.kernel.run(_what(key, name), self._rule("sgd"), zero, torch.zeros(shape),
                                _viewed({"param": b.current["param"]}, view),
                                _viewed({"param": scratch, "working": b.current["working"]}, view))
        finally:
            if temporary:
                self.storage.free(scratch)

    # -- the step ---------------------------------------------------------------------
    def expect_step(self, fetches, updates):
        """The step's order (EPS.expect_step): in memory, the update thread serves its backlog in the
        order of the forward's fetches (the next step's too); on disk, the storage reads ahead along
        the told order and the updates keep it."""
        unknown = sorted({*fetches, *updates} - set(self.shapes))
        if unknown:
            raise KeyError(f"expect_step names unknown EPS groups {unknown}; registered groups: "
                           f"{', '.join(self.shapes) or 'none'}")
        if self.storage.waits_on_io:  # it reads ahead along the told order, so updates keep the push order
            self.order.expect(list(fetches), list(updates))
        else:
            self._open().order(list(fetches))

    def _read_ahead(self, key: str, kind: str) -> None:
        """Group `key` is used for `kind` now: the storage starts reading what the step uses next."""
        if not self.storage.waits_on_io:
            return
        for next_key, next_kind in self.order.reach(key, kind):
            group = self.buffers[next_key].values()
            buffers = [buf for b in group for buf in b.all()] if next_kind == "update" else \
                [buf for b in group for buf in (b.current[self.working_slot], b.previous) if buf is not None]
            self.storage.read_ahead(next_key, buffers)

    def _begin_use(self) -> None:
        if not self._in_use:
            self._in_use = True
            self.storage.registered()

    def _push(self, key, grads, inv_scale):
        worker = self._open()
        self._begin_use()
        if worker.pending(key):  # its update of an earlier step (a group pushed without a fetch between)
            self._collect(key)
        s = step_scalars(self.config, self.step + 1, inv_scale)
        plain = golden.without_weight_decay(s)  # no_decay's tensors
        if self.storage.waits_on_io:
            self.storage.update_queued(key)
        shapes = self.shapes[key]  # a Muon matrix's step depends on its shape (golden.tensor_scalars)
        scalars = {n: golden.tensor_scalars(self.config, plain if n in self.no_decay[key] else s, shapes[n])
                   for n in grads}
        if not self.predicts:
            worker.submit(key, self._update(key, grads, scalars))
            return
        following = step_scalars(self.config, self.step + 2, inv_scale)  # the next step's, for the prediction
        ahead = {n: following if n not in self.no_decay[key] else golden.without_weight_decay(following) for n in grads}
        worker.submit(key, self._update(key, grads, scalars, ahead))

    def _update(self, key: str, grads: dict[str, torch.Tensor], scalars: dict, ahead: dict | None = None) -> Update:
        """Update thread: the group's gradients to the host first (all that can fail), then
        one run per tensor (with its step scalars), in place or into the spare buffers, a
        chunk at a time (`_chunks`): between chunks a group needed sooner may overtake it."""
        # fp32, bf16 or fp16 as they came (push_grads checked shapes and dtypes): the kernel widens
        # them. The relay's gradients come as a Landing, on their way down from the device.
        self._read_ahead(key, "update")
        try:
            with self.storage.hold(key, write_back=True) as view:
                host = {name: grad.detach().to("cpu").contiguous() for name, grad in landed(grads).items()}
                found = False
                for name, g in host.items():
                    b, rule = self.buffers[key][name], self._rule(shape=g.shape)
                    written = [piece for slot in self._slots_written(g.shape) for piece in self._pieces(slot, g.shape)]
                    dst = b.spare if self.out_of_place else {piece: b.current[piece] for piece in written}
                    for part, src, out in self._chunks(rule, g, _viewed(b.current, view), _viewed(dst, view)):
                        if ahead is None:
                            found |= self.kernel.run(_what(key, name), rule, scalars[name], part, src, out)
                        else:  # the kernel writes param and state; the working copy is the prediction
                            ran = {slot: t for slot, t in out.items() if slot != "working"}
                            found |= self.kernel.run(_what(key, name), rule, scalars[name], part, src, ran)
                            self.kernel.predict(rule, ahead[name], part, out)
                        if not self.storage.waits_on_io:  # a storage on disk holds one whole group at a time
                            yield
        finally:
            release(grads)
        if self.double_buffer:
            self._written.setdefault(key, set()).update(host)
        elif self.out_of_place:  # every tensor of the group succeeded: swap the group in
            for name in host:
                self.buffers[key][name].flip()
        return found

    def _chunks(self, rule: UpdateRule, grad: torch.Tensor, src: dict, dst: dict):
        """(grad, src, dst) of one tensor's update in UPDATE_CHUNK-element slices where the rule is
        element-wise and the kernel takes slices (every element's result is the same either way);
        whole otherwise (LAMB, LARS, Muon's matrices). 8-bit state: whole blocks, with their scales."""
        n = grad.numel()
        if not self.kernel.slices or rule.optimizer in WHOLE_TENSOR_RULES or n <= UPDATE_CHUNK:
            yield grad, src, dst
            return
        block = golden.QUANT_BLOCK
        for start in range(0, n, UPDATE_CHUNK):
            end = min(n, start + UPDATE_CHUNK)
            cut = {False: slice(start, end), True: slice(start // block, -(-end // block))}  # elements; scales
            yield grad.reshape(-1)[cut[False]], *(
                {slot: t.reshape(-1)[cut[slot.endswith("_scale")]] for slot, t in buffers.items()}
                for buffers in (src, dst))

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
                    self.storage.write(b.previous, self.storage.read(b.current[slot], shape,
                                                                     WORKING_DTYPES[self.working_dtype]))

    def _discard(self):
        self._written.clear()  # the step's updates wrote only spare buffers

    def _wait(self):
        if self._worker is None:  # closed: nothing is pending
            return
        try:
            found = self._worker.wait()
        finally:
            background, self._background = self._background, set()
        self.found_nonfinite |= bool(found - background)

    def _commit_in_background(self, groups):
        if self.storage.waits_on_io:  # the disk tier reads ahead along one step's order at a time: wait
            self._wait()
            return self.found_nonfinite
        worker, first_error = self._open(), None
        for key in sorted(groups):
            if worker.done(key):
                try:
                    self._collect(key)
                except Exception as exc:  # raised once every finished update is collected
                    first_error = first_error or exc
            else:
                self._background.add(key)
        if first_error is not None:
            raise first_error
        return self.found_nonfinite

    def _collect(self, key: str) -> None:
        """Wait for group `key`'s update; its non-finite flag counts for the step under way
        unless that update belongs to a step committed without waiting."""
        found = self._open().result(key)
        if key in self._background:
            self._background.discard(key)
        else:
            self.found_nonfinite |= found

    # -- reading --------------------------------------------------------------------------
    def fetch_async(self, key, previous=False):
        """A fetch that waits for the group's update only when it is waited for, so the relay's
        prefetch of the next layer never stalls the layer running now; in memory, the working
        copy is handed on by the update thread as soon as the update lands."""
        worker = self._open()
        if self._unsettled is not None or self.double_buffer or worker.done(key):
            return super().fetch_async(key, previous=previous)

        def when_ready(landed) -> bool:
            if self.storage.waits_on_io:  # its reads belong to the caller's thread
                return False
            worker.when_done(key, lambda: landed(self._working(key, previous)))
            return True

        return PendingUpdate(lambda: self.fetch(key, previous=previous), lambda: worker.done(key), when_ready)

    def _fetch(self, key, previous=False):
        worker = self._open()
        self._begin_use()
        self._read_ahead(key, "fetch")
        if not self.double_buffer and worker.pending(key):  # double buffered: updates write the spare
            self._collect(key)
        return self._working(key, previous)

    def _working(self, key: str, previous: bool) -> dict[str, torch.Tensor]:
        dtype = WORKING_DTYPES[self.working_dtype]
        return {name: self.storage.read(b.previous if previous else b.current[self.working_slot],
                                        self.shapes[key][name], dtype) for name, b in self.buffers[key].items()}

    def read_state(self, key, name):
        """fp32 param and optimizer slots (compressed state decoded by the golden rule)."""
        if self._open().pending(key):
            self._collect(key)
        b, shape = self.buffers[key][name], self.shapes[key][name]
        out = {}
        for slot in self.slots(shape):
            pieces = {p: self.storage.read(b.current[p], s, dtype)
                      for p, (s, dtype) in self._pieces(slot, shape).items()}
            if slot == "param" or self.state_format == "fp32":
                out[slot] = pieces[slot]
            else:
                decoded = golden.decode_state(golden.state_arrays(pieces), self.state_format, slot)
                out[slot] = torch.from_numpy(decoded.reshape(shape))
        return out

    def _reader(self, key, name, slot):
        """One stored piece as it is (compressed state too: a checkpoint keeps it unchanged)."""
        shape, dtype = self.stored_slots(self.shapes[key][name])[slot]
        return lambda: self.storage.read(self.buffers[key][name].current[slot], shape, dtype)

    def close(self) -> None:
        """Wait for the updates under way, join the update thread, give every buffer back and
        close the kernel and the storage (their threads, files and device memory). Idempotent;
        the EPS is unusable afterwards."""
        if self._worker is None:
            return
        worker, self._worker = self._worker, None
        worker.shutdown(wait=True)
        try:
            for group in self.buffers.values():
                for b in group.values():
                    for buf in b.all():
                        self.storage.free(buf)
            self.buffers.clear()
            self.kernel.close()
        finally:
            self.storage.close()


class PendingUpdate(PendingFetch):
    """A fetch of a group whose update is still running: read when waited for, or handed on by
    the update thread when the update lands (when_ready)."""

    def __init__(self, read, done, when_ready):
        self._read, self._done, self._when_ready = read, done, when_ready

    @property
    def ready(self) -> bool:
        return self._done()

    def wait(self) -> dict[str, torch.Tensor]:
        return self._read()

    def when_ready(self, landed) -> bool:
        return self._when_ready(landed)


def check_delay_compensation(compensation: str, config: OptimConfig, name: str, memory: str) -> None:
    """A delay compensation this engine can run: computed on the host, for a rule it predicts."""
    if compensation not in golden.DELAY_COMPENSATIONS:
        raise ValueError(f"unknown delay_compensation {compensation!r}; choose one of "
                         f"{', '.join(golden.DELAY_COMPENSATIONS)}")
    if compensation == "none":
        return
    if memory != "host":
        raise ValueError(f"delay_compensation={compensation!r} is computed on the host from the EPS's state; the "
                         f"{name} EPS keeps it in {memory} memory and its kernel does not predict: use the cpu or "
                         "golden EPS")
    problem = golden.prediction_problem(config)
    if problem:
        raise ValueError(f"delay_compensation={compensation!r} {problem}")


def check_formats(state: str, working_dtype: str) -> None:
    """The optimizer state format and the working copy's dtype are ones the engine keeps."""
    if state not in golden.STATE_FORMATS:
        raise ValueError(f"unknown optimizer state format state={state!r}; choose one of "
                         f"{', '.join(golden.STATE_FORMATS)}")
    if working_dtype not in WORKING_DTYPES:
        raise ValueError(f"unknown working_dtype {working_dtype!r}; choose one of {', '.join(WORKING_DTYPES)}")


def _viewed(buffers: dict[str, Buffer], view) -> dict:
    """What a kernel gets of `buffers` inside a storage's hold(): their views, or themselves."""
    return buffers if view is None else {slot: view(buf) for slot, buf in buffers.items()}


def _what(key: str, name: str) -> str:
    return f"EPS group {key!r} tensor {name!r}"


def _encoded(values: torch.Tensor, state: str, slot: str) -> dict[str, torch.Tensor]:
    return golden.state_tensors(golden.encode_state(values.numpy(), state, slot))
