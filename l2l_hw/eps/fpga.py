"""FPGA-DRAM EPS: master weights and optimizer state in the FPGA's DRAM, updated by
the RTL kernel l2l_optim (hdl/), through one register-level driver (l2l_hw/hw/driver.py)
and a transport: the Verilated RTL with a C++ DRAM model in-process ("fpga-sim"), or a
board through PYNQ ("fpga-pynq").

The engine (l2l_hw/eps/engine.py) owns the buffers and the update thread; here a buffer
is a region of device DRAM and a tensor's update is one kernel run. A run can fail
halfway (an AXI error, a timeout), so updates never run in place: they write a spare
copy of param, m, v and the working copy, which the engine swaps in once every tensor
of the group succeeded, and a failure leaves the group's committed state whole. One
gradient buffer, as large as the largest tensor, serves every run (runs are sequential).

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
from l2l_hw.eps.engine import AsyncEps
from l2l_hw.eps.registry import register_backend
from l2l_hw.hw import regs

GRAD_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# the stored pieces (engine buffers) -> the kernel's (source, destination) pointers
POINTERS = {"param": ("PARAM_SRC", "PARAM_DST"), "m": ("M_SRC", "M_DST"), "v": ("V_SRC", "V_DST"),
            "m_scale": ("M_SCALE_SRC", "M_SCALE_DST"), "v_scale": ("V_SCALE_SRC", "V_SCALE_DST")}


class FpgaEps(AsyncEps):
    """EPS whose updates run on the l2l_optim kernel behind `transport`."""

    in_place = False

    # the RTL reads and writes fp32 m and v, or golden's block-wise 8-bit codes and scales
    # (MODE.STATE); bf16 state is not built
    STATE_FORMATS = ("fp32", "8bit")

    @classmethod
    def check_optimizer(cls, config: OptimConfig) -> None:
        """Refuse an optimizer the RTL lacks (LAMB and LARS need a norm pass it does not have)."""
        if config.optimizer not in regs.MODE_OPTIMIZER_VALUES:
            raise ValueError(f"the {cls.name} EPS runs optimizer {', '.join(regs.MODE_OPTIMIZER_VALUES)} only (the RTL "
                             f"kernel has no trust-ratio pass), not optimizer={config.optimizer!r}; use the cpu or "
                             f"golden EPS for it")

    @classmethod
    def check_state(cls, state: str) -> None:
        """Refuse an optimizer state format the RTL lacks (before any transport is built)."""
        if state not in cls.STATE_FORMATS:
            raise ValueError(f"the {cls.name} EPS supports optimizer state {', '.join(cls.STATE_FORMATS)} only "
                             f"(the RTL kernel keeps fp32 or block-wise 8-bit m and v), not state={state!r}; "
                             f"use the cpu or golden EPS for it")

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 transport=None, timeout_s: float | None = None, max_cycles: int | None = None, state: str = "fp32"):
        self.check_optimizer(config)
        self.check_state(state)
        super().__init__(config, working_dtype, double_buffer, "l2l-fpga-update", state=state)
        from l2l_hw.hw.driver import DEFAULT_TIMEOUT_S, L2lOptimDriver

        self.transport = transport
        self.driver = L2lOptimDriver(transport, timeout_s=timeout_s or DEFAULT_TIMEOUT_S, max_cycles=max_cycles)
        self.grad_buffer = None  # device DRAM for the gradient of the tensor being updated
        self._grad_bytes = 0

    def _allocate(self, shape, dtype, fetched):
        return self.transport.allocate(shape.numel() * dtype.itemsize)

    def _write(self, buf, values):
        self.transport.write(buf, values.contiguous())

    def _read(self, buf, shape, dtype):
        return self.transport.read(buf, torch.empty(shape, dtype=dtype))

    def _free(self, buf):
        self.transport.free(buf)

    def _register(self, key, params):
        self._gradient_buffer(4 * max(p.numel() for p in params.values()))
        super()._register(key, params)

    def _gradient_buffer(self, nbytes: int):
        if nbytes > self._grad_bytes:
            if self.grad_buffer is not None:
                self.transport.free(self.grad_buffer)
            self.grad_buffer, self._grad_bytes = self.transport.allocate(nbytes), nbytes
        return self.grad_buffer

    def _run(self, key, name, optimizer, s, grad, src, dst):
        grad_buffer = self._gradient_buffer(4 * grad.numel())
        self.transport.write(grad_buffer, grad)
        pointers = {"GRAD_SRC": grad_buffer.address}
        for slot, (source, destination) in POINTERS.items():
            if slot in src:  # a slot the rule leaves alone (m under plain SGD) is its own destination
                pointers[source] = src[slot].address
                pointers[destination] = dst.get(slot, src[slot]).address
        if "working" in dst:
            pointers["COPY_DST"] = dst["working"].address
        copy = self.working_dtype if "working" in dst else "none"
        mode = regs.mode(optimizer, GRAD_NAMES[grad.dtype], copy, self.config.nesterov, self.state_format)
        result = self.driver.run(layer=f"EPS group {key!r} tensor {name!r}", n=grad.numel(), mode=mode,
                                 scalars=s, pointers=pointers)
        return result.nonfinite

    def close(self) -> None:
        """Wait for the update thread and free every device buffer."""
        if getattr(self, "_worker", None) is None:
            return
        super().close()
        self.driver.close()
        if self.grad_buffer is not None:
            self.transport.free(self.grad_buffer)
            self.grad_buffer = None


@register_backend("fpga-sim")
class FpgaSimEps(FpgaEps):
    """The RTL in the loop: l2l_optim Verilated (built on first use) with a C++ DRAM model;
    `compute_units` instances of it on that DRAM (None: verilator.default_compute_units())."""

    def __init__(self, config: OptimConfig, working_dtype: str = "fp32", double_buffer: bool = False,
                 data_width: int | None = None, dram_bytes: int | None = None, read_latency: int = 0,
                 transport=None, lanes: int | None = None, compute_units: int | None = None, **driver_options):
        self.check_optimizer(config)
        self.check_state(driver_options.get("state", "fp32"))
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
        self.check_optimizer(config)
        self.check_state(driver_options.get("state", "fp32"))
        if transport is None:
            if overlay is None:
                raise ValueError("fpga-pynq needs overlay='path/to/l2l_optim.bit' (or an .xclbin); see docs/BOARD.md")
            from l2l_hw.hw.pynq import PynqTransport

            transport = PynqTransport(overlay, kernel=kernel)
        super().__init__(config, working_dtype, double_buffer, transport=transport, **driver_options)
