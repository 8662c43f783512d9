// SPDX-License-Identifier: Apache-2.0
// Round a normalized significand to an IEEE-754 format (round to nearest,
// ties to even) and pack it, with the overflow, underflow and inexact flags.
// Shared by every unit whose result may need rounding.
//
// Pipelined: FP_ROUND_LATENCY = 2 registers (hdl/fp/fp_latency.vh) between
// the inputs and the (combinational) outputs; a side band of SIDE_W bits and
// the valid bit travel alongside, ce low holds every stage.
//   stage 1  subnormal shift distance, exponent field, overflow (the rounding
//            carry included) and tininess tests
//   stage 2  shift, guard / round / sticky, round-up decision
//   outputs  the packing add (a rounding carry bumps the exponent) and the
//            Inf select, driven by the registered overflow: no test on the
//            add's result, so the select's fanout starts at a register
//
// Input: value = sig * 2^(exp - BIAS - (SIG_W-1)), sig[SIG_W-1] == 1, plus a
// sticky bit for anything below sig. exp is the biased exponent of the leading
// one, signed, and may be <= 0 (result below the normal range) or >= all-ones
// (overflow). SIG_W must be >= MAN_W + 3 (hidden bit, mantissa, guard, one
// more bit; callers pad with zeros).
//
// Subnormal results: the significand is shifted right by 1 - exp first, every
// bit shifted out goes to sticky, and the rounding carry may promote the
// result to the smallest normal number (the exponent field is formed by
// addition, as in SoftFloat's packToF32 with the hidden bit included).
//
// Tininess is detected AFTER rounding (IEEE 754-2008 option, SoftFloat's
// softfloat_tininess_afterRounding): the result is tiny when it would be below
// 2^emin even if rounded to full precision with an unbounded exponent. That
// differs from "exp <= 0" only for exp == 0 with a significand that rounds up
// to 2.0 at full precision. Underflow = tiny and inexact (IEEE default
// exception handling; an exact subnormal result raises nothing).
//
// Overflow returns infinity (the round-to-nearest overflow result) and raises
// overflow and inexact.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp_round_pack #
(
    parameter EXP_W = 8,
    parameter MAN_W = 23,
    parameter SIG_W = 28,
    parameter E_W   = 10,
    parameter SIDE_W = 1
)
(
    input  wire                 clk,
    input  wire                 rst,
    input  wire                 ce,

    input  wire                 in_valid,
    input  wire [SIDE_W-1:0]    in_side,
    input  wire                 sign,
    input  wire signed [E_W-1:0] exp,
    input  wire [SIG_W-1:0]     sig,
    input  wire                 sticky,

    output wire                 out_valid,
    output wire [SIDE_W-1:0]    out_side,
    output wire [EXP_W+MAN_W:0] y,
    output wire                 overflow,
    output wire                 underflow,
    output wire                 inexact
);

`include "fp_latency.vh"
localparam SH_W = $clog2(SIG_W+2);
localparam [EXP_W-1:0] EXP_ONES = {EXP_W{1'b1}};
// Largest shift worth doing: SIG_W+1 moves every bit of sig into sticky.
localparam integer SH_MAX_INT = SIG_W + 1;
localparam [SH_W-1:0] SH_MAX = SH_MAX_INT[SH_W-1:0];
localparam integer SIG_W_INT = SIG_W;
localparam integer EXP_MAX_INT = (1 << EXP_W) - 1;
localparam integer EXP_TOP_INT = EXP_MAX_INT - 1;
// Wires rather than localparams: their widths follow this instance's E_W (the
// multi-top lint of the whole tree sizes localparams from the defaults).
wire signed [E_W:0]   sig_w_s = SIG_W_INT[E_W:0];
wire signed [E_W-1:0] exp_max = EXP_MAX_INT[E_W-1:0];
wire signed [E_W-1:0] exp_top = EXP_TOP_INT[E_W-1:0];

// ---------------------------------------------------------------- stage 1
wire denorm = (exp < 1);

// Shift distance for a subnormal result: 1 - exp, saturated.
wire signed [E_W:0] shift_full = 1 - {exp[E_W-1], exp};
wire [SH_W-1:0] shift = !denorm ? {SH_W{1'b0}} :
                        (shift_full > sig_w_s) ? SH_MAX : shift_full[SH_W-1:0];

// Exponent field minus the hidden bit: adding `kept` (hidden bit included)
// restores it, and a rounding carry out of the mantissa bumps the exponent.
wire [EXP_W-1:0] exp_base = denorm ? {EXP_W{1'b0}} : exp[EXP_W-1:0] - 1'b1;
wire exp_too_big = !denorm && (exp >= exp_max);

// Rounding at full precision (no subnormal shift) carries into the exponent
// when every kept bit is one and guard is set: round-up is then guard alone,
// since kept[0] = 1 breaks a tie upwards.
wire carries_at_full_precision = (&sig[SIG_W-1 -: MAN_W+1]) && sig[SIG_W-2-MAN_W];

// Overflow, decided here rather than on the packed exponent: a normal result
// (exp >= 1, no shift) packs to exponent field exp + carry, so it reaches
// all-ones when exp >= exp_max or exp == exp_max - 1 (exp_top) with the carry; a
// subnormal one packs to a field of at most 2.
wire overflows = exp_too_big || ((exp == exp_top) && carries_at_full_precision);

// Tiny after rounding: below 2^emin unless exp == 0 and full-precision
// rounding (all ones kept, guard set) would carry up to 2^emin.
wire tiny = denorm && !((exp == 0) && carries_at_full_precision);

reg [SIG_W-1:0] r1_sig;
reg             r1_sticky;
reg [SH_W-1:0]  r1_shift;
reg [EXP_W-1:0] r1_exp_base;
reg             r1_overflow;
reg             r1_tiny;
reg             r1_sign;

always @(posedge clk) begin
    if (ce) begin
        r1_sig         <= sig;
        r1_sticky      <= sticky;
        r1_shift       <= shift;
        r1_exp_base    <= exp_base;
        r1_overflow    <= overflows;
        r1_tiny        <= tiny;
        r1_sign        <= sign;
    end
end

// ---------------------------------------------------------------- stage 2
wire [SIG_W-1:0] shifted     = r1_sig >> r1_shift;
wire             shifted_out = |(r1_sig & ~({SIG_W{1'b1}} << r1_shift));

// kept = hidden bit + mantissa; guard is the first bit below; the rest is sticky.
wire [MAN_W:0] kept  = shifted[SIG_W-1 -: MAN_W+1];
wire           guard = shifted[SIG_W-2-MAN_W];
wire           rest  = |shifted[SIG_W-3-MAN_W:0] | r1_sticky | shifted_out;

reg [MAN_W:0]   r2_kept;
reg             r2_round_up;
reg             r2_lost;
reg [EXP_W-1:0] r2_exp_base;
reg             r2_overflow;
reg             r2_tiny;
reg             r2_sign;

always @(posedge clk) begin
    if (ce) begin
        r2_kept        <= kept;
        r2_round_up    <= guard && (rest || kept[0]);
        r2_lost        <= guard || rest;
        r2_exp_base    <= r1_exp_base;
        r2_overflow    <= r1_overflow;
        r2_tiny        <= r1_tiny;
        r2_sign        <= r1_sign;
    end
end

// FP_ROUND_LATENCY names these two stages for the units that count their latency.
fp_pipe #(.WIDTH(SIDE_W), .DEPTH(FP_ROUND_LATENCY)) side_pipe (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(in_valid), .in_data(in_side),
    .out_valid(out_valid), .out_data(out_side)
);

// ---------------------------------------------------------------- outputs
wire [EXP_W+MAN_W-1:0] packed_abs = {r2_exp_base, {MAN_W{1'b0}}} + {{(EXP_W-1){1'b0}}, r2_kept}
                                  + {{(EXP_W+MAN_W-1){1'b0}}, r2_round_up};

assign overflow  = r2_overflow;
assign inexact   = r2_lost || overflow;
assign underflow = r2_tiny && r2_lost;

assign y = overflow ? {r2_sign, EXP_ONES, {MAN_W{1'b0}}} : {r2_sign, packed_abs};

endmodule

`resetall
`default_nettype wire
