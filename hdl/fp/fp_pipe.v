// SPDX-License-Identifier: Apache-2.0
// Delay line for a valid bit and side-band data, DEPTH registers deep, held
// when ce is low. Only the valid bits are reset; data registers need no reset.

`resetall
`timescale 1ns / 1ps
`default_nettype none

module fp_pipe #
(
    parameter WIDTH = 8,
    parameter DEPTH = 1
)
(
    input  wire             clk,
    input  wire             rst,
    input  wire             ce,

    input  wire             in_valid,
    input  wire [WIDTH-1:0] in_data,
    output wire             out_valid,
    output wire [WIDTH-1:0] out_data
);

reg [DEPTH-1:0] valid_reg;
reg [WIDTH-1:0] data_reg [0:DEPTH-1];

integer i;

always @(posedge clk) begin
    if (ce) begin
        valid_reg[0] <= in_valid;
        data_reg[0]  <= in_data;
        for (i = 1; i < DEPTH; i = i + 1) begin
            valid_reg[i] <= valid_reg[i-1];
            data_reg[i]  <= data_reg[i-1];
        end
    end
    if (rst) begin
        valid_reg <= {DEPTH{1'b0}};
    end
end

assign out_valid = valid_reg[DEPTH-1];
assign out_data  = data_reg[DEPTH-1];

endmodule

`resetall
`default_nettype wire
