"""`l2l bench eps --backend fpga-sim`: the RTL optimizer kernel in the loop, per wall second.

One AdamW update of n elements (grad bf16, bf16 working copy, by default) through the
fpga-sim EPS path: the gradient copied into the simulated DRAM, the kernel programmed and
run by the register-level driver (l2l_hw/hw/driver.py) on the Verilated l2l_optim with the
C++ DRAM model (l2l_hw/hw/verilator.py). Reports wall-clock elements per second (the
copy-in included) and simulated clocks per element (the kernel's CYCLES register; with
several compute units the slowest unit's, i.e. the board's time for the update), for the
default number of compute units (verilator.default_compute_units()) and, for comparison,
for one. The first call builds the simulation for the DATA_WIDTH asked for (cached).
"""
from __future__ import annotations

import json
import os
import time

import torch

GRAD = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def run(n: int = 1 << 20, data_width: int | None = None, grad: str = "bf16", copy: str = "bf16", repeats: int = 3,
        lanes: int | None = None, compute_units: int | None = None) -> dict:
    from l2l_hw.eps import golden
    from l2l_hw.eps.base import OptimConfig
    from l2l_hw.hw import regs, verilator
    from l2l_hw.hw.driver import L2lOptimDriver

    data_width, lanes = verilator.resolve(data_width, lanes)
    t_build = time.perf_counter()
    verilator.library_path(data_width, lanes=lanes)
    build_s = time.perf_counter() - t_build
    compute_units = compute_units or verilator.default_compute_units()
    transport = verilator.VerilatorTransport(data_width, dram_bytes=max(1 << 28, 40 * n), lanes=lanes,
                                             compute_units=compute_units)
    driver = L2lOptimDriver(transport)
    buf = {k: transport.allocate(4 * n) for k in ("p", "m", "v", "g", "p2", "m2", "v2", "copy")}
    for k in ("p", "m", "v"):
        transport.write(buf[k], torch.rand(n))
    g = torch.randn(n).to(GRAD[grad])
    pointers = {"PARAM_SRC": buf["p"].address, "M_SRC": buf["m"].address, "V_SRC": buf["v"].address,
                "GRAD_SRC": buf["g"].address, "PARAM_DST": buf["p2"].address, "M_DST": buf["m2"].address,
                "V_DST": buf["v2"].address, "COPY_DST": buf["copy"].address if copy != "none" else 0}
    mode = regs.mode("adamw", grad, copy)
    best, cycles, unit_cycles = float("inf"), 0, 0
    for step in range(1, repeats + 1):
        s = golden.step_scalars(OptimConfig(), step)
        t0 = time.perf_counter()
        transport.write(buf["g"], g)
        result = driver.run(layer="bench", n=n, mode=mode, scalars=s, pointers=pointers)
        best = min(best, time.perf_counter() - t0)
        cycles, unit_cycles = result.cycles, sum(result.unit_cycles)
    driver.close()
    transport.close()
    return {"backend": "fpga-sim", "n": n, "data_width": data_width, "lanes": lanes, "compute_units": compute_units,
            "units_used": len(result.unit_cycles), "optimizer": "adamw", "grad_dtype": grad,
            "copy_dtype": copy, "wall_s": round(best, 4), "elements_per_s": round(n / best),
            "cycles": cycles, "cycles_per_element": round(cycles / n, 4),
            "sim_clocks_per_s": round(unit_cycles / best), "build_s_first_use": round(build_s, 1),
            "threads": torch.get_num_threads(), "load_avg_1min": round(os.getloadavg()[0], 2)}


def _line(r: dict) -> str:
    units = f"{r['compute_units']} compute unit" + ("s" if r["compute_units"] > 1 else "")
    return (f"  {units}: {r['elements_per_s'] / 1e6:.3f} M elements / wall s ({r['wall_s']} s per update), "
            f"{r['cycles_per_element']:.3f} simulated clocks / element, "
            f"{r['sim_clocks_per_s'] / 1e3:.0f} k unit clocks / s")


def format_report(r: dict) -> str:
    lines = [f"fpga-sim (Verilated l2l_optim, DATA_WIDTH {r['data_width']}, LANES {r['lanes']}), AdamW, n = {r['n']}, "
             f"grad {r['grad_dtype']}, copy {r['copy_dtype']}, load average {r['load_avg_1min']}:", _line(r)]
    if "one_compute_unit" in r:
        lines.append(_line(r["one_compute_unit"]) + "  (for comparison)")
    return "\n".join(lines)


DEFAULT_N = 1 << 20  # ~0.7 s at ~1.5 M elements / s (DATA_WIDTH 512, LANES 4, 2 compute units)


def run_from_args(args) -> int:
    """Behind `l2l bench eps --backend fpga-sim` (the parser of l2l_hw/bench/eps.py): the default
    number of compute units, then one for comparison."""
    from l2l_hw.bench import eps as bench_eps

    n = args.n if args.n and args.n != bench_eps.N else DEFAULT_N  # the host kernel's 2^25 would take minutes
    repeats = min(getattr(args, "repeats", 3) or 3, 3)
    r = run(n=n, repeats=repeats)
    if r["compute_units"] > 1:
        r["one_compute_unit"] = run(n=n, repeats=repeats, compute_units=1)
    print(json.dumps(r, indent=2) if getattr(args, "json", False) else format_report(r))
    return 0
