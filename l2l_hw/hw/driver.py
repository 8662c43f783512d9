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
    units (optional)                             the board's compute units: one control port
                                                 (read32/write32/advance/recover) per l2l_optim
                                                 instance, all on the transport's DRAM; absent,
                                                 the transport itself is the one unit

The driver programs the arguments (the 64-bit pointers, N, MODE and the per-step
float32 scalars of golden.StepScalars as their bit patterns), starts the kernel
(CTRL.AP_START), polls CTRL.AP_DONE with a cycle and a wall-clock limit and reads
STATUS and CYCLES. At open it checks ID and VERSION and refuses hardware it was not
written for.

Compute units (Vitis' term for several instances of one kernel on a board): a run of n
elements is split into one contiguous chunk per unit, each chunk's start a multiple of
DATA_BYTES/2 elements so that every pointer of every stream (4-byte fp32, 2-byte bf16/fp16)
stays DATA_BYTES-aligned and no two units touch one bus word; with the 8-bit state
(MODE.STATE) a multiple of QUANT_BLOCK * DATA_BYTES/4 elements, so that each chunk starts a
block and its block scales (4 bytes per block) a bus word. The chunks run at once (the
first on the caller's thread, the others on one thread per unit: a simulator releases the
GIL while it clocks) and the run returns when all have ended; an error of any unit is
raised after every unit has stopped.

Failure contract: the kernel is always pointed at destination buffers distinct from
its sources (the EPS double-buffers every tensor), so a run that times out or ends
with an AXI error has written only the spare copy; the committed copy in device DRAM
is unchanged and the EPS keeps using it. KernelError says so and names the layer (and,
with several compute units, the unit and its elements).
"""
from __future__ import annotations

import functools
import operator
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

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
# A run is split over compute units only into chunks of at least this many elements: a
# run's fixed cost (~40 register accesses, pipeline fill, a thread hand-off) is ~0.7 ms in
# the simulator, a 4096-element run ~6.4 ms (512/4 build, measured); on a board both are
# microseconds.
MIN_CHUNK_ELEMENTS = 4096
NARROWEST_ELEMENT_BYTES = 2  # bf16 / fp16 gradient and working copy; fp32 streams are 4
BOARD_POLL_S = 20e-6  # between CTRL polls on a board: a layer's update takes ~0.1-10 ms there


@dataclass
class DeviceBuffer:
    """A buffer in device DRAM: `address` is the kernel's view, `handle` the transport's."""

    address: int
    nbytes: int
    handle: object = None


class KernelError(RuntimeError):
    """The kernel failed on one tensor; the message names it and the status registers. (An
    update that raises it reaches the relay as the EPS's UpdateError, this error its cause.)"""

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
    status: int  # STATUS of every unit ORed
    cycles: int  # kernel clocks of the run: the slowest unit's CYCLES (units run side by side)
    unit_cycles: tuple[int, ...] = ()  # CYCLES of each unit that ran a chunk

    @property
    def nonfinite(self) -> bool:
        return bool(self.status & regs.STATUS_NONFINITE)


def _field(mode: int, name: str) -> int:
    return mode >> getattr(regs, f"MODE_{name}_BIT") & ((1 << getattr(regs, f"MODE_{name}_WIDTH")) - 1)


def state_8bit(mode: int) -> bool:
    """m and v are 8-bit codes with block scales under MODE `mode`."""
    return _field(mode, "STATE") == regs.MODE_STATE_VALUES["8bit"]


def pointer_offset(pointer: str, mode: int, start: int) -> int:
    """Bytes from the stream behind `pointer` to its element `start` under MODE `mode` (for
    a block scale stream, `start` is a multiple of QUANT_BLOCK)."""
    if pointer in ("M_SCALE_SRC", "V_SCALE_SRC", "M_SCALE_DST", "V_SCALE_DST"):
        return start // regs.QUANT_BLOCK * 4
    if pointer == "COPY_DST":
        return start * NARROWEST_ELEMENT_BYTES
    if pointer == "GRAD_SRC":
        return start * (4 if _field(mode, "GRAD_DTYPE") == regs.MODE_GRAD_DTYPE_VALUES["fp32"] else 2)
    if pointer in ("M_SRC", "V_SRC", "M_DST", "V_DST") and state_8bit(mode):
        return start  # one code per element
    return start * 4  # param, fp32 m and v


class L2lOptimDriver:
    """Drives the l2l_optim instances (compute units) behind `transport`, splitting each run
    over them. Thread-safe: one run at a time."""

    def __init__(self, transport, timeout_s: float = DEFAULT_TIMEOUT_S, max_cycles: int | None = None):
        self.transport = transport
        ports = list(getattr(transport, "units", None) or [transport])
        where = getattr(transport, "name", type(transport).__name__)
        self.units = [_UnitDriver(port, f"{where} unit {i}" if len(ports) > 1 else where, timeout_s, max_cycles)
                      for i, port in enumerate(ports)]
        self.data_bytes = self.units[0].data_bytes  # pointer alignment
        if any(u.data_bytes != self.data_bytes for u in self.units):
            raise KernelVersionError(f"the compute units behind {where} have different DATA_BYTES "
                                     f"{[u.data_bytes for u in self.units]}; one driver needs one bus width")
        self._lock = threading.Lock()
        self._pool = (ThreadPoolExecutor(len(self.units) - 1, thread_name_prefix="l2l-compute-unit")
                      if len(self.units) > 1 else None)
        self.runs = 0    # run() calls
        self.cycles = 0  # kernel clocks over all runs and units (sum of the CYCLES registers)

    @property
    def compute_units(self) -> int:
        return len(self.units)

    def chunks(self, n: int, mode: int = 0) -> list[tuple[int, int]]:
        """[(first element, count)] per unit for a run of n elements: near-equal shares, each
        start a multiple of DATA_BYTES/2 elements (8-bit state: of QUANT_BLOCK * DATA_BYTES/4),
        at most n // MIN_CHUNK_ELEMENTS of them (so small tensors run on one unit)."""
        granule = max(self.data_bytes // NARROWEST_ELEMENT_BYTES, 1)
        if state_8bit(mode):
            granule = regs.QUANT_BLOCK * max(self.data_bytes // 4, 1)
        parts = max(1, min(len(self.units), n // MIN_CHUNK_ELEMENTS))
        share = -(-n // parts // granule) * granule  # ceil(n / parts), rounded up to a granule
        bounds = [min(i * share, n) for i in range(parts)] + [n]
        return [(lo, hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo] or [(0, n)]

    def run(self, *, layer: str, n: int, mode: int, scalars, pointers: dict[str, int]) -> RunResult:
        """One kernel run over n elements. `pointers` maps POINTERS names to device addresses
        (missing ones are written 0: the kernel leaves streams its mode does not use alone).
        Raises KernelTimeout / KernelAxiError naming `layer` and the status registers."""
        for name in regs.POINTERS:
            addr = pointers.get(name, 0)
            if addr % self.data_bytes:
                raise KernelError(f"{layer}: {name} 0x{addr:X} is not {self.data_bytes}-byte aligned", layer)
        with self._lock:
            chunks = self.chunks(n, mode)
            if len(chunks) == 1:
                results = [self.units[0].run(layer, "", n, mode, scalars, pointers)]
            else:
                results = self._run_split(layer, chunks, mode, scalars, pointers)
            self.runs += 1
            self.cycles += sum(r.cycles for r in results)
        return RunResult(status=functools.reduce(operator.or_, (r.status for r in results)), cycles=max(r.cycles for r in results),
                         unit_cycles=tuple(r.cycles for r in results))

    def _run_split(self, layer, chunks, mode, scalars, pointers) -> list[RunResult]:
        def part(i, start, count):
            moved = {name: addr + pointer_offset(name, mode, start) if addr else 0 for name, addr in pointers.items()}
            where = f" (compute unit {i}: elements {start}..{start + count - 1})"
            return self.units[i].run(layer, where, count, mode, scalars, moved)

        futures = [self._pool.submit(part, i, *chunk) for i, chunk in enumerate(chunks) if i]
        results, errors = [], []
        try:
            results.append(part(0, *chunks[0]))
        except Exception as exc:
            errors.append(exc)
        for future in futures:  # every unit has stopped before anything is raised
            try:
                results.append(future.result())
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class _UnitDriver:
    """Register-level driver of one l2l_optim instance behind `port` (read32/write32/advance/recover)."""

    def __init__(self, port, where: str, timeout_s: float, max_cycles: int | None):
        self.transport = transport = port
        self.timeout_s = timeout_s
        self.max_cycles = max_cycles  # None: CYCLES_PER_ELEMENT_LIMIT * n + CYCLES_FIXED_LIMIT per run
        ident, version = transport.read32(regs.ID), transport.read32(regs.VERSION)
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

    def _clear_isr(self) -> None:
        isr = self.transport.read32(regs.ISR)
        if isr:
            self.transport.write32(regs.ISR, isr)  # toggle-on-write clears the bits that are set

    def _write64(self, offset: int, value: int) -> None:
        self.transport.write32(offset, value & 0xFFFFFFFF)
        self.transport.write32(offset + 4, value >> 32)

    def _read64(self, offset: int) -> int:
        return self.transport.read32(offset) | self.transport.read32(offset + 4) << 32

    def run(self, layer: str, part: str, n: int, mode: int, scalars, pointers: dict[str, int]) -> RunResult:
        """One run of this unit over n elements (L2lOptimDriver checked the pointers and holds
        its lock); `part` says which share of `layer` it is, for the error message."""
        t = self.transport
        for name in regs.POINTERS:
            self._write64(regs.REGISTERS[name][0], pointers.get(name, 0))
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
                    f"l2l_optim did not finish updating {layer}{part} (n = {n}) within {limit} clocks / "
                    f"{self.timeout_s:g} s: CTRL 0x{ctrl:08X}, STATUS {describe_status(status)}, CYCLES {cycles}. "
                    f"The kernel writes only the spare copy, so the committed state of {layer} in device DRAM "
                    f"is unchanged; " + ("the kernel was reset." if recovered else
                                         "the kernel could not be reset: reload the overlay."),
                    layer, status, ctrl)
        self._clear_isr()
        status = t.read32(regs.STATUS)
        cycles = self._read64(regs.CYCLES)
        if status & (regs.STATUS_AXI_ERROR | regs.STATUS_MISALIGNED):
            kind = "an AXI error response (SLVERR/DECERR)" if status & regs.STATUS_AXI_ERROR else "a misaligned pointer"
            raise KernelAxiError(
                f"l2l_optim stopped updating {layer}{part} (n = {n}) on {kind}: STATUS {describe_status(status)}, "
                f"CTRL 0x{ctrl:08X}, CYCLES {cycles}. The kernel wrote only the spare copy, so the committed "
                f"state of {layer} in device DRAM is unchanged and the step's update of it was not applied.",
                layer, status, ctrl)
        return RunResult(status, cycles)
