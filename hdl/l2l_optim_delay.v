// SPDX-License-Identifier: Apache-2.0
// Fixed delay line: y = x delayed by DEPTH clocks (DEPTH = 0: a wire).
//
// The optimizer pipeline never stalls (issue is gated by FIFO credit), so
// there is no enable. With RESET = 0 the stages have no reset and map to
// shift-register LUTs (SRL); RESET = 1 clears them (for valid bits).

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_delay #
(
    parameter WIDTH = 32,
    parameter DEPTH = 1,
    parameter RESET = 0
)
(
    input  wire             clk,
    input  wire             rst,
    input  wire [WIDTH-1:0] x,
    output wire [WIDTH-1:0] y
);

generate
if (DEPTH == 0) begin : g_wire
    assign y = x;
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused = clk ^ rst;
    /* verilator lint_on UNUSEDSIGNAL */
end else begin : g_shift
    reg [WIDTH-1:0] stage_reg [0:DEPTH-1];
    integer i;

    always @(posedge clk) begin
        stage_reg[0] <= x;
        for (i = 1; i < DEPTH; i = i + 1) begin
            stage_reg[i] <= stage_reg[i-1];
        end
        if (RESET != 0 && rst) begin
            for (i = 0; i < DEPTH; i = i + 1) begin
                stage_reg[i] <= {WIDTH{1'b0}};
            end
        end
    end

    assign y = stage_reg[DEPTH-1];
end
endgenerate

endmodule

`resetall
