"""cocotb bench of l2l_optim_quant: block-wise 8-bit encoding against golden.quantize.

The runner (tests/test_sim_state8.py) builds the module for one code book (EXP_BITS,
SIGNED: golden.M_CODE or V_CODE) and LANES. Each run streams n elements in groups of LANES
(element e in lane e % LANES, the lanes beyond n in the last group hold garbage and are
masked), with idle clocks between groups or none, and checks that the scales and codes
that come out are bit for bit golden.quantize's: random values of every magnitude,
lengths that are not multiples of the block, blocks of zeros (and -0.0), blocks holding
Inf or NaN, values that land on the subnormal codes and below, magnitudes at both clamps
of the scale exponent. A run of back-to-back groups checks that the input never waits:
every code is out a fixed number of clocks after the last group went in.
"""

import os
import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, RisingEdge

from l2l_hw.eps import golden
from l2l_hw.hw.regs import QUANT_BLOCK

CODE = golden.M_CODE if int(os.environ.get("L2L_QUANT_SIGNED", "1")) else golden.V_CODE


class TB:
    def __init__(self, dut):
        self.dut = dut
        self.lanes = len(dut.in_mask)
        cocotb.start_soon(Clock(dut.clk, 4, unit="ns").start())

    async def reset(self):
        dut = self.dut
        dut.rst.value = 1
        dut.clear.value = 0
        dut.in_valid.value = 0
        dut.in_last.value = 0
        dut.in_mask.value = 0
        dut.in_x.value = 0
        await ClockCycles(dut.clk, 4)
        dut.rst.value = 0
        await ClockCycles(dut.clk, 2)

    async def run(self, x: np.ndarray, busy: float, rng: random.Random):
        """Stream x through the quantizer; returns (codes, scales, clocks from the last group
        in to the last code out)."""
        dut, lanes = self.dut, self.lanes
        n = x.size
        groups = -(-n // lanes)
        bits = np.zeros(groups * lanes, np.uint32)
        bits[:n] = x.view(np.uint32)
        bits[n:] = [rng.getrandbits(32) for _ in range(groups * lanes - n)]  # masked garbage
        codes, scales, last_seen = [], [], []
        done = cocotb.start_soon(self._collect(groups, codes, scales, last_seen))
        dut.clear.value = 1
        await RisingEdge(dut.clk)
        dut.clear.value = 0
        for gi in range(groups):
            while rng.random() < busy:
                dut.in_valid.value = 0
                await RisingEdge(dut.clk)
            word = 0
            for li in range(lanes):
                word |= int(bits[gi * lanes + li]) << (32 * li)
            last = gi == groups - 1
            valid_lanes = n - gi * lanes if last else lanes
            dut.in_valid.value = 1
            dut.in_last.value = int(last)
            dut.in_mask.value = (1 << valid_lanes) - 1
            dut.in_x.value = word
            await RisingEdge(dut.clk)
        dut.in_valid.value = 0
        dut.in_last.value = 0
        clocks = 0
        while not done.done():
            await RisingEdge(dut.clk)
            clocks += 1
        await done
        assert int(dut.held.value) == 0
        return np.array(codes, np.uint8)[:n], np.array(scales, np.uint32).view(np.float32), clocks, last_seen

    async def _collect(self, groups, codes, scales, last_seen):
        dut, lanes = self.dut, self.lanes
        blocks = -(-groups * lanes // QUANT_BLOCK)
        got = 0
        while got < groups:
            await RisingEdge(dut.clk)
            if int(dut.scale_valid.value):
                scales.append(int(dut.scale.value))
                if int(dut.scale_last.value):
                    last_seen.append(("scale", len(scales)))
            if int(dut.out_valid.value):
                word = int(dut.out_code.value)
                codes.extend((word >> (8 * li)) & 0xFF for li in range(lanes))
                got += 1
                if int(dut.out_last.value):
                    last_seen.append(("code", got))
        assert len(scales) == blocks, (len(scales), blocks)


def check(x, codes, scales, last_seen, groups):
    want_codes, want_scales = golden.quantize(x, CODE)
    assert np.array_equal(scales.view(np.uint32), want_scales.view(np.uint32)), \
        [(i, hex(a), hex(b)) for i, (a, b) in enumerate(zip(scales.view(np.uint32), want_scales.view(np.uint32))) if a != b][:8]
    bad = np.nonzero(codes != want_codes)[0]
    assert bad.size == 0, [(int(i), hex(int(x.view(np.uint32)[i])), int(codes[i]), int(want_codes[i])) for i in bad[:8]]
    assert last_seen == [("scale", len(want_scales)), ("code", groups)], last_seen


def block_values(rng: np.random.Generator, kind: str, size: int) -> np.ndarray:
    signed = CODE.signed
    if kind == "random":
        e = rng.integers(-140, 128)
        x = rng.standard_normal(size).astype(np.float32) * np.float32(2.0 ** min(e, 100))
        x *= np.float32(2.0 ** (e - min(e, 100)))
    elif kind == "wide":  # one large value, the rest spread down into the subnormal codes and below
        x = (rng.standard_normal(size) * 2.0 ** rng.integers(-40, 1, size)).astype(np.float32)
        x[rng.integers(size)] = np.float32(rng.uniform(1, 2) * 2.0 ** rng.integers(-20, 20))
    elif kind == "zero":
        x = np.zeros(size, np.float32)
        if signed:
            x[rng.random(size) < 0.5] = np.float32(-0.0)
    elif kind == "nonfinite":
        x = rng.standard_normal(size).astype(np.float32)
        x[rng.integers(size)] = rng.choice([np.inf, -np.inf, np.nan])
    elif kind == "huge":  # the scale exponent's upper clamp
        x = (rng.uniform(0.5, 1.0, size) * 2.0**127).astype(np.float32)
        x[rng.integers(size)] = np.float32(3.4e38)
    elif kind == "tiny":  # the lower clamp, fp32 subnormals
        x = (rng.standard_normal(size) * 2.0**-140).astype(np.float32)
    elif kind == "ties":  # magnitudes on the rounding midpoints of the normal and subnormal grids
        c = rng.integers(0, CODE.max_magnitude, size)
        lo = golden.decode_codes(c.astype(np.uint8), CODE).astype(np.float64)
        hi = golden.decode_codes((c + 1).astype(np.uint8), CODE).astype(np.float64)
        x = ((lo + hi) / 2).astype(np.float32)
        x[0] = np.float32(1.875)
    else:
        raise ValueError(kind)
    if not signed:
        x = np.abs(x)
    return x


KINDS = ("random", "wide", "zero", "nonfinite", "huge", "tiny", "ties")


def make_case(rng: np.random.Generator, n: int) -> np.ndarray:
    parts, left = [], n
    while left > 0:
        size = min(left, QUANT_BLOCK)
        parts.append(block_values(rng, rng.choice(KINDS), size))
        left -= size
    return np.concatenate(parts)


@cocotb.test()
async def test_quantize_bit_identical(dut):
    tb = TB(dut)
    await tb.reset()
    rng = np.random.default_rng(19)
    prng = random.Random(19)
    b = QUANT_BLOCK
    for n, busy in [(1, 0.0), (b - 1, 0.3), (b, 0.0), (b + 1, 0.5), (1000, 0.2), (3 * b + 5, 0.0),
                    (4096 + 77, 0.1), (2048, 0.0)]:
        x = make_case(rng, n)
        codes, scales, _, last_seen = await tb.run(x, busy, prng)
        check(x, codes, scales, last_seen, -(-n // tb.lanes))


@cocotb.test()
async def test_every_kind_of_block(dut):
    tb = TB(dut)
    await tb.reset()
    rng = np.random.default_rng(7)
    prng = random.Random(7)
    for kind in KINDS:
        x = np.concatenate([block_values(rng, kind, QUANT_BLOCK) for _ in range(3)] +
                           [block_values(rng, kind, 100)])
        codes, scales, _, last_seen = await tb.run(x, 0.1, prng)
        check(x, codes, scales, last_seen, -(-x.size // tb.lanes))


@cocotb.test()
async def test_back_to_back_never_waits(dut):
    """Groups every clock: the double buffer keeps up, and the last code leaves a fixed
    number of clocks after the last group went in (the drain of the last block: its
    groups, the block latency and the drain latency), whatever the length."""
    tb = TB(dut)
    await tb.reset()
    rng = np.random.default_rng(3)
    prng = random.Random(3)
    tails = set()
    for blocks in (1, 2, 5, 8):
        n = blocks * QUANT_BLOCK
        x = make_case(rng, n)
        codes, scales, clocks, last_seen = await tb.run(x, 0.0, prng)
        check(x, codes, scales, last_seen, n // tb.lanes)
        tails.add(clocks)
    assert len(tails) == 1, tails
