// The schedule of l2l_optim_lane: the clock at which each value of the update
// rule is ready, an element entering at 0, computed from the unit latencies of
// hdl/fp/fp_latency.vh (include that first). The lane aligns every operand
// with delay lines of these differences; the kernel delays its side band by
// LANE_LATENCY. Included inside a module body.
/* verilator lint_off UNUSEDPARAM */
// Every operand select of the lane whose result feeds a unit is registered: it reads its
// inputs and the configuration LANE_SELECT_LATENCY clocks before the point it is named
// for (timing: a select driven by a configuration tap straight into a unit's first stage
// set the lane's clock on the ECP5, docs/BENCHMARKS.md).
localparam integer LANE_SELECT_LATENCY = 1;
localparam integer T_G32  = FP_CONVERT_LATENCY + LANE_SELECT_LATENCY;   // g widened to fp32, selected
localparam integer T_GS   = T_G32 + FP32_MUL_LATENCY;            // A gs = g*inv_scale, B pw = p*decay
localparam integer T_G1   = T_GS + FP32_ADD_LATENCY + LANE_SELECT_LATENCY;  // C gs + pw or gs, selected
// D d = g1 - m and G y_g = g1*(1-beta2) run side by side; both wait for the slower
localparam integer T_DG   = T_G1 + ((FP32_ADD_LATENCY > FP32_MUL_LATENCY) ? FP32_ADD_LATENCY : FP32_MUL_LATENCY);
localparam integer T_EHI  = T_DG + FP32_MUL_LATENCY;             // E dm, H gg, I y_i
localparam integer T_J    = T_EHI + LANE_SELECT_LATENCY;         // J's operand (gg or SGD y_g) selected
localparam integer T_MV   = T_J + FP32_ADD_LATENCY;              // J v' (or SGD m'); F m' one select earlier
localparam integer T_MN   = T_MV + LANE_SELECT_LATENCY;          // m' selected (Adam F, SGD J or m)
localparam integer T_SQ   = T_MV + FP32_SQRT_LATENCY;            // K sqrt(v')
localparam integer T_Q    = T_SQ + FP32_DIV_LATENCY;             // L sq / bias_correction2_sqrt
localparam integer T_DEN  = T_Q + FP32_ADD_LATENCY;              // M q + eps
localparam integer T_YN   = T_MN + FP32_MUL_LATENCY;             // N m' * (momentum or step_size)
localparam integer T_GN   = T_YN + FP32_ADD_LATENCY;             // Q g1 + y_n (nesterov)
localparam integer T_G2   = T_GN + LANE_SELECT_LATENCY;          // SGD g2 selected
localparam integer T_USGD = T_G2 + FP32_MUL_LATENCY;             // R g2 * lr
localparam integer T_UPD  = T_DEN + FP32_DIV_LATENCY;            // O y_n / den
localparam integer T_U    = T_UPD + LANE_SELECT_LATENCY;         // u selected (Adam O or SGD R)
localparam integer T_P    = T_U + FP32_ADD_LATENCY;              // P p1 - u
localparam integer LANE_LATENCY = T_P + FP_CONVERT_LATENCY;      // the working copy of p'
/* verilator lint_on UNUSEDPARAM */
