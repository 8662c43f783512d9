"""bf16_to_fp32 against SoftFloat bf16_to_f32 on all 65,536 inputs."""

import cocotb
import softfloatpy as sf

from fp_common import BF16, F32, FpTB


class TB(FpTB):
    OPERAND_PORTS = ("a",)

    async def check_ops(self, name, operands, stall=True):
        await self.check(name, sf.bf16_to_f32, (BF16,), F32, operands, stall)


@cocotb.test()
async def run_test_all_inputs(dut):
    tb = TB(dut, seed=1)
    await tb.cycle_reset()
    await tb.check_ops("all inputs", [(x,) for x in range(1 << 16)])


@cocotb.test()
async def run_test_back_to_back(dut):
    tb = TB(dut, seed=2)
    await tb.cycle_reset()
    await tb.check_back_to_back([(x,) for x in BF16.specials()] * 3)
