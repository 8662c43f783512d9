"""Run the cocotb bench of the optimizer kernel (sim/l2l_optim/) on Verilator.

One build per DATA_WIDTH into sim_build/l2l_optim_dw<W> (l2l_hw.bench.rtl.build);
each runs every test of sim/l2l_optim/test_l2l_optim.py: bit identity to
golden.apply_rule over every optimizer form and dtype, the control registers,
and one bench per fault (n = 0, misaligned pointer, read and write SLVERR,
reset in the middle of a run).
"""
import pytest


@pytest.mark.sim
@pytest.mark.parametrize("data_width", [64, 128])
def test_l2l_optim(data_width):
    pytest.importorskip("cocotb")
    pytest.importorskip("cocotbext.axi")
    from l2l_hw.bench.rtl import run_bench_module

    total, failed = run_bench_module(data_width)
    assert failed == 0, f"DATA_WIDTH {data_width}: {failed} of {total} cocotb tests failed"
