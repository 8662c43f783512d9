"""cocotb bench of l2l_optim_dequant: code x block scale against golden.dequantize.

Every one of the 256 codes against scales of every kind (powers of two across the whole
clamp range, 2^-126, NaN, and arbitrary fp32 values, for products that round or fall
below 2^-126), one element per clock; the result must come LATENCY clocks later, bit
for bit golden's (NaN: the canonical quiet NaN).
"""

import os

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from l2l_hw.eps import golden

CODE = golden.M_CODE if int(os.environ.get("L2L_QUANT_SIGNED", "1")) else golden.V_CODE


def expected(codes, scales):
    with np.errstate(all="ignore"):
        y = golden.decode_codes(codes, CODE) * scales
    return golden.canonicalize_nan(y.astype(np.float32)).view(np.uint32)


@cocotb.test()
async def test_dequantize_bit_identical(dut):
    cocotb.start_soon(Clock(dut.clk, 4, unit="ns").start())
    dut.rst.value = 1
    await ClockCycles(dut.clk, 2)
    dut.rst.value = 0
    latency = int(dut.LATENCY.value)
    rng = np.random.default_rng(11)
    scales = np.concatenate([
        golden._exp2(np.arange(-golden.SCALE_EXP_LIMIT, golden.SCALE_EXP_LIMIT + 1)),
        np.array([np.nan], np.float32),
        rng.standard_normal(64).astype(np.float32) * np.float32(2.0**-120),
        np.abs(rng.standard_normal(64).astype(np.float32)) * np.float32(1e30),
    ]).astype(np.float32)
    codes = np.tile(np.arange(256, dtype=np.uint8), scales.size)
    per = np.repeat(scales, 256)
    want = expected(codes, per)
    got = []
    total = codes.size
    for i in range(total + latency):
        if i < total:
            dut.code.value = int(codes[i])
            dut.scale.value = int(per.view(np.uint32)[i])
        await RisingEdge(dut.clk)
        if i >= latency:
            got.append(int(dut.y.value))
    got = np.array(got, np.uint32)
    bad = np.nonzero(got != want)[0]
    assert bad.size == 0, [(int(codes[i]), hex(int(per.view(np.uint32)[i])), hex(int(got[i])), hex(int(want[i])))
                           for i in bad[:8]]
