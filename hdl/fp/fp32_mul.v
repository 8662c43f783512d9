// SPDX-License-Identifier: Apache-2.0
// IEEE-754 binary32 multiplier: y = a * b.
//
// Round to nearest even; subnormal inputs and outputs exact (no flush to
// zero); every NaN result is the canonical quiet NaN 0x7FC00000; a signalling
// NaN operand raises invalid, as does Inf * 0.
//
// flags = {invalid, divide_by_zero, overflow, underflow, inexact} = [4:0]: the
// bit layout of Berkeley SoftFloat's softfloat_exceptionFlags (inexact = 1,
// underflow = 2, overflow = 4, infinite = 8, invalid = 16). Tininess is
// detected after rounding.
//
// Fully pipelined: one operation per clock, LATENCY = 4 cycles from an input
// accepted (in_valid with ce high) to out_valid. ce low holds every stage,
// out_valid included.
//   stage 1  classify, special results, exponent sum
//   stage 2  24 x 24 significand product (one DSP cascade, registered)
//   stage 3  count leading zeros of the 48-bit product and normalize; the
//            significands are not normalized before the product, so a
//            subnormal operand shows up here as leading zeros
//   stage 4  round and pack (fp_round_pack), output register

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp32_mul
(
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,

    input  wire        in_valid,
    input  wire [31:0] a,
    input  wire [31:0] b,

    output wire        out_valid,
    output wire [31:0] y,
    output wire [4:0]  flags
);

// Cycles from input to output; the bench checks it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = 4;
/* verilator lint_on UNUSEDPARAM */
localparam [31:0] QNAN = 32'h7FC00000;
localparam BIAS = 127;

// ---------------------------------------------------------------- stage 1
wire        a_sign, b_sign;
wire [7:0]  a_exp, b_exp;
wire [23:0] a_sig, b_sig;
wire a_zero, a_inf, a_nan, a_snan;
wire b_zero, b_inf, b_nan, b_snan;

fp_classify #(.EXP_W(8), .MAN_W(23)) classify_a (
    .x(a), .sign(a_sign), .exp_eff(a_exp), .sig(a_sig),
    .is_zero(a_zero), .is_inf(a_inf), .is_nan(a_nan), .is_snan(a_snan)
);

fp_classify #(.EXP_W(8), .MAN_W(23)) classify_b (
    .x(b), .sign(b_sign), .exp_eff(b_exp), .sig(b_sig),
    .is_zero(b_zero), .is_inf(b_inf), .is_nan(b_nan), .is_snan(b_snan)
);

wire sign = a_sign ^ b_sign;
wire inf_times_zero = (a_inf && b_zero) || (a_zero && b_inf);
wire special = a_nan || b_nan || a_inf || b_inf || a_zero || b_zero;
wire [31:0] special_y = (a_nan || b_nan || inf_times_zero) ? QNAN :
                        (a_inf || b_inf) ? {sign, 8'hFF, 23'd0} : {sign, 31'd0};
wire special_invalid = a_snan || b_snan || inf_times_zero;

reg        s1_valid;
reg        s1_special;
reg [31:0] s1_special_y;
reg        s1_special_invalid;
reg        s1_sign;
reg [8:0]  s1_exp_sum;
reg [23:0] s1_a_sig;
reg [23:0] s1_b_sig;

always @(posedge clk) begin
    if (ce) begin
        s1_valid           <= in_valid;
        s1_special         <= special;
        s1_special_y       <= special_y;
        s1_special_invalid <= special_invalid;
        s1_sign            <= sign;
        s1_exp_sum         <= {1'b0, a_exp} + {1'b0, b_exp};
        s1_a_sig           <= a_sig;
        s1_b_sig           <= b_sig;
    end
    if (rst) begin
        s1_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 2
reg        s2_valid;
reg        s2_special;
reg [31:0] s2_special_y;
reg        s2_special_invalid;
reg        s2_sign;
reg [8:0]  s2_exp_sum;
reg [47:0] s2_prod;

always @(posedge clk) begin
    if (ce) begin
        s2_valid           <= s1_valid;
        s2_special         <= s1_special;
        s2_special_y       <= s1_special_y;
        s2_special_invalid <= s1_special_invalid;
        s2_sign            <= s1_sign;
        s2_exp_sum         <= s1_exp_sum;
        s2_prod            <= s1_a_sig * s1_b_sig;
    end
    if (rst) begin
        s2_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 3
wire [5:0] prod_lz;

fp_lzc #(.WIDTH(48), .COUNT_W(6)) lzc_prod (
    .in(s2_prod), .count(prod_lz)
);

// value = prod * 2^(ea + eb - 2*BIAS - 46); with the leading one moved to
// bit 47 the biased exponent is ea + eb - BIAS + 1 - lz.
wire signed [9:0] norm_exp = $signed({1'b0, s2_exp_sum}) - BIAS + 1 - $signed({4'b0000, prod_lz});

reg        s3_valid;
reg        s3_special;
reg [31:0] s3_special_y;
reg        s3_special_invalid;
reg        s3_sign;
reg signed [9:0] s3_exp;
reg [47:0] s3_sig;

always @(posedge clk) begin
    if (ce) begin
        s3_valid           <= s2_valid;
        s3_special         <= s2_special;
        s3_special_y       <= s2_special_y;
        s3_special_invalid <= s2_special_invalid;
        s3_sign            <= s2_sign;
        s3_exp             <= norm_exp;
        s3_sig             <= s2_prod << prod_lz;
    end
    if (rst) begin
        s3_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 4
wire [31:0] rounded_y;
wire rounded_overflow, rounded_underflow, rounded_inexact;

fp_round_pack #(.EXP_W(8), .MAN_W(23), .SIG_W(48), .E_W(10)) round_prod (
    .sign(s3_sign), .exp(s3_exp), .sig(s3_sig), .sticky(1'b0),
    .y(rounded_y), .overflow(rounded_overflow), .underflow(rounded_underflow),
    .inexact(rounded_inexact)
);

// The output register is a one-deep fp_pipe: valid reset, data held with ce.
wire [32-1:0] result_y;
wire [4:0] result_flags;
assign result_y     = s3_special ? s3_special_y : rounded_y;
assign result_flags = s3_special ? {s3_special_invalid, 4'b0000} : {2'b00, rounded_overflow, rounded_underflow, rounded_inexact};

fp_pipe #(.WIDTH(32+5), .DEPTH(1)) out_reg (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(s3_valid), .in_data({result_y, result_flags}),
    .out_valid(out_valid), .out_data({y, flags})
);

endmodule

`resetall
`default_nettype wire
