"""Shared pieces of the IEEE-754 unit benches (sim/fp32_*/, sim/*_to_fp32/).

The golden model is Berkeley SoftFloat 3e through softfloatpy, set to round to
nearest even with tininess detected after rounding. Vectors and expected
results are computed before the clock loop; the loop only drives and samples;
the comparison runs at the end. SoftFloat propagates NaN payloads while the
RTL returns the canonical quiet NaN, so a NaN result matches when both are NaN
and ours is exactly the canonical pattern; flags must always be equal.
"""

import os
import random

import cocotb
import softfloatpy as sf
from cocotb.clock import Clock
from cocotb.triggers import RisingEdge

# Random vectors per unit: the CI count, or 10^7 under `make sim-long`.
CI_RANDOM = 200_000
LONG_RANDOM = 10_000_000
CHUNK = 1_000_000  # long runs go in chunks so the vector lists stay small

# SoftFloat flag bits equal the RTL's flags[4:0] = {invalid, divide_by_zero,
# overflow, underflow, inexact}.
FLAG_NAMES = ("inexact", "underflow", "overflow", "divide_by_zero", "invalid")


def random_count():
    return LONG_RANDOM if os.environ.get("L2L_SIM_LONG") == "1" else CI_RANDOM


def chunks(total, seed):
    """Yield (count, random.Random) pieces of a random run of `total` vectors."""
    rng = random.Random(seed)
    while total > 0:
        n = min(total, CHUNK)
        yield n, rng
        total -= n


# ---------------------------------------------------------------- formats

class Fmt:
    def __init__(self, name, exp_w, man_w, sf_type):
        self.name = name
        self.exp_w = exp_w
        self.man_w = man_w
        self.width = 1 + exp_w + man_w
        self.bias = (1 << (exp_w - 1)) - 1
        self.exp_max = (1 << exp_w) - 1
        self.sf_type = sf_type
        self.nbytes = self.width // 8
        # canonical quiet NaN: sign 0, exponent all ones, top mantissa bit
        self.qnan = (self.exp_max << man_w) | (1 << (man_w - 1))

    def pack(self, sign, exp, man):
        return (sign << (self.width - 1)) | (exp << self.man_w) | man

    def is_nan(self, x):
        return ((x >> self.man_w) & self.exp_max) == self.exp_max and (x & ((1 << self.man_w) - 1)) != 0

    def to_sf(self, x):
        return self.sf_type.from_bytes(x.to_bytes(self.nbytes, "big"))

    def specials(self):
        """Every special class: +-0, +-min/max subnormal, +-min/max normal,
        +-1, +-Inf, quiet and signalling NaN (both signs), plus a mid subnormal."""
        m, e = self.man_w, self.exp_max
        mags = [
            0,
            1,                              # min subnormal
            (1 << m) - 1,                   # max subnormal
            1 << (m - 1),                   # mid subnormal
            1 << m,                         # min normal
            (1 << m) | 1,                   # min normal + ulp
            ((e - 1) << m) | ((1 << m) - 1),  # max normal
            self.bias << m,                 # 1.0
            (self.bias << m) | 1,           # 1 + ulp
            ((self.bias - 1) << m) | ((1 << m) - 1),  # 1 - ulp/2
            e << m,                         # Inf
            (e << m) | (1 << (m - 1)),      # quiet NaN
            (e << m) | ((1 << m) - 1),      # quiet NaN with payload
            (e << m) | 1,                   # signalling NaN
            (e << m) | (1 << (m - 2)),      # signalling NaN
        ]
        return [s << (self.width - 1) | x for s in (0, 1) for x in mags]

    def random_value(self, rng, exp_lo=0, exp_hi=None, sign=None):
        """Random sign, exponent uniform over [exp_lo, exp_hi], random mantissa:
        every binade equally likely, unlike uniform bit patterns."""
        if exp_hi is None:
            exp_hi = self.exp_max
        s = rng.getrandbits(1) if sign is None else sign
        exp = rng.randint(exp_lo, exp_hi)
        return self.pack(s, exp, rng.getrandbits(self.man_w))


F32 = Fmt("f32", 8, 23, sf.Float32)
BF16 = Fmt("bf16", 8, 7, sf.BFloat16)
F16 = Fmt("f16", 5, 10, sf.Float16)


def boundary_grid(fmt):
    """Values at rounding and range boundaries: exponents at the ends of the
    range, near 1 and one significand width apart; mantissas 0, 1, all ones,
    all ones - 1, the half point and alternating patterns. Crossed into pairs
    this exercises ties, carries out of the significand, overflow and
    underflow thresholds and cancellation."""
    m, b = fmt.man_w, fmt.bias
    exps = sorted({0, 1, 2, 3, b - m - 2, b - m - 1, b - 2, b - 1, b, b + 1, b + m, b + m + 1,
                   fmt.exp_max - 2, fmt.exp_max - 1})
    mans = [0, 1, 2, (1 << m) - 1, (1 << m) - 2, 1 << (m - 1), (1 << (m - 1)) + 1,
            int("10" * m, 2) & ((1 << m) - 1)]
    return [fmt.pack(s, e, x) for s in (0, 1) for e in exps for x in mans]


# ---------------------------------------------------------------- golden model

def softfloat_setup():
    sf.set_rounding_mode(sf.RoundingMode.NEAR_EVEN)
    sf.set_tininess_mode(sf.TininessMode.AFTER_ROUNDING)


def golden(fn, in_fmts, out_fmt, operands):
    """Apply the SoftFloat function fn to each operand tuple (ints, bit
    patterns; a None format passes the int through, e.g. a sub select).
    Returns (results, flags) as lists of ints."""
    softfloat_setup()
    conv = [f.to_sf if f is not None else int for f in in_fmts]
    set_flags, get_flags = sf.set_exception_flags, sf.get_exception_flags
    ys, fl = [], []
    for ops in operands:
        args = [c(x) for c, x in zip(conv, ops)]
        set_flags(0)
        r = fn(*args)
        ys.append(int.from_bytes(r.to_bytes(), "big"))
        fl.append(get_flags())
    return ys, fl


def compare(name, out_fmt, operands, exp_y, exp_f, got_y, got_f, max_report=10):
    """Bit-exact comparison; a NaN expectation requires our canonical NaN."""
    assert len(got_y) == len(exp_y), f"{name}: {len(got_y)} results for {len(exp_y)} inputs"
    bad = []
    for i, (ey, ef, gy, gf) in enumerate(zip(exp_y, exp_f, got_y, got_f)):
        if ey == gy and ef == gf:
            continue
        if out_fmt.is_nan(ey) and gy == out_fmt.qnan and ef == gf:
            continue
        bad.append(i)
        if len(bad) >= 1000:
            break
    lines = []
    for i in bad[:max_report]:
        ops = " ".join(f"{x:#x}" for x in operands[i])
        lines.append(f"  in {ops}: want y={exp_y[i]:#x} flags={exp_f[i]:05b}, "
                     f"got y={got_y[i]:#x} flags={got_f[i]:05b}")
    assert not bad, f"{name}: {len(bad)}+ mismatches of {len(exp_y)}\n" + "\n".join(lines)


# ---------------------------------------------------------------- bench

class FpTB:
    """Driver for one IEEE unit: clk, rst, ce, in_valid, operand ports, out_valid,
    y, flags. Subclasses name the operand ports and make the vectors."""

    OPERAND_PORTS = ("a",)

    def __init__(self, dut, seed=1):
        self.dut = dut
        # the unit's own LATENCY localparam (hdl/fp/fp_latency.vh), read from the model
        self.latency = int(dut.LATENCY.value)
        self.rng = random.Random(seed)
        cocotb.start_soon(Clock(dut.clk, 10, unit="ns").start())
        dut.rst.value = 0
        dut.ce.value = 1
        dut.in_valid.value = 0
        for p in self.OPERAND_PORTS:
            getattr(dut, p).value = 0

    async def cycle_reset(self):
        self.dut.rst.value = 1
        for _ in range(3):
            await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)

    def stall_pattern(self, cycles, stall=True):
        """ce and in_valid per cycle. With stall: ce low in random bursts and
        random idle cycles between inputs; else both held high."""
        if not stall:
            return [1] * cycles, [1] * cycles
        rng = self.rng
        ce, idle = [], []
        hold = 0
        for _ in range(cycles):
            if hold:
                hold -= 1
                ce.append(0)
            elif rng.random() < 0.08:
                hold = rng.randint(0, 4)
                ce.append(0)
            else:
                ce.append(1)
            idle.append(0 if rng.random() < 0.1 else 1)
        return ce, idle

    async def run(self, operands, stall=True):
        """Push every operand tuple through the unit; return (ys, flags, edges).

        Values read right after `await RisingEdge` are those from before the
        edge (Verilator evaluates the flops after the callback), i.e. what the
        unit showed during the cycle that just ended. An output counts as
        delivered at that edge when ce was high in that cycle, the rule a
        downstream stage applies. edges = the edge that delivered the last
        result, counted from the edge that took the first input as 1."""
        dut = self.dut
        clk_edge = RisingEdge(dut.clk)
        ports = [getattr(dut, p) for p in self.OPERAND_PORTS]
        ce_h, iv_h, ov_h, y_h, f_h = dut.ce, dut.in_valid, dut.out_valid, dut.y, dut.flags
        n = len(operands)
        budget = int(n * 1.5) + 4 * self.latency + 64
        ce_pat, iv_pat = self.stall_pattern(budget, stall)
        ys, fl = [], []
        nxt = 0
        cycle = 0
        ce_prev = 0
        while True:
            # outputs of the cycle that just ended
            if ce_prev and int(ov_h.value):
                ys.append(int(y_h.value))
                fl.append(int(f_h.value))
                if len(ys) == n:
                    break
            if cycle >= len(ce_pat):
                # out of stall pattern: run freely; a unit that stops
                # producing results fails instead of hanging
                assert cycle < budget + n + 16 * self.latency, \
                    f"only {len(ys)} of {n} results after {cycle} cycles"
                ce_pat.append(1)
                iv_pat.append(1)
            ce = ce_pat[cycle]
            if ce != ce_prev:
                ce_h.value = ce
            if ce:
                if nxt < n and iv_pat[cycle]:
                    for h, v in zip(ports, operands[nxt]):
                        h.value = v
                    iv_h.value = 1
                    nxt += 1
                else:
                    iv_h.value = 0
            ce_prev = ce
            cycle += 1
            await clk_edge
        iv_h.value = 0
        return ys, fl, cycle

    async def check(self, name, fn, in_fmts, out_fmt, operands, stall=True):
        exp_y, exp_f = golden(fn, in_fmts, out_fmt, operands)
        got_y, got_f, _ = await self.run(operands, stall)
        compare(name, out_fmt, operands, exp_y, exp_f, got_y, got_f)
        self.dut._log.info("%s: %d vectors bit-exact", name, len(operands))

    async def check_back_to_back(self, operands):
        """N operations with ce and in_valid held high finish in N + LATENCY
        cycles: the last result is delivered at edge N + LATENCY."""
        _, _, cycles = await self.run(operands, stall=False)
        n = len(operands)
        assert cycles == n + self.latency, \
            f"{n} back-to-back operations took {cycles} cycles, expected {n + self.latency}"


def vector_tests(tb_class, special_vectors, boundary_vectors, random_vectors, random_seed):
    """The four cocotb tests of a unit bench, named run_test_*; a bench module puts them
    in its globals, where cocotb discovers them."""

    async def run_test_specials(dut):
        tb = tb_class(dut, seed=1)
        await tb.cycle_reset()
        await tb.check_ops("specials", special_vectors())

    async def run_test_boundaries(dut):
        tb = tb_class(dut, seed=2)
        await tb.cycle_reset()
        await tb.check_ops("boundaries", boundary_vectors())

    async def run_test_random(dut):
        tb = tb_class(dut, seed=3)
        await tb.cycle_reset()
        for n, rng in chunks(random_count(), seed=random_seed):
            await tb.check_ops("random", random_vectors(n, rng))

    async def run_test_back_to_back(dut):
        tb = tb_class(dut, seed=4)
        await tb.cycle_reset()
        await tb.check_back_to_back((special_vectors() * 4)[:100])  # 100 in a row, unary units too

    tests = (run_test_specials, run_test_boundaries, run_test_random, run_test_back_to_back)
    return {t.__name__: cocotb.test(name=t.__name__)(t) for t in tests}
