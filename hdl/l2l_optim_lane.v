// SPDX-License-Identifier: Apache-2.0
// One lane of the optimizer datapath: golden.apply_rule for one element.
//
// Every operation of the rule is one instance of an hdl/fp unit; the units
// run every clock (ce = 1, the kernel never stalls the pipeline) and the
// operands are aligned with delay lines. Units are shared between the Adam
// and SGD forms of the rule where their slots line up (the mode is fixed
// for a run), so the lane has 9 multipliers, 7 adders, 1 square root and 2
// dividers. Skipped steps of the rule (weight_decay == 0, momentum == 0, not
// nesterov) take the delayed input instead of the unit's result, so the
// latency is LATENCY for every mode.
//
// The configuration travels beside the element: each operand select reads its
// own copy of the mode bits, delayed to the schedule point of the select (the
// copies are taps of one shift chain). One register feeding every select of
// the lane would fan out to ~250 LUTs across the whole lane; its routing set
// the lane's clock (116.7 MHz on the ECP5-85, the select in front of unit P).
// Every select whose result feeds a unit is registered (LANE_SELECT_LATENCY):
// it reads its inputs and its tap one select latency before its point, so the
// unit's first stage starts at a register (a select driven by a tap straight
// into a multiplier's classification set the clock at 120 MHz). Selects of run
// constants (a unit's second operand) cost no latency; selects of results add
// a clock where they sit (g32, g1, J's operand, m', SGD's g2, u).
// The configuration must be valid from the clock the run's first element
// enters; the kernel sets it before the run starts.
//
// Schedule: hdl/l2l_optim_lane_schedule.vh gives the clock at which each value
// is ready (an element enters at 0), computed from the unit latencies of
// hdl/fp/fp_latency.vh; every operand reaches its unit through a delay line of
// the difference. In order:
//   T_G32   widen bf16/fp16 (exact) or delay fp32, selected
//   T_GS    A  g * inv_scale (non-finite check);  B  p * (adamw ? decay : weight_decay)
//   T_G1    C  gs + pw                            (adam/sgd, weight_decay != 0), selected
//   T_DG    D  g1 - m;    G  g1 * (sgd ? dampening_complement : one_minus_beta2)
//   T_EHI   E  d * one_minus_beta1;  H  y_g * g1;  I  (sgd ? m : v) * (sgd ? momentum : beta2)
//   T_J     (sgd ? y_g : gg) selected
//   T_MV    F  m + dm (one select earlier);    J  y_i + (sgd ? y_g : gg)  (v' or SGD m')
//   T_MN    m' selected
//   T_SQ    K  sqrt(v')
//   T_Q     L  sq / bias_correction2_sqrt
//   T_DEN   M  q + eps
//   T_YN    N  m' * (sgd ? momentum : step_size)
//   T_GN    Q  g1 + y_n                               (nesterov)
//   T_G2    g2 selected
//   T_USGD  R  g2 * lr
//   T_UPD   O  y_n / den
//   T_U     (sgd ? u_sgd : u_adam) selected
//   T_P     P  p1 - u
//   LATENCY    fp32_to_bf16 / fp32_to_fp16 of p'

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_lane
(
    input  wire        clk,
    input  wire        rst,

    // configuration of the run (held constant while it runs)
    input  wire        mode_sgd,
    input  wire        mode_adamw,
    input  wire        nesterov,
    input  wire        wd_nonzero,    // weight_decay != 0
    input  wire        mom_nonzero,   // momentum != 0
    input  wire [1:0]  grad_dtype,    // 0 fp32, 1 bf16, 2 fp16
    input  wire        copy_fp16,     // 1: fp16 copy, 0: bf16 copy

    input  wire [31:0] inv_scale,
    input  wire [31:0] lr,
    input  wire [31:0] weight_decay,
    input  wire [31:0] decay,
    input  wire [31:0] one_minus_beta1,
    input  wire [31:0] beta2,
    input  wire [31:0] one_minus_beta2,
    input  wire [31:0] step_size,
    input  wire [31:0] bias_correction2_sqrt,
    input  wire [31:0] eps,
    input  wire [31:0] momentum,
    input  wire [31:0] dampening_complement,

    // element in (every clock; validity travels beside the lane)
    input  wire [31:0] p,
    input  wire [31:0] m,
    input  wire [31:0] v,
    input  wire [31:0] g,             // fp32, or bf16/fp16 in [15:0]

    // element out, LATENCY clocks later
    output wire [31:0] p_out,
    output wire [31:0] m_out,
    output wire [31:0] v_out,
    output wire [15:0] copy_out,
    output wire        nonfinite
);

`include "fp_latency.vh"
`include "l2l_optim_lane_schedule.vh"

// Cycles from element in to element out; l2l_optim delays its side band by it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = LANE_LATENCY;
/* verilator lint_on UNUSEDPARAM */

// Unit outputs the lane does not use: valid (the side band carries it) and flags.
/* verilator lint_off UNUSEDSIGNAL */
wire [22:0] unused_valid;
wire [4:0]  unused_flags [0:22];
/* verilator lint_on UNUSEDSIGNAL */

`define L2L_UNIT_PORTS(idx) .clk(clk), .rst(rst), .ce(1'b1), .in_valid(1'b1), .out_valid(unused_valid[idx]), .flags(unused_flags[idx])

// Operand names carry the schedule point at which they are valid: x_t<POINT>.
`define L2L_DELAY(name, width, depth, from, to) l2l_optim_delay #(.WIDTH(width), .DEPTH(depth)) name (.clk(clk), .rst(rst), .x(from), .y(to))

// A registered operand select: the value at POINT, chosen from inputs and a
// configuration tap LANE_SELECT_LATENCY clocks earlier.
localparam integer SEL = LANE_SELECT_LATENCY;

// ---------------------------------------------------------------- configuration taps
// cfg_t<POINT>: the run's configuration as the element at POINT sees it;
// cfg_s<POINT>: as it sees it SEL clocks before POINT, for the selects registered at POINT
localparam integer CFG_WIDTH = 9;
localparam integer CFG_SGD = 0, CFG_ADAMW = 1, CFG_ADAMW_DECAY = 2, CFG_L2_DECAY = 3, CFG_MOM = 4,
                   CFG_NESTEROV = 5, CFG_G_BF16 = 6, CFG_G_FP16 = 7, CFG_COPY_FP16 = 8;
wire [CFG_WIDTH-1:0] cfg = {copy_fp16, grad_dtype == 2'd2, grad_dtype == 2'd1, nesterov, mom_nonzero,
                            !mode_adamw && wd_nonzero, mode_adamw && wd_nonzero, mode_adamw, mode_sgd};
wire [CFG_WIDTH-1:0] cfg_sg32, cfg_tgs, cfg_sg1, cfg_sdg, cfg_tehi, cfg_tmv, cfg_tgn, cfg_tupd, cfg_out;
`L2L_DELAY(d_cfg_sg32, CFG_WIDTH, T_G32 - SEL, cfg, cfg_sg32);
`L2L_DELAY(d_cfg_tgs, CFG_WIDTH, T_GS - (T_G32 - SEL), cfg_sg32, cfg_tgs);
`L2L_DELAY(d_cfg_sg1, CFG_WIDTH, (T_G1 - SEL) - T_GS, cfg_tgs, cfg_sg1);
`L2L_DELAY(d_cfg_sdg, CFG_WIDTH, (T_DG - SEL) - (T_G1 - SEL), cfg_sg1, cfg_sdg);
`L2L_DELAY(d_cfg_tehi, CFG_WIDTH, T_EHI - (T_DG - SEL), cfg_sdg, cfg_tehi);   // = T_J - SEL
`L2L_DELAY(d_cfg_tmv, CFG_WIDTH, T_MV - T_EHI, cfg_tehi, cfg_tmv);            // = T_MN - SEL
`L2L_DELAY(d_cfg_tgn, CFG_WIDTH, T_GN - T_MV, cfg_tmv, cfg_tgn);              // = T_G2 - SEL
`L2L_DELAY(d_cfg_tupd, CFG_WIDTH, T_UPD - T_GN, cfg_tgn, cfg_tupd);           // = T_U - SEL
`L2L_DELAY(d_cfg_out, CFG_WIDTH, LATENCY - T_UPD, cfg_tupd, cfg_out);

// ---------------------------------------------------------------- widen g: 0 -> T_G32
wire [31:0] g_bf16, g_fp16, g_fp32_sg32, p_tg32, g32, b_decay_tg32;
bf16_to_fp32 widen_bf16 (`L2L_UNIT_PORTS(0), .a(g[15:0]), .y(g_bf16));
fp16_to_fp32 widen_fp16 (`L2L_UNIT_PORTS(1), .a(g[15:0]), .y(g_fp16));
`L2L_DELAY(d_g, 32, T_G32 - SEL, g, g_fp32_sg32);
`L2L_DELAY(d_p_tg32, 32, T_G32, p, p_tg32);
`L2L_DELAY(s_g32, 32, SEL, (cfg_sg32[CFG_G_BF16] ? g_bf16 : cfg_sg32[CFG_G_FP16] ? g_fp16 : g_fp32_sg32), g32);
`L2L_DELAY(s_b_decay, 32, SEL, (cfg_sg32[CFG_ADAMW] ? decay : weight_decay), b_decay_tg32);

// ---------------------------------------------------------------- T_G32 -> T_GS
wire [31:0] gs, pw, p_tgs;
fp32_mul unit_a (`L2L_UNIT_PORTS(2), .a(g32), .b(inv_scale), .y(gs));
fp32_mul unit_b (`L2L_UNIT_PORTS(3), .a(p_tg32), .b(b_decay_tg32), .y(pw));
`L2L_DELAY(d_p_tgs, 32, T_GS - T_G32, p_tg32, p_tgs);
// AdamW: p = p * decay when weight_decay != 0 (into a delay line, not a unit: not registered)
wire [31:0] p1_tgs = cfg_tgs[CFG_ADAMW_DECAY] ? pw : p_tgs;
wire gs_nonfinite_tgs = (gs[30:23] == 8'hFF);

// ---------------------------------------------------------------- T_GS -> T_G1
wire [31:0] g_sum, gs_sg1, g1, b_g_tg1;
fp32_add unit_c (`L2L_UNIT_PORTS(4), .a(gs), .b(pw), .sub(1'b0), .y(g_sum));
`L2L_DELAY(d_gs_sg1, 32, (T_G1 - SEL) - T_GS, gs, gs_sg1);
// Adam and SGD: g = g + p * weight_decay when weight_decay != 0
`L2L_DELAY(s_g1, 32, SEL, (cfg_sg1[CFG_L2_DECAY] ? g_sum : gs_sg1), g1);
`L2L_DELAY(s_b_g, 32, SEL, (cfg_sg1[CFG_SGD] ? dampening_complement : one_minus_beta2), b_g_tg1);

wire [31:0] m_tg1, m_sdg, m_tehi, m_tmv, v_sdg, a_i_tdg, b_i_tdg;
`L2L_DELAY(d_m_tg1, 32, T_G1, m, m_tg1);
`L2L_DELAY(d_m_sdg, 32, (T_DG - SEL) - T_G1, m_tg1, m_sdg);
`L2L_DELAY(d_m_tehi, 32, T_EHI - (T_DG - SEL), m_sdg, m_tehi);
`L2L_DELAY(d_m_tmv, 32, T_MV - T_EHI, m_tehi, m_tmv);
`L2L_DELAY(d_v_sdg, 32, T_DG - SEL, v, v_sdg);
`L2L_DELAY(s_a_i, 32, SEL, (cfg_sdg[CFG_SGD] ? m_sdg : v_sdg), a_i_tdg);
`L2L_DELAY(s_b_i, 32, SEL, (cfg_sdg[CFG_SGD] ? momentum : beta2), b_i_tdg);

// ---------------------------------------------------------------- T_G1 -> T_DG
wire [31:0] d_diff, y_g, d_diff_tdg, y_g_tdg, g1_tdg;
fp32_add unit_d (`L2L_UNIT_PORTS(5), .a(g1), .b(m_tg1), .sub(1'b1), .y(d_diff));
fp32_mul unit_g (`L2L_UNIT_PORTS(6), .a(g1), .b(b_g_tg1), .y(y_g));
// the faster of the two waits for the slower
`L2L_DELAY(d_d_tdg, 32, T_DG - T_G1 - FP32_ADD_LATENCY, d_diff, d_diff_tdg);
`L2L_DELAY(d_yg_tdg, 32, T_DG - T_G1 - FP32_MUL_LATENCY, y_g, y_g_tdg);
`L2L_DELAY(d_g1_tdg, 32, T_DG - T_G1, g1, g1_tdg);

// ---------------------------------------------------------------- T_DG -> T_EHI
wire [31:0] dm, gg, y_i, y_g_tehi;
fp32_mul unit_e (`L2L_UNIT_PORTS(7), .a(d_diff_tdg), .b(one_minus_beta1), .y(dm));
fp32_mul unit_h (`L2L_UNIT_PORTS(8), .a(y_g_tdg), .b(g1_tdg), .y(gg));
fp32_mul unit_i (`L2L_UNIT_PORTS(9), .a(a_i_tdg), .b(b_i_tdg), .y(y_i));
`L2L_DELAY(d_yg_tehi, 32, T_EHI - T_DG, y_g_tdg, y_g_tehi);

// ---------------------------------------------------------------- T_EHI -> T_MV
wire [31:0] m_adam, m_adam_tmv, y_i_tj, b_j_tj, y_j;
fp32_add unit_f (`L2L_UNIT_PORTS(10), .a(m_tehi), .b(dm), .sub(1'b0), .y(m_adam));
`L2L_DELAY(d_madam_tmv, 32, T_MV - (T_EHI + FP32_ADD_LATENCY), m_adam, m_adam_tmv);
`L2L_DELAY(d_yi_tj, 32, T_J - T_EHI, y_i, y_i_tj);
`L2L_DELAY(s_b_j, 32, SEL, (cfg_tehi[CFG_SGD] ? y_g_tehi : gg), b_j_tj);
fp32_add unit_j (`L2L_UNIT_PORTS(11), .a(y_i_tj), .b(b_j_tj), .sub(1'b0), .y(y_j));

// m and v as written back
wire [31:0] m_new_tmn, b_n_tmn;
`L2L_DELAY(s_m_new, 32, SEL, (!cfg_tmv[CFG_SGD] ? m_adam_tmv : (cfg_tmv[CFG_MOM] ? y_j : m_tmv)), m_new_tmn);
wire [31:0] v_new_tmv = y_j;
`L2L_DELAY(s_b_n, 32, SEL, (cfg_tmv[CFG_SGD] ? momentum : step_size), b_n_tmn);

// ---------------------------------------------------------------- Adam: T_MV -> T_UPD
wire [31:0] sq, q, den, y_n, y_n_tden, u_adam;
fp32_sqrt unit_k (`L2L_UNIT_PORTS(12), .a(y_j), .y(sq));
fp32_div  unit_l (`L2L_UNIT_PORTS(13), .a(sq), .b(bias_correction2_sqrt), .y(q));
fp32_add  unit_m (`L2L_UNIT_PORTS(14), .a(q), .b(eps), .sub(1'b0), .y(den));
fp32_mul  unit_n (`L2L_UNIT_PORTS(15), .a(m_new_tmn), .b(b_n_tmn), .y(y_n));
`L2L_DELAY(d_yn_tden, 32, T_DEN - T_YN, y_n, y_n_tden);
fp32_div  unit_o (`L2L_UNIT_PORTS(16), .a(y_n_tden), .b(den), .y(u_adam));

// ---------------------------------------------------------------- SGD: T_YN -> T_USGD
wire [31:0] g1_tyn, g1_tgn, m_new_tgn, g_nest, g2_tg2, u_sgd, u_sgd_tupd;
`L2L_DELAY(d_g1_tyn, 32, T_YN - T_DG, g1_tdg, g1_tyn);
`L2L_DELAY(d_g1_tgn, 32, T_GN - T_YN, g1_tyn, g1_tgn);
`L2L_DELAY(d_mn_tgn, 32, T_GN - T_MN, m_new_tmn, m_new_tgn);
fp32_add unit_q (`L2L_UNIT_PORTS(17), .a(g1_tyn), .b(y_n), .sub(1'b0), .y(g_nest));
// momentum: g = g + m * momentum (nesterov) or g = m
`L2L_DELAY(s_g2, 32, SEL, (!cfg_tgn[CFG_MOM] ? g1_tgn : (cfg_tgn[CFG_NESTEROV] ? g_nest : m_new_tgn)), g2_tg2);
fp32_mul unit_r (`L2L_UNIT_PORTS(18), .a(g2_tg2), .b(lr), .y(u_sgd));
`L2L_DELAY(d_usgd_tupd, 32, T_UPD - T_USGD, u_sgd, u_sgd_tupd);

// ---------------------------------------------------------------- T_UPD -> T_P -> LATENCY
wire [31:0] p1_tu, u_tu, p_new;
`L2L_DELAY(d_p1_tu, 32, T_U - T_GS, p1_tgs, p1_tu);
`L2L_DELAY(s_u, 32, SEL, (cfg_tupd[CFG_SGD] ? u_sgd_tupd : u_adam), u_tu);
fp32_add unit_p (`L2L_UNIT_PORTS(19), .a(p1_tu), .b(u_tu), .sub(1'b1), .y(p_new));

wire [15:0] c_bf16, c_fp16;
fp32_to_bf16 narrow_bf16 (`L2L_UNIT_PORTS(20), .a(p_new), .y(c_bf16));
fp32_to_fp16 narrow_fp16 (`L2L_UNIT_PORTS(21), .a(p_new), .y(c_fp16));
assign copy_out = cfg_out[CFG_COPY_FP16] ? c_fp16 : c_bf16;
assign unused_valid[22] = 1'b0;
assign unused_flags[22] = 5'd0;

`L2L_DELAY(d_pout, 32, LATENCY - T_P, p_new, p_out);
`L2L_DELAY(d_mout, 32, LATENCY - T_MN, m_new_tmn, m_out);
`L2L_DELAY(d_vout, 32, LATENCY - T_MV, v_new_tmv, v_out);
`L2L_DELAY(d_nf, 1, LATENCY - T_GS, gs_nonfinite_tgs, nonfinite);

`undef L2L_UNIT_PORTS
`undef L2L_DELAY

endmodule

`resetall
