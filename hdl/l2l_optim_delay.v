// SPDX-License-Identifier: Apache-2.0
// Fixed delay line: y = x delayed by DEPTH clocks (DEPTH = 0: a wire).
//
// The optimizer pipeline never stalls (issue is gated by FIFO credit), so
// there is no enable. RESET = 1 clears the stages (for valid bits): a chain of
// flip-flops. With RESET = 0, a line shorter than RAM_MIN_DEPTH is a chain without
// reset (shift-register LUTs where the part has them); a longer one is a circular
// buffer in block RAM (DEPTH - 1 words, read into the RAM's output register) and
// one register in the fabric after it: the ECP5 has no shift-register LUTs, and the
// lane's long lines as flip-flops took about 16k of its 30k (docs/BENCHMARKS.md).

`resetall
`timescale 1ns / 1ps
`default_nettype none

module l2l_optim_delay #
(
    parameter WIDTH = 32,
    parameter DEPTH = 1,
    parameter RESET = 0,
    parameter RAM_MIN_DEPTH = 16
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
end else if (RESET == 0 && DEPTH >= RAM_MIN_DEPTH) begin : g_ram
    localparam AW = $clog2(DEPTH - 1);
    localparam integer READ_STEP_I = (1 << AW) + 3 - DEPTH;  // read address = write address + 2 - DEPTH
    localparam [AW-1:0] READ_STEP = READ_STEP_I[AW-1:0];
    (* ram_style = "block" *) reg [WIDTH-1:0] mem [0:(1 << AW) - 1];
    reg [AW-1:0] wr_reg, rd_reg;
    reg [WIDTH-1:0] read_reg, y_reg;

    // x written at a clock is read DEPTH - 2 clocks later, then waits in y_reg: y is x of
    // DEPTH clocks before. The addresses differ (DEPTH - 2 < 2^AW), so no read meets a write.
    always @(posedge clk) begin
        mem[wr_reg] <= x;
        read_reg <= mem[rd_reg];
        y_reg <= read_reg;
        wr_reg <= wr_reg + 1'b1;
        rd_reg <= wr_reg + READ_STEP;
    end

    assign y = y_reg;
    /* verilator lint_off UNUSEDSIGNAL */
    wire unused = rst;
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
