// SPDX-License-Identifier: Apache-2.0
// Classify one IEEE-754 operand of any width (binary32, bfloat16, binary16)
// and give the significand and exponent the arithmetic uses: subnormals get
// the effective exponent 1 and a hidden bit of 0, so that
// value = sig * 2^(exp_eff - BIAS - MAN_W) holds for every finite operand.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp_classify #
(
    parameter EXP_W = 8,
    parameter MAN_W = 23
)
(
    input  wire [EXP_W+MAN_W:0] x,

    output wire                 sign,
    output wire [EXP_W-1:0]     exp_eff,
    output wire [MAN_W:0]       sig,
    output wire                 is_zero,
    output wire                 is_inf,
    output wire                 is_nan,
    output wire                 is_snan
);

wire [EXP_W-1:0] exp_field = x[EXP_W+MAN_W-1:MAN_W];
wire [MAN_W-1:0] man_field = x[MAN_W-1:0];
wire exp_zero = (exp_field == {EXP_W{1'b0}});
wire exp_ones = (exp_field == {EXP_W{1'b1}});

assign sign    = x[EXP_W+MAN_W];
assign exp_eff = exp_zero ? {{(EXP_W-1){1'b0}}, 1'b1} : exp_field;
assign sig     = {~exp_zero, man_field};
assign is_zero = exp_zero && (man_field == {MAN_W{1'b0}});
assign is_inf  = exp_ones && (man_field == {MAN_W{1'b0}});
assign is_nan  = exp_ones && (man_field != {MAN_W{1'b0}});
// A NaN is signalling when the top mantissa bit (the quiet bit) is clear.
assign is_snan = is_nan && !man_field[MAN_W-1];

endmodule

`resetall
`default_nettype wire
