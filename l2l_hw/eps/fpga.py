"""FPGA-DRAM EPS: master weights and optimizer state in the FPGA's DRAM, updated by
the RTL kernel l2l_optim (hdl/), through one register-level driver (l2l_hw/hw/driver.py)
and a transport: the Verilated RTL with a C++ DRAM model in-process ("fpga-sim"), or a
board through PYNQ ("fpga-pynq").

The engine (l2l_hw/eps/engine.py) owns the buffers and the update thread; here it is
composed of two halves sharing one transport: `FpgaDram`, the storage (a buffer is a region
of device DRAM), and `RtlKernel`, the update kernel (a tensor's update is one kernel run).
A run can fail halfway (an AXI error, a timeout), so updates never run in place: they
write a spare copy of param, m, v and the working copy, which the engine swaps in once
every tensor of the group succeeded, and a failure leaves the group's committed state
whole. One gradient buffer, as large as the largest tensor, serves every run (runs are
sequential).

With several compute units (kernel instances on one DRAM; fpga-sim `compute_units=`,
default one per core up to 2) the driver splits each tensor's run over them and returns
once all have ended; every unit writes only its share of the spare copies, so the failure
contract above holds whichever unit fails. The working copy of loaded weights is made by
the kernel too (the engine's zero-step SGD run), so every bit the accelerator fetches
came out of the RTL.

Optimizer state: fp32 m and v, or (state="8bit") golden's block-wise 8-bit codes with one
fp32 scale per block, which the kernel decodes and encodes itself (MODE.STATE, the m/v
scale pointers); the driver splits such a run at block boundaries.
"""
from __future__ import annotations

import torch

from l2l_hw.eps.base import OptimConfig
from l2l_hw.eps.engine import Kernel
from l2l_hw.eps.registry import register_backend
from l2l_hw.eps.storage import Storage
from l2l_hw.hw import regs

GRAD_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# the stored pieces (engine buffers) -> the kernel's (source, destination) pointers
POINTERS = {"param": ("PARAM_SRC", "PARAM_DST"), "m": ("M_SRC", "M_DST"), "v": ("V_SRC", "V_DST"),
            "m_scale": ("M_SCALE_SRC", "M_SCALE_DST"), "v_scale": ("V_SCALE_SRC", "V_SCALE_DST")}
# the RTL reads and writes fp32 m and v, or golden's block-wise 8-bit codes and scales
# (MODE.STATE); bf16 state is not built
STATE_FORMATS = ("fp32", "8bit")


def check_rule(name: str, config: OptimConfig, state: str) -> None:
    """Refuse an optimizer or a state format the RTL lacks, before any transport is built (LAMB
    and LARS need a norm pass it does not have)."""
    if config.optimizer not in regs.MODE_OPTIMIZER_VALUES:
        lacks = "no matrix unit for Muon's Newton-Schulz iterations" if config.optimizer == "muon" else \
            "no trust-ratio pass"
        raise ValueError(f"the {name} EPS runs optimizer {', '.join(regs.MODE_OPTIMIZER_VALUES)} only (the RTL "
                         f"kernel has {lacks}), not optimizer={config.optimizer!r}; use the cpu or "
                         f"golden EPS for it")
    if state not in STATE_FORMATS:
        raise ValueError(f"the {name} EPS supports optimizer state {', '.join(STATE_FORMATS)} only "
                         f"(the RTL kernel keeps fp32 or block-wise 8-bit m and v), not state={state!r}; "
                         f"use the cpu or golden EPS for it")


class FpgaDram(Storage):
    """Every buffer a region of the device DRAM behind `transport`; bytes move through it."""

    memory = "fpga"

    def __init__(self, transport):
        self.transport = transport

    def allocate(self, group, rule):
        return [self.transport.allocate(s.shape.numel() * s.dtype.itemsize) for s in group.specs]

    def scratch(self, shape, dtype):
        return self.transport.allocate(shape.numel() * dtype.itemsize)

    def free(self, buf):
        self.transport.free(buf)

    def write(self, buf, values):
        self.transport.write(buf, values.contiguous())

    def read(self, buf, shape, dtype):
        return self.transport.read(buf, torch.empty(shape, dtype=dtype))


class RtlKernel(Kernel):
    """Updates by the l2l_optim kernel behind `transport`, through the register-level driver.
    `owns_transport`: the kernel built it, and closes it."""

    name = "rtl"
    memory = "fpga"
    in_place = False

    def __init__(self, transport, timeout_s: float | None = None, max_cycles: int | None = None,
                 owns_transport: bool = False):
        from l2l_hw.hw.driver import DEFAULT_TIMEOUT_S, L2lOptimDriver

        self.transport, self.owns_transport = transport, owns_transport
        self.driver = L2lOptimDriver(transport, timeout_s=timeout_s or DEFAULT_TIMEOUT_S, max_cycles=max_cycles)
        self.grad_buffer = None  # device DRAM for the gradient of the tensor being updated
        self.grad_bytes = 0

    def prepare(self, shapes):
        self._gradient_buffer(4 * max(shape.numel() for shape in shapes.values()))

    def _gradient_buffer(self, nbytes: int):
        if nbytes > self.grad_bytes:
            if self.grad_buffer is not None:
                self.transport.free(self.grad_buffer)
            self.grad_buffer, self.grad_bytes = self.transport.allocate(nbytes), nbytes
        return self.grad_buffer

    def run(self, what, rule, s, grad, src, dst):
        grad_buffer = self._gradient_buffer(4 * grad.numel())
        self.transport.write(grad_buffer, grad)
        pointers = {"GRAD_SRC": grad_buffer.address}
        for slot, (source, destination) in POINTERS.items():
            if slot in src:  # a slot the rule leaves alone (m under plain SGD) is its own destination
                pointers[source] = src[slot].address
                pointers[destination] = dst.get(slot, src[slot]).address
        if "working" in dst:
            pointers["COPY_DST"] = dst["working"].address
        copy = rule.working_dtype if "working" in dst else "none"
        mode = regs.mode(rule.optimizer, GRAD_NAMES[grad.dtype], copy, rule.nesterov, rule.state)
        result = self.driver.run(layer=what, n=grad.numel(), mode=mode, scalars=s, pointers=pointers)
        return result.nonfinite

    def close(self) -> None:
        """Stop the driver's unit threads and free the gradient buffer (and the transport, if built here)."""
        self.driver.close()
        if self.grad_buffer is not None:
            self.transport.free(self.grad_buffer)
            self.grad_buffer = None
        if self.owns_transport:
            self.transport.close()


def dram(kernel: RtlKernel) -> FpgaDram:
    return FpgaDram(kernel.transport)


@register_backend("fpga-sim", storage=dram)
def fpga_sim(config: OptimConfig, state: str = "fp32", data_width: int | None = None, dram_bytes: int | None = None,
             read_latency: int = 0, transport=None, lanes: int | None = None, compute_units: int | None = None,
             timeout_s: float | None = None, max_cycles: int | None = None) -> RtlKernel:
    """The RTL in the loop: l2l_optim Verilated (built on first use) with a C++ DRAM model;
    `compute_units` instances of it on that DRAM (None: verilator.default_compute_units())."""
    check_rule("fpga-sim", config, state)
    owned = transport is None
    if owned:
        from l2l_hw.hw import verilator

        transport = verilator.VerilatorTransport(
            data_width, dram_bytes or verilator.DEFAULT_DRAM_BYTES, read_latency, lanes=lanes,
            compute_units=compute_units or verilator.default_compute_units())
    return _kernel(transport, owned, timeout_s, max_cycles)


@register_backend("fpga-pynq", storage=dram)
def fpga_pynq(config: OptimConfig, state: str = "fp32", overlay=None, kernel: str | None = None, transport=None,
              timeout_s: float | None = None, max_cycles: int | None = None) -> RtlKernel:
    """A board: `overlay` is a bitstream (with its .hwh beside it) or an xclbin (docs/BOARD.md)."""
    check_rule("fpga-pynq", config, state)
    owned = transport is None
    if owned:
        if overlay is None:
            raise ValueError("fpga-pynq needs overlay='path/to/l2l_optim.bit' (or an .xclbin); see docs/BOARD.md")
        from l2l_hw.hw.pynq import PynqTransport

        transport = PynqTransport(overlay, kernel=kernel)
    return _kernel(transport, owned, timeout_s, max_cycles)


def _kernel(transport, owned: bool, timeout_s, max_cycles) -> RtlKernel:
    try:
        return RtlKernel(transport, timeout_s, max_cycles, owns_transport=owned)
    except BaseException:  # refused hardware (ID, VERSION): the transport built here goes again
        if owned:
            transport.close()
        raise
