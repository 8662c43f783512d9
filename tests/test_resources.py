"""The Xilinx resource flow (l2l_hw/hw/resources.py) runs on small units and reads its counts right.

The full table (the kernel at 1, 4 and 16 lanes) is `make resources`, a benchmark, not CI. Here
two units synthesize uncached for UltraScale+ in seconds: fp32_mul, whose 24x24 mantissa
product must land in DSP48E2 slices, and one stream FIFO deep enough that it must land in
block RAM; the counting and the lanes-that-fit arithmetic are checked against hand-made
counts; the part constants against the UltraScale+ CLB (8 LUTs and 16 flip-flops per CLB).
"""
import pytest

from l2l_hw.hw import resources, timing
from l2l_hw.hw.timing import Design
from tests.test_timing import needs_tools




@needs_tools
def test_fp32_mul_maps_its_product_to_dsp48e2(tmp_path, monkeypatch):
    monkeypatch.setenv("L2L_HW_CACHE", str(tmp_path))
    r = resources.synthesize(timing.DESIGNS["fp32_mul"], use_cache=False)
    res = r["resources"]
    assert res["dsp"] >= 2, res  # a DSP48E2 multiplies 27x18: a 24x24 product takes at least two
    # its pipeline registers: at least the two 32-bit operands and the 32-bit result
    assert res["ff"] >= 3 * 32 and res["lut"] > 0, res
    assert res["ramb36"] == res["ramb18"] == res["uram"] == 0, res
    assert r["cells"].get("DSP48E2") == res["dsp"]
    # kept hierarchical, the counts are the hierarchy's primitives (its rounding stage's
    # registers included), not its submodules' instances
    assert all("\\" not in c for c in r["cells"]), r["cells"]
    assert resources.synthesize(timing.DESIGNS["fp32_mul"])["resources"] == res  # cached, same counts


@needs_tools
def test_a_deep_fifo_lands_in_block_ram(tmp_path, monkeypatch):
    monkeypatch.setenv("L2L_HW_CACHE", str(tmp_path))
    fifo = Design("l2l_optim_fifo_72x512", "l2l_optim_fifo", {"WIDTH": 72, "DEPTH": 512})
    res = resources.synthesize(fifo, use_cache=False)["resources"]
    # 72 x 512 = 36 Kb: one RAMB36E2 (512 x 72) or two RAMB18E2, not LUT RAM
    assert res["bram36"] == 1, res
    assert res["dsp"] == 0 and res["lut_as_memory"] == 0, res


def test_count_reads_luts_flip_flops_and_memories():
    cells = {"LUT1": 1, "LUT6": 10, "INV": 2, "SRLC32E": 3, "RAM64M": 2, "FDRE": 20, "FDSE": 1,
             "CARRY4": 5, "DSP48E2": 4, "RAMB36E2": 3, "RAMB18E2": 3, "URAM288": 1, "BUFG": 1, "MUXF7": 9}
    got = resources.count(cells)
    assert got["lut"] == 1 + 10 + 2 + 3 + 2 * 4 and got["lut_as_memory"] == 3 + 8
    assert (got["ff"], got["carry"], got["dsp"], got["uram"]) == (21, 5, 4, 1)
    assert got["bram36"] == 3 + 3 / 2


def test_lanes_that_fit_is_the_line_through_the_largest_measured_points():
    part = resources.Part("X", "board", lut=100_000, ff=200_000, dsp=1_000, bram36=100, uram=0, source="")
    # per lane: 5,000 LUTs, 20 DSPs, 2 BRAM; fixed: 2,000 LUTs, 0 DSPs, 10 BRAM
    counts = {n: {"lut": 2_000 + 5_000 * n, "dsp": 20 * n, "bram36": 10 + 2 * n} for n in (1, 4, 16)}
    fit = resources.lanes_that_fit(counts, part)
    # 70%: LUT (70,000 - 2,000) / 5,000 = 13.6; DSP 700 / 20 = 35; BRAM (70 - 10) / 2 = 30
    assert fit["by_resource"] == {"lut": 13, "dsp": 35, "bram36": 30}
    assert (fit["lanes"], fit["bound"], fit["from_lanes"]) == (13, "lut", [4, 16])
    assert fit["kernel_lanes"] == 8  # LANES is a power of two
    assert fit["measured_fit"] == 4  # 16 lanes take 82,000 LUTs, over 70%
    # a 16-lane kernel: 82,000 LUTs, 320 DSPs, 42 BRAM; 70,000 LUTs hold none of it
    assert fit["kernels_of_16"] == 0
    big = resources.Part("Y", "board", lut=1_000_000, ff=2_000_000, dsp=1_000, bram36=1_000, uram=0, source="")
    fit = resources.lanes_that_fit(counts, big)
    # LUT 8 kernels, DSP 700 / 320 = 2, BRAM 700 / 42 = 16: DSP-bound at 35 lanes, 2 kernels
    assert (fit["lanes"], fit["bound"], fit["kernel_lanes"], fit["kernels_of_16"]) == (35, "dsp", 16, 2)


def test_parts_have_the_ultrascale_plus_clb_ratio():
    for part in resources.PARTS:
        assert part.ff == 2 * part.lut, part  # 8 LUTs and 16 flip-flops per CLB (UG574)
        assert part.lut % 8 == 0 and part.dsp > 0 and part.bram36 > 0 and part.uram > 0 and part.source
