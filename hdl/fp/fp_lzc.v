// SPDX-License-Identifier: Apache-2.0
// Leading-zero counter: count = number of zero bits above the most significant
// one of `in`; WIDTH when `in` is zero. Combinational; the units put it inside
// a pipeline stage. Shared by every unit that normalizes a significand.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp_lzc #
(
    parameter WIDTH   = 24,
    parameter COUNT_W = $clog2(WIDTH+1)
)
(
    input  wire [WIDTH-1:0]   in,
    output reg  [COUNT_W-1:0] count
);

integer i;
// Only the low COUNT_W bits of the integer are the result.
/* verilator lint_off UNUSEDSIGNAL */
integer zeros;
/* verilator lint_on UNUSEDSIGNAL */

// Scan from the LSB up so the highest set bit is the last to write `zeros`;
// synthesis turns this into a priority encoder.
always @* begin
    zeros = WIDTH;
    for (i = 0; i < WIDTH; i = i + 1) begin
        if (in[i]) begin
            zeros = WIDTH - 1 - i;
        end
    end
    count = zeros[COUNT_W-1:0];
end

endmodule

`resetall
`default_nettype wire
