// The schedule of l2l_optim_lane: the clock at which each value of the update
// rule is ready, an element entering at 0, computed from the unit latencies of
// hdl/fp/fp_latency.vh (include that first). The lane aligns every operand
// with delay lines of these differences; the kernel delays its side band by
// LANE_LATENCY. Included inside a module body.
/* verilator lint_off UNUSEDPARAM */
localparam integer T_G32  = FP_CONVERT_LATENCY;                 // g widened to fp32
localparam integer T_GS   = T_G32 + FP32_MUL_LATENCY;            // A gs = g*inv_scale, B pw = p*decay
localparam integer T_G1   = T_GS + FP32_ADD_LATENCY;             // C g1 = gs + pw
// D d = g1 - m and G y_g = g1*(1-beta2) run side by side; both wait for the slower
localparam integer T_DG   = T_G1 + ((FP32_ADD_LATENCY > FP32_MUL_LATENCY) ? FP32_ADD_LATENCY : FP32_MUL_LATENCY);
localparam integer T_EHI  = T_DG + FP32_MUL_LATENCY;             // E dm, H gg, I y_i
localparam integer T_MV   = T_EHI + FP32_ADD_LATENCY;            // F m', J v' (or SGD m')
localparam integer T_SQ   = T_MV + FP32_SQRT_LATENCY;            // K sqrt(v')
localparam integer T_Q    = T_SQ + FP32_DIV_LATENCY;             // L sq / bias_correction2_sqrt
localparam integer T_DEN  = T_Q + FP32_ADD_LATENCY;              // M q + eps
localparam integer T_YN   = T_MV + FP32_MUL_LATENCY;             // N m' * (momentum or step_size)
localparam integer T_GN   = T_YN + FP32_ADD_LATENCY;             // Q g1 + y_n (nesterov)
localparam integer T_USGD = T_GN + FP32_MUL_LATENCY;             // R g2 * lr
localparam integer T_UPD  = T_DEN + FP32_DIV_LATENCY;            // O y_n / den
localparam integer T_P    = T_UPD + FP32_ADD_LATENCY;            // P p1 - u
localparam integer LANE_LATENCY = T_P + FP_CONVERT_LATENCY;      // the working copy of p'
/* verilator lint_on UNUSEDPARAM */
