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
// Schedule (cycle at which a value is ready, input at 0):
//   g32        2   widen bf16/fp16 (exact) or delay fp32
//   gs         6   A  g * inv_scale                      (non-finite check)
//   pw         6   B  p * (adamw ? decay : weight_decay)
//   g1        10   C  gs + pw                 (adam/sgd, weight_decay != 0)
//   d, y_g    14   D  g1 - m;    G  g1 * (sgd ? dampening_complement : one_minus_beta2)
//   dm,gg,y_i 18   E  d * one_minus_beta1;  H  y_g * g1;  I  (sgd ? m : v) * (sgd ? momentum : beta2)
//   m',y_j    22   F  m + dm;    J  y_i + (sgd ? y_g : gg)     (v' or SGD m')
//   sq        32   K  sqrt(v')
//   q         42   L  sq / bias_correction2_sqrt
//   den       46   M  q + eps
//   y_n       26   N  m' * (sgd ? momentum : step_size)
//   g2n       30   Q  g1 + y_n                               (nesterov)
//   u_sgd     34   R  g2 * lr
//   u_adam    56   O  y_n / den
//   p'        60   P  p1 - (sgd ? u_sgd : u_adam)
//   copy      62   fp32_to_bf16 / fp32_to_fp16 of p'

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

// Cycles from element in to element out; l2l_optim delays its side band by it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = 62;
/* verilator lint_on UNUSEDPARAM */

// Unit outputs the lane does not use: valid (the side band carries it) and flags.
/* verilator lint_off UNUSEDSIGNAL */
wire [22:0] unused_valid;
wire [4:0]  unused_flags [0:22];
/* verilator lint_on UNUSEDSIGNAL */

`define L2L_UNIT_PORTS(idx) .clk(clk), .rst(rst), .ce(1'b1), .in_valid(1'b1), .out_valid(unused_valid[idx]), .flags(unused_flags[idx])

// ---------------------------------------------------------------- widen g: 0 -> 2
wire [31:0] g_bf16, g_fp16, g_fp32_d;
bf16_to_fp32 widen_bf16 (`L2L_UNIT_PORTS(0), .a(g[15:0]), .y(g_bf16));
fp16_to_fp32 widen_fp16 (`L2L_UNIT_PORTS(1), .a(g[15:0]), .y(g_fp16));
l2l_optim_delay #(.WIDTH(32), .DEPTH(2)) d_g (.clk(clk), .rst(rst), .x(g), .y(g_fp32_d));
wire [31:0] g32 = (grad_dtype == 2'd1) ? g_bf16 : (grad_dtype == 2'd2) ? g_fp16 : g_fp32_d;

wire [31:0] p_2;
l2l_optim_delay #(.WIDTH(32), .DEPTH(2)) d_p2 (.clk(clk), .rst(rst), .x(p), .y(p_2));

// ---------------------------------------------------------------- 2 -> 6
wire [31:0] gs, pw;
fp32_mul unit_a (`L2L_UNIT_PORTS(2), .a(g32), .b(inv_scale), .y(gs));
fp32_mul unit_b (`L2L_UNIT_PORTS(3), .a(p_2), .b(mode_adamw ? decay : weight_decay), .y(pw));

wire [31:0] p_6;
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_p6 (.clk(clk), .rst(rst), .x(p_2), .y(p_6));
// AdamW: p = p * decay when weight_decay != 0
wire [31:0] p1_6 = (mode_adamw && wd_nonzero) ? pw : p_6;

wire gs_nonfinite_6 = (gs[30:23] == 8'hFF);

// ---------------------------------------------------------------- 6 -> 10
wire [31:0] g_sum, gs_10;
fp32_add unit_c (`L2L_UNIT_PORTS(4), .a(gs), .b(pw), .sub(1'b0), .y(g_sum));
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_gs (.clk(clk), .rst(rst), .x(gs), .y(gs_10));
// Adam and SGD: g = g + p * weight_decay when weight_decay != 0
wire [31:0] g1 = (!mode_adamw && wd_nonzero) ? g_sum : gs_10;

wire [31:0] m_10, m_14, m_18, m_22, v_14;
l2l_optim_delay #(.WIDTH(32), .DEPTH(10)) d_m10 (.clk(clk), .rst(rst), .x(m), .y(m_10));
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_m14 (.clk(clk), .rst(rst), .x(m_10), .y(m_14));
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_m18 (.clk(clk), .rst(rst), .x(m_14), .y(m_18));
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_m22 (.clk(clk), .rst(rst), .x(m_18), .y(m_22));
l2l_optim_delay #(.WIDTH(32), .DEPTH(14)) d_v14 (.clk(clk), .rst(rst), .x(v), .y(v_14));

// ---------------------------------------------------------------- 10 -> 14
wire [31:0] d_diff, y_g, g1_14;
fp32_add unit_d (`L2L_UNIT_PORTS(5), .a(g1), .b(m_10), .sub(1'b1), .y(d_diff));
fp32_mul unit_g (`L2L_UNIT_PORTS(6), .a(g1), .b(mode_sgd ? dampening_complement : one_minus_beta2), .y(y_g));
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_g1_14 (.clk(clk), .rst(rst), .x(g1), .y(g1_14));

// ---------------------------------------------------------------- 14 -> 18
wire [31:0] dm, gg, y_i, y_g_18;
fp32_mul unit_e (`L2L_UNIT_PORTS(7), .a(d_diff), .b(one_minus_beta1), .y(dm));
fp32_mul unit_h (`L2L_UNIT_PORTS(8), .a(y_g), .b(g1_14), .y(gg));
fp32_mul unit_i (`L2L_UNIT_PORTS(9), .a(mode_sgd ? m_14 : v_14), .b(mode_sgd ? momentum : beta2), .y(y_i));
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_yg18 (.clk(clk), .rst(rst), .x(y_g), .y(y_g_18));

// ---------------------------------------------------------------- 18 -> 22
wire [31:0] m_adam, y_j;
fp32_add unit_f (`L2L_UNIT_PORTS(10), .a(m_18), .b(dm), .sub(1'b0), .y(m_adam));
fp32_add unit_j (`L2L_UNIT_PORTS(11), .a(y_i), .b(mode_sgd ? y_g_18 : gg), .sub(1'b0), .y(y_j));

// m and v as written back
wire [31:0] m_new_22 = !mode_sgd ? m_adam : (mom_nonzero ? y_j : m_22);
wire [31:0] v_new_22 = y_j;

// ---------------------------------------------------------------- Adam: 22 -> 56
wire [31:0] sq, q, den, y_n, y_n_46, u_adam;
fp32_sqrt unit_k (`L2L_UNIT_PORTS(12), .a(y_j), .y(sq));
fp32_div  unit_l (`L2L_UNIT_PORTS(13), .a(sq), .b(bias_correction2_sqrt), .y(q));
fp32_add  unit_m (`L2L_UNIT_PORTS(14), .a(q), .b(eps), .sub(1'b0), .y(den));
fp32_mul  unit_n (`L2L_UNIT_PORTS(15), .a(m_new_22), .b(mode_sgd ? momentum : step_size), .y(y_n));
l2l_optim_delay #(.WIDTH(32), .DEPTH(20)) d_yn46 (.clk(clk), .rst(rst), .x(y_n), .y(y_n_46));
fp32_div  unit_o (`L2L_UNIT_PORTS(16), .a(y_n_46), .b(den), .y(u_adam));

// ---------------------------------------------------------------- SGD: 26 -> 34
wire [31:0] g1_26, g1_30, m_new_30, g_nest, u_sgd, u_sgd_56;
l2l_optim_delay #(.WIDTH(32), .DEPTH(12)) d_g1_26 (.clk(clk), .rst(rst), .x(g1_14), .y(g1_26));
l2l_optim_delay #(.WIDTH(32), .DEPTH(4)) d_g1_30 (.clk(clk), .rst(rst), .x(g1_26), .y(g1_30));
l2l_optim_delay #(.WIDTH(32), .DEPTH(8)) d_mn30 (.clk(clk), .rst(rst), .x(m_new_22), .y(m_new_30));
fp32_add unit_q (`L2L_UNIT_PORTS(17), .a(g1_26), .b(y_n), .sub(1'b0), .y(g_nest));
// momentum: g = g + m * momentum (nesterov) or g = m
wire [31:0] g2_30 = !mom_nonzero ? g1_30 : (nesterov ? g_nest : m_new_30);
fp32_mul unit_r (`L2L_UNIT_PORTS(18), .a(g2_30), .b(lr), .y(u_sgd));
l2l_optim_delay #(.WIDTH(32), .DEPTH(22)) d_usgd (.clk(clk), .rst(rst), .x(u_sgd), .y(u_sgd_56));

// ---------------------------------------------------------------- 56 -> 62
wire [31:0] p1_56, p_new;
l2l_optim_delay #(.WIDTH(32), .DEPTH(50)) d_p56 (.clk(clk), .rst(rst), .x(p1_6), .y(p1_56));
fp32_add unit_p (`L2L_UNIT_PORTS(19), .a(p1_56), .b(mode_sgd ? u_sgd_56 : u_adam), .sub(1'b1), .y(p_new));

wire [15:0] c_bf16, c_fp16;
fp32_to_bf16 narrow_bf16 (`L2L_UNIT_PORTS(20), .a(p_new), .y(c_bf16));
fp32_to_fp16 narrow_fp16 (`L2L_UNIT_PORTS(21), .a(p_new), .y(c_fp16));
assign copy_out = copy_fp16 ? c_fp16 : c_bf16;
assign unused_valid[22] = 1'b0;
assign unused_flags[22] = 5'd0;

`undef L2L_UNIT_PORTS

l2l_optim_delay #(.WIDTH(32), .DEPTH(2)) d_pout (.clk(clk), .rst(rst), .x(p_new), .y(p_out));
l2l_optim_delay #(.WIDTH(64), .DEPTH(40)) d_mvout (.clk(clk), .rst(rst), .x({m_new_22, v_new_22}), .y({m_out, v_out}));
l2l_optim_delay #(.WIDTH(1), .DEPTH(56)) d_nf (.clk(clk), .rst(rst), .x(gs_nonfinite_6), .y(nonfinite));

endmodule

`resetall
