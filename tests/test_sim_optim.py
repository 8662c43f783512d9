"""Run the cocotb bench of the optimizer kernel (sim/l2l_optim/) on Verilator.

One build per (DATA_WIDTH, LANES) into sim_build/ (l2l_hw.bench.rtl.run_bench_module); LANES
defaults to DATA_WIDTH/32, and (128, 2) runs the width conversion (two groups per fp32
beat, four per 16-bit beat);
each runs every test of sim/l2l_optim/test_l2l_optim.py: bit identity to
golden.apply_rule over every optimizer form and dtype, the control registers,
and one bench per fault (n = 0, misaligned pointer, read and write SLVERR,
reset in the middle of a run); and the bench of its FIFO (sim/l2l_optim_fifo/).
"""
import pytest


@pytest.mark.sim
@pytest.mark.parametrize("data_width,lanes", [(64, None), (128, None), (128, 2)])
def test_l2l_optim(data_width, lanes):
    pytest.importorskip("cocotb")
    pytest.importorskip("cocotbext.axi")
    from l2l_hw.bench.rtl import run_bench_module

    total, failed = run_bench_module(data_width, lanes=lanes)
    assert failed == 0, f"DATA_WIDTH {data_width} LANES {lanes}: {failed} of {total} cocotb tests failed"


@pytest.mark.sim
@pytest.mark.parametrize("head_reg", [0, 1])
def test_fifo_against_deque(head_reg):
    """The kernel's FIFO (sim/l2l_optim_fifo/) against a Python deque, with its head read from
    the memory and with its head in a register (the writer's): order, count, and a pop every
    clock served while words are in it."""
    pytest.importorskip("cocotb")
    from l2l_hw.hw import harness

    params = {"WIDTH": 16, "DEPTH": 16, "HEAD_REG": head_reg}
    build = harness.BUILD / f"l2l_optim_fifo_head{head_reg}"
    total, failed = harness.run_bench("l2l_optim_fifo", harness.SIM / "l2l_optim_fifo", build, params)
    assert total > 0, "l2l_optim_fifo: cocotb found no tests"
    assert failed == 0, f"l2l_optim_fifo HEAD_REG {head_reg}: {failed} of {total} cocotb tests failed"


@pytest.mark.parametrize("failures", [1, 2])
def test_a_failed_cpp_build_is_tried_once_more_and_a_second_failure_names_the_free_disk(tmp_path, monkeypatch,
                                                                                      failures):
    """make resumes at the failed target; a design that does not build fails both tries, its error
    naming the build and the free disk (a full disk also loses the compiler's captured message)."""
    runner_module = pytest.importorskip("cocotb_tools.runner")
    from l2l_hw.hw import harness

    tries = []

    class Runner:
        def build(self, **kw):
            tries.append(kw["build_dir"])
            if len(tries) <= failures:
                raise RuntimeError("Command failed with return code: 2")

    monkeypatch.setattr(runner_module, "get_runner", lambda simulator: Runner())
    if failures == 1:
        assert isinstance(harness.build("l2l_optim", tmp_path), Runner)
    else:
        with pytest.raises(RuntimeError, match=r"l2l_optim: the C\+\+ build in .* GiB free in .*, twice"):
            harness.build("l2l_optim", tmp_path)
    assert tries == [tmp_path, tmp_path]
