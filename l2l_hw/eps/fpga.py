"""FPGA-DRAM EPS: master weights and optimizer state in the FPGA's DRAM, updated by
the RTL kernel l2l_optim (hdl/), through one register-level driver (l2l_hw/hw/driver.py)
and a transport: the Verilated RTL with a C++ DRAM model in-process ("fpga-sim"), or a
board through PYNQ ("fpga-pynq").

Buffers in device DRAM, per tensor: two copies of the fp32 param, m and v and of the
bf16/fp16 working copy, plus the gradient. A run reads the committed copy ("cur") and
writes the other one; a run that fails (timeout, AXI error) has therefore changed only
the spare copy, and the group keeps its committed state, whole. Slots the rule does not
write (m under plain SGD) have one copy.
  - default (double_buffer=False): a group's copies flip right after every tensor of the
    group was written without error (on the update thread); `fetch` waits for the group.
  - double_buffer=True: the copies flip for every group at commit_step, so a step can be
    discarded whole; fetch(previous=True) returns the version one commit back, kept in
    host memory (read back at the flip).

Gradients go to device DRAM and the kernel runs on one update thread, in push order, so
the simulation (ctypes releases the GIL) overlaps the relay's backward of the next layer.
With several compute units (kernel instances on one DRAM; fpga-sim `compute_units=`,
default one per core up to 2) the driver splits each tensor's run over them and returns
once all have ended; every unit writes only its share of the spare copies, so the failure
contract above holds whichever unit fails.
The working copy of loaded weights is made by the kernel too (a zero-step SGD run), so
every bit the accelerator fetches came out of the RTL.
"""
from __future__ import annotations


import torch

from l2l_hw.eps.base import EPS, STATE_SLOTS, WORKING_DTYPES, OptimConfig, register_backend
from l2l_hw.eps.golden import step_scalars
from l2l_hw.eps.worker import UpdateWorker
from l2l_hw.hw import regs

GRAD_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


class _DeviceTensor:
    """Device buffers of one tensor: {slot: [copy 0, copy 1]} and the gradient buffer."""

    def __init__(self, transport, n: int, slots_updated: tuple[str, ...], slots: tuple[str, ...], working: bool):
        self.n = n
        self.cur = 0
        self.copies = {}
        for slot in slots:
            first = transport.allocate(4 * n)
            self.copies[slot] = [first, transport.allocate(4 * n) if slot in slots_updated else first]
        if working:
            self.copies["working"] = [transport.allocate(2 * n), transport.allocate(2 * n)]
        self.grad = transport.allocate(4 * n)

    def committed(self, slot):
        return self.copies[slot][self.cur]

    def spare(self, slot):
        return self.copies[slot][1 - self.cur]

    def buffers(self):
        seen = {id(b): b for pair in self.copies.values() for b in pair}
        return list(seen.values()) + [self.grad]


class FpgaEps(EPS):
    """EPS whose updates run on the l2l_optim kernel behind `transport`."""

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 transport=None, timeout_s: float | None = None, max_cycles: int | None = None):
        super().__init__(config, working_dtype, double_buffer)
        from l2l_hw.hw.driver import DEFAULT_TIMEOUT_S, L2lOptimDriver

        self.transport = transport
        self.driver = L2lOptimDriver(transport, timeout_s=timeout_s or DEFAULT_TIMEOUT_S, max_cycles=max_cycles)
        self.tensors: dict[str, dict[str, _DeviceTensor]] = {}
        self.previous: dict[str, dict[str, torch.Tensor]] = {}  # double_buffer: fetch(previous=True)
        self._worker = UpdateWorker("l2l-fpga-update")
        self._written: dict[str, set[str]] = {}

    def _slots_updated(self) -> tuple[str, ...]:
        cfg = self.config
        return ("param",) + (() if cfg.optimizer == "sgd" and cfg.momentum == 0 else STATE_SLOTS[cfg.optimizer])

    def _mode(self, grad_dtype: str, optimizer: str | None = None) -> int:
        copy = "none" if self.working_dtype == "fp32" else self.working_dtype
        return regs.mode(optimizer or self.config.optimizer, grad_dtype, copy, self.config.nesterov)

    # -- registration -------------------------------------------------------------
    def _register(self, key, params):
        for name, p in params.items():
            self._load(key, name, {"param": p})

    def _load(self, key, name, slots):
        p = slots["param"].contiguous()
        t = self.tensors.setdefault(key, {}).get(name)
        if t is None:
            t = _DeviceTensor(self.transport, p.numel(), self._slots_updated(),
                              ("param",) + STATE_SLOTS[self.config.optimizer], self.working_dtype != "fp32")
            self.tensors[key][name] = t
        self.transport.write(t.committed("param"), p)
        for slot in STATE_SLOTS[self.config.optimizer]:
            src = slots[slot].contiguous() if slot in slots else torch.zeros_like(p)
            self.transport.write(t.committed(slot), src)
        if self.working_dtype != "fp32":
            # Working copy of the loaded weights by the kernel's own conversion: a zero-step
            # SGD run (p - 0 * 0 = p) writing the copy, its param output going to the spare.
            self.transport.write(t.grad, torch.zeros_like(p))
            zero = step_scalars(OptimConfig(optimizer="sgd", lr=0.0), 1)
            self.driver.run(layer=f"{key}/{name}", n=t.n, mode=self._mode("fp32", "sgd"), scalars=zero, pointers={
                "PARAM_SRC": t.committed("param").address, "GRAD_SRC": t.grad.address,
                "PARAM_DST": t.spare("param").address, "COPY_DST": t.committed("working").address})
        if self.double_buffer:
            self.previous.setdefault(key, {})[name] = self._read_working(key, name, t)

    def _load_previous(self, key, name, working):
        self.previous[key][name] = working.clone()

    def _read_working(self, key, name, t: _DeviceTensor) -> torch.Tensor:
        shape = self.shapes[key][name]
        if self.working_dtype == "fp32":
            return self.transport.read(t.committed("param"), torch.empty(shape))
        return self.transport.read(t.committed("working"), torch.empty(shape, dtype=WORKING_DTYPES[self.working_dtype]))

    def _tensors(self, key, name):
        t, shape = self.tensors[key][name], self.shapes[key][name]
        return {slot: self.transport.read(t.committed(slot), torch.empty(shape))
                for slot in ("param",) + STATE_SLOTS[self.config.optimizer]}

    # -- the step -------------------------------------------------------------------
    def _fetch(self, key, previous=False):
        if not self.double_buffer:  # double buffered: updates write the spare, fetch need not wait
            self.found_nonfinite |= self._worker.result(key)
        if previous and self.double_buffer:
            return dict(self.previous[key])
        return {name: self._read_working(key, name, t) for name, t in self.tensors[key].items()}

    def _push(self, key, grads, inv_scale):
        s = step_scalars(self.config, self.step + 1, inv_scale)
        self._worker.submit(key, self._update, key, grads, s)

    def _update(self, key, grads, s) -> bool:
        """Update thread: gradient to device DRAM, one kernel run per tensor writing the spare
        copies; the group flips (default) only once every tensor succeeded."""
        found = False
        for name, grad in grads.items():
            t = self.tensors[key][name]
            g = grad.detach().to("cpu").contiguous()
            self.transport.write(t.grad, g)
            pointers = {"GRAD_SRC": t.grad.address}
            for slot, (src, dst) in (("param", ("PARAM_SRC", "PARAM_DST")), ("m", ("M_SRC", "M_DST")),
                                     ("v", ("V_SRC", "V_DST"))):
                if slot in t.copies:
                    pointers[src], pointers[dst] = t.committed(slot).address, t.spare(slot).address
            if "working" in t.copies:
                pointers["COPY_DST"] = t.spare("working").address
            result = self.driver.run(layer=f"EPS group {key!r} tensor {name!r}", n=t.n,
                                     mode=self._mode(GRAD_NAMES[g.dtype]), scalars=s, pointers=pointers)
            found |= result.nonfinite
        if self.double_buffer:
            self._written.setdefault(key, set()).update(grads)
        else:
            for name in grads:
                self.tensors[key][name].cur ^= 1
        return found

    def _swap(self):
        for key, group in self.tensors.items():
            written = self._written.pop(key, set())
            for name, t in group.items():
                self.previous[key][name] = self._read_working(key, name, t)
                if name in written:
                    t.cur ^= 1

    def discard_step(self):
        super().discard_step()  # waits first; the runs wrote only spare copies
        self._written.clear()

    def wait(self):
        self.found_nonfinite |= self._worker.wait()

    def close(self) -> None:
        """Wait for the update thread and free every device buffer."""
        if getattr(self, "_worker", None) is None:
            return
        self._worker.shutdown(wait=True)
        self._worker = None
        self.driver.close()
        for group in self.tensors.values():
            for t in group.values():
                for buf in t.buffers():
                    self.transport.free(buf)
        self.tensors.clear()

    def __del__(self):
        if getattr(self, "_worker", None) is not None:
            self._worker.shutdown(wait=False)


@register_backend("fpga-sim")
class FpgaSimEps(FpgaEps):
    """The RTL in the loop: l2l_optim Verilated (built on first use) with a C++ DRAM model;
    `compute_units` instances of it on that DRAM (None: verilator.default_compute_units())."""

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 data_width: int | None = None, dram_bytes: int | None = None, read_latency: int = 0,
                 transport=None, lanes: int | None = None, compute_units: int | None = None, **driver_options):
        if transport is None:
            from l2l_hw.hw import verilator

            transport = verilator.VerilatorTransport(
                data_width, dram_bytes or verilator.DEFAULT_DRAM_BYTES, read_latency, lanes=lanes,
                compute_units=compute_units or verilator.default_compute_units())
        super().__init__(config, working_dtype, double_buffer, transport=transport, **driver_options)


@register_backend("fpga-pynq")
class FpgaPynqEps(FpgaEps):
    """A board: `overlay` is a bitstream (with its .hwh beside it) or an xclbin (docs/BOARD.md)."""

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 overlay=None, kernel: str | None = None, transport=None, **driver_options):
        if transport is None:
            if overlay is None:
                raise ValueError("fpga-pynq needs overlay='path/to/l2l_optim.bit' (or an .xclbin); see docs/BOARD.md")
            from l2l_hw.hw.pynq import PynqTransport

            transport = PynqTransport(overlay, kernel=kernel)
        super().__init__(config, working_dtype, double_buffer, transport=transport, **driver_options)
