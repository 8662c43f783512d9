"""PYNQ transport: l2l_optim on a board, driven through the `pynq` package.

    overlay   pynq.Overlay(bitstream) (the .hwh beside the .bit names the IP) or an xclbin
              (Alveo / Vitis), or an Overlay object already loaded
    control   the kernel IP's MMIO (`overlay.<ip>.mmio`, read/write of 32-bit words);
              PYNQ 3.1 removed DefaultIP.call/start, so the driver writes CTRL.AP_START itself.
              An overlay with several l2l_optim IPs on one DRAM: each is a compute unit
              (`units`, sorted by IP name) and the driver splits every run over them
    DRAM      pynq.allocate(...) buffers (contiguous, physically addressed; their
              `device_address` is what the kernel's AXI master sees), with
              sync_to_device / sync_from_device around every host access (cache coherence
              on Zynq, the PCIe copy on Alveo)
    waiting   the driver polls CTRL.AP_DONE; advance() sleeps a short interval between polls

Without a board: with L2L_PYNQ_SIM=1, pynq's device probe finds l2l_hw/hw/pynq_sim.py's
SimulatedDevice (the Verilated RTL and its DRAM model behind pynq's Device interface), and
this file runs unchanged on the real `pynq` package against it (tests/test_pynq.py). No
board was used to test this file (docs/BOARD.md).
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from l2l_hw.hw.driver import BOARD_POLL_S, DeviceBuffer

KERNEL_NAMES = ("l2l_optim",)  # IP name prefix: block design l2l_optim_0, Vitis l2l_optim_1


def _pynq():
    try:
        import pynq
    except ImportError as exc:
        raise RuntimeError("the fpga-pynq EPS needs the `pynq` package on the board (pip install pynq)") from exc
    if os.environ.get("L2L_PYNQ_SIM") == "1":
        from l2l_hw.hw import pynq_sim  # noqa: F401  defining its Device subclass lets pynq's probe find it
    return pynq


class _ControlPort:
    """One l2l_optim IP's AXI4-Lite registers through its pynq MMIO: a compute unit."""

    def __init__(self, mmio):
        self.mmio = mmio

    def read32(self, offset: int) -> int:
        return int(self.mmio.read(offset)) & 0xFFFFFFFF

    def write32(self, offset: int, value: int) -> None:
        self.mmio.write(offset, value & 0xFFFFFFFF)

    def advance(self, max_cycles: int) -> int:
        time.sleep(BOARD_POLL_S)
        return 0  # a board does not count clocks for us: the driver's wall-clock limit applies

    def recover(self) -> bool:
        return False  # ap_ctrl_hs has no soft reset: a hung kernel needs the overlay reloaded


class PynqTransport(_ControlPort):
    """The overlay's DRAM, and its l2l_optim IPs as compute units: `kernel` (an IP name) picks
    one, None takes every IP named l2l_optim*. The transport's own control port is unit 0's."""

    name = "pynq"

    def __init__(self, overlay, kernel: str | None = None):
        pynq = _pynq()
        if isinstance(overlay, (str, Path)):
            if not Path(overlay).exists():
                raise FileNotFoundError(f"overlay {overlay} not found (a .bit with its .hwh, or an .xclbin)")
            overlay = pynq.Overlay(str(overlay))
        self.overlay = overlay
        names = list(getattr(overlay, "ip_dict", {}))
        self.kernels = [kernel] if kernel is not None else sorted(n for n in names if n.startswith(KERNEL_NAMES))
        if not self.kernels:
            raise RuntimeError(f"no l2l_optim IP in the overlay among {names}; pass kernel='<ip name>'")
        self.kernel = self.kernels[0]
        super().__init__(getattr(overlay, self.kernel).mmio)
        self.units = [self] + [_ControlPort(getattr(overlay, k).mmio) for k in self.kernels[1:]]
        # Buffers on the overlay's device (pynq's active device unless the Overlay was given one)
        self._allocate = pynq.allocate
        self._target = getattr(overlay, "device", None)

    def allocate(self, nbytes: int) -> DeviceBuffer:
        import numpy as np

        # 64 bytes at least: reads may run to the end of the last DATA_WIDTH/8 block (<= 64 B)
        handle = self._allocate(shape=(max(64, -(-nbytes // 64) * 64),), dtype=np.uint8, target=self._target)
        return DeviceBuffer(int(handle.device_address), nbytes, handle)

    def free(self, buf: DeviceBuffer) -> None:
        buf.handle.freebuffer()

    def write(self, buf: DeviceBuffer, tensor, offset: int = 0) -> None:
        data = tensor.contiguous().reshape(-1).view(_uint8()).numpy()
        if offset + data.size > buf.nbytes:
            raise ValueError(f"{data.size} bytes at {offset} overrun a {buf.nbytes}-byte device buffer")
        buf.handle[offset:offset + data.size] = data
        buf.handle.sync_to_device()

    def read(self, buf: DeviceBuffer, out, offset: int = 0):
        view = out.reshape(-1).view(_uint8()).numpy()
        if offset + view.size > buf.nbytes:
            raise ValueError(f"{view.size} bytes at {offset} overrun a {buf.nbytes}-byte device buffer")
        buf.handle.sync_from_device()
        view[:] = buf.handle[offset:offset + view.size]
        return out

    def close(self) -> None:
        pass


def _uint8():
    import torch

    return torch.uint8
