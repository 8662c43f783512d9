"""cocotb bench of l2l_optim: the whole kernel against golden.apply_rule.

The DUT reads and writes an AxiRam (cocotbext-axi) and is driven through its
AXI4-Lite port by an AxiLiteMaster, as the driver will. Every run places the
arrays at DATA_WIDTH/8-aligned addresses that straddle 4 KiB pages, fills the
bytes right after each array with guard words, and checks afterwards that the
DRAM holds exactly golden's result (bit for bit, NaNs canonical) and that no
guard byte changed. Idle and back-pressure inserters run on every AXI channel
of both ports.

Parameters come from the runner (tests/test_sim_optim.py): DATA_WIDTH and
LANES are build parameters (LANES reaches the bench as L2L_LANES); L2L_BENCH_* environment variables drive test_throughput
(L2L_BENCH_STATE: fp32 or 8bit m and v),
the measurement behind `l2l bench rtl`.
"""

import collections
import itertools
import json
import os
import random

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, Event, RisingEdge
from cocotbext.axi import AxiBus, AxiLiteBus, AxiLiteMaster, AxiRam

import l2l_hw.hw.regs as regs
from l2l_hw.eps import golden
from l2l_hw.eps.base import OptimConfig

CLK_NS = 4
GUARD = 64          # guard bytes after every array
GUARD_BYTE = 0xA5
RAM_SIZE = 1 << 22
GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


class ReadLatency:
    """Delays every read burst of an AxiRam by `latency` clocks, pipelined.

    ARs are still accepted at once (the sink's queue is drained every cycle);
    the RAM's read process sees each AR only `latency` cycles after it was
    taken, so the first R beat of a burst comes at least `latency` cycles
    after its AR handshake, while any number of bursts are in flight."""

    def __init__(self, ram, clk, latency):
        self.channel = ram.read_if.ar_channel
        self.recv_orig = self.channel.recv
        self.clk = clk
        self.latency = latency
        self.cycle = 0
        self.queue = collections.deque()
        self.event = Event()
        self.channel.recv = self.recv
        cocotb.start_soon(self._count())
        cocotb.start_soon(self._accept())

    async def _count(self):
        while True:
            await RisingEdge(self.clk)
            self.cycle += 1

    async def _accept(self):
        while True:
            ar = await self.recv_orig()
            self.queue.append((ar, self.cycle))
            self.event.set()

    async def recv(self):
        while not self.queue:
            self.event.clear()
            await self.event.wait()
        ar, taken = self.queue.popleft()
        wait = taken + self.latency - self.cycle
        if wait > 0:
            await ClockCycles(self.clk, wait)
        return ar


def random_pause(seed, busy):
    """Pause generator: 1 (stall) with probability `busy`."""
    rng = random.Random(seed)
    while True:
        yield int(rng.random() < busy)


class TB:
    def __init__(self, dut, latency=0):
        self.dut = dut
        self.data_width = len(dut.m_axi_wdata)
        self.data_bytes = self.data_width // 8
        self.beat_lanes = self.data_width // 32  # fp32 elements per beat
        self.lanes = int(os.environ.get("L2L_LANES", self.beat_lanes))  # elements per clock
        cocotb.start_soon(Clock(dut.clk, CLK_NS, unit="ns").start())
        self.axil = AxiLiteMaster(AxiLiteBus.from_prefix(dut, "s_axil"), dut.clk, dut.rst)
        self.ram = AxiRam(AxiBus.from_prefix(dut, "m_axi"), dut.clk, dut.rst, size=RAM_SIZE)
        for log in ("cocotb.l2l_optim.s_axil", "cocotb.l2l_optim.m_axi"):
            import logging
            logging.getLogger(log).setLevel(logging.WARNING)
        if latency:
            ReadLatency(self.ram, dut.clk, latency)
        self.bursts = {"ar": 0, "aw": 0}
        self.beats = {"ar": 0, "r": 0, "aw": 0, "w": 0, "b": 0}
        cocotb.start_soon(self._count_bursts())

    async def _count_bursts(self):
        dut = self.dut
        while True:
            await RisingEdge(dut.clk)
            if int(dut.m_axi_arvalid.value) and int(dut.m_axi_arready.value):
                self.bursts["ar"] += 1
                self.beats["ar"] += int(dut.m_axi_arlen.value) + 1
            if int(dut.m_axi_awvalid.value) and int(dut.m_axi_awready.value):
                self.bursts["aw"] += 1
                self.beats["aw"] += int(dut.m_axi_awlen.value) + 1
            if int(dut.m_axi_rvalid.value) and int(dut.m_axi_rready.value):
                self.beats["r"] += 1
            if int(dut.m_axi_wvalid.value) and int(dut.m_axi_wready.value):
                self.beats["w"] += 1
            if int(dut.m_axi_bvalid.value) and int(dut.m_axi_bready.value):
                self.beats["b"] += 1

    def assert_no_open_transaction(self):
        """Every AR got all its R beats, every AW all its W beats and its B."""
        b = self.beats
        assert b["ar"] == b["r"] and b["aw"] == b["w"] and self.bursts["aw"] == b["b"], (b, self.bursts)

    def channels(self):
        return [self.ram.write_if.aw_channel, self.ram.write_if.w_channel, self.ram.write_if.b_channel,
                self.ram.read_if.ar_channel, self.ram.read_if.r_channel,
                self.axil.write_if.aw_channel, self.axil.write_if.w_channel, self.axil.write_if.b_channel,
                self.axil.read_if.ar_channel, self.axil.read_if.r_channel]

    def set_idle_generator(self, seed=None):
        # master-side channels of the AXI-Lite master: idle cycles on valid
        if seed is not None:
            for i, ch in enumerate([self.ram.read_if.r_channel, self.ram.write_if.b_channel,
                                    self.axil.write_if.aw_channel, self.axil.write_if.w_channel,
                                    self.axil.read_if.ar_channel]):
                ch.set_pause_generator(random_pause(seed + i, 0.25))

    def set_backpressure_generator(self, seed=None):
        # ready-side channels: back pressure
        if seed is not None:
            for i, ch in enumerate([self.ram.write_if.aw_channel, self.ram.write_if.w_channel,
                                    self.ram.read_if.ar_channel, self.axil.write_if.b_channel,
                                    self.axil.read_if.r_channel]):
                ch.set_pause_generator(random_pause(seed + 100 + i, 0.25))

    async def cycle_reset(self):
        self.dut.rst.setimmediatevalue(0)
        await RisingEdge(self.dut.clk)
        await RisingEdge(self.dut.clk)
        self.dut.rst.value = 1
        await RisingEdge(self.dut.clk)
        await RisingEdge(self.dut.clk)
        self.dut.rst.value = 0
        await RisingEdge(self.dut.clk)
        await RisingEdge(self.dut.clk)

    async def write_reg(self, offset, value):
        await self.axil.write_dword(offset, value & 0xFFFFFFFF)

    async def read_reg(self, offset):
        return await self.axil.read_dword(offset)

    async def write_pointer(self, offset, value):
        await self.write_reg(offset, value & 0xFFFFFFFF)
        await self.write_reg(offset + 4, value >> 32)

    async def start_and_wait(self, timeout_cycles=400_000, poll=16):
        await self.write_reg(regs.CTRL, regs.CTRL_AP_START)
        for _ in range(timeout_cycles // poll):
            ctrl = await self.read_reg(regs.CTRL)
            if ctrl & regs.CTRL_AP_DONE:
                assert ctrl & regs.CTRL_AP_IDLE
                return
            await ClockCycles(self.dut.clk, poll)
        dut = self.dut
        state = {name: int(getattr(dut, name).value) for name in
                 ("state_reg", "status_reg", "left_reg", "in_flight_reg")}
        state.update({f"{u}.{name}": int(getattr(getattr(dut, u), name).value)
                      for u in ("reader_inst", "writer_inst") for name in ("idle", "all_requested", "s_reg")})
        state.update({name: int(getattr(dut.reader_inst, name).value) for name in
                      ("tile_loaded_reg", "tleft_reg", "route_empty", "arvalid_reg", "room_reg")})
        state.update({name: int(getattr(dut.reader_inst, name).value) for name in
                      ("route_count", "route_head", "rbeat_reg")})
        raise AssertionError(f"ap_done never came: {state} {self.beats} {self.bursts}")


# ---------------------------------------------------------------- one run

class Layout:
    """Places arrays in the RAM: DATA_WIDTH/8 aligned, guard bytes after each."""

    def __init__(self, tb, rng, base=0x1000):
        self.tb, self.rng = tb, rng
        self.addr = base
        self.guards = []

    def place(self, nbytes):
        align = self.tb.data_bytes
        # start a little below a 4 KiB boundary now and then, so bursts split
        if self.rng.random() < 0.5:
            page_end = (self.addr | 0xFFF) + 1
            self.addr = max(self.addr, page_end - align * self.rng.randrange(1, 8))
        addr = self.addr
        self.guards.append((addr + nbytes, GUARD))
        self.addr = addr + nbytes + GUARD
        self.addr = (self.addr + align - 1) // align * align + align * self.rng.randrange(0, 3)
        assert self.addr < RAM_SIZE
        return addr


def grad_bits(rng, n, dtype, specials):
    """Random gradient (bit patterns of dtype) with Inf/NaN/subnormal/zero sprinkled in."""
    g32 = (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 2, n)).astype(np.float32)
    if dtype == "fp32":
        bits = g32.view(np.uint32).copy()
        pool = [0x7F800000, 0xFF800000, 0x7FC00000, 0x7FA00001, 0x00000001, 0x807FFFFF, 0, 0x80000000]
    elif dtype == "bf16":
        bits = golden.to_bf16_bits(g32)
        pool = [0x7F80, 0xFF80, 0x7FC0, 0x7FA1, 0x0001, 0x807F, 0, 0x8000]
    else:
        bits = golden.to_fp16_bits(g32)
        pool = [0x7C00, 0xFC00, 0x7E00, 0x7D01, 0x0001, 0x83FF, 0, 0x8000]
    if specials and n:
        idx = rng.choice(n, size=max(1, n // 16), replace=True)
        bits[idx] = rng.choice(np.array(pool, dtype=bits.dtype), size=idx.size)
    return bits


def widen(bits, dtype):
    if dtype == "fp32":
        return bits.view(np.float32)
    if dtype == "bf16":
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def state_arrays(rng, n, special):
    p = (rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)).astype(np.float32)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (np.abs(rng.standard_normal(n)) * 1e-6).astype(np.float32)
    if special and n:
        k = max(1, n // 16)
        p[rng.choice(n, k)] = np.array([3e38, -3e38, 1e-40, -1e-45, 0.0, -0.0, 1e30, 1e-30], np.float32)[rng.integers(0, 8, k)]
        v[rng.choice(n, k)] = np.array([0.0, 1e-45, 1e-40, 3e38], np.float32)[rng.integers(0, 4, k)]
        m[rng.choice(n, k)] = np.array([0.0, -0.0, 1e-40, -1e30], np.float32)[rng.integers(0, 4, k)]
    return p, m, v


def state8_arrays(rng, m, v, specials):
    """m and v as the 8-bit state stores them (golden.quantize): codes and block scales. With
    specials, whole blocks of zeros and a block whose scale is NaN (it held Inf or NaN)."""
    m, v = m.copy(), v.copy()
    blocks = -(-m.size // regs.QUANT_BLOCK)
    if specials and blocks > 1:
        zero = int(rng.integers(blocks)) * regs.QUANT_BLOCK
        m[zero:zero + regs.QUANT_BLOCK] = 0.0
        v[zero:zero + regs.QUANT_BLOCK] = 0.0
        bad = int(rng.integers(blocks)) * regs.QUANT_BLOCK
        m[min(bad + 3, m.size - 1)] = np.inf
    stored = {}
    for slot, x in (("m", m), ("v", v)):
        stored.update(golden.encode_state(x, "8bit", slot))
    return stored


async def run_case(tb, rng, n, optimizer="adamw", grad="fp32", copy="none", in_place=False,
                   cfg=None, step=3, inv_scale=1.0, specials=True, check=True, state="fp32"):
    """One kernel run on fresh random data, m and v in `state` format; returns (status, cycles)."""
    cfg = cfg or OptimConfig(optimizer=optimizer, lr=1e-3, weight_decay=0.01)
    s = golden.step_scalars(cfg, step, inv_scale)
    p, m, v = state_arrays(rng, n, specials)
    g = grad_bits(rng, n, grad, specials)
    q8 = state == "8bit"
    if q8:
        stored = state8_arrays(rng, m, v, specials)
        m, v = stored["m"], stored["v"]
    layout = Layout(tb, random.Random(int(rng.integers(1 << 30))))
    mem = tb.ram
    # fill the RAM span we use with a known pattern, guards included
    start = layout.addr
    state_bytes = n if q8 else 4 * n
    scale_bytes = 4 * -(-n // regs.QUANT_BLOCK)
    src = {"p": layout.place(4 * n), "m": layout.place(state_bytes), "v": layout.place(state_bytes),
           "g": layout.place(GRAD_BYTES[grad] * n)}
    if q8:
        src.update(ms=layout.place(scale_bytes), vs=layout.place(scale_bytes))
    if in_place:
        dst = {k: src[k] for k in src if k != "g"}
    else:
        dst = {"p": layout.place(4 * n), "m": layout.place(state_bytes), "v": layout.place(state_bytes)}
        if q8:
            dst.update(ms=layout.place(scale_bytes), vs=layout.place(scale_bytes))
    dst["c"] = layout.place(2 * n)
    end = layout.addr
    mem.write(start, bytes([GUARD_BYTE]) * (end - start))
    for key, arr in (("p", p), ("m", m), ("v", v), ("g", g)):
        mem.write(src[key], arr.tobytes())
    if q8:
        mem.write(src["ms"], stored["m_scale"].tobytes())
        mem.write(src["vs"], stored["v_scale"].tobytes())
    before = mem.read(start, end - start)

    pointers = [(regs.PARAM_SRC, src["p"]), (regs.M_SRC, src["m"]), (regs.V_SRC, src["v"]),
                (regs.GRAD_SRC, src["g"]), (regs.PARAM_DST, dst["p"]), (regs.M_DST, dst["m"]),
                (regs.V_DST, dst["v"]), (regs.COPY_DST, dst["c"])]
    if q8:
        pointers += [(regs.M_SCALE_SRC, src["ms"]), (regs.V_SCALE_SRC, src["vs"]),
                     (regs.M_SCALE_DST, dst["ms"]), (regs.V_SCALE_DST, dst["vs"])]
    for reg, key in pointers:
        await tb.write_pointer(reg, key)
    await tb.write_reg(regs.N, n)
    await tb.write_reg(regs.MODE, regs.mode(optimizer, grad, copy, s.nesterov, state))
    for name in regs.SCALARS:
        await tb.write_reg(getattr(regs, name.upper()), int(np.float32(getattr(s, name)).view(np.uint32)))
    await tb.start_and_wait()
    status = await tb.read_reg(regs.STATUS)
    cycles = await tb.read_reg(regs.CYCLES) | (await tb.read_reg(regs.CYCLES + 4)) << 32
    if not check:
        return status, cycles

    # golden
    g32 = widen(g, grad)
    touches_m = optimizer != "sgd" or s.momentum != 0
    expect = bytearray(before)
    def put(addr, arr):
        expect[addr - start:addr - start + arr.nbytes] = arr.tobytes()
    with np.errstate(all="ignore"):
        nonfinite = not np.isfinite(g32 * np.float32(s.inv_scale)).all()
        if q8:
            slots = ("m", "v") if optimizer != "sgd" else ("m",) if touches_m else ()
            held = {k: a for slot in slots for k, a in stored.items() if k.startswith(slot)}
            p2, new = golden.apply_rule_stored(optimizer, s, p.copy(), held, g32, "8bit")
        else:
            p2, m2, v2 = golden.apply_rule(optimizer, s, p.copy(), m.copy(), v.copy() if optimizer != "sgd" else None,
                                          g32, np.sqrt)
    p2 = golden.canonicalize_nan(np.asarray(p2, np.float32).copy())
    put(dst["p"], p2)
    if q8:
        for slot in slots:
            put(dst[slot], new[slot])
            put(dst[slot + "s"], new[slot + "_scale"])
    else:
        m2 = golden.canonicalize_nan(np.asarray(m2, np.float32).copy())
        if touches_m:
            put(dst["m"], m2)
        if optimizer != "sgd":
            put(dst["v"], golden.canonicalize_nan(np.asarray(v2, np.float32).copy()))
    if copy == "bf16":
        put(dst["c"], golden.to_bf16_bits(p2))
    elif copy == "fp16":
        put(dst["c"], golden.to_fp16_bits(p2))
    after = mem.read(start, end - start)
    what = f"n={n} {optimizer} grad={grad} copy={copy} in_place={in_place} state={state} dw={tb.data_width}"
    if after != bytes(expect):
        got = np.frombuffer(after, np.uint8)
        exp = np.frombuffer(bytes(expect), np.uint8)
        bad = np.nonzero(got != exp)[0]
        names = {**{f"src_{k}": a for k, a in src.items()}, **{f"dst_{k}": a for k, a in dst.items()}}
        where = sorted(((a, k) for k, a in names.items()))
        first = bad[0] + start
        region = [k for a, k in where if a <= first][-1] if any(a <= first for a, _ in where) else "?"
        raise AssertionError(f"{what}: {bad.size} bytes differ; first at 0x{first:x} ({region}, "
                             f"byte {first - names.get(region, first)}): got {got[bad[:8]]} expected {exp[bad[:8]]}")
    want = regs.STATUS_NONFINITE if nonfinite else 0
    assert status == want, f"{what}: status {status:#x}, expected {want:#x}"
    return status, cycles


def configs():
    """Every optimizer form of the rule."""
    return [
        ("adamw", OptimConfig(optimizer="adamw", lr=1e-3, weight_decay=0.01)),
        ("adamw", OptimConfig(optimizer="adamw", lr=3e-4, weight_decay=0.0, eps=0.0)),
        ("adam", OptimConfig(optimizer="adam", lr=1e-3, weight_decay=0.05)),
        ("adam", OptimConfig(optimizer="adam", lr=1e-2, weight_decay=0.0)),
        ("sgd", OptimConfig(optimizer="sgd", lr=0.1)),
        ("sgd", OptimConfig(optimizer="sgd", lr=0.1, momentum=0.9, weight_decay=1e-4)),
        ("sgd", OptimConfig(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True)),
        ("sgd", OptimConfig(optimizer="sgd", lr=0.05, momentum=0.8, dampening=0.3, weight_decay=0.01)),
    ]


async def setup(dut, seed, pauses=True, latency=0):
    tb = TB(dut, latency=latency)
    if pauses:
        tb.set_idle_generator(seed)
        tb.set_backpressure_generator(seed)
    await tb.cycle_reset()
    return tb


# ---------------------------------------------------------------- tests

@cocotb.test()
async def test_rule_bit_identical(dut):
    """Every optimizer form x grad dtype x copy dtype, odd sizes, in place and
    separate, with idle/back-pressure on every channel: DRAM == golden."""
    tb = await setup(dut, seed=1)
    rng = np.random.default_rng(1)
    lanes = tb.lanes
    beat = tb.beat_lanes
    sizes = [1, max(1, lanes - 1), 2 * lanes + 1, 5 * lanes, 300 + 3 * beat // 2 + 1]
    if lanes < beat:  # width conversion: tails inside an fp32 beat and a 16-bit beat
        sizes += [beat + lanes, 2 * beat + 1, 3 * beat + lanes + 1, 4 * beat - 1]
    grads = ["fp32", "bf16", "fp16"]
    copies = ["none", "bf16", "fp16"]
    case = 0
    for opt, cfg in configs():
        for step in (1, 4):
            grad = grads[case % 3]
            copy = copies[(case // 3) % 3]
            n = sizes[case % len(sizes)]
            await run_case(tb, rng, n, opt, grad, copy, in_place=bool(case % 2), cfg=cfg, step=step,
                           inv_scale=(1.0 if case % 3 else 2.0 ** -10))
            case += 1
    # every grad dtype with every copy dtype once
    for grad, copy in itertools.product(grads, copies):
        await run_case(tb, rng, sizes[case % len(sizes)], "adamw", grad, copy, in_place=bool(case % 2))
        case += 1


@cocotb.test()
async def test_state8_bit_identical(dut):
    """8-bit m and v (golden.quantize's codes and block scales in DRAM): every optimizer
    form, lengths that are not multiples of the block (short last block, partial last beat
    of codes and of scales), blocks of zeros, a NaN-scale block, Inf/NaN gradients, m and v
    down in the subnormal codes; DRAM == golden.apply_rule_stored, guards untouched."""
    tb = await setup(dut, seed=5)
    rng = np.random.default_rng(5)
    b = regs.QUANT_BLOCK
    sizes = [1, b - 1, b + tb.lanes + 1, 3 * b + 5, 2 * b]
    grads = ["fp32", "bf16", "fp16"]
    copies = ["bf16", "none", "fp16"]
    for case, (opt, cfg) in enumerate(configs()):
        await run_case(tb, rng, sizes[case % len(sizes)], opt, grads[case % 3], copies[case % 3],
                       in_place=bool(case % 2), cfg=cfg, step=1 + case % 3, state="8bit",
                       inv_scale=(1.0 if case % 3 else 2.0 ** -10))
    # several tiles of every stream, the scale streams running ahead, bursts split at 4 KiB
    await run_case(tb, rng, 64 * tb.beat_lanes * 4 + 3 * b + 7, "adamw", "bf16", "bf16", state="8bit")


@cocotb.test()
async def test_long_run_crosses_pages(dut):
    """A run of several tiles (bursts split at 4 KiB, FIFOs wrap) without specials."""
    tb = await setup(dut, seed=2)
    rng = np.random.default_rng(2)
    await run_case(tb, rng, 64 * tb.beat_lanes * 5 + 3, "adam", "bf16", "bf16", specials=False)
    await run_case(tb, rng, 64 * tb.beat_lanes * 3 + tb.lanes, "sgd", "fp16", "fp16", in_place=True,
                   cfg=OptimConfig(optimizer="sgd", lr=0.1, momentum=0.9))


@cocotb.test()
async def test_n_zero_completes_at_once(dut):
    tb = await setup(dut, seed=3)
    rng = np.random.default_rng(3)
    bursts = dict(tb.bursts)
    status, cycles = await run_case(tb, rng, 0, "adamw", "fp32", "bf16")
    assert status == 0 and cycles < 8, (status, cycles)
    assert tb.bursts == bursts, "n = 0 must not touch memory"


@cocotb.test()
async def test_misaligned_pointer_refused(dut):
    tb = await setup(dut, seed=4)
    rng = np.random.default_rng(4)
    await run_case(tb, rng, 40, "adamw", "fp32", "none")
    for reg in (regs.PARAM_SRC, regs.GRAD_SRC, regs.V_DST, regs.COPY_DST):
        bursts = dict(tb.bursts)
        snapshot = tb.ram.read(0, 1 << 16)
        await tb.write_pointer(regs.PARAM_SRC, 0x1000)
        await tb.write_pointer(regs.GRAD_SRC, 0x2000)
        await tb.write_pointer(regs.V_DST, 0x3000)
        await tb.write_pointer(regs.COPY_DST, 0x4000)
        await tb.write_pointer(reg, 0x5000 + 4)
        await tb.write_reg(regs.MODE, regs.mode("adamw", "bf16", "fp16"))
        await tb.write_reg(regs.N, 100)
        await tb.start_and_wait()
        status = await tb.read_reg(regs.STATUS)
        assert status == regs.STATUS_MISALIGNED, hex(status)
        assert tb.bursts == bursts and tb.ram.read(0, 1 << 16) == snapshot
    # the next proper run works
    await run_case(tb, rng, 40, "adam", "fp16", "fp16")


async def inject_error(tb, rng, kind):
    """Make one burst of a long run answer SLVERR; the run must end with
    AXI_ERROR and every issued burst completed (the RAM model would assert
    otherwise), and the next run must be right."""
    iface = tb.ram.read_if if kind == "read" else tb.ram.write_if
    name = "_read" if kind == "read" else "_write"
    orig = getattr(iface, name)
    hits = {"n": 0}

    async def failing(address, *args):
        hits["n"] += 1
        if hits["n"] == 200:
            raise IOError("injected fault")
        return await orig(address, *args)

    setattr(iface, name, failing)
    status, _ = await run_case(tb, rng, 64 * tb.beat_lanes * 4, "adamw", "fp32", "bf16", check=False)
    setattr(iface, name, orig)
    assert status & regs.STATUS_AXI_ERROR, hex(status)
    tb.assert_no_open_transaction()
    await ClockCycles(tb.dut.clk, 50)
    for sig in ("m_axi_arvalid", "m_axi_awvalid", "m_axi_wvalid"):
        assert int(getattr(tb.dut, sig).value) == 0, sig
    await run_case(tb, rng, 3 * tb.lanes + 1, "adamw", "bf16", "fp16")


@cocotb.test()
async def test_read_error_ends_run(dut):
    tb = await setup(dut, seed=5)
    await inject_error(tb, np.random.default_rng(5), "read")


@cocotb.test()
async def test_write_error_ends_run(dut):
    tb = await setup(dut, seed=6)
    await inject_error(tb, np.random.default_rng(6), "write")


@cocotb.test()
async def test_reset_mid_run(dut):
    """Reset while bursts are in flight: the master drops every valid and the
    next run is right."""
    tb = await setup(dut, seed=7)
    rng = np.random.default_rng(7)
    task = cocotb.start_soon(run_case(tb, rng, 64 * tb.beat_lanes * 4, "adam", "fp32", "fp16", check=False))
    await ClockCycles(dut.clk, 400)
    assert int(dut.state_reg.value) == 2, "the run should still be going"
    assert tb.beats["ar"] > tb.beats["r"] or tb.beats["aw"] > tb.beats["b"], "no burst open at reset"
    task.cancel()
    dut.rst.value = 1
    await RisingEdge(dut.clk)
    await RisingEdge(dut.clk)
    for sig in ("m_axi_arvalid", "m_axi_awvalid", "m_axi_wvalid", "s_axil_bvalid", "s_axil_rvalid"):
        assert int(getattr(dut, sig).value) == 0, sig
    await tb.cycle_reset()
    ctrl = await tb.read_reg(regs.CTRL)
    assert ctrl & regs.CTRL_AP_IDLE and not ctrl & regs.CTRL_AP_START
    await run_case(tb, rng, 5 * tb.lanes + 3, "adamw", "bf16", "bf16")


@cocotb.test()
async def test_control_registers(dut):
    """ID/VERSION/DATA_BYTES, ap_done clear-on-read, ISR toggle-on-write, interrupt."""
    tb = await setup(dut, seed=8)
    rng = np.random.default_rng(8)
    assert await tb.read_reg(regs.ID) == regs.ID_VALUE
    assert await tb.read_reg(regs.VERSION) == regs.VERSION_VALUE
    assert await tb.read_reg(regs.DATA_BYTES) == tb.data_bytes
    assert await tb.read_reg(regs.CTRL) == regs.CTRL_AP_IDLE
    await tb.write_reg(regs.GIE, 1)
    await tb.write_reg(regs.IER, 3)
    await run_case(tb, rng, 9, "adamw", "fp32", "none")   # polls CTRL: reading it cleared ap_done
    assert await tb.read_reg(regs.CTRL) == regs.CTRL_AP_IDLE
    assert await tb.read_reg(regs.ISR) == 3
    assert int(dut.interrupt.value) == 1
    await tb.write_reg(regs.ISR, 1)
    assert await tb.read_reg(regs.ISR) == 2
    await tb.write_reg(regs.ISR, 2)
    assert await tb.read_reg(regs.ISR) == 0
    await RisingEdge(dut.clk)
    assert int(dut.interrupt.value) == 0
    # an argument register reads back what was written
    await tb.write_reg(regs.LR, 0x3A83126F)
    assert await tb.read_reg(regs.LR) == 0x3A83126F


@cocotb.test(skip=os.environ.get("L2L_BENCH_OUT") is None)
async def test_throughput(dut):
    """`l2l bench rtl`: one run of n elements, no idle or back pressure, with
    L2L_BENCH_LATENCY cycles of read latency; writes the figures as JSON."""
    latency = int(os.environ.get("L2L_BENCH_LATENCY", "0"))
    n = int(os.environ.get("L2L_BENCH_N", str(1 << 16)))
    grad = os.environ.get("L2L_BENCH_GRAD", "bf16")
    copy = os.environ.get("L2L_BENCH_COPY", "bf16")
    state = os.environ.get("L2L_BENCH_STATE", "fp32")
    tb = await setup(dut, seed=None, pauses=False, latency=latency)
    rng = np.random.default_rng(9)
    status, cycles = await run_case(tb, rng, n, "adamw", grad, copy, specials=False, state=state)
    with open(os.environ["L2L_BENCH_OUT"], "w") as f:
        json.dump({"data_width": tb.data_width, "n": n, "grad_dtype": grad, "copy_dtype": copy, "state": state,
                   "read_latency": latency, "cycles": cycles, "status": status}, f)
