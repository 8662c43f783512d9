// SPDX-License-Identifier: Apache-2.0
// IEEE-754 binary16 to binary32 conversion (exact; NaN canonicalized).
// A thin wrapper around fp_convert, which holds the semantics: round to
// nearest even, exact subnormals, canonical quiet NaN, sNaN raises invalid,
// tininess after rounding.
//
// flags = {invalid, divide_by_zero, overflow, underflow, inexact} = [4:0]: the
// bit layout of Berkeley SoftFloat's softfloat_exceptionFlags (inexact = 1,
// underflow = 2, overflow = 4, infinite = 8, invalid = 16).
//
// Fully pipelined: one conversion per clock, LATENCY = FP_CONVERT_LATENCY cycles
// (hdl/fp/fp_latency.vh) from an input accepted (in_valid with ce high) to
// out_valid; ce low holds the pipeline.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp16_to_fp32
(
    input  wire        clk,
    input  wire        rst,
    input  wire        ce,

    input  wire        in_valid,
    input  wire [15:0] a,

    output wire        out_valid,
    output wire [31:0] y,
    output wire [4:0]  flags
);

`include "fp_latency.vh"
// Cycles from input to output (hdl/fp/fp_latency.vh); the bench reads and checks it.
/* verilator lint_off UNUSEDPARAM */
localparam LATENCY = FP_CONVERT_LATENCY;
/* verilator lint_on UNUSEDPARAM */

fp_convert #(
    .IN_EXP_W(5), .IN_MAN_W(10), .OUT_EXP_W(8), .OUT_MAN_W(23)
) convert (
    .clk(clk), .rst(rst), .ce(ce),
    .in_valid(in_valid), .a(a),
    .out_valid(out_valid), .y(y), .flags(flags)
);

endmodule

`resetall
`default_nettype wire
