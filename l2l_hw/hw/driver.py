"""One register-level driver for the l2l_optim kernel, over any transport.

A transport is the narrow interface between this driver and a piece of hardware
(the Verilated RTL in-process, l2l_hw/hw/verilator.py; a board through PYNQ,
l2l_hw/hw/pynq.py):

    read32(offset) / write32(offset, value)      AXI4-Lite control registers
    allocate(nbytes) -> DeviceBuffer             device DRAM, .address is what the kernel sees
    write(buf, tensor, offset=0) / read(buf, out, offset=0)   host <-> device DRAM (bytes of a
                                                 contiguous CPU tensor, any dtype)
    free(buf)
    advance(max_cycles) -> int                   let the device run: the simulator clocks until
                                                 the kernel's interrupt (or max_cycles) and returns
                                                 the clocks run (-1: interrupt never came); a
                                                 board sleeps a poll interval and returns 0
    recover()                                    bring a hung kernel back to idle, if it can
    close()

The driver programs the arguments (eight 64-bit pointers, N, MODE and the per-step
float32 scalars of golden.StepScalars as their bit patterns), starts the kernel
(CTRL.AP_START), polls CTRL.AP_DONE with a cycle and a wall-clock limit and reads
STATUS and CYCLES. At open it checks ID and VERSION and refuses hardware it was not
written for.

Failure contract: the kernel is always pointed at destination buffers distinct from
its sources (the EPS double-buffers every tensor), so a run that times out or ends
with an AXI error has written only the spare copy; the committed copy in device DRAM
is unchanged and the EPS keeps using it. KernelError says so and names the layer.
"""
from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass

from l2l_hw.eps.worker import UpdateError
from l2l_hw.hw import regs

# Wall-clock limit of one run on a board. A run moves at most a few hundred MiB at
# several GB/s (an HP port of a Zynq UltraScale+ moves ~4 GB/s), i.e. well under a
# second; 10 s only catches a hung kernel.
DEFAULT_TIMEOUT_S = 10.0
# Clock limit of one run: the kernel needs ~n / elements-per-clock clocks (>= 0.5
# element per clock at DATA_WIDTH 64, docs/BENCHMARKS.md) plus its pipeline fill; 64 n +
# 100k leaves a wide margin and still stops a hung simulation.
CYCLES_PER_ELEMENT_LIMIT = 64
CYCLES_FIXED_LIMIT = 100_000


@dataclass
class DeviceBuffer:
    """A buffer in device DRAM: `address` is the kernel's view, `handle` the transport's."""

    address: int
    nbytes: int
    handle: object = None


class KernelError(UpdateError):
    """The kernel failed on one tensor; the message names it and the status registers."""

    def __init__(self, message: str, layer: str = "", status: int = 0, ctrl: int = 0):
        super().__init__(message)
        self.layer, self.status, self.ctrl = layer, status, ctrl


class KernelTimeout(KernelError):
    pass


class KernelAxiError(KernelError):
    pass


class KernelVersionError(KernelError):
    pass


def f32_bits(x: float) -> int:
    """The binary32 bit pattern of a float (the StepScalars are exact float32 values)."""
    return struct.unpack("<I", struct.pack("<f", x))[0]


def describe_status(status: int) -> str:
    flags = [name for name, bit in (("NONFINITE", regs.STATUS_NONFINITE), ("AXI_ERROR", regs.STATUS_AXI_ERROR),
                                    ("MISALIGNED", regs.STATUS_MISALIGNED)) if status & bit]
    return f"0x{status:08X}" + (f" ({', '.join(flags)})" if flags else "")


@dataclass
class RunResult:
    status: int
    cycles: int

    @property
    def nonfinite(self) -> bool:
        return bool(self.status & regs.STATUS_NONFINITE)


class L2lOptimDriver:
    """Drives one l2l_optim instance through `transport`. Thread-safe: one run at a time."""

    def __init__(self, transport, timeout_s: float = DEFAULT_TIMEOUT_S, max_cycles: int | None = None):
        self.transport = transport
        self.timeout_s = timeout_s
        self.max_cycles = max_cycles  # None: CYCLES_PER_ELEMENT_LIMIT * n + CYCLES_FIXED_LIMIT per run
        self._lock = threading.Lock()
        ident, version = transport.read32(regs.ID), transport.read32(regs.VERSION)
        where = getattr(transport, "name", type(transport).__name__)
        if ident != regs.ID_VALUE or version != regs.VERSION_VALUE:
            raise KernelVersionError(
                f"the hardware behind {where} reads ID 0x{ident:08X} VERSION 0x{version:08X}; this driver needs "
                f"l2l_optim ID 0x{regs.ID_VALUE:08X} ('L2LO') VERSION 0x{regs.VERSION_VALUE:08X} "
                f"(hdl/l2l_optim_regs.json). Rebuild the bitstream or the simulation from this checkout; "
                f"the EPS will not run on it.")
        self.data_bytes = transport.read32(regs.DATA_BYTES)  # pointer alignment
        # Completion raises the interrupt line: the simulator clocks until it, a board polls CTRL.
        transport.write32(regs.GIE, regs.GIE_ENABLE)
        transport.write32(regs.IER, regs.IER_DONE)
        self._clear_isr()
        self.runs = 0
        self.cycles = 0  # kernel clocks over all runs (the CYCLES register)

    def _clear_isr(self) -> None:
        isr = self.transport.read32(regs.ISR)
        if isr:
            self.transport.write32(regs.ISR, isr)  # toggle-on-write clears the bits that are set

    def _write64(self, offset: int, value: int) -> None:
        self.transport.write32(offset, value & 0xFFFFFFFF)
        self.transport.write32(offset + 4, value >> 32)

    def _read64(self, offset: int) -> int:
        return self.transport.read32(offset) | self.transport.read32(offset + 4) << 32

    def run(self, *, layer: str, n: int, mode: int, scalars, pointers: dict[str, int]) -> RunResult:
        """One kernel run over n elements. `pointers` maps POINTERS names to device addresses
        (missing ones are written 0: the kernel leaves streams its mode does not use alone).
        Raises KernelTimeout / KernelAxiError naming `layer` and the status registers."""
        t = self.transport
        with self._lock:
            for name in regs.POINTERS:
                addr = pointers.get(name, 0)
                if addr % self.data_bytes:
                    raise KernelError(f"{layer}: {name} 0x{addr:X} is not {self.data_bytes}-byte aligned", layer)
                self._write64(regs.REGISTERS[name][0], addr)
            t.write32(regs.N, n)
            t.write32(regs.MODE, mode)
            for field in regs.SCALARS:
                t.write32(regs.REGISTERS[field.upper()][0], f32_bits(getattr(scalars, field)))
            t.write32(regs.CTRL, regs.CTRL_AP_START)
            limit = self.max_cycles if self.max_cycles is not None else CYCLES_PER_ELEMENT_LIMIT * n + CYCLES_FIXED_LIMIT
            deadline = time.monotonic() + self.timeout_s
            clocks = 0
            while True:
                ctrl = t.read32(regs.CTRL)  # reading clears AP_DONE: keep this one value
                if ctrl & regs.CTRL_AP_DONE:
                    break
                ran = t.advance(limit - clocks)
                clocks += max(ran, 0)
                if ran < 0 or clocks >= limit or time.monotonic() > deadline:
                    ctrl = t.read32(regs.CTRL)
                    if ctrl & regs.CTRL_AP_DONE:
                        break
                    status = t.read32(regs.STATUS)
                    cycles = self._read64(regs.CYCLES)
                    recovered = t.recover()
                    raise KernelTimeout(
                        f"l2l_optim did not finish updating {layer} (n = {n}) within {limit} clocks / "
                        f"{self.timeout_s:g} s: CTRL 0x{ctrl:08X}, STATUS {describe_status(status)}, CYCLES {cycles}. "
                        f"The kernel writes only the spare copy, so the committed state of {layer} in device DRAM "
                        f"is unchanged; " + ("the kernel was reset." if recovered else
                                             "the kernel could not be reset: reload the overlay."),
                        layer, status, ctrl)
            self._clear_isr()
            status = t.read32(regs.STATUS)
            cycles = self._read64(regs.CYCLES)
            self.runs += 1
            self.cycles += cycles
        if status & (regs.STATUS_AXI_ERROR | regs.STATUS_MISALIGNED):
            kind = "an AXI error response (SLVERR/DECERR)" if status & regs.STATUS_AXI_ERROR else "a misaligned pointer"
            raise KernelAxiError(
                f"l2l_optim stopped updating {layer} (n = {n}) on {kind}: STATUS {describe_status(status)}, "
                f"CTRL 0x{ctrl:08X}, CYCLES {cycles}. The kernel wrote only the spare copy, so the committed "
                f"state of {layer} in device DRAM is unchanged and the step's update of it was not applied.",
                layer, status, ctrl)
        return RunResult(status, cycles)
