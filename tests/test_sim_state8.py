"""Run the cocotb benches of the 8-bit optimizer state stages (sim/l2l_optim_quant/,
sim/l2l_optim_dequant/) on Verilator: bit identity to golden.quantize and golden.dequantize
for both code books (golden.M_CODE: sign + 4 exponent bits; golden.V_CODE: 5 exponent
bits), the encoder at 1, 4 and 16 lanes."""
import pytest

from l2l_hw.eps import golden
from l2l_hw.hw import harness

CODES = {"m": golden.M_CODE, "v": golden.V_CODE}


def run(top, slot, lanes=None):
    pytest.importorskip("cocotb")
    code = CODES[slot]
    params = {"EXP_BITS": code.exp_bits, "SIGNED": int(code.signed)}
    if lanes is not None:
        params["LANES"] = lanes
    build = harness.BUILD / f"{top}_{slot}" / (f"lanes{lanes}" if lanes else "")
    total, failed = harness.run_bench(top, harness.SIM / top, build, params,
                                      extra_env={"L2L_QUANT_SIGNED": str(int(code.signed))})
    assert total > 0, f"{top}: cocotb found no tests"
    assert failed == 0, f"{top} {slot} LANES {lanes}: {failed} of {total} cocotb tests failed"


@pytest.mark.sim
@pytest.mark.parametrize("slot,lanes", [("m", 1), ("v", 4), ("m", 16)])
def test_quant_bit_identical_to_golden(slot, lanes):
    run("l2l_optim_quant", slot, lanes)


@pytest.mark.sim
@pytest.mark.parametrize("slot", ["m", "v"])
def test_dequant_bit_identical_to_golden(slot):
    run("l2l_optim_dequant", slot)
