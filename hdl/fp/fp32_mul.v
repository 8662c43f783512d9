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
// Fully pipelined: one operation per clock, LATENCY = FP32_MUL_LATENCY cycles
// (hdl/fp/fp_latency.vh) from an input accepted (in_valid with ce high) to
// out_valid. ce low holds every stage, out_valid included.
//   stage 1  classify, exponent sum
//   stage 2  special results from the classes; four partial products of the 24 x 24 significand product, split
//            at bit 18 (the 18 x 18 multipliers of an FPGA DSP block)
//   stage 3  sum of the partial products
//   stage 4  count leading zeros of the 48-bit product; the significands are
//            not normalized before the product, so a subnormal operand shows
//            up here as leading zeros
//   stage 5  normalize
//   stages   round and pack (fp_round_pack, FP_ROUND_LATENCY stages)
//   last     special results, output register

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

`include "fp_latency.vh"
// Cycles from input to output (hdl/fp/fp_latency.vh); the bench reads and checks it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = FP32_MUL_LATENCY;
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

// the operands' classes, registered: the special results follow from them in stage 2
// (timing: classify and the special-case decision did not fit one clock after the operand's
// route in the lane)
reg        s1_valid;
reg        s1_nan, s1_inf, s1_zero;  // either operand NaN, infinite, zero
reg        s1_inf_times_zero;
reg        s1_snan;
reg        s1_sign;
reg [8:0]  s1_exp_sum;
reg [23:0] s1_a_sig;
reg [23:0] s1_b_sig;

always @(posedge clk) begin
    if (ce) begin
        s1_valid           <= in_valid;
        s1_nan             <= a_nan || b_nan;
        s1_inf             <= a_inf || b_inf;
        s1_zero            <= a_zero || b_zero;
        s1_inf_times_zero  <= (a_inf && b_zero) || (a_zero && b_inf);
        s1_snan            <= a_snan || b_snan;
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
// a * b = (ah * 2^18 + al) * (bh * 2^18 + bl), al and bl 18 bits, ah and bh 6.
// Side band of the datapath: special, special_y, special_invalid, sign.
localparam SIDE_W = 1 + 32 + 1 + 1;
wire special = s1_nan || s1_inf || s1_zero;
wire [31:0] special_y = (s1_nan || s1_inf_times_zero) ? QNAN :
                        s1_inf ? {s1_sign, 8'hFF, 23'd0} : {s1_sign, 31'd0};
wire special_invalid = s1_snan || s1_inf_times_zero;

reg              s2_valid;
reg [SIDE_W-1:0] s2_side;
reg [8:0]        s2_exp_sum;
reg [35:0]       s2_pp_ll;
reg [23:0]       s2_pp_lh, s2_pp_hl;
reg [11:0]       s2_pp_hh;

always @(posedge clk) begin
    if (ce) begin
        s2_valid   <= s1_valid;
        s2_side    <= {special, special_y, special_invalid, s1_sign};
        s2_exp_sum <= s1_exp_sum;
        s2_pp_ll   <= s1_a_sig[17:0] * s1_b_sig[17:0];
        s2_pp_lh   <= s1_a_sig[17:0] * s1_b_sig[23:18];
        s2_pp_hl   <= s1_a_sig[23:18] * s1_b_sig[17:0];
        s2_pp_hh   <= s1_a_sig[23:18] * s1_b_sig[23:18];
    end
    if (rst) begin
        s2_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 3
// The outer products do not overlap: {hh, ll}; the cross terms sit at bit 18.
wire [24:0] pp_mid = {1'b0, s2_pp_lh} + {1'b0, s2_pp_hl};

reg              s3_valid;
reg [SIDE_W-1:0] s3_side;
reg [8:0]        s3_exp_sum;
reg [47:0]       s3_prod;

always @(posedge clk) begin
    if (ce) begin
        s3_valid   <= s2_valid;
        s3_side    <= s2_side;
        s3_exp_sum <= s2_exp_sum;
        s3_prod    <= {s2_pp_hh, s2_pp_ll} + {5'd0, pp_mid, 18'd0};
    end
    if (rst) begin
        s3_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 4
wire [5:0] prod_lz;

fp_lzc #(.WIDTH(48), .COUNT_W(6)) lzc_prod (
    .in(s3_prod), .count(prod_lz)
);

reg              s4_valid;
reg [SIDE_W-1:0] s4_side;
reg [8:0]        s4_exp_sum;
reg [47:0]       s4_prod;
reg [5:0]        s4_lz;

always @(posedge clk) begin
    if (ce) begin
        s4_valid   <= s3_valid;
        s4_side    <= s3_side;
        s4_exp_sum <= s3_exp_sum;
        s4_prod    <= s3_prod;
        s4_lz      <= prod_lz;
    end
    if (rst) begin
        s4_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- stage 5
// value = prod * 2^(ea + eb - 2*BIAS - 46); with the leading one moved to
// bit 47 the biased exponent is ea + eb - BIAS + 1 - lz.
wire signed [9:0] norm_exp = $signed({1'b0, s4_exp_sum}) - BIAS + 1 - $signed({4'b0000, s4_lz});

reg              s5_valid;
reg [SIDE_W-1:0] s5_side;
reg signed [9:0] s5_exp;
reg [47:0]       s5_sig;

always @(posedge clk) begin
    if (ce) begin
        s5_valid <= s4_valid;
        s5_side  <= s4_side;
        s5_exp   <= norm_exp;
        s5_sig   <= s4_prod << s4_lz;
    end
    if (rst) begin
        s5_valid <= 1'b0;
    end
end

// ---------------------------------------------------------------- round
wire              rounded_valid;
wire [SIDE_W-1:0] rounded_side;
wire [31:0]       rounded_y;
wire rounded_overflow, rounded_underflow, rounded_inexact;

fp_round_pack #(.EXP_W(8), .MAN_W(23), .SIG_W(48), .E_W(10), .SIDE_W(SIDE_W)) round_prod (
    .clk(clk), .rst(rst), .ce(ce), .in_valid(s5_valid), .in_side(s5_side),
    .sign(s5_side[0]), .exp(s5_exp), .sig(s5_sig), .sticky(1'b0),
    .out_valid(rounded_valid), .out_side(rounded_side),
    .y(rounded_y), .overflow(rounded_overflow), .underflow(rounded_underflow),
    .inexact(rounded_inexact)
);

// ---------------------------------------------------------------- last stage
wire        r_special         = rounded_side[SIDE_W-1];
wire [31:0] r_special_y       = rounded_side[SIDE_W-2 -: 32];
wire        r_special_invalid = rounded_side[1];

// The output register is a one-deep fp_pipe: valid reset, data held with ce.
wire [32-1:0] result_y;
wire [4:0] result_flags;
assign result_y     = r_special ? r_special_y : rounded_y;
assign result_flags = r_special ? {r_special_invalid, 4'b0000} : {2'b00, rounded_overflow, rounded_underflow, rounded_inexact};

fp_pipe #(.WIDTH(32+5), .DEPTH(1)) out_reg (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(rounded_valid), .in_data({result_y, result_flags}),
    .out_valid(out_valid), .out_data({y, flags})
);

endmodule

`resetall
`default_nettype wire
