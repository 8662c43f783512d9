"""Run the cocotb benches of the IEEE-754 units (sim/<unit>/) on Verilator.

One test per unit; each builds the unit once into sim_build/<unit> and runs
its bench. `make sim-long` (L2L_SIM_LONG=1) raises the random vectors per unit
from 2*10^5 to 10^7.
"""

import pytest

from l2l_hw.hw import harness


def run_unit(unit):
    pytest.importorskip("cocotb")
    pytest.importorskip("softfloatpy")
    total, failed = harness.run_bench(unit, harness.SIM / unit, harness.BUILD / unit)
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
