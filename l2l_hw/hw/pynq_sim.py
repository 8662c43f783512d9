"""A PYNQ `Device` backed by the Verilated l2l_optim: the PYNQ transport against the RTL, no board.

The real `pynq` package drives everything above the device layer: `pynq.Overlay` parses
the overlay's .hwh with pynqmetadata (what a board does), builds `ip_dict` and binds the
kernel IP to `DefaultIP` with its `MMIO` and `register_map`; `pynq.allocate` returns
`PynqBuffer`s with `sync_to_device` / `sync_from_device`. Below that, where a board has
/dev/mem, XRT and the FPGA manager, this module has the Verilated kernel and its C++ DRAM
model (l2l_hw/hw/verilator.py):

    probing     pynq.Device.devices asks every Device subclass's `_probe_`, lowest
                `_probe_priority_` first, and the first device found is the active one.
                SimulatedDevice answers only with L2L_PYNQ_SIM=1 in the environment, and
                its priority comes after every device class PYNQ ships, so it never
                shadows a board.
    overlay     write_overlay(dir) writes l2l_optim_sim.bit (a marker, not a bitstream)
                and l2l_optim_sim.hwh: a ZynqMP block design whose PS reaches the IP
                l2l_optim_0 at KERNEL_BASE through M_AXI_HPM0_FPD, its registers taken
                from hdl/l2l_optim_regs.json the way Vitis HLS lists an ap_ctrl_hs kernel
                (64-bit pointers as NAME_1 / NAME_2). write_overlay(dir, compute_units=k):
                IPs l2l_optim_0..k-1 on one DRAM, each in the next KERNEL_RANGE window.
    download    "programming" starts a fresh simulation (kernels reset, DRAM zeroed),
                built with the DATA_WIDTH and LANES the .hwh gives the IPs, one Verilated
                instance per IP (VerilatorTransport(compute_units=k)).
    MMIO        capability REGISTER_RW: pynq.MMIO calls read_registers /
                write_registers with absolute addresses; those inside a kernel's
                window become AXI4-Lite accesses of that instance. While its run is
                under way (CTRL.AP_START written, interrupt not yet seen), each read
                first lets that kernel run up to CLOCKS_PER_READ clocks, stopping at its
                interrupt: a board's clock runs while the host polls. Clocks of an idle
                kernel change nothing, so they are not simulated.
    DRAM        allocate() hands out PynqBuffers whose host array is ordinary memory
                and whose device_address is an address in the simulated DRAM;
                flush / invalidate (behind sync_to_device / sync_from_device) copy
                between the two, as on a board whose HP ports are not cache-coherent.

What it cannot show: anything of the board itself (bitstream, timing, the real
interconnect and DDR, cache maintenance, interrupts). docs/BOARD.md.

    python -m l2l_hw.hw.pynq_sim DIR     writes the overlay into DIR, prints the .bit path
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.etree import ElementTree as ET

import numpy as np
import pynq
from pynq.buffer import PynqBuffer
from pynq.pl_server.hwh_parser import get_hwh_name

from l2l_hw.hw import regs, verilator
from l2l_hw.hw.driver import BOARD_POLL_S, DeviceBuffer

ENV = "L2L_PYNQ_SIM"  # "1": pynq's device probe finds the simulated device
# After every Device class PYNQ 3.1 / 4.0 ships (versal 40, embedded 50, remote 100, XRT
# 200): with a board present, the board is the active device.
PROBE_PRIORITY = 1000
OVERLAY_NAME = "l2l_optim_sim"
KERNEL_TYPE = "l2l_optim"  # its instances are l2l_optim_0, l2l_optim_1, ... as Vivado names them
PS_INSTANCE = "zynq_ultra_ps_e_0"
# Where M_AXI_HPM0_FPD's window starts on a ZynqMP (Vivado assigns the first slave there)
# and Vivado's default 64 KiB segment, the next kernel's in the next; a kernel decodes
# ADDR_WIDTH (8) bits of it.
KERNEL_BASE = 0xA000_0000
KERNEL_RANGE = 0x1_0000
# Kernel clocks per register read while a run is under way: PynqTransport's poll interval
# at the 200 MHz PL clock of hdl/board/build_bd.tcl (4000).
KERNEL_CLOCK_HZ = 200e6
CLOCKS_PER_READ = round(BOARD_POLL_S * KERNEL_CLOCK_HZ)
MARKER = b"l2l_hw simulated overlay: not a bitstream. Load it only with L2L_PYNQ_SIM=1 (l2l_hw/hw/pynq_sim.py).\n"
REGS_JSON = verilator.HDL / "l2l_optim_regs.json"
_ACCESS = {"rw": "read-write", "ro": "read-only", "cor": "read-only", "tow": "read-write"}


# ------------------------------------------------------------------------------ overlay

def _register_elements(parent: ET.Element, reg_map: dict) -> None:
    """REGISTER elements of an ADDRESSBLOCK, as Vivado writes them for an HLS kernel."""
    def prop(el, name, value):
        ET.SubElement(el, "PROPERTY", NAME=name, VALUE=str(value))

    for reg in reg_map["registers"]:
        offset, width = int(reg["offset"], 16), reg.get("width", 32)
        words = [(reg["name"], offset)] if width == 32 else \
            [(f"{reg['name']}_{i + 1}", offset + 4 * i) for i in range(width // 32)]  # low word first
        for name, word_offset in words:
            r = ET.SubElement(parent, "REGISTER", NAME=name)
            prop(r, "DESCRIPTION", reg["doc"])
            prop(r, "ADDRESS_OFFSET", hex(word_offset))
            prop(r, "SIZE", 32)
            prop(r, "ACCESS", _ACCESS[reg["access"]])
            prop(r, "IS_ENABLED", "true")
            prop(r, "RESET_VALUE", "0x0")
            fields = ET.SubElement(r, "FIELDS")
            for f in reg.get("fields", []) if width == 32 else []:
                fe = ET.SubElement(fields, "FIELD", NAME=f["name"])
                prop(fe, "DESCRIPTION", f["doc"])
                prop(fe, "ADDRESS_OFFSET", 0)
                prop(fe, "ACCESS", _ACCESS[f["access"]])
                prop(fe, "BIT_OFFSET", f["bit"])
                prop(fe, "BIT_WIDTH", f.get("width", 1))


def hwh_text(data_width: int | None = None, lanes: int | None = None, compute_units: int = 1) -> str:
    """The hardware handoff of the simulated design (see the module docstring)."""
    kernels = [f"{KERNEL_TYPE}_{i}" for i in range(compute_units)]
    data_width, lanes = verilator.resolve(data_width, lanes)
    reg_map = json.loads(REGS_JSON.read_text())
    root = ET.Element("EDKSYSTEM", EDWVERSION="1.2", VIVADOVERSION="simulation")
    ET.SubElement(root, "SYSTEMINFO", ARCH="zynquplus", DEVICE="xczu7ev", NAME=OVERLAY_NAME, PACKAGE="ffvc1156",
                  SPEEDGRADE="-2")
    ET.SubElement(root, "EXTERNALPORTS")
    ET.SubElement(root, "EXTERNALINTERFACES")
    modules = ET.SubElement(root, "MODULES")

    # The PS. pynqmetadata needs the PL clock parameters; the simulated device ignores
    # them (the simulation counts clocks, it has no clock generator to program).
    ps = ET.SubElement(modules, "MODULE", FULLNAME=f"/{PS_INSTANCE}", INSTANCE=PS_INSTANCE, IPTYPE="PERIPHERAL",
                       IS_ENABLE="1", MODCLASS="PROCESSOR", MODTYPE="zynq_ultra_ps_e",
                       VLNV="xilinx.com:ip:zynq_ultra_ps_e:3.5")
    params = ET.SubElement(ps, "PARAMETERS")
    for clk in range(4):
        for name, value in ((f"PSU__FPGA_PL{clk}_ENABLE", int(clk == 0)),
                            (f"PSU__CRL_APB__PL{clk}_REF_CTRL__SRCSEL", "IOPLL"),
                            (f"PSU__CRL_APB__PL{clk}_REF_CTRL__DIVISOR0", 15),
                            (f"PSU__CRL_APB__PL{clk}_REF_CTRL__DIVISOR1", 1)):
            ET.SubElement(params, "PARAMETER", NAME=name, VALUE=str(value))
    memmap = ET.SubElement(ps, "MEMORYMAP")
    for i, kernel in enumerate(kernels):
        base = KERNEL_BASE + i * KERNEL_RANGE
        ET.SubElement(memmap, "MEMRANGE", ADDRESSBLOCK="reg0", BASENAME="C_BASEADDR", BASEVALUE=hex(base),
                      HIGHNAME="C_HIGHADDR", HIGHVALUE=hex(base + KERNEL_RANGE - 1), INSTANCE=kernel,
                      IS_DATA="TRUE", IS_INSTRUCTION="TRUE", MASTERBUSINTERFACE="M_AXI_HPM0_FPD",
                      MEMTYPE="REGISTER", SLAVEBUSINTERFACE="s_axil")
    ET.SubElement(ps, "PORTS")
    ps_buses = ET.SubElement(ps, "BUSINTERFACES")
    ET.SubElement(ps_buses, "BUSINTERFACE", BUSNAME="ps_to_kernel", DATAWIDTH="32", NAME="M_AXI_HPM0_FPD",
                  TYPE="MASTER", VLNV="xilinx.com:interface:aximm:1.0")
    ET.SubElement(ps_buses, "BUSINTERFACE", BUSNAME="kernel_to_ddr", DATAWIDTH=str(min(data_width, 128)),
                  NAME="S_AXI_HP0_FPD", TYPE="SLAVE", VLNV="xilinx.com:interface:aximm:1.0")

    # The kernels: each an AXI4-Lite slave (the registers) and an AXI4 master to DRAM.
    for kernel in kernels:
        k = ET.SubElement(modules, "MODULE", FULLNAME=f"/{kernel}", INSTANCE=kernel, IPTYPE="PERIPHERAL",
                          IS_ENABLE="1", MODCLASS="PERIPHERAL", MODTYPE=KERNEL_TYPE, VLNV="l2l-hw:hls:l2l_optim:1.0")
        params = ET.SubElement(k, "PARAMETERS")
        for name, value in (("DATA_WIDTH", data_width), ("LANES", lanes), ("ID", reg_map["id"]),
                            ("VERSION", reg_map["version"])):
            ET.SubElement(params, "PARAMETER", NAME=name, VALUE=str(value))
        blocks = ET.SubElement(k, "ADDRESSBLOCKS")
        block = ET.SubElement(blocks, "ADDRESSBLOCK", ACCESS="read-write", INTERFACE="s_axil", NAME="reg0",
                              RANGE=str(1 << reg_map["addr_width"]), USAGE="register")
        _register_elements(ET.SubElement(block, "REGISTERS"), reg_map)
        ET.SubElement(k, "PORTS")
        buses = ET.SubElement(k, "BUSINTERFACES")
        ET.SubElement(buses, "BUSINTERFACE", BUSNAME="ps_to_kernel", DATAWIDTH="32", NAME="s_axil", TYPE="SLAVE",
                      VLNV="xilinx.com:interface:aximm:1.0")
        ET.SubElement(buses, "BUSINTERFACE", BUSNAME="kernel_to_ddr", DATAWIDTH=str(data_width), NAME="m_axi",
                      TYPE="MASTER", VLNV="xilinx.com:interface:aximm:1.0")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8" standalone="no" ?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_overlay(directory, data_width: int | None = None, lanes: int | None = None,
                  compute_units: int = 1) -> Path:
    """Write l2l_optim_sim.bit (the marker) and .hwh (`compute_units` l2l_optim IPs) into
    `directory`; returns the .bit path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    bit = directory / f"{OVERLAY_NAME}.bit"
    bit.write_bytes(MARKER)
    Path(get_hwh_name(str(bit))).write_text(hwh_text(data_width, lanes, compute_units))
    return bit


def _check_marker(bitfile_name: str) -> None:
    if Path(bitfile_name).read_bytes()[:len(MARKER)] != MARKER:
        raise RuntimeError(f"{bitfile_name} is not a simulated overlay (l2l_hw.hw.pynq_sim.write_overlay): the "
                           f"simulated device runs the Verilated RTL of this checkout, not a bitstream")


# ------------------------------------------------------------------------------ device

@dataclass
class _SimBo:
    """What a PynqBuffer's `bo` is here: a buffer in the DRAM of one simulation."""

    transport: verilator.VerilatorTransport
    buf: DeviceBuffer


class SimulatedMemory:
    """The simulated DRAM as a PYNQ memory: allocate() and the buffers' return path."""

    def __init__(self, device: "SimulatedDevice"):
        self.device = device

    def allocate(self, shape, dtype, **kwargs):
        sim = self.device.transport
        count = int(np.prod(shape, dtype=np.int64))
        bo = _SimBo(sim, sim.allocate(count * np.dtype(dtype).itemsize))
        buf = PynqBuffer(shape, dtype, device=self.device, device_address=bo.buf.address, bo=bo, coherent=False)
        # freebuffer() (also run by __del__) hands `pointer` back through return_to.return_pointer;
        # freed: the host array is ordinary memory, there is no mapping for pynq to munmap
        buf.memory, buf.pointer, buf.return_to, buf.freed = self, bo, self, True
        buf.invalidate()  # the host copy starts as what the DRAM holds, as on a board
        return buf

    def return_pointer(self, bo: _SimBo) -> None:
        if bo.transport is self.device.transport:  # a re-download dropped older buffers with their DRAM
            bo.transport.free(bo.buf)


class SimulatedDevice(pynq.Device):
    """The Verilated l2l_optim with its DRAM model, as a PYNQ device (see the module docstring)."""

    _probe_priority_ = PROBE_PRIORITY

    @classmethod
    def _probe_(cls):
        return [cls()] if os.environ.get(ENV) == "1" else []

    def __init__(self, tag: str = "l2l_optim_sim", dram_bytes: int = verilator.DEFAULT_DRAM_BYTES,
                 read_latency: int = 0):
        super().__init__(tag)
        self.name = tag
        self.capabilities = {"REGISTER_RW": True, "MEMORY_MAPPED": False, "CALLABLE": False}
        self.dram_bytes, self.read_latency = dram_bytes, read_latency
        self.transport: verilator.VerilatorTransport | None = None
        self.windows: list[tuple[int, int]] = []  # each kernel's (base, range) in the PS address map
        self.running: list[bool] = []  # per kernel: AP_START written and the interrupt not seen since
        self.timestamp = ""
        self.bitfile_name = None

    # -- bitstream and metadata --------------------------------------------------------
    def get_bitfile_metadata(self, bitfile_name: str):
        """The parser a board uses (pynqmetadata over the .hwh beside the .bit)."""
        from pynqmetadata.frontends import Metadata
        from pynqmetadata.views.runtime import RuntimeMetadataParser

        _check_marker(bitfile_name)
        parser = RuntimeMetadataParser(Metadata(input=get_hwh_name(bitfile_name)))
        parser.clock_dict = {}  # no PS clock generator here: Overlay.download must not program one
        return parser

    def download(self, bitstream, parser=None):
        """Program the "FPGA": a fresh simulation of the kernels the .hwh describes, unit i
        being the i-th l2l_optim IP by name (PynqTransport's order)."""
        _check_marker(bitstream.bitfile_name)
        parser = parser or self.get_bitfile_metadata(bitstream.bitfile_name)
        kernels = [ip for _, ip in sorted(parser.ip_dict.items())
                   if ip.get("type", "").split(":")[2:3] == [KERNEL_TYPE]]
        # absent parameters: the default build (verilator.resolve)
        builds = {tuple(int(ip["parameters"][p]) if p in ip["parameters"] else None for p in ("DATA_WIDTH", "LANES"))
                  for ip in kernels}
        if len(builds) != 1:
            raise RuntimeError(f"the simulated device runs one or more l2l_optim of one build; "
                               f"{bitstream.bitfile_name} names {len(kernels)} with DATA_WIDTH, LANES {builds}")
        (data_width, lanes), = builds
        if self.transport is not None:
            self.transport.close()
        self.transport = verilator.VerilatorTransport(data_width, self.dram_bytes, self.read_latency, lanes=lanes,
                                                      compute_units=len(kernels))
        self.windows = [(ip["phys_addr"], ip["addr_range"]) for ip in kernels]
        self.running = [False] * len(kernels)
        self.post_download(bitstream, parser, self.name)

    # -- MMIO (REGISTER_RW) ------------------------------------------------------------
    def _decode(self, address: int, length: int) -> tuple[int, int]:
        """(unit, register offset) of an access, from the kernel windows of the .hwh."""
        if self.transport is None:
            raise RuntimeError("Overlay is not downloaded")
        for unit, (base, size) in enumerate(self.windows):
            offset = address - base
            if 0 <= offset and offset + length <= min(size, 1 << regs.ADDR_WIDTH) and offset % 4 == 0:
                return unit, offset
        raise ValueError(f"no register at 0x{address:X} (+{length}): the simulated device decodes only the "
                         f"l2l_optim maps at {', '.join(f'0x{base:X}' for base, _ in self.windows)}")

    def read_registers(self, address: int, length: int) -> bytes:
        unit, offset = self._decode(address, length)
        port = self.transport.units[unit]
        # The kernel runs on while the host polls. advance() stops at the interrupt, which the
        # driver enables for ap_done; without it a finished run costs CLOCKS_PER_READ per read.
        if self.running[unit] and port.advance(CLOCKS_PER_READ) >= 0:
            self.running[unit] = False
        return b"".join(port.read32(offset + i).to_bytes(4, "little") for i in range(0, length, 4))

    def write_registers(self, address: int, data: bytes) -> None:
        unit, offset = self._decode(address, len(data))
        for i in range(0, len(data), 4):
            word = int.from_bytes(data[i:i + 4], "little")
            self.transport.units[unit].write32(offset + i, word)
            self.running[unit] |= offset + i == regs.CTRL and bool(word & regs.CTRL_AP_START)

    # -- DRAM ----------------------------------------------------------------------------
    @property
    def default_memory(self) -> SimulatedMemory:
        if self.transport is None:
            raise RuntimeError("Overlay is not downloaded")
        return SimulatedMemory(self)

    def _host_bytes(self, bo: _SimBo, ptr: int, size: int):
        import torch

        if bo.transport is not self.transport:
            raise RuntimeError("this buffer belongs to an overlay download that has been replaced")
        return torch.frombuffer((ctypes.c_uint8 * size).from_address(ptr), dtype=torch.uint8)

    def flush(self, bo: _SimBo, offset: int, ptr: int, size: int) -> None:
        """Host array -> simulated DRAM (behind PynqBuffer.sync_to_device)."""
        if size:
            self.transport.write(bo.buf, self._host_bytes(bo, ptr, size), offset)

    def invalidate(self, bo: _SimBo, offset: int, ptr: int, size: int) -> None:
        """Simulated DRAM -> host array (behind PynqBuffer.sync_from_device)."""
        if size:
            self.transport.read(bo.buf, self._host_bytes(bo, ptr, size), offset)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m l2l_hw.hw.pynq_sim DIR   (writes the simulated overlay, prints its .bit)",
              file=sys.stderr)
        return 2
    print(write_overlay(argv[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
