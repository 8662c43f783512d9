// SPDX-License-Identifier: Apache-2.0
// IEEE-754 binary32 adder/subtractor: y = a + b (sub = 0) or a - b (sub = 1).
//
// Round to nearest even; subnormal inputs and outputs exact (no flush to
// zero); every NaN result is the canonical quiet NaN 0x7FC00000; a signalling
// NaN operand raises invalid, as does Inf - Inf. An exact zero sum is +0
// unless both operands are -0 (the round-to-nearest rule).
//
// flags = {invalid, divide_by_zero, overflow, underflow, inexact} = [4:0]: the
// bit layout of Berkeley SoftFloat's softfloat_exceptionFlags (inexact = 1,
// underflow = 2, overflow = 4, infinite = 8, invalid = 16). Tininess is
// detected after rounding.
//
// Fully pipelined: one operation per clock, LATENCY = FP32_ADD_LATENCY cycles
// (hdl/fp/fp_latency.vh) from an input accepted (in_valid with ce high) to
// out_valid. ce low holds every stage, out_valid included. One carry chain or
// one shifter per stage (timing on the ECP5: docs/BENCHMARKS.md):
//   stage 1  classify, order operands by magnitude
//   stage 2  special results from the classes; align the smaller operand
//            (guard, round, sticky)
//   stage 3  add/subtract
//   stage 4  count leading zeros
//   stage 5  normalize
//   stages   round and pack (fp_round_pack, FP_ROUND_LATENCY stages)
//   last     special results, output register

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp32_add
(
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,

    input  wire        in_valid,
    input  wire [31:0] a,
    input  wire [31:0] b,
    input  wire        sub,

    output wire        out_valid,
    output wire [31:0] y,
    output wire [4:0]  flags
);

`include "fp_latency.vh"
// Cycles from input to output (hdl/fp/fp_latency.vh); the bench reads and checks it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = FP32_ADD_LATENCY;
/* verilator lint_on UNUSEDPARAM */
localparam [31:0] QNAN = 32'h7FC00000;

// ---------------------------------------------------------------- stage 1
wire [31:0] b_eff = {b[31] ^ sub, b[30:0]};

wire       a_sign, b_sign;
wire [7:0] a_exp, b_exp;
wire [23:0] a_sig, b_sig;
wire a_inf, a_nan, a_snan;
wire b_inf, b_nan, b_snan;
// Zeros need no special case in an adder: they flow through the datapath.
/* verilator lint_off UNUSEDSIGNAL */
wire a_zero, b_zero;
/* verilator lint_on UNUSEDSIGNAL */

fp_classify #(.EXP_W(8), .MAN_W(23)) classify_a (
    .x(a), .sign(a_sign), .exp_eff(a_exp), .sig(a_sig),
    .is_zero(a_zero), .is_inf(a_inf), .is_nan(a_nan), .is_snan(a_snan)
);

fp_classify #(.EXP_W(8), .MAN_W(23)) classify_b (
    .x(b_eff), .sign(b_sign), .exp_eff(b_exp), .sig(b_sig),
    .is_zero(b_zero), .is_inf(b_inf), .is_nan(b_nan), .is_snan(b_snan)
);

// NaN and infinity results bypass the datapath. Stage 1 registers the operands' classes and
// stage 2 decides the special result (timing: classify and the decision did not fit one
// clock after the operand's route in the lane). An infinite result has the sign of the
// operand with the larger magnitude, s1_sign: the infinite one.
// The operand with the larger magnitude leads: its sign is the result's sign
// and the subtraction never goes negative.
wire swap = (b[30:0] > a[30:0]);

reg        s1_valid;
reg        s1_nan, s1_inf;  // either operand NaN, infinite
reg        s1_inf_both;     // both infinite
reg        s1_snan;
reg        s1_sign;
reg        s1_eff_sub;
reg [7:0]  s1_exp;
reg [23:0] s1_big_sig;
reg [23:0] s1_small_sig;
reg [7:0]  s1_exp_diff;

always @(posedge clk) begin
    if (ce) begin
        s1_valid           <= in_valid;
        s1_nan             <= a_nan || b_nan;
        s1_inf             <= a_inf || b_inf;
        s1_inf_both        <= a_inf && b_inf;
        s1_snan            <= a_snan || b_snan;
        s1_sign            <= swap ? b_sign : a_sign;
        s1_eff_sub         <= a_sign ^ b_sign;
        s1_exp             <= swap ? b_exp : a_exp;
        s1_big_sig         <= swap ? b_sig : a_sig;
        s1_small_sig       <= swap ? a_sig : b_sig;
        s1_exp_diff        <= swap ? b_exp - a_exp : a_exp - b_exp;
    end
    if (rst) begin
        s1_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 2
// Significands get three extra bits (guard, round, sticky). Shifting the
// smaller one right by the exponent difference ORs everything shifted out into
// the sticky bit; with at most one bit of cancellation when the difference is
// >= 2, these three bits decide the rounding exactly.
localparam ALIGN_W = 27;

wire [4:0] align_shift = (s1_exp_diff > ALIGN_W) ? ALIGN_W[4:0] : s1_exp_diff[4:0];
wire [ALIGN_W-1:0] small_ext   = {s1_small_sig, 3'b000};
wire [ALIGN_W-1:0] small_shift = small_ext >> align_shift;
wire small_lost = |(small_ext & ~({ALIGN_W{1'b1}} << align_shift));

// Side band of the datapath: special, special_y, special_invalid, sign, eff_sub.
localparam SIDE_W = 1 + 32 + 1 + 1 + 1;
wire inf_minus_inf = s1_inf_both && s1_eff_sub;
wire special = s1_nan || s1_inf;
wire [31:0] special_y = (s1_nan || inf_minus_inf) ? QNAN : {s1_sign, 8'hFF, 23'd0};
wire special_invalid = s1_snan || inf_minus_inf;

reg              s2_valid;
reg [SIDE_W-1:0] s2_side;
reg [7:0]        s2_exp;
reg [23:0]       s2_big_sig;
reg [ALIGN_W-1:0] s2_small;

always @(posedge clk) begin
    if (ce) begin
        s2_valid   <= s1_valid;
        s2_side    <= {special, special_y, special_invalid, s1_sign, s1_eff_sub};
        s2_exp     <= s1_exp;
        s2_big_sig <= s1_big_sig;
        s2_small   <= {small_shift[ALIGN_W-1:1], small_shift[0] | small_lost};
    end
    if (rst) begin
        s2_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 3
wire s2_eff_sub = s2_side[0];
wire [ALIGN_W-1:0] big_ext = {s2_big_sig, 3'b000};
// One bit of headroom for the carry of an effective addition.
wire [ALIGN_W:0] sum = s2_eff_sub ? {1'b0, big_ext} - {1'b0, s2_small}
                                  : {1'b0, big_ext} + {1'b0, s2_small};

reg              s3_valid;
reg [SIDE_W-1:0] s3_side;
reg [7:0]        s3_exp;
reg [ALIGN_W:0]  s3_sum;

always @(posedge clk) begin
    if (ce) begin
        s3_valid <= s2_valid;
        s3_side  <= s2_side;
        s3_exp   <= s2_exp;
        s3_sum   <= sum;
    end
    if (rst) begin
        s3_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 4
wire [4:0] sum_lz;

fp_lzc #(.WIDTH(ALIGN_W+1), .COUNT_W(5)) lzc_sum (
    .in(s3_sum), .count(sum_lz)
);

reg              s4_valid;
reg [SIDE_W-1:0] s4_side;
reg [7:0]        s4_exp;
reg [ALIGN_W:0]  s4_sum;
reg [4:0]        s4_lz;
reg              s4_zero;

always @(posedge clk) begin
    if (ce) begin
        s4_valid <= s3_valid;
        s4_side  <= s3_side;
        s4_exp   <= s3_exp;
        s4_sum   <= s3_sum;
        s4_lz    <= sum_lz;
        s4_zero  <= (s3_sum == {(ALIGN_W+1){1'b0}});
    end
    if (rst) begin
        s4_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 5
// The big operand's hidden bit sits at sum[ALIGN_W-1]; after the shift the
// leading one is at sum[ALIGN_W], so the exponent is exp + 1 - lz.
wire signed [9:0] norm_exp = $signed({2'b00, s4_exp}) + 10'sd1 - $signed({5'b00000, s4_lz});

reg                s5_valid;
reg [SIDE_W:0]     s5_side;   // {zero, side}
reg signed [9:0]   s5_exp;
reg [ALIGN_W:0]    s5_sig;

always @(posedge clk) begin
    if (ce) begin
        s5_valid <= s4_valid;
        s5_side  <= {s4_zero, s4_side};
        s5_exp   <= norm_exp;
        s5_sig   <= s4_sum << s4_lz;
    end
    if (rst) begin
        s5_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- round
wire              rounded_valid;
wire [SIDE_W:0]   rounded_side;
wire [31:0]       rounded_y;
wire rounded_overflow, rounded_underflow, rounded_inexact;

fp_round_pack #(.EXP_W(8), .MAN_W(23), .SIG_W(ALIGN_W+1), .E_W(10), .SIDE_W(SIDE_W+1)) round_sum (
    .clk(clk), .rst(rst), .ce(ce), .in_valid(s5_valid), .in_side(s5_side),
    .sign(s5_side[1]), .exp(s5_exp), .sig(s5_sig), .sticky(1'b0),
    .out_valid(rounded_valid), .out_side(rounded_side),
    .y(rounded_y), .overflow(rounded_overflow), .underflow(rounded_underflow),
    .inexact(rounded_inexact)
);

// ---------------------------------------------------------------- last stage
wire        r_zero            = rounded_side[SIDE_W];
wire        r_special         = rounded_side[SIDE_W-1];
wire [31:0] r_special_y       = rounded_side[SIDE_W-2 -: 32];
wire        r_special_invalid = rounded_side[2];
wire        r_sign            = rounded_side[1];
wire        r_eff_sub         = rounded_side[0];

// The output register is a one-deep fp_pipe: valid reset, data held with ce.
wire [32-1:0] result_y;
wire [4:0] result_flags;
// Exact cancellation gives +0 in round-to-nearest; -0 + -0 = -0.
assign result_y     = r_special ? r_special_y :
                      r_zero    ? {r_sign & ~r_eff_sub, 31'd0} : rounded_y;
assign result_flags = r_special ? {r_special_invalid, 4'b0000} :
                      r_zero    ? 5'b00000 : {2'b00, rounded_overflow, rounded_underflow, rounded_inexact};

fp_pipe #(.WIDTH(32+5), .DEPTH(1)) out_reg (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(rounded_valid), .in_data({result_y, result_flags}),
    .out_valid(out_valid), .out_data({y, flags})
);

endmodule

`resetall
`default_nettype wire
