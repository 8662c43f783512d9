// Pipeline latency of every IEEE-754 unit of hdl/fp, in clocks from an input
// accepted to out_valid: the one source that the units, l2l_optim_lane's
// schedule (hdl/l2l_optim_lane_schedule.vh), the kernel and the cocotb benches
// (dut.LATENCY) read. Included inside a module body. Each unit sets its
// `LATENCY` from here and its bench fails if the pipeline it builds differs.
/* verilator lint_off UNUSEDPARAM */
// fp_round_pack's register stages (every unit rounds through it)
localparam integer FP_ROUND_LATENCY = 2;
// fp32_add: order, align, add, count leading zeros, normalize; round; output register
localparam integer FP32_ADD_LATENCY = 5 + FP_ROUND_LATENCY + 1;
// fp32_mul: classify, partial products, product sum, count leading zeros,
// normalize; round; output register
localparam integer FP32_MUL_LATENCY = 5 + FP_ROUND_LATENCY + 1;
// fp32_div: classify, count leading zeros, normalize; restoring steps
// (STEPS_PER_STAGE per stage, 26 quotient bits); select; round; output register
localparam integer FP32_DIV_STEPS_PER_STAGE = 2;
localparam integer FP32_DIV_LATENCY = 3 + (26 + FP32_DIV_STEPS_PER_STAGE - 1) / FP32_DIV_STEPS_PER_STAGE
                                    + 1 + FP_ROUND_LATENCY + 1;
// fp32_sqrt: classify, count leading zeros, normalize; restoring steps
// (STEPS_PER_STAGE per stage, 25 root bits); sticky; round; output register
localparam integer FP32_SQRT_STEPS_PER_STAGE = 1;
localparam integer FP32_SQRT_LATENCY = 3 + (25 + FP32_SQRT_STEPS_PER_STAGE - 1) / FP32_SQRT_STEPS_PER_STAGE
                                     + 1 + FP_ROUND_LATENCY + 1;
// fp_convert (fp32_to_bf16, fp32_to_fp16, bf16_to_fp32, fp16_to_fp32):
// classify and count leading zeros, normalize; round; output register
localparam integer FP_CONVERT_LATENCY = 2 + FP_ROUND_LATENCY + 1;
/* verilator lint_on UNUSEDPARAM */
