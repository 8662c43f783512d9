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
// Fully pipelined: one operation per clock, LATENCY = 4 cycles from an input
// accepted (in_valid with ce high) to out_valid. ce low holds every stage,
// out_valid included.
//   stage 1  classify, special results, order operands by magnitude
//   stage 2  align the smaller operand (guard, round, sticky) and add/subtract
//   stage 3  count leading zeros and normalize
//   stage 4  round and pack (fp_round_pack), output register

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

// Cycles from input to output; the bench checks it. Documentation for users.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = 4;
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

// NaN and infinity results bypass the datapath.
wire inf_minus_inf = a_inf && b_inf && (a_sign != b_sign);
wire special = a_nan || b_nan || a_inf || b_inf;
wire [31:0] special_y = (a_nan || b_nan || inf_minus_inf) ? QNAN :
                        a_inf ? a : b_eff;
wire special_invalid = a_snan || b_snan || inf_minus_inf;

// The operand with the larger magnitude leads: its sign is the result's sign
// and the subtraction never goes negative.
wire swap = (b[30:0] > a[30:0]);

reg        s1_valid;
reg        s1_special;
reg [31:0] s1_special_y;
reg        s1_special_invalid;
reg        s1_sign;
reg        s1_eff_sub;
reg [7:0]  s1_exp;
reg [23:0] s1_big_sig;
reg [23:0] s1_small_sig;
reg [7:0]  s1_exp_diff;

always @(posedge clk) begin
    if (ce) begin
        s1_valid           <= in_valid;
        s1_special         <= special;
        s1_special_y       <= special_y;
        s1_special_invalid <= special_invalid;
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
wire [ALIGN_W-1:0] small_aligned = {small_shift[ALIGN_W-1:1], small_shift[0] | small_lost};
wire [ALIGN_W-1:0] big_ext = {s1_big_sig, 3'b000};

// One bit of headroom for the carry of an effective addition.
wire [ALIGN_W:0] sum = s1_eff_sub ? {1'b0, big_ext} - {1'b0, small_aligned}
                                  : {1'b0, big_ext} + {1'b0, small_aligned};

reg        s2_valid;
reg        s2_special;
reg [31:0] s2_special_y;
reg        s2_special_invalid;
reg        s2_sign;
reg        s2_eff_sub;
reg [7:0]  s2_exp;
reg [ALIGN_W:0] s2_sum;

always @(posedge clk) begin
    if (ce) begin
        s2_valid           <= s1_valid;
        s2_special         <= s1_special;
        s2_special_y       <= s1_special_y;
        s2_special_invalid <= s1_special_invalid;
        s2_sign            <= s1_sign;
        s2_eff_sub         <= s1_eff_sub;
        s2_exp             <= s1_exp;
        s2_sum             <= sum;
    end
    if (rst) begin
        s2_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 3
wire [4:0] sum_lz;

fp_lzc #(.WIDTH(ALIGN_W+1), .COUNT_W(5)) lzc_sum (
    .in(s2_sum), .count(sum_lz)
);

// The big operand's hidden bit sits at sum[ALIGN_W-1]; after the shift the
// leading one is at sum[ALIGN_W], so the exponent is exp + 1 - lz.
wire signed [9:0] norm_exp = $signed({2'b00, s2_exp}) + 10'sd1 - $signed({5'b00000, sum_lz});

reg        s3_valid;
reg        s3_special;
reg [31:0] s3_special_y;
reg        s3_special_invalid;
reg        s3_sign;
reg        s3_zero;
reg        s3_eff_sub;
reg signed [9:0] s3_exp;
reg [ALIGN_W:0] s3_sig;

always @(posedge clk) begin
    if (ce) begin
        s3_valid           <= s2_valid;
        s3_special         <= s2_special;
        s3_special_y       <= s2_special_y;
        s3_special_invalid <= s2_special_invalid;
        s3_sign            <= s2_sign;
        s3_zero            <= (s2_sum == {(ALIGN_W+1){1'b0}});
        s3_eff_sub         <= s2_eff_sub;
        s3_exp             <= norm_exp;
        s3_sig             <= s2_sum << sum_lz;
    end
    if (rst) begin
        s3_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 4
wire [31:0] rounded_y;
wire rounded_overflow, rounded_underflow, rounded_inexact;

fp_round_pack #(.EXP_W(8), .MAN_W(23), .SIG_W(ALIGN_W+1), .E_W(10)) round_sum (
    .sign(s3_sign), .exp(s3_exp), .sig(s3_sig), .sticky(1'b0),
    .y(rounded_y), .overflow(rounded_overflow), .underflow(rounded_underflow),
    .inexact(rounded_inexact)
);

// The output register is a one-deep fp_pipe: valid reset, data held with ce.
wire [32-1:0] result_y;
wire [4:0] result_flags;
// Exact cancellation gives +0 in round-to-nearest; -0 + -0 = -0.
assign result_y     = s3_special ? s3_special_y :
                      s3_zero    ? {s3_sign & ~s3_eff_sub, 31'd0} : rounded_y;
assign result_flags = s3_special ? {s3_special_invalid, 4'b0000} :
                      s3_zero    ? 5'b00000 : {2'b00, rounded_overflow, rounded_underflow, rounded_inexact};

fp_pipe #(.WIDTH(32+5), .DEPTH(1)) out_reg (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(s3_valid), .in_data({result_y, result_flags}),
    .out_valid(out_valid), .out_data({y, flags})
);

endmodule

`resetall
`default_nettype wire
