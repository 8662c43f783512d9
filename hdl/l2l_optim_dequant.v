// SPDX-License-Identifier: Apache-2.0
// Decode one 8-bit state code and scale it: golden.dequantize for one element.
//
// The code is a minifloat of EXP_BITS exponent and CODE_MAN_BITS mantissa bits
// (golden.Code8; SIGNED: sign-magnitude, bit 7 the sign) whose value at scale 1
// is exact in fp32; y = value * scale is one fp32_mul (one rounding, exact
// unless the product is below 2^-126). A NaN scale (a block that held Inf or
// NaN) gives NaN. LATENCY = DEQUANT_LATENCY clocks (hdl/l2l_optim_state8.vh).

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_dequant #
(
    parameter EXP_BITS = 4,
    parameter SIGNED = 1
)
(
    input  wire        clk,
    input  wire        rst,
    input  wire [7:0]  code,
    input  wire [31:0] scale,
    output wire [31:0] y
);

`include "fp_latency.vh"
`include "l2l_optim_state8.vh"

/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = DEQUANT_LATENCY;
/* verilator lint_on UNUSEDPARAM */
localparam integer BIAS = (1 << EXP_BITS) - 1;
// magnitude code (e, f), e >= 1: fp32 exponent field e - BIAS + 127, mantissa f
localparam integer NORMAL_REBASE_I = 127 - BIAS;
localparam [7:0] NORMAL_REBASE = NORMAL_REBASE_I[7:0];
// subnormal code (0, f): f * 2^-(BIAS - 1 + CODE_MAN_BITS); f in 1..7, normalized here
localparam [7:0] SUB_EXP = NORMAL_REBASE;  // exponent field of f = 4..7 (2^-BIAS * f/4)

wire [7:0] mag = SIGNED ? {1'b0, code[6:0]} : code;
wire [7:0] e = mag >> CODE_MAN_BITS;
wire [2:0] f = mag[2:0];
wire sign = SIGNED ? code[7] : 1'b0;

reg [30:0] sub_bits;
always @* begin
    casez (f)
        3'b1??: sub_bits = {SUB_EXP, f[1:0], 21'd0};
        3'b01?: sub_bits = {SUB_EXP - 8'd1, f[0], 22'd0};
        3'b001: sub_bits = {SUB_EXP - 8'd2, 23'd0};
        default: sub_bits = 31'd0;
    endcase
end

reg [31:0] value_reg;
always @(posedge clk) begin
    value_reg <= {sign, (e != 0) ? {e + NORMAL_REBASE, f, 20'd0} : sub_bits};
end

// the scale waits for the decode register
reg [31:0] scale_reg;
always @(posedge clk) begin
    scale_reg <= scale;
end

/* verilator lint_off UNUSEDSIGNAL */
wire unused_valid;
wire [4:0] unused_flags;
/* verilator lint_on UNUSEDSIGNAL */
fp32_mul mul (.clk(clk), .rst(rst), .ce(1'b1), .in_valid(1'b1), .a(value_reg), .b(scale_reg),
              .y(y), .out_valid(unused_valid), .flags(unused_flags));

endmodule

`resetall
