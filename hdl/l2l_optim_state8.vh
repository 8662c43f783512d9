// The block-wise 8-bit optimizer state of golden.py ("state formats"; docs/NUMERICS.md):
// m and v as 8-bit codes, one fp32 power-of-two scale per QUANT_BLOCK elements per slot
// (QUANT_BLOCK comes from the register-map source, l2l_optim_regs.vh), and the latencies
// of the kernel's decode (l2l_optim_dequant) and encode (l2l_optim_quant) stages. Include
// fp_latency.vh first. Included inside a module body.
/* verilator lint_off UNUSEDPARAM */
localparam integer CODE_MAN_BITS = 3;            // golden.M_CODE / V_CODE man_bits
localparam integer M_CODE_EXP_BITS = 4;          // golden.M_CODE: sign, 4 exponent bits
localparam integer V_CODE_EXP_BITS = 5;          // golden.V_CODE: 5 exponent bits, no sign
localparam integer SCALE_EXP_LIMIT = 126;        // golden.SCALE_EXP_LIMIT
// l2l_optim_dequant: decode the code (register), times the block scale
localparam integer DEQUANT_LATENCY = 1 + FP32_MUL_LATENCY;
// l2l_optim_quant, from a block's scale known to its first code out: buffer read and its
// fabric register, x * 2^-k, encode (both paths; select, saturate, sign)
localparam integer QUANT_ENCODE_LATENCY = 2;
localparam integer QUANT_DRAIN_LATENCY = 2 + FP32_MUL_LATENCY + QUANT_ENCODE_LATENCY;
/* verilator lint_on UNUSEDPARAM */
