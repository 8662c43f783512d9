"""cocotb bench of l2l_optim_fifo against a Python deque.

Random pushes and pops (a pop only when the head is not empty, a push only when there is room),
in phases that fill the FIFO, drain it and stream through it, with a `clear` in between. After
every clock: `count` is the deque's length, a non-empty head is the deque's first word, and
the head is empty only where the parameter allows it: with HEAD_REG = 0 only when the deque is,
with HEAD_REG = 1 also while the first word was pushed in the last two clocks (a push reaches
the head three clocks later). So a pop every clock is served while words are in the FIFO
(II = 1), and a stall loses nothing.
"""

import random
from collections import deque

import cocotb
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge

# (clocks, push probability, pop probability)
PHASES = [(300, 0.9, 0.3), (300, 0.3, 0.9), (400, 1.0, 1.0), (300, 0.6, 0.6), (200, 0.0, 1.0),
          (300, 1.0, 0.0), (400, 0.5, 1.0)]


@cocotb.test()
async def test_fifo_against_deque(dut):
    cocotb.start_soon(Clock(dut.clk, 4, unit="ns").start())
    head_reg = int(dut.HEAD_REG.value)
    depth = int(dut.DEPTH.value)
    width = int(dut.WIDTH.value)
    dut.rst.value = 1
    dut.clear.value = 0
    dut.push.value = 0
    dut.pop.value = 0
    dut.push_data.value = 0
    await ClockCycles(dut.clk, 3)
    dut.rst.value = 0
    rng = random.Random(5)
    model = deque()  # (word, the clock it was pushed)
    clock = 0
    pops = 0
    for rep in range(2):
        for clocks, p_push, p_pop in PHASES:
            for _ in range(clocks):
                await FallingEdge(dut.clk)
                clock += 1
                count = int(dut.count.value)
                empty = int(dut.empty.value)
                assert count == len(model), f"clock {clock}: count {count}, expected {len(model)}"
                if not empty:
                    assert model, f"clock {clock}: head not empty in an empty FIFO"
                    head = int(dut.head.value)
                    assert head == model[0][0], f"clock {clock}: head {head:#x}, expected {model[0][0]:#x}"
                elif model:
                    late = head_reg and model[0][1] >= clock - 2
                    assert late, (f"clock {clock}: head empty with {len(model)} words in the FIFO, the first "
                                  f"pushed {clock - model[0][1]} clocks ago (HEAD_REG {head_reg})")
                pop = not empty and rng.random() < p_pop
                push = len(model) - pop < depth and rng.random() < p_push
                word = rng.getrandbits(width)
                dut.pop.value = int(pop)
                dut.push.value = int(push)
                dut.push_data.value = word
                if pop:
                    model.popleft()
                    pops += 1
                if push:
                    model.append((word, clock))
        # clear in the middle of a run: everything goes
        await FallingEdge(dut.clk)
        dut.push.value = 0
        dut.pop.value = 0
        dut.clear.value = 1
        await FallingEdge(dut.clk)
        dut.clear.value = 0
        model.clear()
        clock += 2
        assert int(dut.count.value) == 0 and int(dut.empty.value) == 1
    assert pops > 1500, pops
